// Activation quantizers of the integer linear kernels: Q8 (int8 per block of 32, llama.cpp's Q8_0; the int4
// kernel's) and Q16 (int16 per block of 64 or 32; the int8 kernel's), AVX2 and scalar, with per-thread buffers.
#pragma once

#include "linear_common.h"

namespace kvserve::linear {
namespace {

#ifdef QL_X86
// ---------------------------------------------------------------- int8 activations (the int4 kernel's)
// Activations are quantized per block of 32 (QK) to int8 with a float32 scale, as llama.cpp's Q8_0: one
// vpmaddubsw multiplies 32 int8 x 4-bit pairs. Weights stay as stored; the result is exactly
// W_hat @ Q8(x) up to float summation order (quant.schemes.quantize_activations is the reference).

// Loads a block of `vectors` x 8 floats into v and returns its max |x|; `bad` becomes true if the block holds a
// NaN or an infinity (both activation quantizers then give the block d = NaN, as the reference does).
__attribute__((target("avx2,fma"))) inline float load_block_absmax(const float* xb, int vectors, __m256* v,
                                                                   bool& bad) {
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  __m256 amax = _mm256_setzero_ps();
  __m256 nonfinite = _mm256_setzero_ps();
  for (int j = 0; j < vectors; ++j) {
    v[j] = _mm256_loadu_ps(xb + 8 * j);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v[j]));
    nonfinite = _mm256_or_ps(nonfinite, _mm256_cmp_ps(_mm256_sub_ps(v[j], v[j]), _mm256_setzero_ps(), _CMP_NEQ_UQ));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  bad = _mm256_movemask_ps(nonfinite) != 0;
  return _mm_cvtss_f32(m4);
}

// One block of 32 values, loaded in v[0..3], to codes qb with scale d (finite, nonzero): q = round(x / d) clamped
// to +-127; returns the codes' sum.
__attribute__((target("avx2,fma"))) inline int32_t quantize_block_avx2(const __m256* v, float d, int8_t* qb) {
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256 sv = _mm256_set1_ps(d);
  __m256i iv[4];
  const __m256 limit = _mm256_set1_ps(127.f);  // reached past 127 only where d is subnormal (the reference clamps)
  for (int j = 0; j < 4; ++j)
    iv[j] = _mm256_cvtps_epi32(_mm256_max_ps(
        _mm256_min_ps(_mm256_round_ps(_mm256_div_ps(v[j], sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                      limit), -limit));
  // pack 4 x 8 int32 -> 32 int8 (packs work per 128-bit lane; the permute restores k order)
  __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3]));
  packed = _mm256_permutevar8x32_epi32(packed, order);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), packed);
  const __m256i wide = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), packed),
                                         _mm256_set1_epi16(1));  // 8 partial sums of q
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(wide), _mm256_extracti128_si256(wide, 1));
  s4 = _mm_hadd_epi32(s4, s4);
  return _mm_cvtsi128_si32(_mm_hadd_epi32(s4, s4));
}

// Quantize x [M, K] per block of 32: q = round(x / d) clamped to +-127, d = max|x| / 127 (a zero block gives
// d = 0, q = 0), with the same division, round-half-even and clamp as the PyTorch reference, so q matches it.
// qsum[m, b] = sum of q.
__attribute__((target("avx2,fma"))) void quantize_blocks_avx2(const float* x, int64_t M, int64_t K, int8_t* q,
                                                              float* d, int32_t* qsum) {
  for (int64_t i = 0; i < M * (K / 32); ++i) {
    __m256 v[4];
    bool bad = false;
    const float scale = load_block_absmax(x + i * 32, 4, v, bad) / 127.f;
    int8_t* qb = q + i * 32;
    d[i] = bad ? std::numeric_limits<float>::quiet_NaN() : scale;  // NaN: as the reference, the products become NaN
    if (bad || scale == 0.f) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), _mm256_setzero_si256());
      qsum[i] = 0;
      continue;
    }
    qsum[i] = quantize_block_avx2(v, scale, qb);
  }
}

