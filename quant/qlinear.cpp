// Weight-only quantized linear layers for CPU decode: y = x @ W_hat^T, reading the packed weights once.
//
// Decode at batch 1 is a matrix-vector product bound by the bytes of W, so the kernel streams the int8 or
// packed 4-bit codes and widens them in registers; it never writes a float copy of W. Activations stay
// float32 (weight-only quantization: the result matches dequantize-then-matmul up to summation order).
//
// Layouts (see quant/schemes.py):
//   int8:  w int8 [N, K], scales float32 [N]                     w_hat[n,k] = w[n,k] * s[n]
//   4-bit: w uint8 [N, K/2] (k even: low nibble, k odd: high),   w_hat[n,k] = lut[code] * s[k/G, n]
//          scales float16 [K/G, N], lut float32 [16]            (int4: lut[c] = c - 8; NF4: the NF4 levels)
//
// The AVX2+FMA paths are compiled with target attributes and chosen at run time, so one build runs on any
// x86-64 CPU; elsewhere the scalar loops run.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define QL_X86 1
#endif

namespace {

constexpr int64_t kRowsPerTask = 8;  // output rows per parallel task: small enough to split N=192 over cores

bool has_avx2() {
#ifdef QL_X86
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
#else
  return false;
#endif
}

// ---------------------------------------------------------------- scalar reference loops
void int8_rows_scalar(const float* x, const int8_t* w, const float* s, float* y, int64_t M, int64_t N,
                      int64_t K, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = w + n * K;
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * K;
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += xm[k] * static_cast<float>(row[k]);
      y[m * N + n] = acc * s[n];
    }
  }
}

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
__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// MT activation rows share each widened weight vector (batched decode reads W once per MT rows). Four
// accumulators per row hide the FMA latency: one chain would retire 8 weights per 4 cycles.
template <int MT>
__attribute__((target("avx2,fma"))) void int8_rows_avx2(const float* x, const int8_t* w, const float* s,
                                                        float* y, int64_t N, int64_t K, int64_t n0,
                                                        int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = w + n * K;
    __m256 acc[MT][4];
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k));
      const __m128i lo = _mm256_castsi256_si128(bytes);
      const __m128i hi = _mm256_extracti128_si256(bytes, 1);
      const __m256 wv[4] = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)),  // 8 weights each, as float
                            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(lo, lo))),
                            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)),
                            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(hi, hi)))};
      for (int m = 0; m < MT; ++m)
        for (int j = 0; j < 4; ++j)
          acc[m][j] = _mm256_fmadd_ps(wv[j], _mm256_loadu_ps(x + m * K + k + 8 * j), acc[m][j]);
    }
    for (int m = 0; m < MT; ++m) {
      const __m256 sum = _mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]), _mm256_add_ps(acc[m][2], acc[m][3]));
      y[m * N + n] = hsum(sum) * s[n];
    }
  }
}

// Four output rows at a time for 1 or 2 activation rows (single-stream decode): the x vector is loaded once
// for four weight rows, int8 codes are widened straight from memory (vpmovsxbd), and the four dot products are
// reduced together (hadd tree) and scaled with one vector multiply. Rows left over go to int8_rows_avx2.
__attribute__((target("avx2,fma"))) inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));  // [sum a0, .., sum a3]
}

__attribute__((target("avx2,fma"))) inline __m256 widen8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

template <int MT>
__attribute__((target("avx2,fma"))) void int8_rows4_avx2(const float* x, const int8_t* w, const float* s,
                                                         float* y, int64_t N, int64_t K, int64_t n0,
                                                         int64_t n1) {
  constexpr int CH = MT == 1 ? 2 : 1;  // chains per (activation row, weight row): 8 accumulators either way
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    const int8_t* rows[4] = {w + n * K, w + (n + 1) * K, w + (n + 2) * K, w + (n + 3) * K};
    __m256 acc[MT][4][CH];
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < 4; ++j)
        for (int c = 0; c < CH; ++c) acc[m][j][c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8 * CH) {
      for (int c = 0; c < CH; ++c) {
        __m256 xv[MT];
        for (int m = 0; m < MT; ++m) xv[m] = _mm256_loadu_ps(x + m * K + k + 8 * c);
        for (int j = 0; j < 4; ++j) {
          const __m256 wv = widen8(rows[j] + k + 8 * c);
          for (int m = 0; m < MT; ++m) acc[m][j][c] = _mm256_fmadd_ps(wv, xv[m], acc[m][j][c]);
        }
      }
    }
    const __m128 scale = _mm_loadu_ps(s + n);
    for (int m = 0; m < MT; ++m) {
      __m256 r[4];
      for (int j = 0; j < 4; ++j) r[j] = CH == 2 ? _mm256_add_ps(acc[m][j][0], acc[m][j][CH - 1]) : acc[m][j][0];
      _mm_storeu_ps(y + m * N + n, _mm_mul_ps(hsum4(r[0], r[1], r[2], r[3]), scale));
    }
  }
  if (n < n1) int8_rows_avx2<MT>(x, w, s, y, N, K, n, n1);
}

