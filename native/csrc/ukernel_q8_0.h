/* Q8_0 micro-kernels (scalar, AVX2, AVX-512 VNNI): layouts and the exact float sequence in ukernel.h.
 * Header-only, C and C++; include it in exactly one translation unit (linear_ggml.cpp, leaves.c). */
#ifndef KVSERVE_UKERNEL_Q8_0_H
#define KVSERVE_UKERNEL_Q8_0_H

#include "ukernel.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The reference: one output at a time, in ukernel.h's order, for panels of any width a->nr. */
void kv_q8_0_scalar(const kv_ggml_args* a) {
  const int nr = a->nr;
  const int64_t block = (int64_t)nr * KV_Q8_0_BYTES;
  for (int r = 0; r < a->rows; ++r)
    for (int n = 0; n < a->cols; ++n) {
      float acc = 0.0f;
      for (int b = 0; b < a->nb; ++b) {
        const uint8_t* wb = a->w + b * block;
        const int8_t* codes = (const int8_t*)(wb + 2 * nr);
        const int8_t* xq = a->xq + r * a->ldq + 32 * b;
        int32_t dot = 0;
        for (int t = 0; t < 8; ++t)
          for (int i = 0; i < 4; ++i) dot += codes[t * 4 * nr + 4 * n + i] * xq[4 * t + i];
        const float s = (float)dot * a->xd[r * a->ldb + b];
        acc = __builtin_fmaf(kv_half_to_float(kv_load_u16(wb + 2 * n)), s, acc);
      }
      a->y[r * a->ldy + n] = acc;
    }
}

#ifdef KV_UK_X86
/* `rows` rows x 8 features. vpmaddubsw multiplies u8 by s8, so |w| takes the unsigned side and x takes w's sign
 * (vpsignb; w = 0 gives 0, as its product): a pair sums to at most 2 * 128 * 127 = 32512 < 2^15, so no
 * saturation; vpmaddwd then widens each chunk to int32 before the next. */
static inline __attribute__((always_inline, target("avx2,fma,f16c"))) void kv_q8_0_avx2_tile(
    const kv_ggml_args* a, const int rows) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[KV_MR_AVX2];
  KV_UNROLL for (int r = 0; r < rows; ++r) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < a->nb; ++b) {
    const uint8_t* wb = a->w + (int64_t)b * (KV_NR_AVX2 * KV_Q8_0_BYTES);
    __m256i dot[KV_MR_AVX2];
    KV_UNROLL for (int r = 0; r < rows; ++r) dot[r] = _mm256_setzero_si256();
    KV_UNROLL for (int t = 0; t < 8; ++t) {
      const __m256i w = _mm256_loadu_si256((const __m256i*)(wb + 2 * KV_NR_AVX2 + 32 * t));
      const __m256i w_abs = _mm256_abs_epi8(w);
      KV_UNROLL for (int r = 0; r < rows; ++r) {
        const __m256i x = _mm256_set1_epi32(kv_load_i32(a->xq + r * a->ldq + 32 * b + 4 * t));
        const __m256i pairs = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(x, w));
        dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(pairs, ones));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)wb));
    KV_UNROLL for (int r = 0; r < rows; ++r) {
      const __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_set1_ps(a->xd[r * a->ldb + b]));
      acc[r] = _mm256_fmadd_ps(d, s, acc[r]);
    }
  }
  KV_UNROLL for (int r = 0; r < rows; ++r) kv_store_avx2(a->y + r * a->ldy, acc[r], a->cols);
}

__attribute__((target("avx2,fma,f16c"))) void kv_q8_0_avx2(const kv_ggml_args* a) {
  KV_AVX2_ROWS(kv_q8_0_avx2_tile, a);
}

/* `rows` rows x 16 features. vpdpbusd multiplies u8 by s8: the codes go in as w + 128 (w xor 0x80, one vpxord
 * per chunk for all rows), and 128 * qsum (the block's activation code sum) comes off each row's int32 dot;
 * |biased dot| <= 32 * 255 * 127 < 2^31, so both steps are exact. Chains as in kv_q4_1_avx512_tile. */
static inline __attribute__((always_inline, target(KV_AVX512_TARGET))) void kv_q8_0_avx512_tile(
    const kv_ggml_args* a, const int rows) {
  const int chains = rows <= 2 ? 4 : rows <= 4 ? 2 : 1;
  const __m512i bias = _mm512_set1_epi8((char)0x80);
  __m512 acc[KV_MR_AVX512];
  KV_UNROLL for (int r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
  for (int b = 0; b < a->nb; ++b) {
    const uint8_t* wb = a->w + (int64_t)b * (KV_NR_AVX512 * KV_Q8_0_BYTES);
    __m512i dot[KV_MR_AVX512][4];
    KV_UNROLL for (int r = 0; r < rows; ++r)
      KV_UNROLL for (int c = 0; c < chains; ++c) dot[r][c] = _mm512_setzero_si512();
    KV_UNROLL for (int t = 0; t < 8; ++t) {
      const __m512i w = _mm512_xor_si512(_mm512_loadu_si512((const void*)(wb + 2 * KV_NR_AVX512 + 64 * t)), bias);
      KV_UNROLL for (int r = 0; r < rows; ++r) {
        const int c = t % chains;
        const __m512i x = _mm512_set1_epi32(kv_load_i32(a->xq + r * a->ldq + 32 * b + 4 * t));
        dot[r][c] = _mm512_dpbusd_epi32(dot[r][c], w, x);
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)wb));
    KV_UNROLL for (int r = 0; r < rows; ++r) {
      __m512i sum = dot[r][0];
      KV_UNROLL for (int c = 1; c < chains; ++c) sum = _mm512_add_epi32(sum, dot[r][c]);
      sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(a->xsum[r * a->ldb + b] * 128));
      const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(a->xd[r * a->ldb + b]));
      acc[r] = _mm512_fmadd_ps(d, s, acc[r]);
    }
  }
  KV_UNROLL for (int r = 0; r < rows; ++r) kv_store_avx512(a->y + r * a->ldy, acc[r], a->cols);
}

__attribute__((target(KV_AVX512_TARGET))) void kv_q8_0_avx512(const kv_ggml_args* a) {
  KV_AVX512_ROWS(kv_q8_0_avx512_tile, a);
}
#endif /* KV_UK_X86 */

#ifdef __cplusplus
}
#endif

#endif /* KVSERVE_UKERNEL_Q8_0_H */