// Quantize x [M, K] per super-block of 256 (K a multiple of 256; the GGUF Q4_K / Q5_K kernels', as llama.cpp's
// Q8_K): one d = max|x| / 127 per 256 values, the codes as above (the reference is quantize_activations(x, 256,
// 127)); d and qsum per block of 32 as above, d repeated over the super-block's 8 blocks.
__attribute__((target("avx2,fma"))) void quantize_supers_avx2(const float* x, int64_t M, int64_t K, int8_t* q,
                                                              float* d, int32_t* qsum) {
  for (int64_t s = 0; s < M * (K / 256); ++s) {
    __m256 v[32];
    bool bad = false;
    const float scale = load_block_absmax(x + s * 256, 32, v, bad) / 127.f;
    for (int b = 0; b < 8; ++b) {
      const int64_t i = 8 * s + b;
      int8_t* qb = q + i * 32;
      d[i] = bad ? std::numeric_limits<float>::quiet_NaN() : scale;
      if (bad || scale == 0.f) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), _mm256_setzero_si256());
        qsum[i] = 0;
        continue;
      }
      qsum[i] = quantize_block_avx2(v + 4 * b, scale, qb);
    }
  }
}

// ---------------------------------------------------------------- int16 activations (int8 weights)
// x [M, K] per block of QB = 64 values (32 where K is not a multiple of 64) to int16: q = round(x / d) clamped
// to +-32767, d = max|x| / 32767 (a zero block: d = 0, q = 0; a block with NaN or infinity: d = NaN), the same
// float32 division, round-half-even and clamp as the PyTorch reference (quant.schemes.quantize_activations
// with qmax 32767), so q matches it exactly (the clamp matters only where d is subnormal, max|x| < ~4e-34).
// Blocks of 64 halve the per-block convert and scale of the tile: 1.2-1.25x faster at 8-32 rows than 32.
__attribute__((target("avx2,fma"))) void quantize16_blocks_avx2(const float* x, int64_t M, int64_t K, int64_t qb,
                                                                int16_t* q, float* d) {
  const __m256 limit = _mm256_set1_ps(32767.f);
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const int vectors = static_cast<int>(qb / 8);
  for (int64_t i = 0; i < M * (K / qb); ++i) {
    const float* xb = x + i * qb;
    __m256 v[8];
    bool bad = false;
    const float scale = load_block_absmax(xb, vectors, v, bad) / 32767.f;
    int16_t* out = q + i * qb;
    d[i] = bad ? std::numeric_limits<float>::quiet_NaN() : scale;
    if (bad || scale == 0.f) {
      std::fill(out, out + qb, int16_t{0});
      continue;
    }
    const __m256 sv = _mm256_set1_ps(scale);
    for (int j = 0; j < vectors; j += 2) {
      const __m256 ra = _mm256_round_ps(_mm256_div_ps(v[j], sv), kNearest);
      const __m256 rb = _mm256_round_ps(_mm256_div_ps(v[j + 1], sv), kNearest);
      const __m256i a = _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(ra, limit), -limit));
      const __m256i b = _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(rb, limit), -limit));
      // packs works per 128-bit lane ([a0-3 b0-3 | a4-7 b4-7]); qwords 0, 2, 1, 3 restore k order
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 8 * j), packed);
    }
  }
}
#endif

// Scalar twins of the above (CPUs without AVX2): same quantized activations, same integer products.
void quantize_blocks_scalar(const float* x, int64_t M, int64_t K, int8_t* q, float* d,
                            int32_t* qsum) {
  for (int64_t i = 0; i < M * (K / 32); ++i) {
    const float* xb = x + i * 32;
    float amax = 0.f;
    bool bad = false;  // NaN or infinity: the block's products become NaN, as in the reference
    for (int k = 0; k < 32; ++k) {
      amax = std::max(amax, std::fabs(xb[k]));
      bad = bad || !std::isfinite(xb[k]);
    }
    const float scale = bad ? std::numeric_limits<float>::quiet_NaN() : amax / 127.f;
    d[i] = scale;
    int32_t sum = 0;
    for (int k = 0; k < 32; ++k) {
      const float r = (bad || scale == 0.f) ? 0.f : std::clamp(std::nearbyint(xb[k] / scale), -127.f, 127.f);
      const int v = static_cast<int>(r);
      q[i * 32 + k] = static_cast<int8_t>(v);
      sum += v;
    }
    qsum[i] = sum;
  }
}

void quantize_supers_scalar(const float* x, int64_t M, int64_t K, int8_t* q, float* d, int32_t* qsum) {
  for (int64_t s = 0; s < M * (K / 256); ++s) {
    const float* xs = x + s * 256;
    float amax = 0.f;
    bool bad = false;
    for (int k = 0; k < 256; ++k) {
      amax = std::max(amax, std::fabs(xs[k]));
      bad = bad || !std::isfinite(xs[k]);
    }
    const float scale = bad ? std::numeric_limits<float>::quiet_NaN() : amax / 127.f;
    for (int b = 0; b < 8; ++b) {
      const int64_t i = 8 * s + b;
      d[i] = scale;
      int32_t sum = 0;
      for (int k = 0; k < 32; ++k) {
        const float xv = xs[32 * b + k];
        const float r = (bad || scale == 0.f) ? 0.f : std::clamp(std::nearbyint(xv / scale), -127.f, 127.f);
        const int v = static_cast<int>(r);
        q[i * 32 + k] = static_cast<int8_t>(v);
        sum += v;
      }
      qsum[i] = sum;
    }
  }
}

