// Quantized (and float32) linear layers for CPU decode: y = x @ W_hat^T, reading the packed weights once.
//
// Decode at batch 1 is a matrix-vector product bound by the bytes of W, so the kernels stream the int8 or
// packed 4-bit codes and never write a float copy of W.
//   int8:        activations are quantized per block of 64 (or 32) to int16 and multiplied with the widened
//                codes by AVX2 16-bit dot products (vpmaddwd): y = W_hat @ Q16(x) up to float summation order.
//                Q16's step is 1/32767 of a block's max, ~250x finer than the weights' own int8 grid, so the
//                layer is as accurate as weight-only int8 (Q8 activations had cost 1.6 points of greedy
//                agreement on SmolLM2); widening int8 codes to floats instead capped the kernel at ~10 GB/s.
//   int4:        activations quantized per block of 32 to int8 (llama.cpp's Q8_0), AVX2 8-bit dot products
//                (vpmaddubsw) over panels of 8 weight rows: y = W_hat @ Q8(x) up to float summation order.
//   NF4:         float32 activations; the codes are widened through the 16-level table (lut4_linear).
//   float32:     f32_linear, register tiles of 3 activation rows x 4 weight rows.
//
// Layouts (see quant/schemes.py):
//   int8:  w int8 [N, K], scales float32 [N]                     w_hat[n,k] = w[n,k] * s[n]
//   int8 panels (int8_linear with panels): w int8 [N, K] holding N/16 panels of 16 rows, each 16 * K contiguous
//          bytes in k pairs: byte 2r + j of pair i = w[16p + r, 2i + j] (quant.schemes.pack_int8_panels)
//   4-bit: w uint8 [N, K/2] (k even: low nibble, k odd: high),   w_hat[n,k] = lut[code] * s[k/G, n]
//          scales float16 [K/G, N], lut float32 [16]            (int4: lut[c] = c - 8; NF4: the NF4 levels)
//   int4 panels (int4_linear): w uint8 [N, K/2] holding N/8 panels of 8 rows, each K * 4 contiguous bytes in
//          chunks of 8 k: byte 4r + i of chunk t = code(r, 8t + i) | code(r, 8t + 4 + i) << 4
//          (quant.schemes.pack_nibble_panels), scales float16 [K/G, N]  w_hat[n,k] = (code - offset) * s[k/G, n]
//
// The AVX2+FMA paths are compiled with target attributes and chosen at run time, so one build runs on any
// x86-64 CPU; elsewhere the scalar loops run.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include "kvcheck.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define QL_X86 1
#endif

namespace {

constexpr int64_t kRowsPerTask = 8;  // output rows per parallel task: small enough to split N=192 over cores

bool has_avx2() {
#ifdef QL_X86
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
  return ok;
#else
  return false;
#endif
}

// ---------------------------------------------------------------- scalar reference loops
void lut4_rows_scalar(const float* x, const uint8_t* w, const c10::Half* s, const float* lut, float* y,
                      int64_t M, int64_t N, int64_t K, int64_t G, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * (K / 2);
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * K;
      float total = 0.f;
      for (int64_t g = 0; g < K / G; ++g) {
        float acc = 0.f;
        for (int64_t k = g * G; k < (g + 1) * G; k += 2) {
          const uint8_t byte = row[k / 2];
          acc += xm[k] * lut[byte & 0x0F] + xm[k + 1] * lut[byte >> 4];
        }
        total += acc * static_cast<float>(s[g * N + n]);
      }
      y[m * N + n] = total;
    }
  }
}

void f32_rows_scalar(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0,
                     int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* row = w + n * K;
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * K;
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += xm[k] * row[k];
      y[m * N + n] = acc;
    }
  }
}

#ifdef QL_X86
// ---------------------------------------------------------------- AVX2 + FMA
// The sum of v's 8 lanes in hsum4's order, ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)), so a row's bits do
// not depend on whether it was summed alone (the tail of a thread's rows) or in a group of 4.
__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(v, v), v);  // lane 0: v0 + v1 + v2 + v3 (as pairs), lane 4: v4..v7
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}

// The four sums of a0..a3 in one vector (hadd tree).
__attribute__((target("avx2,fma"))) inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));  // [sum a0, .., sum a3]
}

