/* GEMM micro-kernels for GGUF's blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K), one per
 * (format, ISA): the scalar reference, AVX2 and AVX-512 VNNI. C++ (templates over the format), leaves as in
 * ukernel.h: extern "C" functions of one kv_ggml_args*, so the same source compiles into the extension
 * (linear_ggml.cpp) and freestanding for the CPU emulator (leaves.cpp, native/ggml_leaves.py). Include it in
 * exactly one translation unit of each build.
 *
 * ---- Weights, as ggml defines them (ggml-common.h; the gguf package's quants.py dequantizes the same way). A
 *   unit is one block of 32 weights or one super-block of 256 (8 sub-blocks of 32); a row is K / weights units:
 *   Q4_0 (18 B / 32):  fp16 d; qs[16] (byte j: weight j low nibble, j + 16 high)        w = d (q - 8)
 *   Q4_1 (20 B / 32):  fp16 d, fp16 m; qs[16]                                          w = d q + m
 *   Q5_0 (22 B / 32):  fp16 d; u32 qh (bit k: weight k's fifth bit); qs[16]            w = d (q - 16)
 *   Q5_1 (24 B / 32):  fp16 d, fp16 m; qh; qs                                          w = d q + m
 *   Q8_0 (34 B / 32):  fp16 d; int8 q[32]                                              w = d q
 *   Q4_K (144 B / 256): fp16 d, fp16 dmin; scales[12]: eight 6-bit (sc, m) pairs; qs[128]: bytes 32j..32j+31
 *                      hold sub-block 2j (low nibbles) and 2j + 1 (high nibbles)       w = (d sc) q - (dmin m)
 *   Q5_K (176 B / 256): as Q4_K plus qh[32] before qs: bit u of qh[l] is the fifth bit of weight l of sub-block u
 *   Q6_K (210 B / 256): ql[128], qh[64], int8 scales[16] (one per 16 weights), fp16 d; weight 128h + 32s + l
 *                      (h < 2, s < 4, l < 32): low 4 bits from ql[64h + 32 (s & 1) + l] (high nibble if s >= 2),
 *                      high 2 bits from qh[32h + l] >> 2s                               w = (d sc) (q - 32)
 *   Each product d sc, d sc q, d (q - o) and dmin m is exact in float32 (at most 23 significant bits), so a
 *   weight has at most one rounding (the sum of Q4_1 and Q5_1 / the difference of the K-quants), as gguf has it.
 *
 * ---- Packed (linear_ggml.cpp packs once at load time; native/ggml_leaves.py writes the same in numpy): panels
 *   of NR features, a panel being the row's units in K order, each unit NR * unit-bytes contiguous bytes: the
 *   unit's fields in kLayouts' order, a 2-byte field (an fp16) as NR halves, any other as chunks of NR * 4 bytes,
 *   bytes 4n..4n+3 of chunk c being bytes 4c..4c+3 of the field of feature n. So a 32-bit vector lane is one
 *   feature. Q5_0 / Q5_1's qh word is stored with its bits permuted (kv_qh_pack): bit t of byte i holds weight
 *   4t + i's fifth bit and bit 4 + t weight 16 + 4t + i's, for the lanes of chunk t of qs. Features past N in the
 *   last panel are zero bytes (computed, not stored).
 *
 * ---- Activations (linear_ggml.cpp, act_quant.h): per row and block of 32 (llama.cpp's Q8_0 blocks), or for the
 *   K-quants per super-block of 256 (as llama.cpp's Q8_K: one scale per 256), int8 codes x = round(x / d_x) within
 *   +-127, d_x = max|x| / 127 (a super-block's d_x in each of its 8 blocks' xd); per block of 32 the codes' sum
 *   qsum (xsum; as int16 in xsum16, read by Q4_K and Q5_K), xs = d_x * (float)qsum, and qsum per 16 codes as
 *   int16 (xsum16h, read by Q6_K: its offset on the activation side, -32 sum_j sc_j qsum16_j per super-block).
 *
 * ---- The arithmetic, the same bits on every path, tile position, number of rows and panels of a call, and
 *   batch: per output, acc = 0.0f, then per block b of 32 weights in K order, with exact integer dots of the codes
 *   q (as stored) and the activation codes x:
 *     scale-min (Q4_1, Q5_1): s = (float)dot * d_x; acc = fmaf(d, s, acc); acc = fmaf(m, xs, acc)
 *     offset (Q4_0 o = 8, Q5_0 o = 16, Q8_0 o = 0): s = (float)(dot - o qsum) * d_x; acc = fmaf(d, s, acc)
 *   and per super-block of 256 (the K-quants) in integer: for Q4_K and Q5_K its 8 blocks' dots dot_j, 6-bit scales
 *   sc_j and minimums m_j, I = sum_j sc_j dot_j and Im = sum_j m_j qsum_j (|I| <= 63 * 31 * 127 * 256 < 2^31);
 *   for Q6_K its 16 int8 scales sc_j of 16 weights each, I = sum_j sc_j (dot_j - 32 qsum16_j), dot_j over those
 *   16 (|I| <= 128 * 32 * 127 * 256 < 2^31; the vector paths form sum_j sc_j dot_j of the codes as stored, q up to
 *   63, then take 32 sum_j sc_j qsum16_j off: |sum_j sc_j dot_j| <= 128 * 63 * 127 * 256 < 2^31 too), then
 *     super (Q4_K, Q5_K): acc = fmaf(d, (float)I * d_x, acc); acc = fmaf(-dmin, (float)Im * d_x, acc)
 *     scale16 (Q6_K):     acc = fmaf(d, (float)I * d_x, acc)
 *   (one or two float steps a super-block rather than one or two a block: what lets AMX tiles sum a super-block's
 *   dots inside the tile, ukernel_gguf_amx.h).
 *   y = acc. The integer parts are exact however they are formed, so the float sequence alone fixes the bits:
 *   vpdpbusd (u8 codes x s8 activations; Q8_0's codes as q + 128, 128 qsum taken off; Q4_K's high nibbles in
 *   place as 16 q, the dot shifted back), or vpmaddubsw pairs summed in int16 only as far as they cannot
 *   overflow (Q8_0's sign moved onto x: |q| x sign(x, q)), the K-quants' pairs widened by vpmaddwd against their
 *   scale (sc dot with no int32 dot of its own).
 *
 * ---- Loop order (vector paths): a call takes `panels` panels and any number of rows. A tile is R rows x P
 *   panels (R <= MR; P > 1 only for Q6_K's decode of 2 rows on AVX-512 (kPanelsOf) and Q4_K's tiles of many
 *   rows on AVX2 (kPrefillPanels), so one activation broadcast feeds R * P products); its accumulators stay
 *   in registers over the whole row, and per group of 8 blocks the codes are made from the panel's bytes where they are used (a 32-bit lane = 4 codes of one feature meeting
 *   4 activation codes broadcast as one int32), B blocks at once when they share loads. More rows than MR: per
 *   panel, every tile of MR rows, the K-quants' prefetching the groups to come towards L2 (kAhead: their decode
 *   tiles of 3 rows or more too); or, for the K-quants
 *   kUnpackGroups names, per panel and group, the group's codes and scales unpacked once into memory and every
 *   tile of MR rows taking them, its accumulators read from y and written back around the group (the same float
 *   steps in the same order).
 */
