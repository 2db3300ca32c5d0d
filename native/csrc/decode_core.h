// The torch-free core of paged decode attention, shared by the extension (decode_common.h includes it:
// decode_ops.cpp's float32 cache kernel, kv_quant.cpp's int8 / int4 one) and by the freestanding leaves of
// kv_leaves.cpp (native/kv_leaves.py builds them for the CPU emulator): the call's raw arguments (DecodeCall),
// the AVX2 lane reductions, exp8, its one-lane twin exp1 and the softmax both attention kernels run.
//
// Leaf-safe by construction: no libc or libm call once the leaf build's -mfma -msse4.1 make std::fma and
// std::nearbyint single instructions (the extension's baseline path calls fmaf / nearbyintf: the same correctly
// rounded results), no allocation, no static data with pointers. <algorithm>, <cmath> and <limits> only declare
// here (std::min/max are templates); gcc 12 compiles them under -ffreestanding.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KV_X86 1
#endif

namespace kvserve::decode {

// The checked arguments of one paged decode attention call, as raw pointers (decode_ops.cpp's
// paged_decode_attention documents the tensors; check_decode_call in decode_common.h checks them). One task per
// (sequence b, KV head g): its `group` query heads.
struct DecodeCall {
  const float* q;
  int64_t q_row, q_head;  // q's strides (floats)
  float* out;             // [T, H, D] contiguous
  const int64_t* rows;    // [B]
  const int64_t* tables;  // [B, width]
  const int64_t* lens;    // [B]
  int64_t B, H, D, H_kv, group, width, block_size;
  float scale;
  int64_t window;  // tokens, or <= 0: the whole context

  const float* q_of(int64_t b, int64_t g) const { return q + rows[b] * q_row + g * group * q_head; }
  float* out_of(int64_t b, int64_t g) const { return out + (rows[b] * H + g * group) * D; }
  const int64_t* table_of(int64_t b) const { return tables + b * width; }
  int64_t first_of(int64_t b) const { return window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0; }
};

// _mm256_max_ps(a, b) and _mm_max_ss on one lane: a > b ? a : b (b when either is NaN).
inline float max_like_sse(float a, float b) { return a > b ? a : b; }

// exp8's operations (below) on one float, in its order: fnmadd(n, c, x) is fma(-n, c, x), the rounding of
// x / ln 2 is to nearest even (the default rounding mode), and 2^n is built in the exponent bits. So every
// score of a softmax goes through the same exp, the 8-wide main loop's and the tail's alike. Inlined into the
// AVX2 callers, std::fma and std::nearbyint are vfmadd and vroundss there.
inline __attribute__((always_inline)) float exp1(float x) {
  x = max_like_sse(x, -87.3f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = std::fma(-n, 0.693359375f, x);
  r = std::fma(-n, -2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p, r * r, r + 1.f);
  // n is integral in [-126, 0]: the conversion is exact (exp8's cvtps2dq rounds, this one truncates)
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return p * __builtin_bit_cast(float, bits);
}

#ifdef KV_X86

__attribute__((target("avx2,fma"))) inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// The lanes' sum, ((0+4) + (2+6)) + ((1+5) + (3+7)).
__attribute__((target("avx2,fma"))) inline float hsum8(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// exp(x) for 8 floats with x <= 0 (scores minus their maximum), after Cephes' expf: n = round(x / ln 2),
// r = x - n ln 2 in two parts (Cody-Waite), exp(r) by its degree-6 polynomial, times 2^n built in the exponent
// bits. Inputs below -87.3 give exp(-87.3) ~ 1e-38 instead of a denormal or 0: a weight that vanishes in the sum.
// Attention outputs agree with a float64 softmax to ~1e-6 (tests/test_decode_ops.py). exp1 is one lane of it.
__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(pow2n));
}

// One query head's scores s [span] -> softmax(s) in place: the maximum over 8 lanes (hmax8) then over the tail
// of fewer than 8, exp8 of 8 at a time and exp1 for the tail (the same operations: no libm call, so the leaves
// run it too), the lanes' sum (hsum8) plus the tail's, then one multiply by its inverse. The quantized cache's
// baseline path (kv_attend.h, base::softmax) repeats these operations in this order.
__attribute__((target("avx2,fma"))) inline void softmax_avx2(float* s, int64_t span) {
  __m256 mx8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= span; i += 8) mx8 = _mm256_max_ps(mx8, _mm256_loadu_ps(s + i));
  float mx = hmax8(mx8);
  for (; i < span; ++i) mx = std::max(mx, s[i]);
  __m256 sum8 = _mm256_setzero_ps();
  const __m256 mxv = _mm256_set1_ps(mx);
  for (i = 0; i + 8 <= span; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), mxv));
    _mm256_storeu_ps(s + i, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  float sum = hsum8(sum8);
  for (; i < span; ++i) {
    s[i] = exp1(s[i] - mx);
    sum += s[i];
  }
  const float inv = 1.f / sum;
  for (i = 0; i < span; ++i) s[i] *= inv;
}