// Widen 8 nibble codes (the low 8 bytes of `codes`, one code per byte) to floats through the 16-entry table:
// permutevar looks up the low 3 bits in each half of the table, bit 3 (moved to the sign) picks the half.
__attribute__((target("avx2,fma"))) inline __m256 lut8(__m128i codes, __m256 lut_lo, __m256 lut_hi) {
  const __m256i idx = _mm256_cvtepu8_epi32(codes);
  const __m256 lo = _mm256_permutevar8x32_ps(lut_lo, idx);
  const __m256 hi = _mm256_permutevar8x32_ps(lut_hi, idx);
  return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

// x here is de-interleaved per block of 32: [x0 x2 .. x30 | x1 x3 .. x31], matching the nibble order of
// 16 packed bytes (low nibbles = even k, high nibbles = odd k).
template <int MT>
__attribute__((target("avx2,fma,f16c"))) void lut4_rows_avx2(const float* xd, const uint8_t* w, const c10::Half* s,
                                                        const float* lut, float* y, int64_t N, int64_t K,
                                                        int64_t G, int64_t n0, int64_t n1) {
  const __m256 lut_lo = _mm256_loadu_ps(lut);
  const __m256 lut_hi = _mm256_loadu_ps(lut + 8);
  const __m128i low_mask = _mm_set1_epi8(0x0F);
  const int64_t groups = K / G;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * (K / 2);
    __m256 total[MT];
    for (int m = 0; m < MT; ++m) total[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m256 acc[MT][4];  // four chains per row hide the FMA latency
      for (int m = 0; m < MT; ++m)
        for (int j = 0; j < 4; ++j) acc[m][j] = _mm256_setzero_ps();
      for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2));
        const __m128i even = _mm_and_si128(bytes, low_mask);
        const __m128i odd = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_mask);
        const __m128i parts[4] = {even, _mm_unpackhi_epi64(even, even),  // k, k+2, .., k+14 | k+16, .., k+30
                                  odd, _mm_unpackhi_epi64(odd, odd)};    // k+1, .., k+15  | k+17, .., k+31
        __m256 wv[4];
        for (int j = 0; j < 4; ++j) wv[j] = lut8(parts[j], lut_lo, lut_hi);
        for (int m = 0; m < MT; ++m)
          for (int j = 0; j < 4; ++j)
            acc[m][j] = _mm256_fmadd_ps(wv[j], _mm256_loadu_ps(xd + m * K + k + 8 * j), acc[m][j]);
      }
      const __m256 scale = _mm256_set1_ps(_cvtsh_ss(s[g * N + n].x));
      for (int m = 0; m < MT; ++m) {
        const __m256 sum = _mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]), _mm256_add_ps(acc[m][2], acc[m][3]));
        total[m] = _mm256_fmadd_ps(sum, scale, total[m]);
      }
    }
    for (int m = 0; m < MT; ++m) y[m * N + n] = hsum(total[m]);
  }
}

// float32 weights, a tile of MT activation rows x NT weight rows: MT * NT accumulators (one FMA chain each)
// fed by MT + NT loads per 8 k, so at 3 x 4 the loop is bound by FMAs, not loads. At small M the weights are
// read once (memory-bound), where a general GEMM packs both operands and ran at 6-8 GB/s here for M = 8.
// With PF, `ahead_rows` weight rows at `ahead` are prefetched into L1 while this tile computes, one cache line
// per row every 16 k. for_tiles passes the rows two weight tiles on during the first activation tile of each
// weight tile, so with several activation tiles the DRAM reads overlap their FMAs instead of stalling the
// first of them: 1.2-1.3x faster at 8 rows, level at 1 and 32 (interleaved A/B, 60 SmolLM2-sized layers).
template <int MT, int NT, bool PF>
__attribute__((target("avx2,fma"))) void f32_tile_avx2(const float* x, const float* w, float* y, int64_t N,
                                                       int64_t K, int64_t n, const float* ahead, int64_t ahead_rows) {
  __m256 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) acc[m][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    if (PF && k % 16 == 0)
      for (int64_t j = 0; j < ahead_rows; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + j * K + k), _MM_HINT_T0);
    __m256 xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = _mm256_loadu_ps(x + m * K + k);
    for (int j = 0; j < NT; ++j) {
      const __m256 wv = _mm256_loadu_ps(w + (n + j) * K + k);
      for (int m = 0; m < MT; ++m) acc[m][j] = _mm256_fmadd_ps(wv, xv[m], acc[m][j]);
    }
  }
  for (int m = 0; m < MT; ++m) {
    if constexpr (NT == 4)
      _mm_storeu_ps(y + m * N + n, hsum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
    else
      for (int j = 0; j < NT; ++j) y[m * N + n + j] = hsum(acc[m][j]);
  }
}

// Every (activation tile, weight tile) of rows [n0, n1): weight tiles of NT rows (then single rows), each
// paired with activation tiles of MTMAX, .., 1 rows; a weight tile stays in L1 while the activations stream.
template <int MTMAX, int NT, typename Fn>
void for_tiles(int64_t M, int64_t n0, int64_t n1, Fn&& fn) {
  auto rows = [&](int64_t n, auto nt) {
    int64_t m = 0;
    if constexpr (MTMAX >= 3)
      for (; m + 3 <= M; m += 3) fn(m, n, std::integral_constant<int, 3>{}, nt);
    if constexpr (MTMAX >= 2)
      for (; m + 2 <= M; m += 2) fn(m, n, std::integral_constant<int, 2>{}, nt);
    for (; m < M; ++m) fn(m, n, std::integral_constant<int, 1>{}, nt);
  };
  int64_t n = n0;
  for (; n + NT <= n1; n += NT) rows(n, std::integral_constant<int, NT>{});
  for (; n < n1; ++n) rows(n, std::integral_constant<int, 1>{});
}

