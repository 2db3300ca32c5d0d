// Packed 4-bit codes through a 16-level table (NF4, or int4 groups not a multiple of 32) on float activations.
#include "linear_common.h"

namespace kvserve::linear {
namespace {

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

#ifdef QL_X86
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
#endif

}  // namespace

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
  if (cpu::avx2() && group % 32 == 0) {
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

}  // namespace kvserve::linear
