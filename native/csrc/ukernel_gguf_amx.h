/* GGUF's blocks through AMX-INT8 tiles (Sapphire Rapids and later Xeons): the calls of many rows (prefill
 * chunks, decode batches: linear_ggml.cpp's amx_min_rows), with the bits of the AVX-512 micro-kernels of
 * ukernel_gguf.h.
 *
 * A tile multiply TDPBSUD takes 16 rows of signed bytes (A: 16 activation rows x one block's 32 codes) and a
 * matrix of unsigned bytes in groups of 4 along K (B: the panel's 16 features, 4 codes a 32-bit lane: the lanes
 * ukernel_gguf_body.h's code(i, c) makes), and adds their exact int32 dots into C (16 rows x 16 features). So per
 * block of 32 one multiply gives the integer dots of 16 rows x 16 features, stored to memory, and only the
 * block's float steps remain for the vector units, in ukernel_gguf.h's order per output: the same bits as the
 * AVX-512 kernel (the dots are exact however they are formed), which takes the rows a call has beyond a multiple
 * of 16 (the K-quants': beyond a multiple of 16 in calls of 32 rows or more; a smaller call is all tiles).
 *
 * Per call (linear_ggml.cpp: up to kRowSlice rows x a chunk of panels) and panel: the panel's codes are made once
 * into a thread's buffer (a block's B tile: 8 rows of 64 bytes) with its scales as vectors, then every 16 rows take
 * them a block at a time: load A and B, multiply, store C, the float steps of 16 rows x 16 features from C, the
 * accumulators in registers over the whole row. The K-quants differ (below): their activations' one scale per
 * super-block lets a tile sum all 256 codes of one before its dots leave it. Intel's AMX (Intel 64 and IA-32
 * Architectures Optimization Reference Manual, chapter 20; the instruction set reference for TDPBSUD, TDPBSSD and
 * LDTILECFG) describes the tiles and their configuration; Linux hands out the tile state only after
 * arch_prctl(ARCH_REQ_XCOMP_PERM) (cpu.h's amx()).
 *
 * Include after ukernel_gguf.h, in the extension only (the emulator runs no AMX: these leaves run where the CPU
 * has the tiles, and tests compare them with the AVX-512 kernel there).
 */
#ifndef KVSERVE_UKERNEL_GGUF_AMX_H
#define KVSERVE_UKERNEL_GGUF_AMX_H

#include "ukernel_gguf.h"

#ifdef KV_UK_X86
#include <algorithm>
#include <vector>

#include "aligned_vector.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c,amx-tile,amx-int8")
namespace kvserve::gguf::avx512 {

/* Tile registers of the 32-weight formats: C0 the dots, A0 the activations, B0 the codes. Macros: the intrinsics
 * paste the register's number into their assembly. */
#define KV_TC0 0
#define KV_TA0 4
#define KV_TB0 6

/* LDTILECFG's 64-byte operand (palette 1). */
struct alignas(64) AmxConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

/* C: 16 rows x 16 int32; A: 16 rows x a block's 32 codes; B: 8 rows (32 codes / 4) x 16 features' 4 codes. */
inline void amx_configure() {
  AmxConfig c = {};
  c.palette = 1;
  c.colsb[KV_TC0] = 64, c.rows[KV_TC0] = 16;
  c.colsb[KV_TA0] = 32, c.rows[KV_TA0] = 16;
  c.colsb[KV_TB0] = 64, c.rows[KV_TB0] = 8;
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
  void resize(int nb) {
    if (nb <= cap) return;
    cap = nb;
    bytes.assign((size_t)nb * (512 + 64 + 64), 0);
    codes = bytes.data();
    D = (float*)(codes + (size_t)nb * 512);
    Mn = D + 16 * (size_t)nb;
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
      KV_UNROLL for (int c = 0; c < 8; ++c) st(out.codes + 512 * b + 64 * c, U::code(w, i, c));
      stf(out.D + 16 * b, U::d(w, i));
      if constexpr (Fmt::kFold == Fold::kScaleMin) stf(out.Mn + 16 * b, U::m(w, i));
    }
  }
}

