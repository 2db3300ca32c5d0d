// Small fused CPU ops for the lean Llama-family forward (engine/fastpath.py), float32 only.
//
// At batch 1 a SmolLM2 decode step spends as long in ~1,200 small torch ops (RMSNorm as six ops, RoPE as
// four, the paged-attention gathers, masks and SDPA) as in its projections; each op costs 5-40 us of dispatch
// on this CPU. These functions do the same arithmetic in one call each:
//
//   rms_norm(x, w, eps)                   y = x / sqrt(mean(x^2) + eps) * w      (Zhang & Sennrich 2019)
//   add_rms_norm_(x, r, w, eps)           x += r (in place), then y = rms_norm(x)
//   rope_(qk, cos, sin)                   RoPE in place, transformers' rotate_half layout (Su et al. 2021)
//   write_kv(k_cache, v_cache, slots, k, v)          the step's K/V into the pool at the slot mapping
//   paged_decode_attention(q, rows, tables, lens, k_blocks, v_blocks, scale, window, out)
//       one query token per sequence against its cached context, read block by block through its block
//       table (no gathered copy, no mask tensor), with GQA; softmax in float32 (AVX2: vectorized exp).
//   decode_attention_(qkv, ...)            RoPE, the KV write and paged decode attention for one layer
//   write_kv_quant(k_codes, k_scales, v_codes, v_scales, slots, k, v, bits)
//       the step's K/V quantized into an int8 / int4 pool (kvcache/pool.py has the rule and the layout)
//   paged_decode_attention_quant(q, rows, tables, lens, k_codes, k_scales, v_codes, v_scales, bits, ...)
//       paged_decode_attention over that pool: each key and value row's codes become floats in registers
//       (one head vector at a time, never a float copy of the cache); one body for every ISA path, bit for bit
//   silu_mul(gate, up)                     silu(gate) * up (SwiGLU), with torch's own kernels
//   greedy_pick(logits)                    per row: argmax and its log-softmax value, in three passes
//   log_softmax(logits)                    the same log-softmax for every token (sampled and top tokens)
//
// Each hot loop is compiled for AVX2+FMA and for plain x86-64; kernels/csrc/cpu.h chooses which runs.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "check.h"
#include "cpu.h"

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KV_X86 1
#define KV_AVX2 __attribute__((target("avx2,fma")))
#else
#define KV_AVX2
#endif

// KV_TWO_PATHS(name, (params), (args)): name's always-inline body compiled twice, for AVX2+FMA (the compiler
// vectorizes it) and for the baseline; name() runs the one kernels/csrc/cpu.h chose.
#define KV_TWO_PATHS(name, params, args)                          \
  KV_AVX2 void name##_avx2 params { name##_body args; }           \
  void name##_base params { name##_body args; }                   \
  inline void name params {                                       \
    if (::kvserve::cpu::avx2()) name##_avx2 args; else name##_base args; \
  }

#define KV_BODY inline __attribute__((always_inline))

namespace {

void check_f32(const torch::Tensor& t, const char* name) {
  KV_CHECK(t.scalar_type() == torch::kFloat32 && t.is_cpu(), name, " must be a float32 CPU tensor");
}

KV_BODY void rms_row_body(const float* x, const float* w, float eps, float* y, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] * inv) * w[i];
}
KV_TWO_PATHS(rms_row, (const float* x, const float* w, float eps, float* y, int64_t n), (x, w, eps, y, n))

KV_BODY void add_row_body(float* x, const float* r, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += r[i];
}
KV_TWO_PATHS(add_row, (float* x, const float* r, int64_t n), (x, r, n))

KV_BODY void rope_row_body(float* v, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = v[i], b = v[i + half];
    v[i] = a * cos[i] - b * sin[i];
    v[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}
KV_TWO_PATHS(rope_row, (float* v, const float* cos, const float* sin, int64_t half), (v, cos, sin, half))

// dot and axpy are inlined into the attention task (a call per key row through a dispatch cost
// more than the 64-wide product itself).
inline __attribute__((always_inline)) float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline __attribute__((always_inline)) void axpy(float alpha, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// The `group` query heads (rows q, q + q_head_stride, ...) that share KV head g, against keys first..len-1 of
// one sequence read through its block table; out: `group` rows of D (contiguous).
KV_BODY void attend_loops_body(const float* q, int64_t q_head_stride, const int64_t* table, int64_t first,
                              int64_t len, const float* kp, const float* vp, int64_t bs, int64_t H_kv, int64_t g,
                              int64_t D, int64_t group, float scale, float* scores, float* out) {
  const int64_t span = len - first;
  for (int64_t j = 0; j < group; ++j) {
    const float* qh = q + j * q_head_stride;
    float* sj = scores + j * span;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t t = first; t < len; ++t) {
      const int64_t slot = table[t / bs] * bs + t % bs;
      sj[t - first] = dot(qh, kp + (slot * H_kv + g) * D, D) * scale;
      mx = std::max(mx, sj[t - first]);
    }
    float sum = 0.f;
    for (int64_t i = 0; i < span; ++i) {
      sj[i] = std::exp(sj[i] - mx);
      sum += sj[i];
    }
    float* oh = out + j * D;
    std::fill_n(oh, D, 0.f);
    const float inv = 1.f / sum;
    for (int64_t t = first; t < len; ++t) {
      const int64_t slot = table[t / bs] * bs + t % bs;
      axpy(sj[t - first] * inv, vp + (slot * H_kv + g) * D, oh, D);
    }
  }
}
KV_TWO_PATHS(attend_loops,
             (const float* q, int64_t q_head_stride, const int64_t* table, int64_t first, int64_t len,
              const float* kp, const float* vp, int64_t bs, int64_t H_kv, int64_t g, int64_t D, int64_t group,
              float scale, float* scores, float* out),
             (q, q_head_stride, table, first, len, kp, vp, bs, H_kv, g, D, group, scale, scores, out))

#ifdef KV_X86

__attribute__((target("avx2,fma"))) inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

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

// max of x[0 .. 8k) (k as large as fits in n), whether any was NaN, *done = 8k.
__attribute__((target("avx2,fma"))) float max_avx2(const float* x, int64_t n, int64_t* done, bool* nan) {
  __m256 m8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), bad = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    m8 = _mm256_max_ps(m8, v);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  *done = i;
  *nan = _mm256_movemask_ps(bad) != 0;
  return hmax8(m8);
}

