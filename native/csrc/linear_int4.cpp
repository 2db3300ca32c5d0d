// int4 codes (group scales) x Q8 activations over panels of 8 weight rows.
#include "act_quant.h"

namespace kvserve::linear {
namespace {

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

#ifdef QL_X86
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

}  // namespace

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
    if (cpu::avx2()) {
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

}  // namespace kvserve::linear
