// The int8 / int4 KV cache's ops (--kv-cache-dtype int8 | int4; kvcache/pool.py has the rule and the layout):
//
//   write_kv_quant(k_codes, k_scales, v_codes, v_scales, slots, k, v, bits)
//       the step's K/V quantized into the pool at the slot mapping, each head vector once (pool.quantize's bits)
//   paged_decode_attention_quant(q, rows, tables, lens, k_codes, k_scales, v_codes, v_scales, bits, scale,
//                                window, out)
//       paged decode attention (decode_ops.cpp's paged_decode_attention) straight on the codes: each code row is
//       widened to floats and scaled in registers, then fused multiply-adds, never a float copy of the cache.
//
// The attention is one body (kv_quant_body.h) compiled for three lane types: AVX-512 (16 floats), AVX2 + FMA
// (8) and the baseline (8 floats in an array, std::fma); kernels/csrc/cpu.h chooses. All three perform the same
// float operations in the same order (the body says which), so they give the same bits, and the same bits as
// the float32 cache's AVX2 kernel over the dequantized cache; tests/test_isa.py and tests/test_decode_ops.py
// check both. At long contexts the vector paths are bound by the bytes they read: an int8 row is 64 B per head
// where a float32 row is 256 B, and its loads are prefetched kRowsAhead rows ahead (blocks are scattered, which
// the hardware prefetcher does not follow).
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include "decode_common.h"

#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using kvserve::decode::check_f32;
using kvserve::decode::DecodeCall;

// The checked arguments of one paged_decode_attention_quant call.
struct QuantAttend {
  DecodeCall call;
  const uint8_t* k_codes;
  const c10::Half* k_scales;
  const uint8_t* v_codes;
  const c10::Half* v_scales;
  int bits;
  int64_t G;  // elements per scale
};

constexpr int64_t kMaxChunks = 64;  // Vecs per head vector: D <= 512

// The codes of dims [c * kW, (c + 1) * kW) of a head vector (kW: a path's lanes): the byte they start at, whether
// they are high nibbles (int4: group byte j holds code j low and code j + G / 2 high), and their scale's index.
struct Chunk {
  int32_t offset;
  int32_t high;
  int32_t group;
};

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