// sum of exp(x_i - mx) over x[0 .. 8k) (k as large as fits in n); *done = 8k.
__attribute__((target("avx2,fma"))) float sum_exp_avx2(const float* x, int64_t n, float mx, int64_t* done) {
  const __m256 m = _mm256_set1_ps(mx);
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_add_ps(s0, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), m)));
    s1 = _mm256_add_ps(s1, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), m)));
  }
  if (i + 8 <= n) {
    s0 = _mm256_add_ps(s0, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), m)));
    i += 8;
  }
  *done = i;
  return hsum8(_mm256_add_ps(s0, s1));
}

constexpr int64_t kAhead = 4;  // key/value rows prefetched this many positions ahead

// attend_kv_head for D a multiple of 8 with AVX2: each key and value row is read once for all `group` query
// heads (key-major loops), the row kAhead positions on is prefetched (rows of one KV head are H_kv * D apart
// and blocks are scattered, which the hardware prefetcher does not follow), and the softmax exponentials run
// 8 at a time (exp8). Against attend_kv_head: 1.4x at 1 sequence x 64 keys, 1.9-3x at 8-32 sequences x
// 160-400 keys (SmolLM2's 9 / 3 heads of 64).
__attribute__((target("avx2,fma"))) void attend_kv_head_avx2(const float* q, int64_t q_head_stride,
                                                             const int64_t* table, int64_t first, int64_t len,
                                                             const float* kp, const float* vp, int64_t bs,
                                                             int64_t H_kv, int64_t g, int64_t D, int64_t group,
                                                             float scale, float* scores, float* out) {
  const int64_t span = len - first;
  for (int64_t t = first; t < len; ++t) {
    const int64_t slot = table[t / bs] * bs + t % bs;
    const float* k = kp + (slot * H_kv + g) * D;
    if (t + kAhead < len) {  // the key row kAhead positions on (rows are H_kv * D apart within a block)
      const float* next = kp + ((table[(t + kAhead) / bs] * bs + (t + kAhead) % bs) * H_kv + g) * D;
      for (int64_t i = 0; i < D; i += 16) _mm_prefetch(reinterpret_cast<const char*>(next + i), _MM_HINT_T0);
    }
    for (int64_t j = 0; j < group; ++j) {
      const float* qh = q + j * q_head_stride;
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 16 <= D; i += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i), _mm256_loadu_ps(k + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i + 8), _mm256_loadu_ps(k + i + 8), a1);
      }
      if (i < D) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i), _mm256_loadu_ps(k + i), a0);
      scores[j * span + (t - first)] = hsum8(_mm256_add_ps(a0, a1)) * scale;
    }
  }
  for (int64_t j = 0; j < group; ++j) {
    float* sj = scores + j * span;
    __m256 mx8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t i = 0;
    for (; i + 8 <= span; i += 8) mx8 = _mm256_max_ps(mx8, _mm256_loadu_ps(sj + i));
    float mx = hmax8(mx8);
    for (; i < span; ++i) mx = std::max(mx, sj[i]);
    __m256 sum8 = _mm256_setzero_ps();
    const __m256 mxv = _mm256_set1_ps(mx);
    for (i = 0; i + 8 <= span; i += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sj + i), mxv));
      _mm256_storeu_ps(sj + i, e);
      sum8 = _mm256_add_ps(sum8, e);
    }
    float sum = hsum8(sum8);
    for (; i < span; ++i) {
      sj[i] = std::exp(sj[i] - mx);
      sum += sj[i];
    }
    const float inv = 1.f / sum;
    for (i = 0; i < span; ++i) sj[i] *= inv;
    std::fill_n(out + j * D, D, 0.f);
  }
  for (int64_t t = first; t < len; ++t) {
    const int64_t slot = table[t / bs] * bs + t % bs;
    const float* v = vp + (slot * H_kv + g) * D;
    if (t + kAhead < len) {
      const float* next = vp + ((table[(t + kAhead) / bs] * bs + (t + kAhead) % bs) * H_kv + g) * D;
      for (int64_t i = 0; i < D; i += 16) _mm_prefetch(reinterpret_cast<const char*>(next + i), _MM_HINT_T0);
    }
    for (int64_t j = 0; j < group; ++j) {
      const __m256 w = _mm256_set1_ps(scores[j * span + (t - first)]);
      float* oh = out + j * D;
      for (int64_t i = 0; i < D; i += 8)
        _mm256_storeu_ps(oh + i, _mm256_fmadd_ps(w, _mm256_loadu_ps(v + i), _mm256_loadu_ps(oh + i)));
    }
  }
}
#endif

