/* Q4_1 micro-kernels (scalar, AVX2, AVX-512 VNNI): layouts and the exact float sequence in ukernel.h.
 * Header-only, C and C++; include it in exactly one translation unit (linear_ggml.cpp, leaves.c). */
#ifndef KVSERVE_UKERNEL_Q4_1_H
#define KVSERVE_UKERNEL_Q4_1_H

#include "ukernel.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The reference: one output at a time, in ukernel.h's order, for panels of any width a->nr. */
void kv_q4_1_scalar(const kv_ggml_args* a) {
  const int nr = a->nr;
  const int64_t block = (int64_t)nr * KV_Q4_1_BYTES;
  for (int r = 0; r < a->rows; ++r)
    for (int n = 0; n < a->cols; ++n) {
      float acc = 0.0f;
      for (int b = 0; b < a->nb; ++b) {
        const uint8_t* wb = a->w + b * block;
        const uint8_t* codes = wb + 4 * nr;
        const int8_t* xq = a->xq + r * a->ldq + 32 * b;
        int32_t dot = 0;
        for (int t = 0; t < 4; ++t)
          for (int i = 0; i < 4; ++i) {
            const int byte = codes[t * 4 * nr + 4 * n + i];
            dot += (byte & 15) * xq[4 * t + i] + (byte >> 4) * xq[16 + 4 * t + i];
          }
        const float s = (float)dot * a->xd[r * a->ldb + b];
        acc = __builtin_fmaf(kv_half_to_float(kv_load_u16(wb + 2 * n)), s, acc);
        acc = __builtin_fmaf(kv_half_to_float(kv_load_u16(wb + 2 * nr + 2 * n)), a->xs[r * a->ldb + b], acc);
      }
      a->y[r * a->ldy + n] = acc;
    }
}

#ifdef KV_UK_X86
/* `rows` (a constant once inlined) rows x 8 features. Each chunk's low and high nibbles meet 4 activation codes
 * broadcast as one int32 in vpmaddubsw (codes unsigned: its u8 side); a block's sums stay in int16,
 * |sum| <= 8 * 2 * 15 * 127 = 30480 < 2^15, then vpmaddwd widens a lane's pairs to its int32 dot. */
static inline __attribute__((always_inline, target("avx2,fma,f16c"))) void kv_q4_1_avx2_tile(
    const kv_ggml_args* a, const int rows) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[KV_MR_AVX2];
  KV_UNROLL for (int r = 0; r < rows; ++r) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < a->nb; ++b) {
    const uint8_t* wb = a->w + (int64_t)b * (KV_NR_AVX2 * KV_Q4_1_BYTES);
    __m256i dot[KV_MR_AVX2];
    KV_UNROLL for (int r = 0; r < rows; ++r) dot[r] = _mm256_setzero_si256();
    KV_UNROLL for (int t = 0; t < 4; ++t) {
      const __m256i bytes = _mm256_loadu_si256((const __m256i*)(wb + 4 * KV_NR_AVX2 + 32 * t));
      const __m256i lo = _mm256_and_si256(bytes, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
      KV_UNROLL for (int r = 0; r < rows; ++r) {
        const int8_t* xq = a->xq + r * a->ldq + 32 * b + 4 * t;
        const __m256i x_lo = _mm256_set1_epi32(kv_load_i32(xq));
        const __m256i x_hi = _mm256_set1_epi32(kv_load_i32(xq + 16));
        dot[r] = _mm256_add_epi16(dot[r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, x_lo),
                                                           _mm256_maddubs_epi16(hi, x_hi)));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)wb));
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(wb + 2 * KV_NR_AVX2)));
    KV_UNROLL for (int r = 0; r < rows; ++r) {
      const __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(dot[r], ones)),
                                     _mm256_set1_ps(a->xd[r * a->ldb + b]));
      acc[r] = _mm256_fmadd_ps(d, s, acc[r]);
      acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(a->xs[r * a->ldb + b]), acc[r]);
    }
  }
  KV_UNROLL for (int r = 0; r < rows; ++r) kv_store_avx2(a->y + r * a->ldy, acc[r], a->cols);
}

__attribute__((target("avx2,fma,f16c"))) void kv_q4_1_avx2(const kv_ggml_args* a) {
  KV_AVX2_ROWS(kv_q4_1_avx2_tile, a);
}

/* `rows` rows x 16 features: vpdpbusd takes the unsigned codes directly (u8 x s8, 4 products per lane). With few
 * rows the chunks spread over `chains` int32 accumulators per row (summed exactly at the block's end), so one
 * row is not bound by the latency of a chain of 8 vpdpbusd. */
static inline __attribute__((always_inline, target(KV_AVX512_TARGET))) void kv_q4_1_avx512_tile(
    const kv_ggml_args* a, const int rows) {
  const int chains = rows <= 2 ? 4 : rows <= 4 ? 2 : 1;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[KV_MR_AVX512];
  KV_UNROLL for (int r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
  for (int b = 0; b < a->nb; ++b) {
    const uint8_t* wb = a->w + (int64_t)b * (KV_NR_AVX512 * KV_Q4_1_BYTES);
    __m512i dot[KV_MR_AVX512][4];
    KV_UNROLL for (int r = 0; r < rows; ++r)
      KV_UNROLL for (int c = 0; c < chains; ++c) dot[r][c] = _mm512_setzero_si512();
    KV_UNROLL for (int t = 0; t < 4; ++t) {
      const __m512i bytes = _mm512_loadu_si512((const void*)(wb + 4 * KV_NR_AVX512 + 64 * t));
      const __m512i lo = _mm512_and_si512(bytes, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
      KV_UNROLL for (int r = 0; r < rows; ++r) {
        const int8_t* xq = a->xq + r * a->ldq + 32 * b + 4 * t;
        const int c = t % chains;
        dot[r][c] = _mm512_dpbusd_epi32(dot[r][c], lo, _mm512_set1_epi32(kv_load_i32(xq)));
        dot[r][c] = _mm512_dpbusd_epi32(dot[r][c], hi, _mm512_set1_epi32(kv_load_i32(xq + 16)));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)wb));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(wb + 2 * KV_NR_AVX512)));
    KV_UNROLL for (int r = 0; r < rows; ++r) {
      __m512i sum = dot[r][0];
      KV_UNROLL for (int c = 1; c < chains; ++c) sum = _mm512_add_epi32(sum, dot[r][c]);
      const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(a->xd[r * a->ldb + b]));
      acc[r] = _mm512_fmadd_ps(d, s, acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(a->xs[r * a->ldb + b]), acc[r]);
    }
  }
  KV_UNROLL for (int r = 0; r < rows; ++r) kv_store_avx512(a->y + r * a->ldy, acc[r], a->cols);
}

__attribute__((target(KV_AVX512_TARGET))) void kv_q4_1_avx512(const kv_ggml_args* a) {
  KV_AVX512_ROWS(kv_q4_1_avx512_tile, a);
}
#endif /* KV_UK_X86 */

#ifdef __cplusplus
}
#endif

#endif /* KVSERVE_UKERNEL_Q4_1_H */
