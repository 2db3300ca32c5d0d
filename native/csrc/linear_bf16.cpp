// bfloat16 weights x float32 activations: packing (once, at load time) and the driver around the micro-kernels of
// ukernel_bf16.h (layouts and the exact arithmetic are described there).
//
// The driver converts the activations to bfloat16 pairs once per call (vcvtneps2bf16's rounding), threads over
// panels of 32 output features (at::parallel_for) and walks register tiles of KV_MR_BF16 rows within each panel,
// the panel's weights staying in L1/L2 while the rows stream. Every output is one float32 chain in K order, so a
// row's bits depend neither on the batch, nor on the tile it falls in, nor on the threads.
//
// The AVX512-BF16 micro-kernel runs where cpu::bf16() says so; elsewhere these functions run the scalar reference
// (same bits, for tests: serving then loads float32 weights instead, engine/loader.py).
#include "huge_pages.h"
#include "linear_common.h"
#include "ukernel_bf16.h"

namespace kvserve::linear {
namespace {

using Ukernel = void (*)(const kv_bf16_args*);
using Convert = void (*)(const kv_bf16_convert_args*);

Ukernel ukernel() {
#ifdef KV_UK_X86
  if (cpu::bf16()) return kv_bf16_avx512;
#endif
  return kv_bf16_scalar;
}

Convert converter() {
#ifdef KV_UK_X86
  if (cpu::bf16()) return kv_bf16_convert_avx512;
#endif
  return kv_bf16_convert_scalar;
}

int64_t pairs(int64_t K) { return (K + 1) / 2; }
int64_t panels(int64_t N) { return (N + KV_NR_BF16 - 1) / KV_NR_BF16; }

struct Bf16Weights {
  torch::Tensor packed;  // bfloat16 [panels, kp * 2 * KV_NR_BF16]
  int64_t N, K;
};

Bf16Weights checked(const torch::Tensor& packed, int64_t N, int64_t K) {
  KV_CHECK(N > 0 && K > 0, "bf16 weights need N > 0 and K > 0; got N = ", N, ", K = ", K);
  KV_CHECK(packed.scalar_type() == torch::kBFloat16 && packed.is_contiguous() && packed.is_cpu() && packed.dim() == 2,
           "packed bf16 weights must be a contiguous bfloat16 CPU tensor [panels, elements] (from bf16_pack)");
  KV_CHECK(packed.size(0) == panels(N) && packed.size(1) == pairs(K) * 2 * KV_NR_BF16, "packed bf16 weights for N = ",
           N, ", K = ", K, " must be [", panels(N), ", ", pairs(K) * 2 * KV_NR_BF16, "], got [", packed.size(0), ", ",
           packed.size(1), "] (packed for another shape?)");
  return {packed, N, K};
}

// x float32 [M, K] -> bfloat16 pairs [M, kp] (as uint32), an odd K's last element zero.
std::vector<uint32_t> convert_rows(const torch::Tensor& x, int64_t kp) {
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<uint32_t> pairs_out(static_cast<size_t>(M * kp));
  const float* xp = x.data_ptr<float>();
  const Convert convert = converter();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      uint16_t* out = reinterpret_cast<uint16_t*>(pairs_out.data() + m * kp);
      const kv_bf16_convert_args args{xp + m * K, out, K};
      convert(&args);
      if (K % 2) out[K] = 0;
    }
  });
  return pairs_out;
}

torch::Tensor run(const Bf16Weights& g, const torch::Tensor& x) {
  check_x(x, g.K);
  const int64_t M = x.size(0), kp = pairs(g.K);
  auto y = torch::empty({M, g.N}, x.options());
  if (M == 0) return y;
  const std::vector<uint32_t> xb = convert_rows(x, kp);
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(g.packed.data_ptr<at::BFloat16>());
  const int64_t panel_elements = g.packed.size(1);
  float* yp = y.data_ptr<float>();
  const Ukernel kernel = ukernel();
  at::parallel_for(0, g.packed.size(0), 1, [&](int64_t p0, int64_t p1) {
    kv_bf16_args a;
    a.ldx = kp;
    a.ldy = g.N;
    a.kp = static_cast<int32_t>(kp);
    for (int64_t p = p0; p < p1; ++p) {
      a.w = wp + p * panel_elements;
      a.cols = static_cast<int32_t>(std::min<int64_t>(KV_NR_BF16, g.N - p * KV_NR_BF16));
      for (int64_t m = 0; m < M; m += KV_MR_BF16) {
        a.rows = static_cast<int32_t>(std::min<int64_t>(KV_MR_BF16, M - m));
        a.x = xb.data() + m * kp;
        a.y = yp + m * g.N + p * KV_NR_BF16;
        kernel(&a);
      }
    }
  });
  return y;
}

}  // namespace

torch::Tensor bf16_pack(const torch::Tensor& w) {
  KV_CHECK(w.scalar_type() == torch::kBFloat16 && w.dim() == 2 && w.is_cpu() && w.size(0) > 0 && w.size(1) > 0,
           "bf16 weights must be a bfloat16 CPU tensor [N, K] with N, K > 0");
  const int64_t N = w.size(0), K = w.size(1), kp = pairs(K), np = panels(N);
  // [N, K] -> zero-padded [np * 32, 2 kp] -> [np, 32, kp, 2] -> [np, kp, 32, 2]: pair t of feature n at (t, n)
  const torch::Tensor padded = at::constant_pad_nd(w, {0, 2 * kp - K, 0, np * KV_NR_BF16 - N}, 0);
  auto packed = torch::empty({np, kp * 2 * KV_NR_BF16}, w.options());
  kvserve::advise_huge_pages(packed.data_ptr(), packed.nbytes());  // before its first write (huge_pages.h)
  packed.view({np, kp, KV_NR_BF16, 2}).copy_(padded.view({np, KV_NR_BF16, kp, 2}).permute({0, 2, 1, 3}));
  return packed;
}

torch::Tensor bf16_unpack(const torch::Tensor& packed, int64_t N, int64_t K) {
  const Bf16Weights g = checked(packed, N, K);
  const int64_t kp = pairs(K), np = panels(N);
  return g.packed.view({np, kp, KV_NR_BF16, 2}).permute({0, 2, 1, 3}).reshape({np * KV_NR_BF16, 2 * kp})
      .slice(0, 0, N).slice(1, 0, K).contiguous();
}

torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t N, int64_t K) {
  return run(checked(packed, N, K), x);
}

std::function<torch::Tensor(const torch::Tensor&)> bind_bf16(const torch::Tensor& packed, int64_t N, int64_t K) {
  Bf16Weights g = checked(packed, N, K);
  return [g](const torch::Tensor& x) { return run(g, x); };
}

}  // namespace kvserve::linear