// ---- The quantized cache's attention: one body, the same bits on every path ----
//
// Written with GCC's vector extensions (8 float lanes) instead of intrinsics, and compiled twice by KV_TWO_PATHS:
// for AVX2 the lanes are one ymm register, for the baseline two SSE registers. Every operation is a single IEEE
// float operation per lane in a fixed order (the build passes -ffp-contract=off, so no multiply and add fuse
// into an FMA on one path only), so both paths give the same bits; tests/test_decode_ops.py checks it under
// KVSERVE_ISA=scalar.
typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8v __attribute__((vector_size(32)));
typedef int8_t c8 __attribute__((vector_size(8)));
typedef uint8_t u8 __attribute__((vector_size(8)));

KV_BODY f8 load8(const float* p) {
  f8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

KV_BODY void store8(float* p, f8 v) { std::memcpy(p, &v, sizeof v); }

KV_BODY f8 splat8(float x) { return f8{x, x, x, x, x, x, x, x}; }

// The lanes' sum in the order of the AVX2 kernel's hsum8: ((0+4) + (2+6)) + ((1+5) + (3+7)).
KV_BODY float lane_sum(f8 v) { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }

// exp(x) for x <= 0, exp8's method (Cephes' expf) with separate multiplies and adds; n = round(x / ln 2) by the
// 1.5 * 2^23 shift (round half to even in float arithmetic, for |x / ln 2| < 2^22).
KV_BODY f8 exp_lanes(f8 x) {
  const f8 lo = splat8(-87.3f);
  x = x > lo ? x : lo;
  const f8 shift = splat8(12582912.f);
  const f8 n = (x * splat8(1.44269504088896341f) + shift) - shift;
  f8 r = x - n * splat8(0.693359375f);
  r = r - n * splat8(-2.12194440e-4f);
  f8 p = splat8(1.9875691500e-4f);
  p = p * r + splat8(1.3981999507e-3f);
  p = p * r + splat8(8.3334519073e-3f);
  p = p * r + splat8(4.1665795894e-2f);
  p = p * r + splat8(1.6666665459e-1f);
  p = p * r + splat8(5.0000001201e-1f);
  p = p * (r * r) + (r + splat8(1.f));
  const i8v bits = (__builtin_convertvector(n, i8v) + 127) << 23;
  f8 pow2n;
  std::memcpy(&pow2n, &bits, sizeof pow2n);
  return p * pow2n;
}

// One head vector's codes as floats (unscaled), row [D]. int8: D codes. int4: groups of G codes in G / 2 bytes,
// byte j holding code j (low nibble) and code j + G / 2 (high), each stored plus 8.
KV_BODY void codes_to_floats(const uint8_t* codes, int bits, int64_t D, int64_t G, float* row) {
  if (bits == 8) {
    for (int64_t i = 0; i < D; i += 8) {
      c8 c;
      std::memcpy(&c, codes + i, sizeof c);
      store8(row + i, __builtin_convertvector(c, f8));
    }
    return;
  }
  const f8 eight = splat8(8.f);
  for (int64_t start = 0; start < D; start += G) {
    const uint8_t* group = codes + start / 2;
    for (int64_t i = 0; i < G / 2; i += 8) {
      u8 b;
      std::memcpy(&b, group + i, sizeof b);
      store8(row + start + i, __builtin_convertvector(b & 15, f8) - eight);
      store8(row + start + G / 2 + i, __builtin_convertvector(b >> 4, f8) - eight);
    }
  }
}

KV_BODY void scales_to_floats(const c10::Half* s, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(s[i]);
}

// attend_loops over a quantized pool: the `group` query heads sharing KV head g against keys first..len-1,
// codes [slots, H_kv, row_bytes] and scales [slots, H_kv, D / G]. score = scale * sum over groups of
// scale_g * (q . codes_g); out = sum_t w_t * scale_g * codes_g. scores holds group * pad8(span) floats, row D,
// s D / G.
KV_BODY void attend_quant_body(const float* q, int64_t q_head_stride, const int64_t* table, int64_t first,
                               int64_t len, const uint8_t* kc, const c10::Half* ks, const uint8_t* vc,
                               const c10::Half* vs, int bits, int64_t bs, int64_t H_kv, int64_t g, int64_t D,
                               int64_t G, int64_t group, float scale, float* scores, float* row, float* s,
                               float* out) {
  const int64_t span = len - first, padded = (span + 7) / 8 * 8, row_bytes = D * bits / 8, S = D / G;
  for (int64_t t = first; t < len; ++t) {
    const int64_t at = (table[t / bs] * bs + t % bs) * H_kv + g;
    codes_to_floats(kc + at * row_bytes, bits, D, G, row);
    scales_to_floats(ks + at * S, S, s);
    for (int64_t j = 0; j < group; ++j) {
      const float* qh = q + j * q_head_stride;
      float total = 0.f;
      for (int64_t k = 0; k < S; ++k) {
        f8 acc = splat8(0.f);
        for (int64_t i = k * G; i < (k + 1) * G; i += 8) acc = acc + load8(qh + i) * load8(row + i);
        total = total + lane_sum(acc) * s[k];
      }
      scores[j * padded + (t - first)] = total * scale;
    }
  }
  for (int64_t j = 0; j < group; ++j) {
    float* sj = scores + j * padded;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < span; ++i) mx = sj[i] > mx ? sj[i] : mx;
    for (int64_t i = span; i < padded; ++i) sj[i] = mx - 1e30f;  // the padding's exponentials are ~1e-38
    f8 sum8 = splat8(0.f);
    for (int64_t i = 0; i < padded; i += 8) {
      const f8 e = exp_lanes(load8(sj + i) - splat8(mx));
      store8(sj + i, e);
      sum8 = sum8 + e;
    }
    const float inv = 1.f / lane_sum(sum8);
    for (int64_t i = 0; i < span; ++i) sj[i] = sj[i] * inv;
    std::fill_n(out + j * D, D, 0.f);
  }
  for (int64_t t = first; t < len; ++t) {
    const int64_t at = (table[t / bs] * bs + t % bs) * H_kv + g;
    codes_to_floats(vc + at * row_bytes, bits, D, G, row);
    scales_to_floats(vs + at * S, S, s);
    for (int64_t j = 0; j < group; ++j) {
      const float w = scores[j * padded + (t - first)];
      float* oh = out + j * D;
      for (int64_t k = 0; k < S; ++k) {
        const f8 ws = splat8(w * s[k]);
        for (int64_t i = k * G; i < (k + 1) * G; i += 8) store8(oh + i, load8(oh + i) + ws * load8(row + i));
      }
    }
  }
}
KV_TWO_PATHS(attend_quant,
             (const float* q, int64_t q_head_stride, const int64_t* table, int64_t first, int64_t len,
              const uint8_t* kc, const c10::Half* ks, const uint8_t* vc, const c10::Half* vs, int bits, int64_t bs,
              int64_t H_kv, int64_t g, int64_t D, int64_t G, int64_t group, float scale, float* scores,
              float* row, float* s, float* out),
             (q, q_head_stride, table, first, len, kc, ks, vc, vs, bits, bs, H_kv, g, D, G, group, scale, scores,
              row, s, out))