// x [M, K] per block of 32 (group 32) or per super-block of 256 (group 256) into q, d, qsum (per block of 32):
// AVX2 where the CPU has it, else the scalar twin (the same bits).
void quantize_groups(const float* x, int64_t M, int64_t K, int64_t group, int8_t* q, float* d, int32_t* qsum) {
#ifdef QL_X86
  if (cpu::avx2()) {
    if (group == 256) quantize_supers_avx2(x, M, K, q, d, qsum);
    else quantize_blocks_avx2(x, M, K, q, d, qsum);
    return;
  }
#endif
  if (group == 256) quantize_supers_scalar(x, M, K, q, d, qsum);
  else quantize_blocks_scalar(x, M, K, q, d, qsum);
}

void quantize16_blocks_scalar(const float* x, int64_t M, int64_t K, int64_t qb, int16_t* q, float* d) {
  for (int64_t i = 0; i < M * (K / qb); ++i) {
    const float* xb = x + i * qb;
    float amax = 0.f;
    bool bad = false;
    for (int64_t k = 0; k < qb; ++k) {
      amax = std::max(amax, std::fabs(xb[k]));
      bad = bad || !std::isfinite(xb[k]);
    }
    const float scale = bad ? std::numeric_limits<float>::quiet_NaN() : amax / 32767.f;
    d[i] = scale;
    for (int64_t k = 0; k < qb; ++k) {
      const float r = (bad || scale == 0.f) ? 0.f : std::clamp(std::nearbyint(xb[k] / scale), -32767.f, 32767.f);
      q[i * qb + k] = static_cast<int16_t>(r);
    }
  }
}

// Q8 activations of one call: q int8 [M, K], d float32 [M, K / 32], qsum int32 [M, K / 32]. The buffers are
// reused across calls (per thread): three torch::empty calls cost about as much as a small layer's product. They
// start on cache lines (aligned_vector.h): the kernels load activation rows 32 or 64 bytes at a time.
struct QuantizedX {
  AlignedVector<int8_t> q;
  AlignedVector<float> d;
  AlignedVector<int32_t> qsum;
};

// group: 32, or 256 (quantize_groups).
const QuantizedX& quantize_x(const float* xp, int64_t M, int64_t K, int64_t group = 32) {
  thread_local QuantizedX out;
  out.q.resize(M * K);
  out.d.resize(M * K / 32);
  out.qsum.resize(M * K / 32);
  quantize_groups(xp, M, K, group, out.q.data(), out.d.data(), out.qsum.data());
  return out;
}

const QuantizedX& quantize_x(const torch::Tensor& x) { return quantize_x(x.data_ptr<float>(), x.size(0), x.size(1)); }

// Q16 activations of one call: q int16 [M, K], d float32 [M, K / qb], reused across calls (per thread).
struct QuantizedX16 {
  AlignedVector<int16_t> q;
  AlignedVector<float> d;
};

const QuantizedX16& quantize_x16(const torch::Tensor& x, int64_t qb) {
  thread_local QuantizedX16 out;
  const int64_t M = x.size(0), K = x.size(1);
  out.q.resize(M * K);
  out.d.resize(M * K / qb);
  const float* xp = x.data_ptr<float>();
#ifdef QL_X86
  if (cpu::avx2()) {
    quantize16_blocks_avx2(xp, M, K, qb, out.q.data(), out.d.data());
    return out;
  }
#endif
  quantize16_blocks_scalar(xp, M, K, qb, out.q.data(), out.d.data());
  return out;
}

// xs [M, K / G]: per activation row and weight group, sum over the group's blocks of d_b * qsum_b (the int4
// offset's share, see q8_int4_tile_avx2), accumulated in block order with fma.
const float* group_shifts(const QuantizedX& qx, int64_t M, int64_t K, int64_t G) {
  thread_local AlignedVector<float> xs;
  const int64_t nb = K / 32, per_group = G / 32, ng = K / G;
  xs.assign(M * ng, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < ng; ++g)
      for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b)
        xs[m * ng + g] = std::fma(qx.d[m * nb + b], static_cast<float>(qx.qsum[m * nb + b]), xs[m * ng + g]);
  return xs.data();
}

}  // namespace
}  // namespace kvserve::linear