// How far ahead of the weight bytes being read the int8 tiles and int4 panels prefetch. A task's weight rows
// (panels) are contiguous (at::parallel_for hands each thread one run of them), so an address a few KB on is one
// this thread reads soon. Chosen by interleaved A/Bs of a decode step's projections (SmolLM2's 30 layers, 2
// threads): 256 bytes (less than one row) was the slowest distance tried at 1 activation row; the int8 tile
// gained at 2 KB at 32 rows as well; the int4 panels were level or slightly faster at 4 KB than at 1 KB.
constexpr int64_t kInt8Ahead = 2048;
constexpr int64_t kInt8PanelAhead = 1024;
constexpr int64_t kInt4Ahead = 4096;

// Weight rows a tile (activation rows from m, weight rows from n, in a task ending at n1) prefetches: the NT rows
// of the tile after next, during a weight tile's first activation tile, when there are several (f32_tile_avx2).
inline int64_t rows_ahead(int64_t m, int64_t M, int64_t n, int64_t n1, int64_t NT) {
  return m == 0 && M > 1 ? std::max<int64_t>(std::min(n1 - (n + 2 * NT), NT), 0) : 0;
}

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

// Quantize x [M, K] per block of 32: q = round(x / d) clamped to +-127, d = max|x| / 127 (a zero block gives
// d = 0, q = 0), with the same division, round-half-even and clamp as the PyTorch reference, so q matches it.
// qsum[m, b] = sum of q.
__attribute__((target("avx2,fma"))) void quantize_blocks_avx2(const float* x, int64_t M, int64_t K, int8_t* q,
                                                              float* d, int32_t* qsum) {
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const int64_t nb = K / 32;
  for (int64_t i = 0; i < M * nb; ++i) {
    const float* xb = x + i * 32;
    __m256 v[4];
    bool bad = false;
    const float scale = load_block_absmax(xb, 4, v, bad) / 127.f;
    int8_t* qb = q + i * 32;
    if (bad) {  // as the reference: the block's products become NaN
      d[i] = std::numeric_limits<float>::quiet_NaN();
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), _mm256_setzero_si256());
      qsum[i] = 0;
      continue;
    }
    d[i] = scale;
    if (scale == 0.f) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), _mm256_setzero_si256());
      qsum[i] = 0;
      continue;
    }
    const __m256 sv = _mm256_set1_ps(scale);
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
    qsum[i] = _mm_cvtsi128_si32(_mm_hadd_epi32(s4, s4));
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

// int8 weights (per-row scale s) x Q16 activations in blocks of QB: a tile of MT activation rows x NT weight
// rows. Each weight block is widened to int16 once (vpmovsxbw) for the MT rows; vpmaddwd sums pairs of
// products into int32 (|sum| <= 64 * 32767 * 127 < 2^31), converted and scaled once per block.
template <int QB, int MT, int NT, bool PF>
__attribute__((target("avx2,fma"))) void q16_int8_tile_avx2(const int16_t* q, const float* d, const int8_t* w,
                                                            const float* s, float* y, int64_t N, int64_t K,
                                                            int64_t n, const int8_t* ahead, int64_t ahead_rows) {
  constexpr int H = QB / 16;  // 16-code halves of a block
  const int64_t nb = K / QB;
  __m256 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) acc[m][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const bool line = QB == 64 || b % 2 == 0;  // the block starts a new 64-byte stretch of the row
    if (PF && line)
      for (int64_t j = 0; j < ahead_rows; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + j * K + QB * b), _MM_HINT_T0);
    for (int j = 0; j < NT; ++j) {
      const int8_t* wb = w + (n + j) * K + QB * b;
      if (line)  // software prefetch kInt8Ahead bytes on (rows further on; see kInt8Ahead)
        _mm_prefetch(reinterpret_cast<const char*>(wb + kInt8Ahead), _MM_HINT_T0);
      __m256i wv[H];
      for (int h = 0; h < H; ++h)
        wv[h] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 16 * h)));
      for (int m = 0; m < MT; ++m) {
        const __m256i* xb = reinterpret_cast<const __m256i*>(q + m * K + QB * b);
        __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(wv[0], _mm256_loadu_si256(xb)),
                                       _mm256_madd_epi16(wv[1], _mm256_loadu_si256(xb + 1)));
        if constexpr (H == 4)
          dot = _mm256_add_epi32(dot, _mm256_add_epi32(_mm256_madd_epi16(wv[2], _mm256_loadu_si256(xb + 2)),
                                                       _mm256_madd_epi16(wv[3], _mm256_loadu_si256(xb + 3))));
        acc[m][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(d + m * nb + b), acc[m][j]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) {
    if constexpr (NT == 4)
      _mm_storeu_ps(y + m * N + n, _mm_mul_ps(hsum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]), _mm_loadu_ps(s + n)));
    else
      for (int j = 0; j < NT; ++j) y[m * N + n + j] = hsum(acc[m][j]) * s[n + j];
  }
}