// One head vector x [D] -> codes (int8 [D], or int4 [D / 2] packed) and D / G float16 scales, kvcache/pool.py's
// rule: scale = fp16(max|x_group| / qmax), code = clamp(round_half_even(x / scale), -qmax, qmax), 0 where the
// scale is 0. Exact float operations only, so the codes are torch's (pool.quantize) on every path.
void quantize_head(const float* x, int bits, int64_t D, int64_t G, uint8_t* codes, c10::Half* scales) {
  const float qmax = bits == 8 ? 127.f : 7.f;
  for (int64_t start = 0, k = 0; start < D; start += G, ++k) {
    float amax = 0.f;
    for (int64_t i = start; i < start + G; ++i) amax = std::max(amax, std::fabs(x[i]));
    scales[k] = c10::Half(amax / qmax);
    const float s = static_cast<float>(scales[k]);
    for (int64_t i = 0; i < G; ++i) {
      const float code = s > 0.f ? std::min(qmax, std::max(-qmax, std::nearbyint(x[start + i] / s))) : 0.f;
      if (bits == 8) {
        codes[start + i] = static_cast<uint8_t>(static_cast<int8_t>(code));
      } else if (i < G / 2) {
        codes[start / 2 + i] = static_cast<uint8_t>(code + 8.f);  // the low nibble of byte i
      } else {
        codes[start / 2 + i - G / 2] |= static_cast<uint8_t>(static_cast<int>(code + 8.f) << 4);
      }
    }
  }
}

}  // namespace

// y [T, H] = rms_norm(x [T, H]) * w [H].
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check_f32(x, "x");
  check_f32(w, "w");
  KV_CHECK(x.dim() == 2 && x.is_contiguous() && w.is_contiguous() && w.numel() == x.size(1),
           "x must be contiguous [T, H] and w [H]");
  auto y = torch::empty_like(x);
  const int64_t n = x.size(1);
  for (int64_t t = 0; t < x.size(0); ++t)
    rms_row(x.data_ptr<float>() + t * n, w.data_ptr<float>(), static_cast<float>(eps), y.data_ptr<float>() + t * n, n);
  return y;
}

// x += r in place (the residual stream), then return rms_norm(x) * w.
torch::Tensor add_rms_norm_(torch::Tensor& x, const torch::Tensor& r, const torch::Tensor& w, double eps) {
  check_f32(x, "x");
  check_f32(r, "r");
  KV_CHECK(x.dim() == 2 && x.is_contiguous() && r.is_contiguous() && r.sizes() == x.sizes(),
           "x and r must be contiguous [T, H]");
  const int64_t n = x.size(1);
  for (int64_t t = 0; t < x.size(0); ++t) add_row(x.data_ptr<float>() + t * n, r.data_ptr<float>() + t * n, n);
  return rms_norm(x, w, eps);
}