#ifndef KVSERVE_UKERNEL_GGUF_H
#define KVSERVE_UKERNEL_GGUF_H

#include "ukernel.h"

extern "C" {
void kv_q4_0_scalar(const kv_ggml_args* a);
void kv_q4_1_scalar(const kv_ggml_args* a);
void kv_q4_1_avx2(const kv_ggml_args* a);
void kv_q4_1_avx512(const kv_ggml_args* a);
void kv_q8_0_scalar(const kv_ggml_args* a);
void kv_q8_0_avx2(const kv_ggml_args* a);
void kv_q8_0_avx512(const kv_ggml_args* a);
void kv_q4_0_avx2(const kv_ggml_args* a);
void kv_q4_0_avx512(const kv_ggml_args* a);
void kv_q5_0_scalar(const kv_ggml_args* a);
void kv_q5_0_avx2(const kv_ggml_args* a);
void kv_q5_0_avx512(const kv_ggml_args* a);
void kv_q5_1_scalar(const kv_ggml_args* a);
void kv_q5_1_avx2(const kv_ggml_args* a);
void kv_q5_1_avx512(const kv_ggml_args* a);
void kv_q4_k_scalar(const kv_ggml_args* a);
void kv_q4_k_avx2(const kv_ggml_args* a);
void kv_q4_k_avx512(const kv_ggml_args* a);
void kv_q5_k_scalar(const kv_ggml_args* a);
void kv_q5_k_avx2(const kv_ggml_args* a);
void kv_q5_k_avx512(const kv_ggml_args* a);
void kv_q6_k_scalar(const kv_ggml_args* a);
void kv_q6_k_avx2(const kv_ggml_args* a);
void kv_q6_k_avx512(const kv_ggml_args* a);
}

#include "gguf_layout.h"

