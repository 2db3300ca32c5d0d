// What decode_ops.cpp (the float32 cache's ops) and kv_quant.cpp (the int8 / int4 cache's ops) share: the
// argument checks of paged decode attention, and the AVX2 softmax both attention kernels run (exp8 and the
// lane sums whose order the quantized cache's kernels reproduce on every path).
#pragma once

#include <torch/extension.h>

#include "check.h"
#include "cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KV_X86 1
#endif

namespace kvserve::decode {

inline void check_f32(const torch::Tensor& t, const char* name) {
  KV_CHECK(t.scalar_type() == torch::kFloat32 && t.is_cpu(), name, " must be a float32 CPU tensor");
}

// The checked arguments of one paged decode attention call, as raw pointers (decode_ops.cpp's
// paged_decode_attention documents the tensors). One task per (sequence b, KV head g): its `group` query heads.
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

// q [T, H, D] float32 (D contiguous), out contiguous like q; rows [B], tables [B, max_blocks], lens [B]
// contiguous int64, each row inside q, each context inside its table, each block inside a pool of num_blocks
// blocks of block_size slots with H_kv heads dividing H.
inline DecodeCall check_decode_call(const torch::Tensor& q, const torch::Tensor& rows, const torch::Tensor& tables,
                                    const torch::Tensor& lens, torch::Tensor& out, int64_t num_blocks,
                                    int64_t block_size, int64_t H_kv, double scale, int64_t window) {
  check_f32(q, "q");
  check_f32(out, "out");
  KV_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [T, H, D] with D contiguous");
  KV_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out must be contiguous like q");
  KV_CHECK(rows.scalar_type() == torch::kLong && tables.scalar_type() == torch::kLong &&
               lens.scalar_type() == torch::kLong && rows.is_contiguous() && tables.is_contiguous() &&
               lens.is_contiguous() && tables.dim() == 2 && tables.size(0) == rows.numel() &&
               lens.numel() == rows.numel(),
           "rows [B], tables [B, max_blocks], lens [B] must be contiguous int64");
  const int64_t H = q.size(1);
  KV_CHECK(H_kv >= 1 && H % H_kv == 0, "query heads ", H, " not a multiple of KV heads ", H_kv);
  const DecodeCall call{q.data_ptr<float>(), q.stride(0), q.stride(1), out.data_ptr<float>(),
                        rows.data_ptr<int64_t>(), tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                        rows.numel(), H, q.size(2), H_kv, H / H_kv, tables.size(1), block_size,
                        static_cast<float>(scale), window};
  for (int64_t b = 0; b < call.B; ++b) {
    KV_CHECK(call.lens[b] >= 1 && call.lens[b] <= call.width * block_size, "context length ", call.lens[b],
             " does not fit its block table");
    KV_CHECK(call.rows[b] >= 0 && call.rows[b] < q.size(0), "row ", call.rows[b], " out of range");
    for (int64_t i = 0; i < (call.lens[b] + block_size - 1) / block_size; ++i)
      KV_CHECK(call.table_of(b)[i] >= 0 && call.table_of(b)[i] < num_blocks, "block id out of range");
  }
  return call;
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
// Attention outputs agree with a float64 softmax to ~1e-6 (tests/test_decode_ops.py).
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

// One query head's scores s [span] -> softmax(s) in place: the maximum over 8 lanes, exp8 of 8 at a time
// (std::exp for the tail of fewer than 8), the lanes' sum (hsum8) plus the tail's, then one multiply by its
// inverse. kv_quant.cpp's scalar path repeats these operations in this order (softmax_like_avx2).
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
    s[i] = std::exp(s[i] - mx);
    sum += s[i];
  }
  const float inv = 1.f / sum;
  for (i = 0; i < span; ++i) s[i] *= inv;
}

#endif

}  // namespace kvserve::decode

// The int8 / int4 cache's ops (kv_quant.cpp), bound with the others in decode_ops.cpp.
void write_kv_quant(torch::Tensor& k_codes, torch::Tensor& k_scales, torch::Tensor& v_codes, torch::Tensor& v_scales,
                    const torch::Tensor& slots, const torch::Tensor& k, const torch::Tensor& v, int64_t bits);
void paged_decode_attention_quant(const torch::Tensor& q, const torch::Tensor& rows, const torch::Tensor& tables,
                                  const torch::Tensor& lens, const torch::Tensor& k_codes,
                                  const torch::Tensor& k_scales, const torch::Tensor& v_codes,
                                  const torch::Tensor& v_scales, int64_t bits, double scale, int64_t window,
                                  torch::Tensor& out);
// The ISA path paged_decode_attention_quant runs for `bits` and `group` elements per scale: avx512, avx2, scalar.
std::string kv_quant_path(int64_t bits, int64_t group);