// int8 weights x Q16 activations over one panel of 16 weight rows (see the layout at the top), outer-product
// style: each lane of the two accumulators per activation row is one output row. A k pair of the 16 rows is
// 32 bytes, widened to two vectors of int16 (rows 0-7, 8-15); the activation's two int16 codes for that pair
// are broadcast as one int32, and vpmaddwd gives each row w[k] x[k] + w[k+1] x[k+1]. Block sums stay in int32
// (|sum| <= 64 * 32767 * 127 < 2^31) and are converted and scaled once per block, in block order, so an
// output's float operations do not depend on MT (batch invariance). Against the row tiles: 1.2-1.4x at
// 1 activation row, 1.1x at 8-32 (ad-hoc interleaved A/B, 30 SmolLM2-shaped layers); with 8-row panels it
// was slower than the row tiles (above), which serve layers whose rows do not fill panels.
template <int QB, int MT>
__attribute__((target("avx2,fma"))) void q16_int8_panel_avx2(const int16_t* q, const float* d, const int8_t* w,
                                                             const float* s, float* y, int64_t N, int64_t K,
                                                             int64_t p) {
  const int64_t nb = K / QB;
  const int8_t* panel = w + p * 16 * K;
  __m256 total[MT][2];
  for (int m = 0; m < MT; ++m) total[m][0] = total[m][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i acc[MT][2];
    for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
    const int8_t* wb = panel + 16 * QB * b;
    for (int i = 0; i < QB / 2; ++i) {
      if (i % 2 == 0)  // one cache line per two pairs
        _mm_prefetch(reinterpret_cast<const char*>(wb + 32 * i + kInt8PanelAhead), _MM_HINT_T0);
      const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 32 * i)));
      const __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 32 * i + 16)));
      for (int m = 0; m < MT; ++m) {  // the pair's two int16 codes, broadcast as one 32-bit value
        const __m256i xv = _mm256_castps_si256(
            _mm256_broadcast_ss(reinterpret_cast<const float*>(q + m * K + QB * b + 2 * i)));
        acc[m][0] = _mm256_add_epi32(acc[m][0], _mm256_madd_epi16(lo, xv));
        acc[m][1] = _mm256_add_epi32(acc[m][1], _mm256_madd_epi16(hi, xv));
      }
    }
    for (int m = 0; m < MT; ++m) {
      const __m256 dv = _mm256_broadcast_ss(d + m * nb + b);
      total[m][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][0]), dv, total[m][0]);
      total[m][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][1]), dv, total[m][1]);
    }
  }
  const __m256 s_lo = _mm256_loadu_ps(s + 16 * p), s_hi = _mm256_loadu_ps(s + 16 * p + 8);
  for (int m = 0; m < MT; ++m) {
    _mm256_storeu_ps(y + m * N + 16 * p, _mm256_mul_ps(total[m][0], s_lo));
    _mm256_storeu_ps(y + m * N + 16 * p + 8, _mm256_mul_ps(total[m][1], s_hi));
  }
}