// RoPE in place on qk [T, heads, D] (any row/head strides, D contiguous) with cos, sin [T, D] as transformers'
// rotary embedding returns them: out[:h] = a cos - b sin, out[h:] = b cos + a sin for a = x[:h], b = x[h:].
void rope_(torch::Tensor& qk, const torch::Tensor& cos, const torch::Tensor& sin) {
  check_f32(qk, "qk");
  KV_CHECK(qk.dim() == 3 && qk.stride(2) == 1 && qk.size(2) % 2 == 0, "qk must be [T, heads, D], D contiguous");
  KV_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.dim() == 2 &&
               cos.size(0) == qk.size(0) && cos.size(1) == qk.size(2),
           "cos and sin must be contiguous [T, D]");
  const int64_t T = qk.size(0), heads = qk.size(1), D = qk.size(2);
  float* base = qk.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < heads; ++h)
      rope_row(base + t * qk.stride(0) + h * qk.stride(1), cos.data_ptr<float>() + t * D,
               sin.data_ptr<float>() + t * D, D / 2);
}

// k_cache, v_cache [slots, H_kv, D] (contiguous) <- k, v [T, H_kv, D] (any row/head strides) at slots [T].
void write_kv(torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slots, const torch::Tensor& k,
              const torch::Tensor& v) {
  check_f32(k_cache, "k_cache");
  check_f32(v_cache, "v_cache");
  check_f32(k, "k");
  check_f32(v, "v");
  KV_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
           "caches must be contiguous [slots, H_kv, D]");
  KV_CHECK(slots.scalar_type() == torch::kLong && slots.is_contiguous() && slots.numel() == k.size(0),
           "slots must be int64 [T]");
  KV_CHECK(k.sizes() == v.sizes() && k.size(1) == k_cache.size(1) && k.size(2) == k_cache.size(2) &&
               k.stride(2) == 1 && v.stride(2) == 1,
           "k and v must be [T, H_kv, D] with D contiguous");
  const int64_t T = k.size(0), H = k.size(1), D = k.size(2), num_slots = k_cache.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    KV_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot ", sp[t], " out of range");
    for (int64_t h = 0; h < H; ++h) {
      std::copy_n(k.data_ptr<float>() + t * k.stride(0) + h * k.stride(1), D,
                  k_cache.data_ptr<float>() + (sp[t] * H + h) * D);
      std::copy_n(v.data_ptr<float>() + t * v.stride(0) + h * v.stride(1), D,
                  v_cache.data_ptr<float>() + (sp[t] * H + h) * D);
    }
  }
}

// The decode rows' indices of paged_decode_attention(_quant): rows [B], tables [B, max_blocks], lens [B]
// contiguous int64, each row inside q [T, ...], each context inside its table, each block inside the pool.
static void check_decode_rows(const torch::Tensor& q, const torch::Tensor& rows, const torch::Tensor& tables,
                              const torch::Tensor& lens, int64_t num_blocks, int64_t bs) {
  KV_CHECK(rows.scalar_type() == torch::kLong && tables.scalar_type() == torch::kLong &&
               lens.scalar_type() == torch::kLong && rows.is_contiguous() && tables.is_contiguous() &&
               lens.is_contiguous() && tables.dim() == 2 && tables.size(0) == rows.numel() &&
               lens.numel() == rows.numel(),
           "rows [B], tables [B, max_blocks], lens [B] must be contiguous int64");
  const int64_t B = rows.numel(), width = tables.size(1);
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    KV_CHECK(lp[b] >= 1 && lp[b] <= width * bs, "context length ", lp[b], " does not fit its block table");
    KV_CHECK(rp[b] >= 0 && rp[b] < q.size(0), "row ", rp[b], " out of range");
    for (int64_t i = 0; i < (lp[b] + bs - 1) / bs; ++i)
      KV_CHECK(tp[b * width + i] >= 0 && tp[b * width + i] < num_blocks, "block id out of range");
  }
}

// Decode attention over the paged pool. q [T, H, D] (any row/head strides); rows [B]: the decode rows of q;
// tables [B, max_blocks] int64 block tables; lens [B] context lengths (the query is the last position);
// k_blocks, v_blocks [num_blocks, block_size, H_kv, D] contiguous; window: sliding window (tokens) or <= 0;
// out [T, H, D] contiguous: rows[b] is written. Query head h reads KV head h / (H / H_kv) (GQA).
void paged_decode_attention(const torch::Tensor& q, const torch::Tensor& rows, const torch::Tensor& tables,
                            const torch::Tensor& lens, const torch::Tensor& k_blocks, const torch::Tensor& v_blocks,
                            double scale, int64_t window, torch::Tensor& out) {
  check_f32(q, "q");
  check_f32(k_blocks, "k_blocks");
  check_f32(v_blocks, "v_blocks");
  check_f32(out, "out");
  KV_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [T, H, D] with D contiguous");
  KV_CHECK(k_blocks.dim() == 4 && k_blocks.is_contiguous() && v_blocks.is_contiguous() &&
               k_blocks.sizes() == v_blocks.sizes() && k_blocks.size(3) == q.size(2),
           "k_blocks and v_blocks must be contiguous [blocks, block_size, H_kv, D]");
  KV_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out must be contiguous like q");
  const int64_t B = rows.numel(), H = q.size(1), D = q.size(2);
  const int64_t num_blocks = k_blocks.size(0), bs = k_blocks.size(1), H_kv = k_blocks.size(2);
  check_decode_rows(q, rows, tables, lens, num_blocks, bs);
  KV_CHECK(H % H_kv == 0, "query heads ", H, " not a multiple of KV heads ", H_kv);
  const int64_t group = H / H_kv, width = tables.size(1);
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const float* kp = k_blocks.data_ptr<float>();
  const float* vp = v_blocks.data_ptr<float>();
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
#ifdef KV_X86
  const bool avx2 = kvserve::cpu::avx2() && D % 8 == 0;
#endif
  // one task per (sequence, KV head): its `group` query heads share each K and V row read
  at::parallel_for(0, B * H_kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / H_kv, g = task % H_kv, len = lp[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      scores.resize(group * (len - first));
      const float* qg = qp + rp[b] * q.stride(0) + g * group * q.stride(1);
      float* og = op + (rp[b] * H + g * group) * D;
#ifdef KV_X86
      if (avx2) {
        attend_kv_head_avx2(qg, q.stride(1), tp + b * width, first, len, kp, vp, bs, H_kv, g, D, group, sc,
                            scores.data(), og);
        continue;
      }
#endif
      attend_loops(qg, q.stride(1), tp + b * width, first, len, kp, vp, bs, H_kv, g, D, group, sc,
                     scores.data(), og);
    }
  });
}

