// int8 weights (per-row scale) x Q16 activations: row tiles and panels of 16 rows.
#include "act_quant.h"

namespace kvserve::linear {
namespace {

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

#ifdef QL_X86
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
#endif

}  // namespace

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
      if (cpu::avx2()) {
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
    if (cpu::avx2()) {
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

}  // namespace kvserve::linear