// int4 codes c (w = c - offset, scale per group of G) x Q8 activations: MT activation rows x one panel of 8
// weight rows (see the layout above), outer-product style, so each lane of a vector is one output row and no
// horizontal sums are needed. A 32-byte chunk holds 8 rows x 8 k: its low nibbles are k 0-3 of each row, its
// high nibbles k 4-7, and 4 activation codes broadcast as one int32 meet them in one vpmaddubsw (codes are
// unsigned, 0..15, so they take its unsigned side). A block's 8 products per row accumulate in int16:
// |sum| <= 8 * 2 * 15 * 127 = 30480 < 2^15. The offset comes back as offset * xs_g per group,
// xs_g = sum over the group's blocks of d_b * sum(q_b) (group_shifts, once per activation row). Each output's
// float operations are the same whatever MT is, so a row's bits do not depend on the batch.
// Against the earlier per-row tiles over [N, K/2] rows: 1.4x at 1 activation row, 2x at 8-32 rows (ad-hoc
// interleaved A/B, 30 SmolLM2-shaped layers).
template <int MT>
__attribute__((target("avx2,fma,f16c"))) void q8_int4_panel_avx2(const int8_t* q, const float* d, const float* xs,
                                                            const uint8_t* w, const c10::Half* s, int64_t offset,
                                                            float* y, int64_t N, int64_t K, int64_t G, int64_t p) {
  const int64_t nb = K / 32, per_group = G / 32, ng = K / G;
  const __m256i low_mask = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const uint8_t* panel = w + p * 4 * K;
  __m256 total[MT], shift[MT];
  for (int m = 0; m < MT; ++m) total[m] = shift[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    __m256 gacc[MT];
    for (int m = 0; m < MT; ++m) gacc[m] = _mm256_setzero_ps();
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      const uint8_t* wb = panel + 128 * b;  // 4 chunks of 32 bytes: 8 rows x 32 k
      _mm_prefetch(reinterpret_cast<const char*>(wb + kInt4Ahead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wb + kInt4Ahead + 64), _MM_HINT_T0);
      __m256i acc[MT];
      for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_si256();
      for (int t = 0; t < 4; ++t) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * t));
        const __m256i lo = _mm256_and_si256(bytes, low_mask);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_mask);
        for (int m = 0; m < MT; ++m) {
          const float* xq = reinterpret_cast<const float*>(q + m * K + 32 * b + 8 * t);  // 4 codes as one float
          const __m256i x_lo = _mm256_castps_si256(_mm256_broadcast_ss(xq));
          const __m256i x_hi = _mm256_castps_si256(_mm256_broadcast_ss(xq + 1));
          acc[m] = _mm256_add_epi16(acc[m], _mm256_add_epi16(_mm256_maddubs_epi16(lo, x_lo),
                                                             _mm256_maddubs_epi16(hi, x_hi)));
        }
      }
      for (int m = 0; m < MT; ++m)
        gacc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(acc[m], ones)),
                                  _mm256_broadcast_ss(d + m * nb + b), gacc[m]);
    }
    const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + g * N + 8 * p)));
    for (int m = 0; m < MT; ++m) {
      total[m] = _mm256_fmadd_ps(gacc[m], scale, total[m]);
      shift[m] = _mm256_fmadd_ps(scale, _mm256_broadcast_ss(xs + m * ng + g), shift[m]);
    }
  }
  const __m256 minus_offset = _mm256_set1_ps(-static_cast<float>(offset));
  for (int m = 0; m < MT; ++m) _mm256_storeu_ps(y + m * N + 8 * p, _mm256_fmadd_ps(minus_offset, shift[m], total[m]));
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

void q16_int8_rows_scalar(const int16_t* q, const float* d, const int8_t* w, const float* s, float* y, int64_t M,
                          int64_t N, int64_t K, int64_t qb, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t b = 0; b < K / qb; ++b) {
        int32_t dot = 0;
        for (int64_t k = 0; k < qb; ++k) dot += q[m * K + qb * b + k] * w[n * K + qb * b + k];
        acc += static_cast<float>(dot) * d[m * (K / qb) + b];
      }
      y[m * N + n] = acc * s[n];
    }
}

// q16_int8_panel_avx2's arithmetic one output at a time, for panels [p0, p1).
void q16_int8_panels_scalar(const int16_t* q, const float* d, const int8_t* w, const float* s, float* y, int64_t M,
                            int64_t N, int64_t K, int64_t qb, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p)
    for (int64_t m = 0; m < M; ++m)
      for (int r = 0; r < 16; ++r) {
        float total = 0.f;
        for (int64_t b = 0; b < K / qb; ++b) {
          int32_t dot = 0;
          for (int64_t k = qb * b; k < qb * (b + 1); ++k)
            dot += q[m * K + k] * w[p * 16 * K + 32 * (k / 2) + 2 * r + k % 2];
          total = std::fma(static_cast<float>(dot), d[m * (K / qb) + b], total);
        }
        y[m * N + 16 * p + r] = total * s[16 * p + r];
      }
}

// q8_int4_panel_avx2's arithmetic one output at a time (the same integer block sums, the same fma order), for
// panels [p0, p1).
void q8_int4_panels_scalar(const int8_t* q, const float* d, const float* xs, const uint8_t* w, const c10::Half* s,
                           int64_t offset, float* y, int64_t M, int64_t N, int64_t K, int64_t G, int64_t p0,
                           int64_t p1) {
  const int64_t nb = K / 32, ng = K / G;
  for (int64_t p = p0; p < p1; ++p)
    for (int64_t m = 0; m < M; ++m)
      for (int r = 0; r < 8; ++r) {
        float total = 0.f, shift = 0.f;
        for (int64_t g = 0; g < ng; ++g) {
          float gacc = 0.f;
          for (int64_t b = g * (G / 32); b < (g + 1) * (G / 32); ++b) {
            int32_t dot = 0;
            for (int t = 0; t < 4; ++t)
              for (int i = 0; i < 4; ++i) {
                const uint8_t byte = w[p * 4 * K + 128 * b + 32 * t + 4 * r + i];
                dot += (byte & 0x0F) * q[m * K + 32 * b + 8 * t + i] + (byte >> 4) * q[m * K + 32 * b + 8 * t + 4 + i];
              }
            gacc = std::fma(static_cast<float>(dot), d[m * nb + b], gacc);
          }
          const float scale = static_cast<float>(s[g * N + 8 * p + r]);
          total = std::fma(gacc, scale, total);
          shift = std::fma(scale, xs[m * ng + g], shift);
        }
        y[m * N + 8 * p + r] = std::fma(-static_cast<float>(offset), shift, total);
      }
}