// Widen 8 nibble codes (the low 8 bytes of `codes`, one code per byte) to floats through the 16-entry table:
// permutevar looks up the low 3 bits in each half of the table, bit 3 (moved to the sign) picks the half.
__attribute__((target("avx2,fma"))) inline __m256 lut8(__m128i codes, __m256 lut_lo, __m256 lut_hi) {
  const __m256i idx = _mm256_cvtepu8_epi32(codes);
  const __m256 lo = _mm256_permutevar8x32_ps(lut_lo, idx);
  const __m256 hi = _mm256_permutevar8x32_ps(lut_hi, idx);
  return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

// Codes as plain integers 0..15, for an affine table lut[c] = c + lut[0] (int4): one convert instead of
// two table lookups and a blend; the constant lut[0] * sum(x over the group) is added once per group.
__attribute__((target("avx2,fma"))) inline __m256 codes8(__m128i codes) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes));
}

// x here is de-interleaved per block of 32: [x0 x2 .. x30 | x1 x3 .. x31], matching the nibble order of
// 16 packed bytes (low nibbles = even k, high nibbles = odd k). xsum [MT rows, K/G] holds group sums of x
// (read only when AFFINE).
template <int MT, bool AFFINE>
__attribute__((target("avx2,fma"))) void lut4_rows_avx2(const float* xd, const float* xsum, const uint8_t* w,
                                                        const c10::Half* s, const float* lut, float* y,
                                                        int64_t N, int64_t K, int64_t G, int64_t n0,
                                                        int64_t n1) {
  const __m256 lut_lo = _mm256_loadu_ps(lut);
  const __m256 lut_hi = _mm256_loadu_ps(lut + 8);
  const __m128i low_mask = _mm_set1_epi8(0x0F);
  const int64_t groups = K / G;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * (K / 2);
    __m256 total[MT];
    float offset_sum[MT];  // AFFINE: sum over groups of scale * lut[0] * sum(x in group)
    for (int m = 0; m < MT; ++m) {
      total[m] = _mm256_setzero_ps();
      offset_sum[m] = 0.f;
    }
    for (int64_t g = 0; g < groups; ++g) {
      __m256 acc[MT][4];  // four chains per row, as in int8_rows_avx2
      for (int m = 0; m < MT; ++m)
        for (int j = 0; j < 4; ++j) acc[m][j] = _mm256_setzero_ps();
      for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2));
        const __m128i even = _mm_and_si128(bytes, low_mask);
        const __m128i odd = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_mask);
        const __m128i parts[4] = {even, _mm_unpackhi_epi64(even, even),  // k, k+2, .., k+14 | k+16, .., k+30
                                  odd, _mm_unpackhi_epi64(odd, odd)};    // k+1, .., k+15  | k+17, .., k+31
        __m256 wv[4];
        for (int j = 0; j < 4; ++j) wv[j] = AFFINE ? codes8(parts[j]) : lut8(parts[j], lut_lo, lut_hi);
        for (int m = 0; m < MT; ++m)
          for (int j = 0; j < 4; ++j)
            acc[m][j] = _mm256_fmadd_ps(wv[j], _mm256_loadu_ps(xd + m * K + k + 8 * j), acc[m][j]);
      }
      const float scale = static_cast<float>(s[g * N + n]);
      for (int m = 0; m < MT; ++m) {
        const __m256 sum = _mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]), _mm256_add_ps(acc[m][2], acc[m][3]));
        total[m] = _mm256_fmadd_ps(sum, _mm256_set1_ps(scale), total[m]);
        if (AFFINE) offset_sum[m] += scale * xsum[m * groups + g];
      }
    }
    for (int m = 0; m < MT; ++m) y[m * N + n] = hsum(total[m]) + (AFFINE ? lut[0] * offset_sum[m] : 0.f);
  }
}

// float32 weights, MT activation rows per pass over a weight row: at small M the weights are read once
// (memory-bound), where a general GEMM packs both operands and ran at 6-8 GB/s here for M = 8.
// Two accumulator chains per row keep 2 * MT FMAs in flight within 16 registers.
template <int MT>
__attribute__((target("avx2,fma"))) void f32_rows_avx2(const float* x, const float* w, float* y, int64_t N,
                                                       int64_t K, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* row = w + n * K;
    __m256 acc[MT][2];
    for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      const __m256 w0 = _mm256_loadu_ps(row + k);
      const __m256 w1 = _mm256_loadu_ps(row + k + 8);
      for (int m = 0; m < MT; ++m) {
        acc[m][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * K + k), acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * K + k + 8), acc[m][1]);
      }
    }
    for (int m = 0; m < MT; ++m) y[m * N + n] = hsum(_mm256_add_ps(acc[m][0], acc[m][1]));
  }
}

template <typename Fn>
void for_row_tiles(int64_t M, Fn&& fn) {
  // Rows of x in tiles of 4, then 2, then 1: each tile widens every weight once.
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) fn(m, std::integral_constant<int, 4>{});
  for (; m + 2 <= M; m += 2) fn(m, std::integral_constant<int, 2>{});
  for (; m < M; ++m) fn(m, std::integral_constant<int, 1>{});
}
#endif