// The shapes of one layer's quantized K or V (codes [..., H_kv, D * bits / 8] int8 or uint8, scales
// [..., H_kv, S] float16, the same leading sizes) for head_dim D: returns G = D / S, the elements per scale.
static int64_t check_quant_cache(const torch::Tensor& codes, const torch::Tensor& scales, int64_t bits, int64_t D,
                                 const char* name) {
  KV_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4, got ", bits);
  KV_CHECK(codes.scalar_type() == (bits == 8 ? torch::kInt8 : torch::kUInt8) && codes.is_cpu() &&
               codes.is_contiguous() && codes.size(-1) == D * bits / 8,
           name, " codes must be contiguous ", bits == 8 ? "int8" : "uint8", " [..., H_kv, D * bits / 8]");
  KV_CHECK(scales.scalar_type() == torch::kHalf && scales.is_contiguous() && scales.dim() == codes.dim() &&
               scales.size(-1) >= 1 && D % scales.size(-1) == 0,
           name, " scales must be contiguous float16 [..., H_kv, S] with S dividing D");
  for (int64_t i = 0; i + 1 < codes.dim(); ++i)
    KV_CHECK(scales.size(i) == codes.size(i), name, " scales and codes disagree in dimension ", i);
  const int64_t G = D / scales.size(-1);
  KV_CHECK(G % (bits == 8 ? 8 : 16) == 0, name, ": ", G, " elements per scale is not a multiple of ",
           bits == 8 ? 8 : 16);
  return G;
}

// k, v [T, H_kv, D] float32 (any row/head strides, D contiguous) quantized into codes/scales [slots, H_kv, ...]
// at slots [T] (check_quant_cache's shapes), pool.quantize's rule.
void write_kv_quant(torch::Tensor& k_codes, torch::Tensor& k_scales, torch::Tensor& v_codes, torch::Tensor& v_scales,
                    const torch::Tensor& slots, const torch::Tensor& k, const torch::Tensor& v, int64_t bits) {
  check_f32(k, "k");
  check_f32(v, "v");
  KV_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
           "k and v must be [T, H_kv, D] with D contiguous");
  const int64_t T = k.size(0), H = k.size(1), D = k.size(2);
  const int64_t G = check_quant_cache(k_codes, k_scales, bits, D, "k");
  KV_CHECK(check_quant_cache(v_codes, v_scales, bits, D, "v") == G && v_codes.sizes() == k_codes.sizes(),
           "k and v caches must have the same shapes");
  KV_CHECK(k_codes.dim() == 3 && k_codes.size(1) == H, "caches must be [slots, H_kv, row] with k's H_kv");
  KV_CHECK(slots.scalar_type() == torch::kLong && slots.is_contiguous() && slots.numel() == T,
           "slots must be int64 [T]");
  const int64_t num_slots = k_codes.size(0), row = D * bits / 8, S = D / G;
  const int64_t* sp = slots.data_ptr<int64_t>();
  struct Side {
    const torch::Tensor& x;
    torch::Tensor& codes;
    torch::Tensor& scales;
  };
  for (const Side& side : {Side{k, k_codes, k_scales}, Side{v, v_codes, v_scales}}) {
    auto* codes = static_cast<uint8_t*>(side.codes.data_ptr());
    auto* scales = side.scales.data_ptr<c10::Half>();
    const float* x = side.x.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) {
      KV_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot ", sp[t], " out of range");
      for (int64_t h = 0; h < H; ++h) {
        uint8_t* c = codes + (sp[t] * H + h) * row;
        if (bits == 4) std::fill_n(c, row, uint8_t{0});  // the high nibbles are or-ed in
        quantize_head(x + t * side.x.stride(0) + h * side.x.stride(1), static_cast<int>(bits), D, G, c,
                      scales + (sp[t] * H + h) * S);
      }
    }
  }
}