// ---- The baseline path: 8 float lanes in an array, one std::fma per lane (no FMA instruction needed) ----
namespace base {

constexpr int kW = 8;
struct Vec {
  float v[8];
};

inline Vec zero() { return Vec{}; }
inline Vec load(const float* p) {
  Vec r;
  std::memcpy(r.v, p, sizeof r.v);
  return r;
}
inline void store(float* p, const Vec& a) { std::memcpy(p, a.v, sizeof a.v); }
inline Vec bcast(float x) {
  Vec r;
  for (float& f : r.v) f = x;
  return r;
}
inline Vec mul(const Vec& a, const Vec& b) {
  Vec r;
  for (int l = 0; l < 8; ++l) r.v[l] = a.v[l] * b.v[l];
  return r;
}
inline Vec fma(const Vec& a, const Vec& b, const Vec& c) {
  Vec r;
  for (int l = 0; l < 8; ++l) r.v[l] = std::fma(a.v[l], b.v[l], c.v[l]);
  return r;
}
template <int Bits>
inline Vec codes_of(const uint8_t* row, const Chunk& chunk) {
  Vec r;
  for (int l = 0; l < 8; ++l) {
    const uint8_t byte = row[chunk.offset + l];
    r.v[l] = Bits == 8 ? static_cast<float>(static_cast<int8_t>(byte))
                       : static_cast<float>((chunk.high ? byte >> 4 : byte & 15) - 8);
  }
  return r;
}
// hsum8's order on the lanes of parts[0] + parts[1].
inline float reduce16(const Vec* parts) {
  float x[8];
  for (int l = 0; l < 8; ++l) x[l] = parts[0].v[l] + parts[1].v[l];
  return ((x[0] + x[4]) + (x[2] + x[6])) + ((x[1] + x[5]) + (x[3] + x[7]));
}
inline float half_to_float(c10::Half h) { return static_cast<float>(h); }
inline void prefetch(const void* p) { __builtin_prefetch(p); }

// _mm256_max_ps(a, b) and _mm_max_ss: a > b ? a : b.
inline float max_like_sse(float a, float b) { return a > b ? a : b; }

// exp8's operations on one lane (decode_common.h), fnmadd(n, c, x) being fma(-n, c, x).
inline float exp_like_exp8(float x) {
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
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float pow2n;
  std::memcpy(&pow2n, &bits, sizeof pow2n);
  return p * pow2n;
}

// softmax_avx2's operations in its order (decode_common.h).
inline void softmax(float* s, int64_t span) {
  float m8[8], sum8[8] = {};
  std::fill_n(m8, 8, -std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= span; i += 8)
    for (int l = 0; l < 8; ++l) m8[l] = max_like_sse(m8[l], s[i + l]);
  float m4[4];
  for (int l = 0; l < 4; ++l) m4[l] = max_like_sse(m8[l], m8[l + 4]);
  float mx = max_like_sse(max_like_sse(m4[0], m4[2]), max_like_sse(m4[1], m4[3]));
  for (; i < span; ++i) mx = std::max(mx, s[i]);
  for (i = 0; i + 8 <= span; i += 8)
    for (int l = 0; l < 8; ++l) {
      s[i + l] = exp_like_exp8(s[i + l] - mx);
      sum8[l] = sum8[l] + s[i + l];
    }
  float sum = ((sum8[0] + sum8[4]) + (sum8[2] + sum8[6])) + ((sum8[1] + sum8[5]) + (sum8[3] + sum8[7]));
  for (; i < span; ++i) {
    s[i] = std::exp(s[i] - mx);
    sum += s[i];
  }
  const float inv = 1.f / sum;
  for (i = 0; i < span; ++i) s[i] *= inv;
}

#include "kv_quant_body.h"

}  // namespace base

#ifdef KV_X86

// ---- AVX2 + FMA: 8 lanes in a ymm register ----
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {

constexpr int kW = 8;
using Vec = __m256;

inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, Vec a) { _mm256_storeu_ps(p, a); }
inline Vec bcast(float x) { return _mm256_set1_ps(x); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
template <int Bits>
inline Vec codes_of(const uint8_t* row, const Chunk& chunk) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + chunk.offset));
  if (Bits == 8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  __m256i n = _mm256_cvtepu8_epi32(bytes);
  n = chunk.high ? _mm256_srli_epi32(n, 4) : _mm256_and_si256(n, _mm256_set1_epi32(15));
  return _mm256_cvtepi32_ps(_mm256_sub_epi32(n, _mm256_set1_epi32(8)));
}
inline float reduce16(const Vec* parts) { return kvserve::decode::hsum8(_mm256_add_ps(parts[0], parts[1])); }
inline float half_to_float(c10::Half h) { return _cvtsh_ss(h.x); }
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
inline void softmax(float* s, int64_t span) { kvserve::decode::softmax_avx2(s, span); }

#include "kv_quant_body.h"

}  // namespace avx2
#pragma GCC pop_options

// ---- AVX-512 (F): 16 lanes in a zmm register; lanes 8-15 are the AVX2 path's second accumulator ----
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
namespace avx512 {

constexpr int kW = 16;
using Vec = __m512;

inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, Vec a) { _mm512_storeu_ps(p, a); }
inline Vec bcast(float x) { return _mm512_set1_ps(x); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
template <int Bits>
inline Vec codes_of(const uint8_t* row, const Chunk& chunk) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + chunk.offset));
  if (Bits == 8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
  __m512i n = _mm512_cvtepu8_epi32(bytes);
  n = chunk.high ? _mm512_srli_epi32(n, 4) : _mm512_and_si512(n, _mm512_set1_epi32(15));
  return _mm512_cvtepi32_ps(_mm512_sub_epi32(n, _mm512_set1_epi32(8)));
}
inline float reduce16(const Vec* parts) {
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(parts[0]), 1));
  return kvserve::decode::hsum8(_mm256_add_ps(_mm512_castps512_ps256(parts[0]), hi));
}
inline float half_to_float(c10::Half h) { return _cvtsh_ss(h.x); }
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
inline void softmax(float* s, int64_t span) { kvserve::decode::softmax_avx2(s, span); }