void check_x(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.is_cpu(),
              "x must be a contiguous float32 CPU tensor [M, K]");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " features, the weight ", K);
}

}  // namespace

// y [M, N] = x [M, K] @ (w * s)^T for int8 weights with one float32 scale per output row.
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kInt8 && w.is_contiguous(), "w must be int8 [N, K]");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.numel() == w.size(0) && scales.is_contiguous(),
              "scales must be float32 [N]");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  check_x(x, K);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool vec = has_avx2() && K % 32 == 0;
  at::parallel_for(0, N, kRowsPerTask, [&](int64_t n0, int64_t n1) {
#ifdef QL_X86
    if (vec) {
      for_row_tiles(M, [&](int64_t m, auto mt) {
        constexpr int T = decltype(mt)::value;
        if constexpr (T <= 2)
          int8_rows4_avx2<T>(xp + m * K, wp, sp, yp + m * N, N, K, n0, n1);
        else
          int8_rows_avx2<T>(xp + m * K, wp, sp, yp + m * N, N, K, n0, n1);
      });
      return;
    }
#endif
    int8_rows_scalar(xp, wp, sp, yp, M, N, K, n0, n1);
  });
  return y;
}

// y [M, N] = x [M, K] @ W_hat^T for packed 4-bit codes: W_hat[n, k] = lut[code] * scales[k / G, n].
torch::Tensor lut4_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales,
                          int64_t group, const torch::Tensor& lut) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "w must be uint8 [N, K/2]");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1) * 2;
  check_x(x, K);
  TORCH_CHECK(group > 0 && group % 2 == 0 && K % group == 0, "group ", group, " must be even and divide ", K);
  TORCH_CHECK(scales.scalar_type() == torch::kHalf && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == K / group && scales.size(1) == N,
              "scales must be float16 [K / group, N]");
  TORCH_CHECK(lut.scalar_type() == torch::kFloat32 && lut.numel() == 16 && lut.is_contiguous(),
              "lut must be float32 [16]");
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const c10::Half* sp = scales.data_ptr<c10::Half>();
  const float* lp = lut.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool vec = has_avx2() && group % 32 == 0;
#ifdef QL_X86
  if (vec) {
    // De-interleave x once per call (M*K floats) so the kernel's loads match the nibble order.
    const int64_t groups = K / group;
    auto xd = torch::empty_like(x);
    auto xsum = torch::zeros({M, groups}, x.options());
    auto xa = x.accessor<float, 2>();
    auto da = xd.accessor<float, 2>();
    auto sa = xsum.accessor<float, 2>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; k += 32)
        for (int64_t j = 0; j < 16; ++j) {
          da[m][k + j] = xa[m][k + 2 * j];
          da[m][k + 16 + j] = xa[m][k + 2 * j + 1];
          sa[m][k / group] += xa[m][k + 2 * j] + xa[m][k + 2 * j + 1];
        }
    bool affine = true;
    for (int c = 0; c < 16; ++c) affine = affine && lp[c] == lp[0] + static_cast<float>(c);
    const float* dp = xd.data_ptr<float>();
    const float* xs = xsum.data_ptr<float>();
    at::parallel_for(0, N, kRowsPerTask, [&](int64_t n0, int64_t n1) {
      for_row_tiles(M, [&](int64_t m, auto mt) {
        constexpr int T = decltype(mt)::value;
        if (affine)
          lut4_rows_avx2<T, true>(dp + m * K, xs + m * groups, wp, sp, lp, yp + m * N, N, K, group, n0, n1);
        else
          lut4_rows_avx2<T, false>(dp + m * K, xs + m * groups, wp, sp, lp, yp + m * N, N, K, group, n0, n1);
      });
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
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32 && w.is_contiguous(), "w must be float32 [N, K]");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  check_x(x, K);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool vec = has_avx2() && K % 16 == 0;
  at::parallel_for(0, N, kRowsPerTask, [&](int64_t n0, int64_t n1) {
#ifdef QL_X86
    if (vec) {
      for_row_tiles(M, [&](int64_t m, auto mt) {
        f32_rows_avx2<decltype(mt)::value>(xp + m * K, wp, yp + m * N, N, K, n0, n1);
      });
      return;
    }
#endif
    f32_rows_scalar(xp, wp, yp, M, N, K, n0, n1);
  });
  return y;
}

bool vectorized() { return has_avx2(); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &int8_linear, "x [M,K] f32, w int8 [N,K], scales f32 [N] -> [M,N]");
  m.def("lut4_linear", &lut4_linear, "x [M,K] f32, w u8 [N,K/2], scales f16 [K/G,N], G, lut f32 [16] -> [M,N]");
  m.def("f32_linear", &f32_linear, "x [M,K] f32, w f32 [N,K] -> [M,N] (small M)");
  m.def("vectorized", &vectorized, "True when the AVX2+FMA path runs on this CPU");
}
