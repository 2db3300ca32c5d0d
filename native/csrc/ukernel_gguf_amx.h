/* GGUF's blocks through AMX-INT8 tiles (Sapphire Rapids and later Xeons): the calls of many rows (prefill
 * chunks), with the bits of the AVX-512 micro-kernels of ukernel_gguf.h.
 *
 * A tile multiply TDPBSUD takes 16 rows of signed bytes (A: 16 activation rows x one block's 32 codes) and a
 * matrix of unsigned bytes in groups of 4 along K (B: the panel's 16 features, 4 codes a 32-bit lane: the lanes
 * ukernel_gguf_body.h's code(i, c) makes), and adds their exact int32 dots into C (16 rows x 16 features). So per
 * block of 32 one multiply gives the integer dots of 16 rows x 16 features, stored to memory, and only the
 * block's float steps remain for the vector units, in ukernel_gguf.h's order per output: the same bits as the
 * AVX-512 kernel (the dots are exact however they are formed), which takes the rows a call has beyond a multiple
 * of 16. Q6_K's scales cover 16 weights, so its blocks take a multiply per half (TDPBSSD: its codes as signed
 * q - 32, which the signed-by-signed multiply takes as they are, so no offset is added back) and their two dots'
 * float steps (T = sc' dot' + sc'' dot'', exact in float, as the AVX-512 kernel's unpacked groups form it).
 *
 * Per call (linear_ggml.cpp: up to kRowSlice rows x a chunk of panels) and panel: the panel's codes are made once
 * into a thread's buffer (a block's B tile: 8 rows of 64 bytes; the K-quants'
 * codes as they are, 0..MaxCode, so no dot is shifted back) with its scales as vectors, then every 16 rows take
 * them a block at a time: load A and B, multiply, store C, the float steps of 16 rows x 16 features from C, the
 * accumulators in registers over the whole row. Intel's AMX (Intel 64 and IA-32 Architectures Optimization
 * Reference Manual, chapter 20; the instruction set reference for TDPBSUD, TDPBSSD and LDTILECFG) describes the
 * tiles and their configuration; Linux hands out the tile state only after arch_prctl(ARCH_REQ_XCOMP_PERM) (cpu.h's
 * amx()).
 *
 * Include after ukernel_gguf.h, in the extension only (the emulator runs no AMX: these leaves run where the CPU
 * has the tiles, and tests compare them with the AVX-512 kernel there).
 */
#ifndef KVSERVE_UKERNEL_GGUF_AMX_H
#define KVSERVE_UKERNEL_GGUF_AMX_H

#include "ukernel_gguf.h"

#ifdef KV_UK_X86
#include <vector>

