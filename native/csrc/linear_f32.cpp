// float32 weights: register tiles of 3 activation rows x 4 weight rows (small M: decode batches).
#include "linear_common.h"

namespace kvserve::linear {
namespace {

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
#endif

}  // namespace

// y [M, N] = x [M, K] @ w^T for float32 weights (small M: decode batches).
torch::Tensor f32_linear(const torch::Tensor& x, const torch::Tensor& w) {
  KV_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32 && w.is_contiguous(), "w must be float32 [N, K]");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  check_x(x, K);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool vec = cpu::avx2() && K % 8 == 0;
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

}  // namespace kvserve::linear