// paged_decode_attention over a quantized pool: k_codes/v_codes [num_blocks, block_size, H_kv, D * bits / 8],
// k_scales/v_scales [num_blocks, block_size, H_kv, S] float16; the rest as there (D: q's head size).
void paged_decode_attention_quant(const torch::Tensor& q, const torch::Tensor& rows, const torch::Tensor& tables,
                                  const torch::Tensor& lens, const torch::Tensor& k_codes,
                                  const torch::Tensor& k_scales, const torch::Tensor& v_codes,
                                  const torch::Tensor& v_scales, int64_t bits, double scale, int64_t window,
                                  torch::Tensor& out) {
  check_f32(q, "q");
  check_f32(out, "out");
  KV_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [T, H, D] with D contiguous");
  const int64_t B = rows.numel(), H = q.size(1), D = q.size(2);
  const int64_t G = check_quant_cache(k_codes, k_scales, bits, D, "k");
  KV_CHECK(check_quant_cache(v_codes, v_scales, bits, D, "v") == G && v_codes.sizes() == k_codes.sizes(),
           "k and v caches must have the same shapes");
  KV_CHECK(k_codes.dim() == 4, "codes must be [blocks, block_size, H_kv, row]");
  KV_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out must be contiguous like q");
  const int64_t num_blocks = k_codes.size(0), bs = k_codes.size(1), H_kv = k_codes.size(2);
  check_decode_rows(q, rows, tables, lens, num_blocks, bs);
  KV_CHECK(H % H_kv == 0, "query heads ", H, " not a multiple of KV heads ", H_kv);
  const int64_t group = H / H_kv, width = tables.size(1);
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const auto* kc = static_cast<const uint8_t*>(k_codes.data_ptr());
  const auto* vc = static_cast<const uint8_t*>(v_codes.data_ptr());
  const c10::Half* ks = k_scales.data_ptr<c10::Half>();
  const c10::Half* vs = v_scales.data_ptr<c10::Half>();
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  // one task per (sequence, KV head), as paged_decode_attention
  at::parallel_for(0, B * H_kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, row(D), s(D / G);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / H_kv, g = task % H_kv, len = lp[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      scores.resize(group * ((len - first + 7) / 8 * 8));
      attend_quant(qp + rp[b] * q.stride(0) + g * group * q.stride(1), q.stride(1), tp + b * width, first, len, kc,
                   ks, vc, vs, static_cast<int>(bits), bs, H_kv, g, D, G, group, sc, scores.data(), row.data(),
                   s.data(), op + (rp[b] * H + g * group) * D);
    }
  });
}

// One layer's attention for an all-decode step in one call, the calls above in the same order: RoPE on q and k
// in place, k and v written into the pool at `slots`, paged decode attention. qkv [T, (H + 2 H_kv) * D] is the
// fused q/k/v projection's output (contiguous); k_blocks, v_blocks [blocks, block_size, H_kv, D]. Returns
// out [T, H, D]. At batch 1 this replaces ~10 Python-level tensor calls per layer (slices, views, three ops;
// ~2-4 us each on this CPU) with C++ views.
torch::Tensor decode_attention_(torch::Tensor& qkv, int64_t heads, int64_t kv_heads, const torch::Tensor& cos,
                                const torch::Tensor& sin, const torch::Tensor& slots, torch::Tensor& k_blocks,
                                torch::Tensor& v_blocks, const torch::Tensor& rows, const torch::Tensor& tables,
                                const torch::Tensor& lens, double scale, int64_t window) {
  check_f32(qkv, "qkv");
  KV_CHECK(k_blocks.dim() == 4 && k_blocks.is_contiguous() && v_blocks.is_contiguous() &&
               k_blocks.size(2) == kv_heads,
           "k_blocks and v_blocks must be contiguous [blocks, block_size, H_kv, D]");
  const int64_t T = qkv.size(0), D = k_blocks.size(3);
  KV_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.size(1) == (heads + 2 * kv_heads) * D,
           "qkv must be contiguous [T, (H + 2 H_kv) * D]");
  auto x = qkv.view({T, heads + 2 * kv_heads, D});
  auto qk = x.narrow(1, 0, heads + kv_heads);
  rope_(qk, cos, sin);
  auto k_cache = k_blocks.view({-1, kv_heads, D});
  auto v_cache = v_blocks.view({-1, kv_heads, D});
  write_kv(k_cache, v_cache, slots, x.narrow(1, heads, kv_heads), x.narrow(1, heads + kv_heads, kv_heads));
  auto out = torch::empty({T, heads, D}, qkv.options());
  paged_decode_attention(x.narrow(1, 0, heads), rows, tables, lens, k_blocks, v_blocks, scale, window, out);
  return out;
}

// One row's log-softmax normalizer: m = max_j x_j and log(sum_j exp(x_j - m)), so that log_softmax(x)_j =
// (x_j - m) - log_sum (log_softmax's formula); nan: some x_j is NaN (then every logprob is NaN, as in torch).
// greedy_pick and log_softmax below both use it, so a token's logprob has the same bits from either.
struct Normalizer {
  float mx;
  float log_sum;
  bool nan;
};

static Normalizer row_normalizer(const float* x, int64_t V) {
  float mx = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  bool nan = false;
#ifdef KV_X86
  if (kvserve::cpu::avx2()) mx = max_avx2(x, V, &i, &nan);
#endif
  for (; i < V; ++i) {
    mx = std::max(mx, x[i]);
    nan = nan || std::isnan(x[i]);
  }
  if (nan) return {mx, std::numeric_limits<float>::quiet_NaN(), true};
  float sum = 0.f;
  i = 0;
#ifdef KV_X86
  if (kvserve::cpu::avx2()) {
    sum = sum_exp_avx2(x, V, mx, &i);
    for (; i < V; ++i) sum += std::exp(x[i] - mx);  // the tail of fewer than 8
    return {mx, std::log(sum), false};
  }
#endif
  // The portable path sums in double: one float accumulator over a 49,152-token vocabulary drifts ~2e-5 from
  // torch's log_softmax, where the vector path's 8 lanes stay within 1e-6.
  double total = 0.0;
  for (; i < V; ++i) total += std::exp(x[i] - mx);
  return {mx, std::log(static_cast<float>(total)), false};
}