#include "kv_quant_body.h"

}  // namespace avx512
#pragma GCC pop_options

#endif

}  // namespace

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

// The path paged_decode_attention_quant runs for `bits` and G elements per scale: the one cpu.h chose, except
// that the AVX-512 path needs 16 codes of one scale per Vec (G a multiple of 16; of 32 for int4, whose bytes hold
// a group's two halves), else the AVX2 path runs (the same bits).
static kvserve::cpu::Isa attention_path(int64_t bits, int64_t G) {
  using kvserve::cpu::Isa;
  const Isa isa = kvserve::cpu::chosen();
  if (isa == Isa::kAvx512 && G % (bits == 8 ? 16 : 32) != 0) return Isa::kAvx2;
  return isa;
}

std::string kv_quant_path(int64_t bits, int64_t group) {
  KV_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4, got ", bits);
  return kvserve::cpu::name(attention_path(bits, group));
}

// paged_decode_attention over a quantized pool: k_codes/v_codes [num_blocks, block_size, H_kv, D * bits / 8],
// k_scales/v_scales [num_blocks, block_size, H_kv, S] float16; the rest as there (D: q's head size); runs
// attention_path's path.
void paged_decode_attention_quant(const torch::Tensor& q, const torch::Tensor& rows, const torch::Tensor& tables,
                                  const torch::Tensor& lens, const torch::Tensor& k_codes,
                                  const torch::Tensor& k_scales, const torch::Tensor& v_codes,
                                  const torch::Tensor& v_scales, int64_t bits, double scale, int64_t window,
                                  torch::Tensor& out) {
  KV_CHECK(q.dim() == 3, "q must be [T, H, D] with D contiguous");
  const int64_t D = q.size(2);
  const int64_t G = check_quant_cache(k_codes, k_scales, bits, D, "k");
  KV_CHECK(check_quant_cache(v_codes, v_scales, bits, D, "v") == G && v_codes.sizes() == k_codes.sizes(),
           "k and v caches must have the same shapes");
  KV_CHECK(k_codes.dim() == 4, "codes must be [blocks, block_size, H_kv, row]");
  KV_CHECK(D <= 8 * kMaxChunks && D / G <= base::kMaxScales, "head size ", D, " or its ", D / G,
           " scales per head vector is more than the kernel holds");
  const QuantAttend a{kvserve::decode::check_decode_call(q, rows, tables, lens, out, k_codes.size(0),
                                                         k_codes.size(1), k_codes.size(2), scale, window),
                      static_cast<const uint8_t*>(k_codes.data_ptr()), k_scales.data_ptr<c10::Half>(),
                      static_cast<const uint8_t*>(v_codes.data_ptr()), v_scales.data_ptr<c10::Half>(),
                      static_cast<int>(bits), G};
  const kvserve::cpu::Isa isa = attention_path(bits, G);
  // one task per (sequence, KV head), as paged_decode_attention
  at::parallel_for(0, a.call.B * a.call.H_kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / a.call.H_kv, g = task % a.call.H_kv;
      scores.resize(a.call.group * (a.call.lens[b] - a.call.first_of(b)));
#ifdef KV_X86
      if (isa == kvserve::cpu::Isa::kAvx512) {
        avx512::attend_head(a, b, g, scores.data());
        continue;
      }
      if (isa == kvserve::cpu::Isa::kAvx2) {
        avx2::attend_head(a, b, g, scores.data());
        continue;
      }
#endif
      base::attend_head(a, b, g, scores.data());
    }
  });
}