// exp8's operations on 16 lanes: lane i of exp16(x) is lane i % 8 of exp8 on x's half holding it, bit for bit
// (vrndscaleps rounds to nearest even as vroundps does; vcvtps2dq rounds as MXCSR says for both).
__attribute__((target("avx512f,avx2,fma"))) inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i pow2n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(pow2n));
}

// x[0 .. n) *= inv in place, 16 at a time (each product softmax_avx2's last step).
__attribute__((target("avx512f,avx2,fma"))) inline void scale_scores(float* x, int64_t n, float inv) {
  const __m512 invv = _mm512_set1_ps(inv);
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) _mm512_storeu_ps(x + k, _mm512_mul_ps(_mm512_loadu_ps(x + k), invv));
  for (; k < n; ++k) x[k] *= inv;
}

// 16 scores x -> exp16(x - mx) in place, added to sum8 as two 8-float groups, low then high.
__attribute__((target("avx512f,avx2,fma"), always_inline)) inline void softmax_step16(float* x, __m512 mxv,
                                                                                     __m256& sum8) {
  const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x), mxv));
  _mm512_storeu_ps(x, e);
  sum8 = _mm256_add_ps(sum8, _mm512_castps512_ps256(e));
  sum8 = _mm256_add_ps(sum8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
}

// softmax_avx2 on R score rows at once (s[r] [span[r]] in place), with its bits for each: every row takes
// exactly softmax_avx2's operations in its order, only interleaved with the other rows', and the exponentials and
// the final scaling 16 lanes at a time (exp16 on two of a row's 8-float groups, their sum still added to the row's
// 8 lanes one group after the other). Why: a row's maximum and sum are chains of dependent operations (one max,
// one add per 8 scores), whose latency bound one row alone; R rows run R chains side by side.
//
// Unscaled (a caller that reads every weight once more anyway): each row's exponentials left in place and 1 / sum
// into inv[r] (inv: R floats, required), the caller to take x * inv[r] for each, the product scale_scores would
// have stored.
template <int R, bool Unscaled = false>
__attribute__((target("avx512f,avx2,fma"))) inline void softmax_avx512(float* const* s, const int64_t* span,
                                                                       float* inv = nullptr) {
  int64_t common = span[0];
  for (int r = 1; r < R; ++r) common = std::min(common, span[r]);
  __m256 mx8[R];
  for (int r = 0; r < R; ++r) mx8[r] = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= common; i += 8)
    for (int r = 0; r < R; ++r) mx8[r] = _mm256_max_ps(mx8[r], _mm256_loadu_ps(s[r] + i));
  float mx[R];
  for (int r = 0; r < R; ++r) {
    int64_t k = i;
    for (; k + 8 <= span[r]; k += 8) mx8[r] = _mm256_max_ps(mx8[r], _mm256_loadu_ps(s[r] + k));
    mx[r] = hmax8(mx8[r]);
    for (; k < span[r]; ++k) mx[r] = std::max(mx[r], s[r][k]);
  }
  __m256 sum8[R];
  __m512 mxv[R];
  for (int r = 0; r < R; ++r) {
    sum8[r] = _mm256_setzero_ps();
    mxv[r] = _mm512_set1_ps(mx[r]);
  }
  for (i = 0; i + 16 <= common; i += 16)
    for (int r = 0; r < R; ++r) softmax_step16(s[r] + i, mxv[r], sum8[r]);
  for (int r = 0; r < R; ++r) {
    float* const x = s[r];
    int64_t k = i;
    for (; k + 16 <= span[r]; k += 16) softmax_step16(x + k, mxv[r], sum8[r]);
    if (k + 8 <= span[r]) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + k), _mm512_castps512_ps256(mxv[r])));
      _mm256_storeu_ps(x + k, e);
      sum8[r] = _mm256_add_ps(sum8[r], e);
      k += 8;
    }
    float sum = hsum8(sum8[r]);
    for (; k < span[r]; ++k) {
      x[k] = exp1(x[k] - mx[r]);
      sum += x[k];
    }
    if constexpr (Unscaled) inv[r] = 1.f / sum;
    else scale_scores(x, span[r], 1.f / sum);
  }
}

#endif

}  // namespace kvserve::decode