// Per row of logits [R, V]: the greedy token, the first index of the row's maximum (torch.argmax's pick; a NaN
// counts as the maximum, as there), and its logprob (x_t - m) - log_sum. Vectorized passes for the maximum
// and the sum, a scan for its first index; torch's CPU argmax is not vectorized.
static void greedy_row(const float* x, int64_t V, int64_t* token, float* logprob) {
  const Normalizer n = row_normalizer(x, V);
  if (n.nan) {
    *token = std::find_if(x, x + V, [](float v) { return std::isnan(v); }) - x;
    *logprob = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  *token = std::find(x, x + V, n.mx) - x;
  *logprob = (x[*token] - n.mx) - n.log_sum;
}

// logits [R, V] float32 (contiguous) -> log_softmax over V, with greedy_pick's normalizer (same bits for a
// token from either; within ~1e-5 of torch's log_softmax, whose exponentials and sum order differ).
torch::Tensor log_softmax(const torch::Tensor& logits) {
  check_f32(logits, "logits");
  KV_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0, "logits must be contiguous [R, V]");
  const int64_t R = logits.size(0), V = logits.size(1);
  auto out = torch::empty_like(logits);
  const float* x = logits.data_ptr<float>();
  float* y = out.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const Normalizer n = row_normalizer(x + r * V, V);
      for (int64_t j = 0; j < V; ++j)
        y[r * V + j] = n.nan ? std::numeric_limits<float>::quiet_NaN() : (x[r * V + j] - n.mx) - n.log_sum;
    }
  });
  return out;
}

// logits [R, V] float32 (contiguous) -> (tokens int64 [R], logprobs float32 [R]); see greedy_row.
std::tuple<torch::Tensor, torch::Tensor> greedy_pick(const torch::Tensor& logits) {
  check_f32(logits, "logits");
  KV_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0, "logits must be contiguous [R, V]");
  const int64_t R = logits.size(0), V = logits.size(1);
  auto tokens = torch::empty({R}, logits.options().dtype(torch::kInt64));
  auto logprobs = torch::empty({R}, logits.options());
  const float* x = logits.data_ptr<float>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  float* lp = logprobs.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) greedy_row(x + r * V, V, tp + r, lp + r);
  });
  return {tokens, logprobs};
}

// SwiGLU's gate (Shazeer 2020): silu(gate) * up, gate and up [T, I] (any row stride, e.g. the two halves of a
// fused gate/up projection's output). torch's own silu and mul kernels, so the bits are torch's; one call from
// Python where silu, mul and the activation module's call were three.
torch::Tensor silu_mul(const torch::Tensor& gate, const torch::Tensor& up) {
  check_f32(gate, "gate");
  check_f32(up, "up");
  KV_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes(), "gate and up must both be [T, I]");
  auto y = at::silu(gate);
  y.mul_(up);
  return y;
}

// Without the GIL, as torch's own ops (see quant/qlinear.cpp).
using NoGil = py::call_guard<py::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, NoGil(), "x [T,H] f32, w [H], eps -> rms_norm(x) * w");
  m.def("add_rms_norm_", &add_rms_norm_, NoGil(), "x += r in place; returns rms_norm(x) * w");
  m.def("rope_", &rope_, NoGil(), "RoPE in place on qk [T, heads, D] with cos, sin [T, D]");
  m.def("write_kv", &write_kv, NoGil(), "k_cache/v_cache [slots, H_kv, D] <- k/v [T, H_kv, D] at slots [T]");
  m.def("paged_decode_attention", &paged_decode_attention, NoGil(),
        "q [T,H,D], rows [B], tables [B,nb], lens [B], k_blocks/v_blocks [nb,bs,H_kv,D], scale, window, out [T,H,D]");
  m.def("decode_attention_", &decode_attention_, NoGil(),
        "qkv [T,(H+2H_kv)D], H, H_kv, cos/sin [T,D], slots [T], k_blocks/v_blocks, rows, tables, lens, scale, window "
        "-> out [T,H,D] (RoPE in place, K/V written, paged decode attention)");
  m.def("write_kv_quant", &write_kv_quant, NoGil(),
        "k_codes, k_scales, v_codes, v_scales [slots, H_kv, ...] <- k/v [T, H_kv, D] f32 quantized at slots [T]; bits");
  m.def("paged_decode_attention_quant", &paged_decode_attention_quant, NoGil(),
        "q [T,H,D], rows [B], tables [B,nb], lens [B], k_codes, k_scales, v_codes, v_scales [nb,bs,H_kv,...], bits, "
        "scale, window, out [T,H,D]");
  m.def("silu_mul", &silu_mul, NoGil(), "gate, up [T,I] f32 -> silu(gate) * up [T,I]");
  m.def("greedy_pick", &greedy_pick, NoGil(),
        "logits [R,V] f32 -> (argmax tokens int64 [R], their log-softmax f32 [R])");
  m.def("log_softmax", &log_softmax, NoGil(), "logits [R,V] f32 -> log_softmax [R,V] (greedy_pick's normalizer)");
}