void check_x(const torch::Tensor& x, int64_t K) {
  KV_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.is_cpu(),
           "x must be a contiguous float32 CPU tensor [M, K]");
  KV_CHECK(x.size(1) == K, "x has ", x.size(1), " features, the weight ", K);
}

// Q8 activations of one call: q int8 [M, K], d float32 [M, K / 32], qsum int32 [M, K / 32]. The buffers are
// reused across calls (per thread): three torch::empty calls cost about as much as a small layer's product.
struct QuantizedX {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> qsum;
};

const QuantizedX& quantize_x(const torch::Tensor& x) {
  thread_local QuantizedX out;
  const int64_t M = x.size(0), K = x.size(1);
  out.q.resize(M * K);
  out.d.resize(M * K / 32);
  out.qsum.resize(M * K / 32);
  const float* xp = x.data_ptr<float>();
#ifdef QL_X86
  if (has_avx2()) {
    quantize_blocks_avx2(xp, M, K, out.q.data(), out.d.data(), out.qsum.data());
    return out;
  }
#endif
  quantize_blocks_scalar(xp, M, K, out.q.data(), out.d.data(), out.qsum.data());
  return out;
}

// Q16 activations of one call: q int16 [M, K], d float32 [M, K / qb], reused across calls (per thread).
struct QuantizedX16 {
  std::vector<int16_t> q;
  std::vector<float> d;
};

const QuantizedX16& quantize_x16(const torch::Tensor& x, int64_t qb) {
  thread_local QuantizedX16 out;
  const int64_t M = x.size(0), K = x.size(1);
  out.q.resize(M * K);
  out.d.resize(M * K / qb);
  const float* xp = x.data_ptr<float>();
#ifdef QL_X86
  if (has_avx2()) {
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
  thread_local std::vector<float> xs;
  const int64_t nb = K / 32, per_group = G / 32, ng = K / G;
  xs.assign(M * ng, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < ng; ++g)
      for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b)
        xs[m * ng + g] = std::fma(qx.d[m * nb + b], static_cast<float>(qx.qsum[m * nb + b]), xs[m * ng + g]);
  return xs.data();
}

}  // namespace

// run(std::integral_constant<int, QB>{}) for an activation block QB of 64 or 32 (a template argument of the tiles).
template <typename Fn>
void with_block(int64_t block, Fn&& run) {
  if (block == 64)
    run(std::integral_constant<int, 64>{});
  else
    run(std::integral_constant<int, 32>{});
}

// y [M, N] = Q16(x) [M, K] @ (w * s)^T: int8 weights with one float32 scale per output row, activations
// quantized to int16 per block of `block` (64, or 32 where K is not a multiple of 64; quant.linear.Int8Linear
// passes its act_block).
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales,
                          int64_t block, bool panels) {
  KV_CHECK(w.dim() == 2 && w.scalar_type() == torch::kInt8 && w.is_contiguous(), "w must be int8 [N, K]");
  KV_CHECK(scales.scalar_type() == torch::kFloat32 && scales.numel() == w.size(0) && scales.is_contiguous(),
           "scales must be float32 [N]");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  check_x(x, K);
  KV_CHECK((block == 32 || block == 64) && K % block == 0, "int8_linear quantizes activations per block of 32 or 64 "
           "that divides K; block = ", block, ", K = ", K);
  KV_CHECK(!panels || N % 16 == 0, "int8 panels hold 16 rows; N = ", N);
  const QuantizedX16& qx = quantize_x16(x, block);
  auto y = torch::empty({M, N}, x.options());
  const int16_t* qp = qx.q.data();
  const float* dp = qx.d.data();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (panels) {
    at::parallel_for(0, N / 16, 1, [&](int64_t p0, int64_t p1) {
#ifdef QL_X86
      if (has_avx2()) {
        with_block(block, [&](auto qb) {  // 4 activation rows per tile, then 2, then 1
          constexpr int QB = decltype(qb)::value;
          for (int64_t p = p0; p < p1; ++p) {
            int64_t m = 0;
            auto tile = [&](auto mt) {
              q16_int8_panel_avx2<QB, decltype(mt)::value>(qp + m * K, dp + m * (K / QB), wp, sp, yp + m * N, N, K,
                                                           p);
            };
            for (; m + 4 <= M; m += 4) tile(std::integral_constant<int, 4>{});
            for (; m + 2 <= M; m += 2) tile(std::integral_constant<int, 2>{});
            for (; m < M; ++m) tile(std::integral_constant<int, 1>{});
          }
        });
        return;
      }
#endif
      q16_int8_panels_scalar(qp, dp, wp, sp, yp, M, N, K, block, p0, p1);
    });
    return y;
  }
  at::parallel_for(0, N, kRowsPerTask, [&](int64_t n0, int64_t n1) {
#ifdef QL_X86
    if (has_avx2()) {
      constexpr int64_t NT = 4;
      with_block(block, [&](auto qb) {
        constexpr int QB = decltype(qb)::value;
        for_tiles<2, NT>(M, n0, n1, [&](int64_t m, int64_t n, auto mt, auto nt) {
          const int64_t rows = rows_ahead(m, M, n, n1, NT);
          constexpr int MT_ = decltype(mt)::value, NT_ = decltype(nt)::value;
          if (rows > 0)
            q16_int8_tile_avx2<QB, MT_, NT_, true>(qp + m * K, dp + m * (K / QB), wp, sp, yp + m * N, N, K, n,
                                                   wp + (n + 2 * NT) * K, rows);
          else
            q16_int8_tile_avx2<QB, MT_, NT_, false>(qp + m * K, dp + m * (K / QB), wp, sp, yp + m * N, N, K, n,
                                                    nullptr, 0);
        });
      });
      return;
    }
#endif
    q16_int8_rows_scalar(qp, dp, wp, sp, yp, M, N, K, block, n0, n1);
  });
  return y;
}