#include "aligned_vector.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c,amx-tile,amx-int8")
namespace kvserve::gguf::avx512 {

/* Tile registers: C0 the dots, A0 the activations, B0 the codes (Q6_K: C1, A1, B1 its second half of each block).
 * Macros: the intrinsics paste the register's number into their assembly. */
#define KV_TC0 0
#define KV_TC1 1
#define KV_TA0 4
#define KV_TA1 5
#define KV_TB0 6
#define KV_TB1 7

/* LDTILECFG's 64-byte operand (palette 1). */
struct alignas(64) AmxConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

/* C: 16 rows x 16 int32; A: 16 rows x a block's 32 codes; B: 8 rows (32 codes / 4) x 16 features' 4 codes.
 * Q6_K: a pair of each, per half block: A 16 rows x 16 codes, B 4 rows x 16 features' 4 codes. */
template <class Fmt>
inline void amx_configure() {
  AmxConfig c = {};
  c.palette = 1;
  constexpr bool halves = Fmt::kFold == Fold::kScale16;
  for (int t : {KV_TC0, KV_TC1}) c.colsb[t] = 64, c.rows[t] = 16;
  for (int t : {KV_TA0, KV_TA1}) c.colsb[t] = halves ? 16 : 32, c.rows[t] = 16;
  for (int t : {KV_TB0, KV_TB1}) c.colsb[t] = 64, c.rows[t] = halves ? 4 : 8;
  __asm__ volatile("" : : "m"(c) : "memory");  // GCC may drop the stores to c that only LDTILECFG reads
  _tile_loadconfig(&c);
}

/* A panel made ready for the tiles: per block, its 8 chunks of codes (64 bytes each: 16 features x 4 codes) and
 * its scales as the float steps take them. A thread's, reused across calls; bytes on cache lines
 * (aligned_vector.h), so each 64-byte row a tile loads is one line. */
struct AmxPanel {
  AlignedVector<uint8_t> bytes;
  int cap = 0;
  uint8_t* codes;  // [nb][8][64]
  float* D;        // [nb][16]
  float* Mn;       // [nb][16]
  float* S;        // [nb][2][16]: Q6_K's scales of the block's two halves, as floats
  void resize(int nb) {
    if (nb <= cap) return;
    cap = nb;
    bytes.assign((size_t)nb * (512 + 64 + 64 + 128), 0);
    codes = bytes.data();
    D = (float*)(codes + (size_t)nb * 512);
    Mn = D + 16 * (size_t)nb;
    S = Mn + 16 * (size_t)nb;
  }
};

/* Panel p's codes and scales, group by group (the 32-weight formats' last group may be short). */
template <class Fmt>
inline void amx_unpack(const kv_ggml_args* a, int p, AmxPanel& out) {
  using U = typename UnitOf<Fmt>::T;
  for (int b0 = 0; b0 < a->nb; b0 += 8) {
    const uint8_t* w = group_at(a, Fmt::kKind, p, b0);
    const int nblk = a->nb - b0 < 8 ? a->nb - b0 : 8;
    KV_UNROLL for (int i = 0; i < 8; ++i) {
      if (i >= nblk) break;
      const int64_t b = b0 + i;
      KV_UNROLL for (int c = 0; c < 8; ++c) {
        if constexpr (Fmt::kKind == kQ4_K || Fmt::kKind == kQ5_K) st(out.codes + 512 * b + 64 * c, U::template code<false>(w, i, c));
        else if constexpr (Fmt::kFold == Fold::kScale16)  // Q6_K: q - 32, signed
          st(out.codes + 512 * b + 64 * c, _mm512_sub_epi8(U::code(w, i, c), b8(U::kOffset)));
        else st(out.codes + 512 * b + 64 * c, U::code(w, i, c));
      }
      stf(out.D + 16 * b, U::d(w, i));
      if constexpr (Fmt::kFold == Fold::kScaleMin) stf(out.Mn + 16 * b, U::m(w, i));
      if constexpr (Fmt::kFold == Fold::kScale16) {
        stf(out.S + 32 * b, cvt(U::sc(w, 2 * i)));
        stf(out.S + 32 * b + 16, cvt(U::sc(w, 2 * i + 1)));
      }
    }
  }
}

/* Block b's float steps for rows m..m+15 (ukernel_gguf_body.h's blocks(), per row in block order), its dots in
 * dots (16 rows x 16 int32). */
template <class Fmt>
inline __attribute__((always_inline)) void amx_fold(const kv_ggml_args* a, const AmxPanel& u, int64_t m, int b, const int32_t* dots, F* acc) {
  using U = typename UnitOf<Fmt>::T;
  static_assert(Fmt::kFold != Fold::kScale16, "Q6_K folds in amx_fold_q6k");
  const int64_t at = m * a->ldb + b;  // row m's block b
  const F D = ldf(u.D + 16 * b);
  const F Mn = Fmt::kFold == Fold::kScaleMin ? ldf(u.Mn + 16 * b) : zero_f();
  KV_UNROLL for (int r = 0; r < 16; ++r) {
    const int64_t row = at + r * a->ldb;
    I v = ld(dots + 16 * r);  // codes as they are: no dot to shift back
    if constexpr (U::kOffset != 0) v = sub(v, b32(U::kOffset * a->xsum[row]));
    acc[r] = fma(D, mul(cvt(v), bset(a->xd[row])), acc[r]);
    if constexpr (Fmt::kFold == Fold::kScaleMin) acc[r] = fma(Mn, bset(a->xs[row]), acc[r]);
  }
}

/* Q6_K's block b for rows m..m+15: its halves' dots in dots[0] and dots[1] (each 16 rows x 16 int32, the codes
 * taken as q - 32, so a dot is the AVX-512 kernel's sum (q - 32) x), T = sc' dot' + sc'' dot'' in float (exact:
 * ukernel_gguf.h's bound), then s = T d_x and acc = fma(d, s, acc), as ukernel_gguf_body.h's blocks() does. */
inline __attribute__((always_inline)) void amx_fold_q6k(const kv_ggml_args* a, const AmxPanel& u, int64_t m, int b,
                                                        const int32_t (*dots)[256], F* acc) {
  const int64_t at = m * a->ldb + b;
  const F D = ldf(u.D + 16 * b), S0 = ldf(u.S + 32 * b), S1 = ldf(u.S + 32 * b + 16);
  KV_UNROLL for (int r = 0; r < 16; ++r) {
    const F T = fma(S1, cvt(ld(dots[1] + 16 * r)), mul(S0, cvt(ld(dots[0] + 16 * r))));
    acc[r] = fma(D, mul(T, bset(a->xd[at + r * a->ldb])), acc[r]);
  }
}

/* Rows m..m+15 of panel p over the whole row, a block at a time: its tile multiply, its dots stored, its float
 * steps (Q6_K: a multiply per half block, TDPBSSD on its codes as signed q - 32). (Measured on a Sapphire Rapids
 * VM: issuing a pair of blocks' multiplies ahead of the previous pair's float steps, into two alternating sets of
 * result tiles, overlapped nothing: the stores and loads of the dots order them.) */
template <class Fmt>
inline void amx_rows(const kv_ggml_args* a, const AmxPanel& u, int p, int64_t m) {
  alignas(64) int32_t buf[2][256];
  F acc[16];
  KV_UNROLL for (int r = 0; r < 16; ++r) acc[r] = zero_f();
  const int8_t* x = a->xq + m * a->ldq;
  for (int b = 0; b < a->nb; ++b) {
    if constexpr (Fmt::kFold == Fold::kScale16) {
      _tile_loadd(KV_TA0, x + 32 * b, a->ldq);
      _tile_loadd(KV_TA1, x + 32 * b + 16, a->ldq);
      _tile_loadd(KV_TB0, u.codes + 512 * b, 64);
      _tile_loadd(KV_TB1, u.codes + 512 * b + 256, 64);
      _tile_zero(KV_TC0);
      _tile_zero(KV_TC1);
      _tile_dpbssd(KV_TC0, KV_TA0, KV_TB0);
      _tile_dpbssd(KV_TC1, KV_TA1, KV_TB1);
      _tile_stored(KV_TC0, buf[0], 64);
      _tile_stored(KV_TC1, buf[1], 64);
      amx_fold_q6k(a, u, m, b, buf, acc);
    } else {
      _tile_loadd(KV_TA0, x + 32 * b, a->ldq);
      _tile_loadd(KV_TB0, u.codes + 512 * b, 64);
      _tile_zero(KV_TC0);
      _tile_dpbsud(KV_TC0, KV_TA0, KV_TB0);
      _tile_stored(KV_TC0, buf[0], 64);
      amx_fold<Fmt>(a, u, m, b, buf[0], acc);
    }
  }
  const int cols = panel_cols(a, p);
  KV_UNROLL for (int r = 0; r < 16; ++r) store_y(panel_y(a, p, m + r), acc[r], cols);
}

/* a->panels panels x a->rows rows: every 16 rows through the tiles, the rest (and calls of fewer than 16 rows)
 * through the AVX-512 kernel. */
template <class Fmt>
inline void amx_kernel(const kv_ggml_args* a) {
  const int64_t tiled = a->rows / 16 * 16;
  if (tiled > 0) {
    thread_local AmxPanel panel;
    panel.resize(a->nb);
    amx_configure<Fmt>();
    for (int p = 0; p < a->panels; ++p) {
      amx_unpack<Fmt>(a, p, panel);
      for (int64_t m = 0; m < tiled; m += 16) amx_rows<Fmt>(a, panel, p, m);
    }
    _tile_release();
  }
  if (tiled < a->rows) {
    kv_ggml_args rest = *a;
    rest.rows = (int32_t)(a->rows - tiled);
    rest.xq += tiled * a->ldq;
    rest.xd += tiled * a->ldb;
    rest.xs += tiled * a->ldb;
    rest.xsum += tiled * a->ldb;
    if (rest.xoff16 != nullptr) rest.xoff16 += 2 * tiled * a->ldb;
    rest.y += tiled * a->ldy;
    kernel<Fmt>(&rest);
  }
}

}  // namespace kvserve::gguf::avx512
#pragma GCC pop_options
#undef KV_TC0
#undef KV_TC1
#undef KV_TA0
#undef KV_TA1
#undef KV_TB0
#undef KV_TB1

#define KV_GGUF_AMX_LEAF(name, Fmt)                                                                             \
  extern "C" __attribute__((target(KV_AVX512_TARGET ",amx-tile,amx-int8"))) void kv_##name##_amx(              \
      const kv_ggml_args* a) {                                                                                  \
    kvserve::gguf::avx512::amx_kernel<kvserve::gguf::Fmt>(a);                                                   \
  }
KV_GGUF_AMX_LEAF(q4_0, Q4_0)
KV_GGUF_AMX_LEAF(q5_0, Q5_0)
KV_GGUF_AMX_LEAF(q5_1, Q5_1)
KV_GGUF_AMX_LEAF(q8_0, Q8_0)
KV_GGUF_AMX_LEAF(q4_k, Q4_K)
KV_GGUF_AMX_LEAF(q5_k, Q5_K)
KV_GGUF_AMX_LEAF(q6_k, Q6_K)
#undef KV_GGUF_AMX_LEAF

#endif /* KV_UK_X86 */
#endif /* KVSERVE_UKERNEL_GGUF_AMX_H */