namespace kvserve::gguf {

/* ---- Formats: the unit, the largest code (how far the AVX2 path may sum vpmaddubsw pairs in int16), the fold,
 * and the scalar decoding of one unit as ggml defines it: q[weights] the codes as stored, per block b D[b] and
 * Mn[b] (scale-min), d = D[0] (offset, scale16) and sc[16] (scale16); super: d = D[0], -dmin = Mn[0], sc[b] and
 * sc[8 + b] block b's scale and minimum. */
enum class Fold { kScaleMin, kOffset, kScale16, kSuper };

inline float half_at(const uint8_t* p) { return kv_half_to_float(kv_load_u16(p)); }

/* Q4_K / Q5_K's 6-bit scale and minimum of sub-block b (ggml's get_scale_min_k4). */
inline void scale_min_k4(const uint8_t* s, int b, int32_t& sc, int32_t& m) {
  if (b < 4) {
    sc = s[b] & 63;
    m = s[b + 4] & 63;
  } else {
    sc = (s[b + 4] & 15) | ((s[b - 4] >> 6) << 4);
    m = (s[b + 4] >> 4) | ((s[b] >> 6) << 4);
  }
}

struct Q4_0 {
  static constexpr Kind kKind = kQ4_0;
  static constexpr Fold kFold = Fold::kOffset;
  static constexpr int kMaxCode = 15, kOffset = 8;
  static void decode(const uint8_t* raw, int32_t* q, float* D, float*, int32_t*) {
    for (int j = 0; j < 16; ++j) {
      q[j] = raw[2 + j] & 15;
      q[j + 16] = raw[2 + j] >> 4;
    }
    D[0] = half_at(raw);
  }
};

/* Q5_0 / Q5_1's codes: nibbles at qs, fifth bits in the word at qh. */
inline void decode_q5(const uint8_t* qs, const uint8_t* qh, int32_t* q) {
  const uint32_t h = (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
  for (int j = 0; j < 16; ++j) {
    q[j] = (qs[j] & 15) | (int32_t)(((h >> j) & 1) << 4);
    q[j + 16] = (qs[j] >> 4) | (int32_t)(((h >> (j + 16)) & 1) << 4);
  }
}

struct Q5_0 {
  static constexpr Kind kKind = kQ5_0;
  static constexpr Fold kFold = Fold::kOffset;
  static constexpr int kMaxCode = 31, kOffset = 16;
  static void decode(const uint8_t* raw, int32_t* q, float* D, float*, int32_t*) {
    decode_q5(raw + 6, raw + 2, q);
    D[0] = half_at(raw);
  }
};

/* Q8_0: signed codes, w = d q (an offset of 0: the scalar path takes the codes as they are). */
struct Q8_0 {
  static constexpr Kind kKind = kQ8_0;
  static constexpr Fold kFold = Fold::kOffset;
  static constexpr int kMaxCode = 127, kOffset = 0;
  static void decode(const uint8_t* raw, int32_t* q, float* D, float*, int32_t*) {
    for (int k = 0; k < 32; ++k) q[k] = (int8_t)raw[2 + k];
    D[0] = half_at(raw);
  }
};

struct Q4_1 {
  static constexpr Kind kKind = kQ4_1;
  static constexpr Fold kFold = Fold::kScaleMin;
  static constexpr int kMaxCode = 15, kOffset = 0;
  static void decode(const uint8_t* raw, int32_t* q, float* D, float* Mn, int32_t*) {
    for (int j = 0; j < 16; ++j) {
      q[j] = raw[4 + j] & 15;
      q[j + 16] = raw[4 + j] >> 4;
    }
    D[0] = half_at(raw);
    Mn[0] = half_at(raw + 2);
  }
};

struct Q5_1 {
  static constexpr Kind kKind = kQ5_1;
  static constexpr Fold kFold = Fold::kScaleMin;
  static constexpr int kMaxCode = 31, kOffset = 0;
  static void decode(const uint8_t* raw, int32_t* q, float* D, float* Mn, int32_t*) {
    decode_q5(raw + 8, raw + 4, q);
    D[0] = half_at(raw);
    Mn[0] = half_at(raw + 2);
  }
};

/* Q4_K and Q5_K (Bits 4 or 5): D[0] = d, Mn[0] = -dmin, scm[b] and scm[8 + b] sub-block b's scale and minimum,
 * codes from qs (and qh). */
template <int Bits>
struct QK45 {
  static constexpr Kind kKind = Bits == 4 ? kQ4_K : kQ5_K;
  static constexpr Fold kFold = Fold::kSuper;
  static constexpr int kMaxCode = (1 << Bits) - 1, kOffset = 0;
  static void decode(const uint8_t* raw, int32_t* q, float* D, float* Mn, int32_t* scm) {
    D[0] = half_at(raw);
    Mn[0] = -half_at(raw + 2);
    const uint8_t* qh = raw + 16;
    const uint8_t* qs = raw + (Bits == 5 ? 48 : 16);
    for (int b = 0; b < 8; ++b) {
      scale_min_k4(raw + 4, b, scm[b], scm[8 + b]);
      for (int l = 0; l < 32; ++l) {
        const int byte = qs[32 * (b / 2) + l];
        q[32 * b + l] = (b & 1 ? byte >> 4 : byte & 15) | (Bits == 5 ? ((qh[l] >> b) & 1) << 4 : 0);
      }
    }
  }
};
using Q4_K = QK45<4>;
using Q5_K = QK45<5>;

struct Q6_K {
  static constexpr Kind kKind = kQ6_K;
  static constexpr Fold kFold = Fold::kScale16;
  static constexpr int kMaxCode = 63, kOffset = 32;
  static void decode(const uint8_t* raw, int32_t* q, float* D, float*, int32_t* sc) {
    for (int h = 0; h < 2; ++h)
      for (int s = 0; s < 4; ++s)
        for (int l = 0; l < 32; ++l) {
          const int low = raw[64 * h + 32 * (s & 1) + l];
          q[128 * h + 32 * s + l] = (s >= 2 ? low >> 4 : low & 15) | (((raw[128 + 32 * h + l] >> (2 * s)) & 3) << 4);
        }
    for (int j = 0; j < 16; ++j) sc[j] = (int8_t)raw[192 + j];
    D[0] = half_at(raw + 208);
  }
};

/* The reference: one output at a time, in the order above, for panels of any width a->nr and any rows. Per
 * (feature, unit): the feature's unit is moved back to the file's bytes and decoded as ggml defines it, then every
 * row takes it (the row's accumulator kept in y between units). */
template <class Fmt>
void reference(const kv_ggml_args* a) {
  const UnitLayout& layout = kLayouts[Fmt::kKind];
  const int blocks = layout.weights / 32, units = a->nb / blocks;
  const int64_t unit_bytes = (int64_t)layout.bytes * a->nr;
  uint8_t raw[256];
  int32_t q[256], sc[16];
  float D[8], Mn[8];
  for (int p = 0; p < a->panels; ++p)
  for (int n = 0; n < (p == a->panels - 1 ? a->cols : a->nr); ++n)
    for (int u = 0; u < units; ++u) {
      move_unit(layout, raw, (uint8_t*)a->w + p * a->ldw + u * unit_bytes, a->nr, n, false);
      Fmt::decode(raw, q, D, Mn, sc);
      for (int r = 0; r < a->rows; ++r) {
        float* y = a->y + r * a->ldy + (int64_t)p * a->nr + n;
        float acc = u == 0 ? 0.0f : *y;
        if (Fmt::kFold == Fold::kSuper) {
          const int64_t at = r * a->ldb + 8 * u;  // row r's first block of the super-block
          int32_t I = 0, Im = 0;
          for (int i = 0; i < 8; ++i) {
            const int8_t* x = a->xq + r * a->ldq + 32 * (8 * u + i);
            int32_t dot = 0;
            for (int k = 0; k < 32; ++k) dot += q[32 * i + k] * x[k];
            I += sc[i] * dot;
            Im += sc[8 + i] * a->xsum[at + i];
          }
          acc = __builtin_fmaf(D[0], (float)I * a->xd[at], acc);
          acc = __builtin_fmaf(Mn[0], (float)Im * a->xd[at], acc);
          *y = acc;
          continue;
        }
        if (Fmt::kFold == Fold::kScale16) {
          const int64_t at = r * a->ldb + 8 * u;
          const int8_t* x = a->xq + r * a->ldq + 256 * u;
          int32_t I = 0;
          for (int j = 0; j < 16; ++j) {
            int32_t dot = 0;
            for (int k = 16 * j; k < 16 * j + 16; ++k) dot += (q[k] - Fmt::kOffset) * x[k];
            I += sc[j] * dot;
          }
          *y = __builtin_fmaf(D[0], (float)I * a->xd[at], acc);
          continue;
        }
        for (int i = 0; i < blocks; ++i) {
          const int64_t b = (int64_t)u * blocks + i, at = r * a->ldb + b;
          const int8_t* x = a->xq + r * a->ldq + 32 * b;
          const int32_t* code = q + 32 * i;
          int32_t dot = 0;
          for (int k = 0; k < 32; ++k) dot += (code[k] - Fmt::kOffset) * x[k];
          acc = __builtin_fmaf(D[i], (float)dot * a->xd[at], acc);
          if (Fmt::kFold == Fold::kScaleMin) acc = __builtin_fmaf(Mn[i], a->xs[at], acc);
        }
        *y = acc;
      }
    }
}

}  // namespace kvserve::gguf

#ifdef KV_UK_X86

/* ---- AVX2 (+ FMA, F16C): 8 features per panel, tiles of up to 4 rows ---- */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace kvserve::gguf::avx2 {

constexpr int kW = KV_NR_AVX2, kMR = KV_MR_AVX2;
using I = __m256i;
using F = __m256;

inline I ld(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline void st(void* p, I v) { _mm256_storeu_si256((__m256i*)p, v); }
inline I b8(int v) { return _mm256_set1_epi8((char)v); }
inline I b32(int32_t v) { return _mm256_set1_epi32(v); }
inline I zero_i() { return _mm256_setzero_si256(); }
inline I and_(I a, I b) { return _mm256_and_si256(a, b); }
inline I or_(I a, I b) { return _mm256_or_si256(a, b); }
inline I xor_(I a, I b) { return _mm256_xor_si256(a, b); }
inline I add(I a, I b) { return _mm256_add_epi32(a, b); }
inline I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
inline I mullo(I a, I b) { return _mm256_mullo_epi32(a, b); }
inline I madd16(I acc, I a, I b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
/* 32-bit lanes shifted left by s (right by -s), logically */
inline I shift(I v, int s) { return s >= 0 ? _mm256_slli_epi32(v, s) : _mm256_srli_epi32(v, -s); }
inline I srl(I v, int s) { return _mm256_srli_epi32(v, s); }
inline I sra(I v, int s) { return _mm256_srai_epi32(v, s); }
/* byte k of each 32-bit lane, zero-extended (vpshufb indexes within 128 bits; index 0x80 writes zero) */
inline I byte_of(I v, int k) {
  const int32_t b = (int32_t)(0x80808000u | (uint32_t)k);
  return _mm256_shuffle_epi8(v, _mm256_setr_epi32(b, b + 4, b + 8, b + 12, b, b + 4, b + 8, b + 12));
}
/* byte k of each 32-bit lane in both of its 16-bit halves: zero-extended (byte_pair_of), or sign-extended
 * (sbyte_pair_of): a scale as vpmaddwd's pair of multipliers */
inline I byte_pair_of(I v, int k) {
  const int32_t b = (int32_t)(0x80008000u | (uint32_t)k | ((uint32_t)k << 16)), n = 0x40004;
  return _mm256_shuffle_epi8(v, _mm256_setr_epi32(b, b + n, b + 2 * n, b + 3 * n, b, b + n, b + 2 * n, b + 3 * n));
}
inline I sbyte_pair_of(I v, int k) {
  const int32_t b = (int32_t)(0x00800080u | ((uint32_t)k << 8) | ((uint32_t)k << 24)), n = 0x04000400;
  return _mm256_srai_epi16(
      _mm256_shuffle_epi8(v, _mm256_setr_epi32(b, b + n, b + 2 * n, b + 3 * n, b, b + n, b + 2 * n, b + 3 * n)), 8);
}
/* Q4_K's high nibbles are shifted down to codes 0..15 (vpmaddubsw pairs of codes up to 240 could saturate) */
constexpr bool kHighInPlace = false;
/* Q8_0's codes stay signed: the dots move their signs onto the activations (vpmaddubsw pairs <= 2 * 128 * 127) */
constexpr bool kSignedDots = true;
/* low | (high & mask), bitwise */
inline I merge(I low, I high, I mask) { return _mm256_or_si256(low, _mm256_and_si256(high, mask)); }
inline F cvt(I v) { return _mm256_cvtepi32_ps(v); }
inline F half(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline F ldf(const float* p) { return _mm256_loadu_ps(p); }
inline void stf(float* p, F v) { _mm256_storeu_ps(p, v); }
inline F bset(float v) { return _mm256_set1_ps(v); }
inline F zero_f() { return _mm256_setzero_ps(); }
inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
inline F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
inline F neg(F v) { return _mm256_xor_ps(v, _mm256_set1_ps(-0.0f)); }
inline F load_y(const float* y, int cols) {
  if (cols >= kW) return _mm256_loadu_ps(y);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_maskload_ps(y, _mm256_cmpgt_epi32(_mm256_set1_epi32(cols), lane));
}
inline void store_y(float* y, F v, int cols) { kv_store_avx2(y, v, cols); }

/* v as it is, in a register: an empty asm the compiler cannot see through, so a chain of sums stays a chain. GCC
 * otherwise reassociates the integer sums of `dots` into trees that keep every product of a block live at once:
 * spills on 16 registers (measured: the 8-row Q4_1 / Q8_0 tiles 10-25% slower). No instruction. */
inline __attribute__((always_inline)) void pin(I& v) { __asm__("" : "+x"(v)); }

/* out[b][p][r] += the int32 dots of chunks c0..c1-1 of block i0 + b's codes in panel p (src[p].code(i, c): kW
 * lanes of 4 codes) with row r's activation codes of the block (x + 32 b + r * ldq). vpmaddubsw (u8 codes x s8
 * activations) pairs are summed in int16 for as many chunks as cannot overflow (2 * 127 * MaxCode each), then
 * widened by vpmaddwd. */
template <int R, int P, int B, int MaxCode, bool Signed, bool Scaled, class Src>
inline __attribute__((always_inline)) void pair_dots(const Src* src, int i0, const int8_t* x, int64_t ldq, int c0,
                                                     int c1, const I (*sc16)[P], I* out) {
  constexpr int flush = 32767 / (2 * 127 * MaxCode);
  const I ones = _mm256_set1_epi16(1);
  static_assert(flush >= 1, "vpmaddubsw pairs of these codes would saturate");
  I pairs[B][P][R];
  KV_UNROLL for (int b = 0; b < B; ++b) KV_UNROLL for (int p = 0; p < P; ++p) KV_UNROLL for (int r = 0; r < R; ++r)
    pairs[b][p][r] = zero_i();
  KV_UNROLL for (int c = c0; c < c1; ++c) {
    KV_UNROLL for (int b = 0; b < B; ++b) {
      I cv[P];
      KV_UNROLL for (int p = 0; p < P; ++p) cv[p] = src[p].code(i0 + b, c);
      KV_UNROLL for (int r = 0; r < R; ++r) {
        const I xv = b32(kv_load_i32(x + 32 * b + r * ldq + 4 * c));
        KV_UNROLL for (int p = 0; p < P; ++p) {
          /* signed codes: |w| on the unsigned side, w's sign moved onto x (w = 0 gives 0, as its product) */
          const I u = Signed ? _mm256_abs_epi8(cv[p]) : cv[p], s8 = Signed ? _mm256_sign_epi8(xv, cv[p]) : xv;
          pairs[b][p][r] = _mm256_add_epi16(pairs[b][p][r], _mm256_maddubs_epi16(u, s8));
          pin(pairs[b][p][r]);
        }
      }
    }
    if ((c - c0 + 1) % flush == 0 || c + 1 == c1) {
      KV_UNROLL for (int b = 0; b < B; ++b) KV_UNROLL for (int p = 0; p < P; ++p) KV_UNROLL for (int r = 0; r < R; ++r) {
        I& o = out[Scaled ? p * R + r : (b * P + p) * R + r];
        o = add(o, _mm256_madd_epi16(pairs[b][p][r], Scaled ? sc16[b][p] : ones));
        pin(o);
        pairs[b][p][r] = zero_i();
      }
    }
  }
}

template <int R, int P, int B, int MaxCode, bool Signed, class Src>
inline __attribute__((always_inline)) void dots(const Src* src, int i0, const int8_t* x, int64_t ldq, int c0, int c1,
                                                I (*out)[P][R]) {
  pair_dots<R, P, B, MaxCode, Signed, false>(src, i0, x, ldq, c0, c1, nullptr, &out[0][0][0]);
}

/* The K-quants' dots of blocks i0.. each times its scale, into the super-block's sums: out[p][r] += sum_b
 * sc_b dot_b, the scale in vpmaddwd's multipliers (sc16[b][p]: byte_pair_of's form) where the pairs widen anyway,
 * so no int32 dot, vpmulld or sum of its own (as llama.cpp's AVX2 K-quant dots weight their pairs). Exact: a pair
 * sum times a scale is below 2^31, and so is the super-block's sum (ukernel_gguf.h). */
constexpr bool kScaledPairs = true;
/* bytes 2t and 2t + 1 of each 32-bit lane, sign-extended into its low and high 16-bit halves */
inline I sbyte_pairs(I v, int t) {
  const int32_t b = (int32_t)(((uint32_t)(2 * t + 1) << 24) | 0x800000u | ((uint32_t)(2 * t) << 8) | 0x80u), n = 0x04000400;
  return _mm256_srai_epi16(
      _mm256_shuffle_epi8(v, _mm256_setr_epi32(b, b + n, b + 2 * n, b + 3 * n, b, b + n, b + 2 * n, b + 3 * n)), 8);
}
static_assert(!kHighInPlace, "scaled pairs take codes as they are (no dot shifted down)");
template <int R, int P, int B, int MaxCode, bool Signed, class Src>
inline __attribute__((always_inline)) void scaled_dots(const Src* src, int i0, const int8_t* x, int64_t ldq, int c0,
                                                       int c1, const I (*sc16)[P], I (*out)[R]) {
  pair_dots<R, P, B, MaxCode, Signed, true>(src, i0, x, ldq, c0, c1, sc16, &out[0][0]);
}

/* Panels per direct tile of R rows, and the int32 accumulators a tile's dots may keep (each has an int16 twin).
 * One panel: a tile of several panels spills here and reads several streams at once (measured slower for every
 * format, 1 row to 4). */
template <class Fmt, int R>
constexpr int kPanelsOf = 1;
constexpr int kDotRegs = 4;
/* Panels per tile of kMR rows in calls of more than kMR rows: Q4_K's tiles take two, so one broadcast of a row's
 * activation codes feeds two vpmaddubsw (measured on an AVX2-only AMD EPYC, one thread, a Llama-3.2-1B layer:
 * 1.02-1.09x at 8, 32 and 512 rows; a bare loop of the same operations 1.25x, the rest lost to the registers the
 * eight accumulators take). Q5_K and Q6_K take their groups unpacked (below). */
template <class Fmt>
constexpr int kPrefillPanels = Fmt::kKind == kQ4_K ? 2 : 1;
/* Tiles of many rows take Q5_K's and Q6_K's groups unpacked once (Unpacked; measured on an AMD EPYC, a
 * Llama-3.2-1B layer at 32 and 512 rows: 1.1-1.2x the tiles that make the codes per tile). Not Q4_K: its codes
 * are one mask a chunk, and over the layer the unpacked tiles were no faster. */
template <class Fmt>
constexpr bool kUnpackGroups = Fmt::kKind == kQ5_K || Fmt::kKind == kQ6_K;
template <class Fmt>
constexpr bool kUnpackable = false;  // kv_ggml_args.unpack changes nothing here
/* Tiles of one and two rows ignore kv_ggml_args.ahead: prefetching one-row tiles towards L1 made Q4_K's slower on a
 * Sapphire Rapids VM. */
constexpr bool kPrefetchL1 = false;

#include "ukernel_gguf_body.h"

}  // namespace kvserve::gguf::avx2
#pragma GCC pop_options

/* ---- AVX-512 F/BW/VL/VNNI: 16 features per panel, tiles of up to 8 rows ---- */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c") /* KV_AVX512_TARGET: a pragma takes no macro */
namespace kvserve::gguf::avx512 {

constexpr int kW = KV_NR_AVX512, kMR = KV_MR_AVX512;
using I = __m512i;
using F = __m512;

inline I ld(const void* p) { return _mm512_loadu_si512(p); }
inline void st(void* p, I v) { _mm512_storeu_si512(p, v); }
inline I b8(int v) { return _mm512_set1_epi8((char)v); }
inline I b32(int32_t v) { return _mm512_set1_epi32(v); }
inline I zero_i() { return _mm512_setzero_si512(); }
inline I and_(I a, I b) { return _mm512_and_si512(a, b); }
inline I or_(I a, I b) { return _mm512_or_si512(a, b); }
inline I xor_(I a, I b) { return _mm512_xor_si512(a, b); }
inline I add(I a, I b) { return _mm512_add_epi32(a, b); }
inline I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
inline I mullo(I a, I b) { return _mm512_mullo_epi32(a, b); }
inline I madd16(I acc, I a, I b) { return _mm512_dpwssd_epi32(acc, a, b); }
inline I shift(I v, int s) { return s >= 0 ? _mm512_slli_epi32(v, s) : _mm512_srli_epi32(v, -s); }
inline I srl(I v, int s) { return _mm512_srli_epi32(v, s); }
inline I sra(I v, int s) { return _mm512_srai_epi32(v, s); }
inline I byte_of(I v, int k) {
  const int32_t b = (int32_t)(0x80808000u | (uint32_t)k);
  return _mm512_shuffle_epi8(v, _mm512_set4_epi32(b + 12, b + 8, b + 4, b));
}
/* vpdpbusd sums its products in int32 lanes: the scales multiply int32 dots (no scaled pairs; byte_pair_of and
 * sbyte_pair_of are declared for the shared body, never used here) */
constexpr bool kScaledPairs = false;
I byte_pair_of(I v, int k);
I sbyte_pair_of(I v, int k);
template <int R, int P, int B, int MaxCode, bool Signed, class Src>
void scaled_dots(const Src* src, int i0, const int8_t* x, int64_t ldq, int c0, int c1, const I (*sc16)[P],
                 I (*out)[R]);
/* bytes 2t and 2t + 1 of each 32-bit lane, sign-extended into its low and high 16-bit halves: two int8 scales as
 * vpdpwssd's pair of multipliers */
inline I sbyte_pairs(I v, int t) {
  const int32_t b = (int32_t)(((uint32_t)(2 * t + 1) << 24) | 0x800000u | ((uint32_t)(2 * t) << 8) | 0x80u);
  return _mm512_srai_epi16(_mm512_shuffle_epi8(v, _mm512_set4_epi32(b + 0x0C000C00, b + 0x08000800, b + 0x04000400, b)), 8);
}
/* Q4_K's high nibbles go into vpdpbusd in place (q & 0xF0 = 16 q: 240 * 127 * 4 per lane and instruction, < 2^20
 * a block), the block's dot shifted down by 4 after: exact, and one operation fewer per chunk */
constexpr bool kHighInPlace = true;
/* Q8_0's codes go into vpdpbusd as w + 128 (w xor 0x80); 128 qsum comes off the dot */
constexpr bool kSignedDots = false;
/* low | (high & mask) as vpandd then vpord: one vpternlogd would do, but on an AMD Zen 4 it takes the pipes of
 * vpdpbusd and the float multiplies (measured: 8 vpdpbusd + 8 vpternlogd 16 cycles, + 8 vpandd 8), where the two
 * bitwise operations go to the others. The empty asm keeps GCC from fusing them back. */
inline I merge(I low, I high, I mask) {
  I masked = _mm512_and_si512(high, mask);
  __asm__("" : "+v"(masked));
  return _mm512_or_si512(low, masked);
}
inline F cvt(I v) { return _mm512_cvtepi32_ps(v); }
inline F half(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline F ldf(const float* p) { return _mm512_loadu_ps(p); }
inline void stf(float* p, F v) { _mm512_storeu_ps(p, v); }
inline F bset(float v) { return _mm512_set1_ps(v); }
inline F zero_f() { return _mm512_setzero_ps(); }
inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
inline F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
inline F neg(F v) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000u))); }
inline F load_y(const float* y, int cols) { return _mm512_maskz_loadu_ps((__mmask16)((1u << cols) - 1u), y); }
inline void store_y(float* y, F v, int cols) { kv_store_avx512(y, v, cols); }

/* out[b][p][r] += the int32 dots of chunks c0..c1-1 of block i0 + b in panel p (vpdpbusd: u8 codes x s8
 * activations, 4 products a lane), one activation broadcast serving every panel. With few accumulators the chunks
 * spread over independent chains, summed exactly at the end. */
template <int R, int P, int B, int MaxCode, bool Signed, class Src>
inline __attribute__((always_inline)) void dots(const Src* src, int i0, const int8_t* x, int64_t ldq, int c0, int c1,
                                                I (*out)[P][R]) {
  static_assert(!Signed, "vpdpbusd takes unsigned codes");
  constexpr int chains = B * R * P >= 4 ? 1 : 4 / (B * R * P);
  I part[B][P][R][chains];
  KV_UNROLL for (int b = 0; b < B; ++b) KV_UNROLL for (int p = 0; p < P; ++p) KV_UNROLL for (int r = 0; r < R; ++r) {
    part[b][p][r][0] = out[b][p][r];
    KV_UNROLL for (int k = 1; k < chains; ++k) part[b][p][r][k] = zero_i();
  }
  KV_UNROLL for (int c = c0; c < c1; ++c)
    KV_UNROLL for (int b = 0; b < B; ++b) {
      I cv[P];
      KV_UNROLL for (int p = 0; p < P; ++p) cv[p] = src[p].code(i0 + b, c);
      KV_UNROLL for (int r = 0; r < R; ++r) {
        const int8_t* xr = x + 32 * b + r * ldq + 4 * c;
        if constexpr (P == 1) {
          /* the activations' broadcast inside vpdpbusd ({1to16}): GCC makes it a vpbroadcastd of its own, one more
           * operation per vpdpbusd (measured: the tiles of many rows 2-9% faster without) */
          __asm__("vpdpbusd %2%{1to16%}, %1, %0"
                  : "+v"(part[b][0][r][c % chains])
                  : "v"(cv[0]), "m"(*(const int32_t*)xr));
        } else {
          const I xv = b32(kv_load_i32(xr));
          KV_UNROLL for (int p = 0; p < P; ++p)
            part[b][p][r][c % chains] = _mm512_dpbusd_epi32(part[b][p][r][c % chains], cv[p], xv);
        }
      }
    }
  KV_UNROLL for (int b = 0; b < B; ++b) KV_UNROLL for (int p = 0; p < P; ++p) KV_UNROLL for (int r = 0; r < R; ++r) {
    out[b][p][r] = part[b][p][r][0];
    KV_UNROLL for (int k = 1; k < chains; ++k) out[b][p][r] = add(out[b][p][r], part[b][p][r][k]);
  }
}

/* Panels per direct tile of R rows (one activation broadcast feeds R * P products), and the int32 accumulators a
 * tile's dots may keep in registers. Several panels only for Q6_K (its many operations per code are shared by
 * the panels); the lighter formats are bound by the stream of weights, read fastest one panel at a time with
 * four chains of dots per row (measured). */
template <class Fmt, int R>
constexpr int kPanelsOf = Fmt::kKind == kQ6_K ? (R == 2 ? 2 : 1) : 1;
template <class Fmt>
constexpr int kPrefillPanels = 1;  // the tiles of many rows read one panel each
constexpr int kDotRegs = 16;
/* No format's tiles of many rows take their groups unpacked: the codes made per tile cost bitwise operations
 * (merge as vpandd and vpord), which run beside vpdpbusd, and the accumulators stay in registers over the whole
 * row (measured on an AMD EPYC, a Llama-3.2-1B layer at 512 rows: Q6_K's direct tiles 1.25x its unpacked ones;
 * Q4_K's run near the bound of its vpdpbusd and float steps, 11 of Zen 4's vpdpbusd-or-float cycles a block and
 * row, and unpacked ran 0.9x; Q5_K's no faster). */
template <class Fmt>
constexpr bool kUnpackGroups = false;
/* ... unless the call says so (kv_ggml_args.unpack: cpu.h's gguf_unpack_default, on Intel CPUs). There vpdpbusd,
 * the float steps and every bitwise operation share two ports (0 and 5), so the codes made per tile cost what
 * they save elsewhere: measured on a Sapphire Rapids VM, one thread, a 2048 x 2048 layer at 32 and 64 rows, Q6_K
 * unpacked 1.09-1.11x its direct tiles (its per-16 scales applied in integer), Q5_K 1.05-1.17x, Q4_K 0.99-1.04x
 * (its codes are one mask a chunk: not taken). */
template <class Fmt>
constexpr bool kUnpackable = Fmt::kKind == kQ5_K || Fmt::kKind == kQ6_K;
/* The K-quants' tiles of one and two rows prefetch kv_ggml_args.ahead bytes ahead towards L1 (cpu.h's
 * gguf_prefetch_default). */
constexpr bool kPrefetchL1 = true;

#include "ukernel_gguf_body.h"

}  // namespace kvserve::gguf::avx512
#pragma GCC pop_options

#endif /* KV_UK_X86 */

/* ---- The leaves: extern "C", one struct argument. */
#ifdef KV_UK_X86
#define KV_GGUF_LEAVES(name, Fmt)                                                                        \
  extern "C" void kv_##name##_scalar(const kv_ggml_args* a) { kvserve::gguf::reference<kvserve::gguf::Fmt>(a); } \
  extern "C" __attribute__((target("avx2,fma,f16c"))) void kv_##name##_avx2(const kv_ggml_args* a) {  \
    kvserve::gguf::avx2::kernel<kvserve::gguf::Fmt>(a);                                                    \
  }                                                                                                    \
  extern "C" __attribute__((target(KV_AVX512_TARGET))) void kv_##name##_avx512(const kv_ggml_args* a) { \
    kvserve::gguf::avx512::kernel<kvserve::gguf::Fmt>(a);                                                  \
  }
#else
#define KV_GGUF_LEAVES(name, Fmt) \
  extern "C" void kv_##name##_scalar(const kv_ggml_args* a) { kvserve::gguf::reference<kvserve::gguf::Fmt>(a); }
#endif

KV_GGUF_LEAVES(q4_0, Q4_0)
KV_GGUF_LEAVES(q4_1, Q4_1)
KV_GGUF_LEAVES(q5_0, Q5_0)
KV_GGUF_LEAVES(q5_1, Q5_1)
KV_GGUF_LEAVES(q8_0, Q8_0)
KV_GGUF_LEAVES(q4_k, Q4_K)
KV_GGUF_LEAVES(q5_k, Q5_K)
KV_GGUF_LEAVES(q6_k, Q6_K)

#undef KV_GGUF_LEAVES

#endif /* KVSERVE_UKERNEL_GGUF_H */