// y [M, N] = Q8(x) [M, K] @ W_hat^T for int4 codes in panels of 8 rows (see the layout at the top):
// W_hat[n, k] = (code - offset) * scales[k / G, n]; G must be a multiple of 32 and N of 8.
torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales,
                          int64_t group, int64_t offset) {
  KV_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "w must be uint8 [N, K/2]");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1) * 2;
  check_x(x, K);
  KV_CHECK(N % 8 == 0, "int4_linear reads panels of 8 rows; N = ", N);
  KV_CHECK(group > 0 && group % 32 == 0 && K % group == 0, "group ", group,
           " must be a multiple of 32 that divides ", K);
  KV_CHECK(scales.scalar_type() == torch::kHalf && scales.is_contiguous() && scales.dim() == 2 &&
               scales.size(0) == K / group && scales.size(1) == N,
           "scales must be float16 [K / group, N]");
  const QuantizedX& qx = quantize_x(x);
  const float* xs = group_shifts(qx, M, K, group);
  auto y = torch::empty({M, N}, x.options());
  const int8_t* qp = qx.q.data();
  const float* dp = qx.d.data();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const c10::Half* sp = scales.data_ptr<c10::Half>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N / 8, 1, [&](int64_t p0, int64_t p1) {
#ifdef QL_X86
    if (has_avx2()) {
      // 3 activation rows per tile (4 was slower at 8-32 rows: the accumulators no longer fit 16 registers)
      for (int64_t p = p0; p < p1; ++p) {
        int64_t m = 0;
        auto tile = [&](auto mt) {
          q8_int4_panel_avx2<decltype(mt)::value>(qp + m * K, dp + m * (K / 32), xs + m * (K / group), wp, sp,
                                                  offset, yp + m * N, N, K, group, p);
        };
        for (; m + 3 <= M; m += 3) tile(std::integral_constant<int, 3>{});
        for (; m + 2 <= M; m += 2) tile(std::integral_constant<int, 2>{});
        for (; m < M; ++m) tile(std::integral_constant<int, 1>{});
      }
      return;
    }
#endif
    q8_int4_panels_scalar(qp, dp, xs, wp, sp, offset, yp, M, N, K, group, p0, p1);
  });
  return y;
}

// y [M, N] = x [M, K] @ W_hat^T for packed 4-bit codes with float activations (NF4, or int4 groups that are
// not a multiple of 32): W_hat[n, k] = lut[code] * scales[k / G, n].
torch::Tensor lut4_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales,
                          int64_t group, const torch::Tensor& lut) {
  KV_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "w must be uint8 [N, K/2]");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1) * 2;
  check_x(x, K);
  KV_CHECK(group > 0 && group % 2 == 0 && K % group == 0, "group ", group, " must be even and divide ", K);
  KV_CHECK(scales.scalar_type() == torch::kHalf && scales.is_contiguous() && scales.dim() == 2 &&
               scales.size(0) == K / group && scales.size(1) == N,
           "scales must be float16 [K / group, N]");
  KV_CHECK(lut.scalar_type() == torch::kFloat32 && lut.numel() == 16 && lut.is_contiguous(),
           "lut must be float32 [16]");
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const c10::Half* sp = scales.data_ptr<c10::Half>();
  const float* lp = lut.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#ifdef QL_X86
  if (has_avx2() && group % 32 == 0) {
    // De-interleave x once per call (M*K floats) so the kernel's loads match the nibble order.
    auto xd = torch::empty_like(x);
    auto xa = x.accessor<float, 2>();
    auto da = xd.accessor<float, 2>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; k += 32)
        for (int64_t j = 0; j < 16; ++j) {
          da[m][k + j] = xa[m][k + 2 * j];
          da[m][k + 16 + j] = xa[m][k + 2 * j + 1];
        }
    const float* dp = xd.data_ptr<float>();
    at::parallel_for(0, N, kRowsPerTask, [&](int64_t n0, int64_t n1) {
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) lut4_rows_avx2<4>(dp + m * K, wp, sp, lp, yp + m * N, N, K, group, n0, n1);
      for (; m + 2 <= M; m += 2) lut4_rows_avx2<2>(dp + m * K, wp, sp, lp, yp + m * N, N, K, group, n0, n1);
      for (; m < M; ++m) lut4_rows_avx2<1>(dp + m * K, wp, sp, lp, yp + m * N, N, K, group, n0, n1);
    });
    return y;
  }