/* Block b's float steps for rows m..m+15 (ukernel_gguf_body.h's blocks(), per row in block order), its dots in
 * dots (16 rows x 16 int32). */
template <class Fmt>
inline __attribute__((always_inline)) void amx_fold(const kv_ggml_args* a, const AmxPanel& u, int64_t m, int b, const int32_t* dots, F* acc) {
  using U = typename UnitOf<Fmt>::T;
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

/* Rows m..m+15 of panel p over the whole row, a block at a time: its tile multiply, its dots stored, its float
 * steps. (Measured on a Sapphire Rapids
 * VM: issuing a pair of blocks' multiplies ahead of the previous pair's float steps, into two alternating sets of
 * result tiles, overlapped nothing: the stores and loads of the dots order them.) */
template <class Fmt>
inline void amx_rows(const kv_ggml_args* a, const AmxPanel& u, int p, int64_t m) {
  alignas(64) int32_t buf[256];
  F acc[16];
  KV_UNROLL for (int r = 0; r < 16; ++r) acc[r] = zero_f();
  const int8_t* x = a->xq + m * a->ldq;
  for (int b = 0; b < a->nb; ++b) {
    _tile_loadd(KV_TA0, x + 32 * b, a->ldq);
    _tile_loadd(KV_TB0, u.codes + 512 * b, 64);
    _tile_zero(KV_TC0);
    _tile_dpbsud(KV_TC0, KV_TA0, KV_TB0);
    _tile_stored(KV_TC0, buf, 64);
    amx_fold<Fmt>(a, u, m, b, buf, acc);
  }
  const int cols = panel_cols(a, p);
  KV_UNROLL for (int r = 0; r < 16; ++r) store_y(panel_y(a, p, m + r), acc[r], cols);
}

/* ---- Q4_K and Q5_K (Fold::kSuper): a super-block's dots summed inside the tiles. Their integer part per
 * super-block and output, I = sum_j sc_j dot_j, is a dot of the activations with the codes times their sub-block's
 * scale, q sc (up to 31 x 63: more than a byte), so the panel holds it in two pieces of unsigned bytes, q lo and
 * q hi with sc = lo + 2^s hi (s = 4 for Q4_K, 3 for Q5_K: each product at most 255), and I = C_lo + 2^s C_hi, each
 * C a tile summed over the super-block's 256 codes (4 multiplies of 64). Then per super-block and row one store
 * of the dots and ukernel_gguf.h's two float steps (its minimums' integer sum from 16-bit pairs, as the AVX-512
 * kernel forms it), not two per block: the same bits as the AVX-512 kernel. Rows two tiles of 16 at a time (C:
 * 4 tiles, A: 2, B: the two pieces), so each piece's tile serves 32 rows; a group of panels a super-block at a
 * time, each panel's super-block made ready for all the call's rows (its 8 KB of pieces stay in L1; the
 * accumulators wait in memory) while the super-block's activations stay in L2 for the group, the call taking all
 * the rows and all a thread's panels (linear_ggml.cpp), so the pieces are made once (docs/kernels.md has the
 * measurements).
 *   Q6_K (Fold::kScale16) likewise, its integer part I = sum_j sc_j (dot_j - 32 qsum16_j) being a dot of the
 * activations with sc (q - 32) (int8 scales of 16 weights: |sc (q - 32)| <= 128 * 32, 14 bits), held as its low
 * byte, unsigned (TDPBSUD), and its high byte, signed (TDPBSSD), 2^8 apart; one float step per super-block. */
constexpr int kSuperShift4 = 4, kSuperShift5 = 3;

/* Tiles: C lo and hi for rows 0-15 (0, 1) and 16-31 (2, 3), A rows 0-15 and 16-31 (4, 5), B lo and hi (6, 7);
 * every one 16 rows x 64 bytes, but in a call of fewer than 32 rows the C and A tiles of its first (rows0) and
 * second (rows1) tile of rows. */
inline void amx_configure_super(int rows0 = 16, int rows1 = 16) {
  AmxConfig c = {};
  c.palette = 1;
  for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;
  /* a call of fewer than 32 rows: rows0 in the first C and A tiles, rows1 in the second */
  c.rows[0] = c.rows[1] = c.rows[4] = (uint8_t)rows0;
  c.rows[2] = c.rows[3] = c.rows[5] = (uint8_t)rows1;
  __asm__ volatile("" : : "m"(c) : "memory");
  _tile_loadconfig(&c);
}

/* One super-block of a panel made ready: the two pieces' 4 B tiles each (tile t: blocks 2t, 2t + 1, 8 chunks of 64
 * bytes each) and d, -dmin and the minimums' pairs as vectors (Q6_K: d). A thread's, reused across calls; on cache
 * lines (aligned_vector.h), so each 64-byte row a tile loads is one line. */
struct AmxPieces {
  static constexpr int kBytes = 2 * 4096 + 6 * 64;
  AlignedVector<uint8_t> bytes;
  uint8_t* data() {
    if (bytes.size() < (size_t)kBytes) bytes.assign(kBytes, 0);
    return bytes.data();
  }
};

/* Q6_K's chunk c of block i as its two pieces (the low bytes and the signed high bytes of sc (q - 32), 16 bits
 * each: |sc (q - 32)| <= 128 * 32), its codes' bytes widened to 16 bits, even and odd apart, and multiplied by the
 * scale of their 16 weights. */
inline __attribute__((always_inline)) void q6k_pieces(const uint8_t* w, int i, int c, uint8_t* lo, uint8_t* hi) {
  const I sc = UnitQ6K::sc(w, 2 * i + c / 4);  // sign-extended 32-bit lanes
  const I sc16 = or_(and_(sc, b32(0xFFFF)), shift(sc, 16));
  const I q = _mm512_sub_epi8(UnitQ6K::code(w, i, c), b8(32));
  const I even = _mm512_mullo_epi16(_mm512_srai_epi16(_mm512_slli_epi16(q, 8), 8), sc16);
  const I odd = _mm512_mullo_epi16(_mm512_srai_epi16(q, 8), sc16);
  st(lo, or_(and_(even, _mm512_set1_epi16(0x00FF)), _mm512_slli_epi16(odd, 8)));
  st(hi, or_(_mm512_srli_epi16(even, 8), and_(odd, _mm512_set1_epi16((short)0xFF00))));
}

/* Super-block u of panel p made ready for the tiles into o (AmxPieces::kBytes). */
template <class Fmt>
inline void amx_unpack_super(const kv_ggml_args* a, int p, int u, uint8_t* o) {
  using U = typename UnitOf<Fmt>::T;
  const uint8_t* w = group_at(a, Fmt::kKind, p, 8 * u);
  if constexpr (Fmt::kFold == Fold::kScale16) {
    KV_UNROLL for (int i = 0; i < 8; ++i) KV_UNROLL for (int c = 0; c < 8; ++c) {
      uint8_t* row = o + 1024 * (i / 2) + 64 * (8 * (i & 1) + c);
      q6k_pieces(w, i, c, row, row + 4096);
    }
  } else {
    constexpr int s = Fmt::kKind == kQ4_K ? kSuperShift4 : kSuperShift5;
    KV_UNROLL for (int i = 0; i < 8; ++i) {
      const I sc = U::sc(w, i);
      const I lo = and_(sc, b32((1 << s) - 1)), hi = srl(sc, s);
      const I lo16 = or_(lo, shift(lo, 16)), hi16 = or_(hi, shift(hi, 16));  // the scale in both 16-bit halves
      /* one 16-bit multiply makes both bytes' products: the low byte's (at most 255) cannot carry into the high
       * one's, and the high one's (at most 255, times 256) stays within 16 bits */
      KV_UNROLL for (int c = 0; c < 8; ++c) {
        const I q = U::template code<false>(w, i, c);
        uint8_t* row = o + 1024 * (i / 2) + 64 * (8 * (i & 1) + c);
        st(row, _mm512_mullo_epi16(q, lo16));
        st(row + 4096, _mm512_mullo_epi16(q, hi16));
      }
    }
    KV_UNROLL for (int k = 0; k < 4; ++k) st(o + 8192 + 64 * k, U::mpair(w, k));
    stf((float*)(o + 8192 + 320), U::m(w, 0));
  }
  stf((float*)(o + 8192 + 256), U::d(w, 0));
}

/* Super-block v of a panel (its pieces at `panel`) for rows m..m+rows-1 (T = 1 or 2 tiles of up to 16 rows): the tiles'
 * dots, stored, then each row's float steps into its accumulator acc[r] (memory: every row's of the call and
 * panel, since a panel's super-block is taken for all of them before the next, its B tiles staying in L1). */
template <class Fmt, int T>
inline void amx_super_block(const kv_ggml_args* a, const uint8_t* panel, int v, int64_t m, float (*acc)[16],
                            int rows = 16 * T) {
  constexpr bool q6k = Fmt::kFold == Fold::kScale16;  // its high piece signed, 2^8 apart; no minimums
  constexpr int s = q6k ? 8 : Fmt::kKind == kQ4_K ? kSuperShift4 : kSuperShift5;
  alignas(64) int32_t c[4][256];  // C lo, hi of rows 0-15, lo, hi of rows 16-31
  const int8_t* x = a->xq + m * a->ldq + 256 * v;
  _tile_zero(0);
  _tile_zero(1);
  if (T == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  KV_UNROLL for (int t = 0; t < 4; ++t) {
    _tile_loadd(4, x + 64 * t, a->ldq);
    if (T == 2) _tile_loadd(5, x + 16 * a->ldq + 64 * t, a->ldq);
    _tile_loadd(6, panel + 1024 * t, 64);
    _tile_loadd(7, panel + 4096 + 1024 * t, 64);
    _tile_dpbsud(0, 4, 6);
    if (q6k) _tile_dpbssd(1, 4, 7);
    else _tile_dpbsud(1, 4, 7);
    if (T == 2) {
      _tile_dpbsud(2, 5, 6);
      if (q6k) _tile_dpbssd(3, 5, 7);
      else _tile_dpbsud(3, 5, 7);
    }
  }
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  if (T == 2) {
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
  }
  I mp[4];
  KV_UNROLL for (int k = 0; k < 4; ++k) mp[k] = ld(panel + 8192 + 64 * k);
  const F D = ldf((const float*)(panel + 8192 + 256)), ND = ldf((const float*)(panel + 8192 + 320));
  /* the rows' scales and code sums by pointers held in registers (through `a`, GCC reloads them after each store) */
  const int64_t ldb = a->ldb;
  const float* xd = a->xd + m * ldb + 8 * v;
  const int16_t* pairs = a->xsum16 + m * ldb + 8 * v;
  const bool first = v == 0;
  if constexpr (q6k) {
    for (int r = 0; r < rows; ++r, xd += ldb) {
      const int32_t* lo = c[2 * (r / 16)] + 16 * (r % 16);
      const I sum = add(ld(lo), shift(ld(lo + 256), s));
      const F y = first ? zero_f() : ldf(acc[r]);
      stf(acc[r], fma(D, mul(cvt(sum), bset(*xd)), y));
    }
    return;
  }
  for (int r = 0; r < rows; ++r, xd += ldb, pairs += ldb) {
    const int32_t* lo = c[2 * (r / 16)] + 16 * (r % 16);
    const I sum = add(ld(lo), shift(ld(lo + 256), s));
    /* the minimums' sum in two chains */
    I im0 = madd16(zero_i(), mp[0], b32(kv_load_i32((const int8_t*)pairs)));
    I im1 = madd16(zero_i(), mp[2], b32(kv_load_i32((const int8_t*)(pairs + 4))));
    im0 = madd16(im0, mp[1], b32(kv_load_i32((const int8_t*)(pairs + 2))));
    im1 = madd16(im1, mp[3], b32(kv_load_i32((const int8_t*)(pairs + 6))));
    const F scale = bset(*xd);
    F y = first ? zero_f() : ldf(acc[r]);
    y = fma(D, mul(cvt(sum), scale), y);
    y = fma(ND, mul(cvt(add(im0, im1)), scale), y);
    stf(acc[r], y);
  }
}

/* The K-quants' tiles take up to kAmxGroupPanels panels a super-block at a time, fewer where their accumulators
 * would pass kAmxAccBytes. */
constexpr int64_t kAmxGroupPanels = 8;
constexpr int64_t kAmxAccBytes = 256 << 10;

/* a->panels panels x a->rows rows: every 16 rows through the tiles, the rest (and the 32-weight formats' calls of
 * fewer than 16 rows) through the AVX-512 kernel; the K-quants' calls of fewer than 32 rows all through the tiles. */
template <class Fmt>
inline void amx_kernel(const kv_ggml_args* a) {
  constexpr bool super = Fmt::kFold == Fold::kSuper || Fmt::kFold == Fold::kScale16;
  /* the K-quants' calls of fewer than 32 rows: one unit of all their rows, in tiles of as many rows */
  const bool small = super && a->rows < 32;
  const int64_t tiled = small ? a->rows : a->rows / 16 * 16;
  if (tiled > 0) {
    if constexpr (super) {
      /* G panels at a time, super-block by super-block: a super-block's activations for all the rows (tiled x
       * 256 bytes) stay in L2 while the G panels take them, and each panel's super-block is made ready once, for
       * all the rows (its 8 KB of pieces in L1); the accumulators (G x tiled x 64 bytes) wait in memory */
      const int G = (int)std::max<int64_t>(1, std::min<int64_t>(kAmxGroupPanels, (kAmxAccBytes / 64) / tiled));
      thread_local AmxPieces pieces;
      uint8_t* const panel = pieces.data();
      thread_local AlignedVector<float> accs;
      if (accs.size() < (size_t)G * tiled * 16) accs.resize((size_t)G * tiled * 16);  // grown only: no refill
      if (small) amx_configure_super(tiled < 16 ? (int)tiled : 16, tiled > 16 ? (int)tiled - 16 : 16);
      else amx_configure_super();
      for (int p0 = 0; p0 < a->panels; p0 += G) {
        const int g = a->panels - p0 < G ? a->panels - p0 : G;
        for (int v = 0; v < a->nb / 8; ++v) {
          for (int j = 0; j < g; ++j) {
            float (*acc)[16] = (float (*)[16])accs.data() + j * tiled;
            amx_unpack_super<Fmt>(a, p0 + j, v, panel);
            int64_t m = 0;
            for (; m + 32 <= tiled; m += 32) amx_super_block<Fmt, 2>(a, panel, v, m, acc + m);
            if (tiled - m > 16) amx_super_block<Fmt, 2>(a, panel, v, m, acc + m, (int)(tiled - m));  // small
            else if (m < tiled) amx_super_block<Fmt, 1>(a, panel, v, m, acc + m, (int)(tiled - m));
          }
        }
        for (int j = 0; j < g; ++j) {
          const float (*acc)[16] = (const float (*)[16])accs.data() + j * tiled;
          const int cols = panel_cols(a, p0 + j);
          for (int64_t r = 0; r < tiled; ++r) store_y(panel_y(a, p0 + j, r), ldf(acc[r]), cols);
        }
      }
    } else {
      thread_local AmxPanel panel;
      panel.resize(a->nb);
      amx_configure();
      for (int p = 0; p < a->panels; ++p) {
        amx_unpack<Fmt>(a, p, panel);
        for (int64_t m = 0; m < tiled; m += 16) amx_rows<Fmt>(a, panel, p, m);
      }
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
    if (rest.xsum16 != nullptr) rest.xsum16 += tiled * a->ldb;
    if (rest.xsum16h != nullptr) rest.xsum16h += 2 * tiled * a->ldb;
    rest.y += tiled * a->ldy;
    kernel<Fmt>(&rest);
  }
}

}  // namespace kvserve::gguf::avx512
#pragma GCC pop_options
#undef KV_TC0
#undef KV_TA0
#undef KV_TB0

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