#endif
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, N, kRowsPerTask, [&](int64_t n0, int64_t n1) {
    lut4_rows_scalar(xp, wp, sp, lp, yp, M, N, K, group, n0, n1);
  });
  return y;
}

// y [M, N] = x [M, K] @ w^T for float32 weights (small M: decode batches).
torch::Tensor f32_linear(const torch::Tensor& x, const torch::Tensor& w) {
  KV_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32 && w.is_contiguous(), "w must be float32 [N, K]");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  check_x(x, K);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool vec = has_avx2() && K % 8 == 0;
  at::parallel_for(0, N, kRowsPerTask, [&](int64_t n0, int64_t n1) {
#ifdef QL_X86
    if (vec) {
      constexpr int64_t NT = 4;
      for_tiles<3, NT>(M, n0, n1, [&](int64_t m, int64_t n, auto mt, auto nt) {
        const int64_t rows = rows_ahead(m, M, n, n1, NT);
        constexpr int MT_ = decltype(mt)::value, NT_ = decltype(nt)::value;
        if (rows > 0)
          f32_tile_avx2<MT_, NT_, true>(xp + m * K, wp, yp + m * N, N, K, n, wp + (n + 2 * NT) * K, rows);
        else
          f32_tile_avx2<MT_, NT_, false>(xp + m * K, wp, yp + m * N, N, K, n, nullptr, 0);
      });
      return;
    }
#endif
    f32_rows_scalar(xp, wp, yp, M, N, K, n0, n1);
  });
  return y;
}

bool vectorized() { return has_avx2(); }

using NoGil = py::call_guard<py::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels run without the GIL, as torch's own ops do: a server's event loop thread (SSE, HTTP) can run
  // its Python while a step's projections compute, instead of waiting for the step's Python to yield the GIL.
  m.def("int8_linear", &int8_linear, NoGil(),
        "x [M,K] f32, w int8 [N,K] (rows or panels of 16), scales f32 [N], block (32 or 64), panels -> [M,N] "
        "(x as Q16 blocks)");
  m.def("int4_linear", &int4_linear, NoGil(),
        "x [M,K] f32, w u8 [N,K/2], scales f16 [K/G,N], G, offset -> [M,N] (x as Q8 blocks of 32)");
  m.def("lut4_linear", &lut4_linear, NoGil(),
        "x [M,K] f32, w u8 [N,K/2], scales f16 [K/G,N], G, lut f32 [16] -> [M,N]");
  m.def("f32_linear", &f32_linear, NoGil(), "x [M,K] f32, w f32 [N,K] -> [M,N] (small M)");
  m.def("vectorized", &vectorized, "True when the AVX2+FMA path runs on this CPU");
  // A layer's kernel bound to its weights once: f(x) -> y. A call then converts one argument and runs no
  // Python frame (a Python lambda around the kernel cost both, on each of a decode step's ~120-210 calls).
  m.def("bind_int8", [](torch::Tensor w, torch::Tensor scales, int64_t block, bool panels) {
    return py::cpp_function(
        [w, scales, block, panels](const torch::Tensor& x) { return int8_linear(x, w, scales, block, panels); },
        NoGil());
  }, "int8_linear bound to (w, scales, block, panels)");
  m.def("bind_int4", [](torch::Tensor w, torch::Tensor scales, int64_t group, int64_t offset) {
    return py::cpp_function(
        [w, scales, group, offset](const torch::Tensor& x) { return int4_linear(x, w, scales, group, offset); },
        NoGil());
  }, "int4_linear bound to (w, scales, group, offset)");
  m.def("bind_lut4", [](torch::Tensor w, torch::Tensor scales, int64_t group, torch::Tensor lut) {
    return py::cpp_function(
        [w, scales, group, lut](const torch::Tensor& x) { return lut4_linear(x, w, scales, group, lut); },
        NoGil());
  }, "lut4_linear bound to (w, scales, group, lut)");
  m.def("bind_f32", [](torch::Tensor w) {
    return py::cpp_function([w](const torch::Tensor& x) { return f32_linear(x, w); }, NoGil());
  }, "f32_linear bound to w");
}
