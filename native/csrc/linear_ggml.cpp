// GGUF's own Q4_1 and Q8_0 blocks served as they are: packing (once, at load time) and the driver around the
// micro-kernels of ukernel_q4_1.h / ukernel_q8_0.h (layouts and the exact arithmetic: ukernel.h).
//
// The driver quantizes the activations once per call (act_quant.h's Q8 blocks of 32, plus xs = d_x * qsum per
// block), threads over panels of output features (at::parallel_for) and walks register tiles of MR activation
// rows within each panel, the panel's weights staying in L1 while the rows stream. Every output is computed by
// one micro-kernel call in ukernel.h's fixed order, so a row's bits depend neither on the batch, nor on the tile
// it falls in, nor on the threads.
#include "act_quant.h"
#include "ukernel_q4_1.h"
#include "ukernel_q8_0.h"

#include <cstring>
#include <string>

namespace kvserve::linear {
namespace {

enum class Kind { kQ4_1, kQ8_0 };

Kind parse_kind(const std::string& kind) {
  if (kind == "q4_1") return Kind::kQ4_1;
  KV_CHECK(kind == "q8_0", "kind must be \"q4_1\" or \"q8_0\", got \"", kind, "\"");
  return Kind::kQ8_0;
}

int64_t block_bytes(Kind kind) { return kind == Kind::kQ4_1 ? KV_Q4_1_BYTES : KV_Q8_0_BYTES; }

// Bytes of one block's scales (d, and m for Q4_1) at its start, raw and packed alike.
int64_t scale_bytes(Kind kind) { return kind == Kind::kQ4_1 ? 4 : 2; }

// The panel width and register tile rows of the chosen ISA (the scalar path reads AVX2's panels).
int64_t panel_width() { return cpu::chosen() == cpu::Isa::kAvx512 ? KV_NR_AVX512 : KV_NR_AVX2; }
int64_t tile_rows() { return cpu::chosen() == cpu::Isa::kAvx512 ? KV_MR_AVX512 : KV_MR_AVX2; }

using Ukernel = void (*)(const kv_ggml_args*);

Ukernel ukernel_for(Kind kind) {
  const bool q4 = kind == Kind::kQ4_1;
#ifdef KV_UK_X86
  switch (cpu::chosen()) {
    case cpu::Isa::kAvx512: return q4 ? kv_q4_1_avx512 : kv_q8_0_avx512;
    case cpu::Isa::kAvx2: return q4 ? kv_q4_1_avx2 : kv_q8_0_avx2;
    case cpu::Isa::kScalar: break;
  }
#endif
  return q4 ? kv_q4_1_scalar : kv_q8_0_scalar;
}

// Moves one block between the raw GGUF order and the panel order (ukernel.h): `raw` is feature n's block
// (block_bytes), `panel` the panel's block (nr * block_bytes). The codes move in 4-byte groups: group t of the
// feature is lane n of chunk t. to_panel false goes back.
void move_block(Kind kind, uint8_t* raw, uint8_t* panel, int64_t nr, int64_t n, bool to_panel) {
  auto move = [&](uint8_t* r, uint8_t* p, size_t bytes) { to_panel ? std::memcpy(p, r, bytes) : std::memcpy(r, p, bytes); };
  move(raw, panel + 2 * n, 2);                                    // d
  if (kind == Kind::kQ4_1) move(raw + 2, panel + 2 * nr + 2 * n, 2);  // m
  const int64_t head = scale_bytes(kind), groups = (block_bytes(kind) - head) / 4;
  for (int64_t t = 0; t < groups; ++t) move(raw + head + 4 * t, panel + head * nr + 4 * (t * nr + n), 4);
}

// A weight matrix in the layout of the chosen ISA, checked once.
struct GgmlWeights {
  torch::Tensor packed;
  Kind kind;
  int64_t N, K, nr;
  Ukernel ukernel;
};

GgmlWeights checked(const torch::Tensor& packed, const std::string& kind_name, int64_t N, int64_t K) {
  const Kind kind = parse_kind(kind_name);
  KV_CHECK(N > 0 && K > 0 && K % 32 == 0, "ggml weights need N > 0 and K a positive multiple of 32; got N = ", N,
           ", K = ", K);
  const int64_t nr = panel_width(), panels = (N + nr - 1) / nr, row = K / 32 * nr * block_bytes(kind);
  KV_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() && packed.is_cpu() && packed.dim() == 2,
           "packed ggml weights must be a contiguous uint8 CPU tensor [panels, bytes] (from ggml_pack)");
  KV_CHECK(packed.size(0) == panels && packed.size(1) == row, "packed ", kind_name, " weights for N = ", N,
           ", K = ", K, " on the ", cpu::name(cpu::chosen()), " path must be [", panels, ", ", row, "], got [",
           packed.size(0), ", ", packed.size(1), "] (packed for another shape or ISA?)");
  return {packed, kind, N, K, nr, ukernel_for(kind)};
}

torch::Tensor run(const GgmlWeights& g, const torch::Tensor& x) {
  check_x(x, g.K);
  const int64_t M = x.size(0), nb = g.K / 32, mr = tile_rows();
  auto y = torch::empty({M, g.N}, x.options());
  if (M == 0) return y;
  const QuantizedX& qx = quantize_x(x);
  const float* xs = group_shifts(qx, M, g.K, 32);  // groups of one block: xs = d_x * qsum
  const uint8_t* wp = g.packed.data_ptr<uint8_t>();
  const int64_t panel_bytes = g.packed.size(1);
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, g.packed.size(0), 1, [&](int64_t p0, int64_t p1) {
    kv_ggml_args a;
    a.ldq = g.K;
    a.ldb = nb;
    a.ldy = g.N;
    a.nb = static_cast<int32_t>(nb);
    a.nr = static_cast<int32_t>(g.nr);
    for (int64_t p = p0; p < p1; ++p) {
      a.w = wp + p * panel_bytes;
      a.cols = static_cast<int32_t>(std::min(g.nr, g.N - p * g.nr));
      for (int64_t m = 0; m < M; m += mr) {
        a.rows = static_cast<int32_t>(std::min(mr, M - m));
        a.xq = qx.q.data() + m * g.K;
        a.xd = qx.d.data() + m * nb;
        a.xs = xs + m * nb;
        a.xsum = qx.qsum.data() + m * nb;
        a.y = yp + m * g.N + p * g.nr;
        g.ukernel(&a);
      }
    }
  });
  return y;
}

}  // namespace

torch::Tensor ggml_pack(const torch::Tensor& raw, const std::string& kind_name) {
  const Kind kind = parse_kind(kind_name);
  const int64_t bytes = block_bytes(kind);
  KV_CHECK(raw.scalar_type() == torch::kUInt8 && raw.dim() == 2 && raw.is_cpu() && raw.size(0) > 0 &&
               raw.size(1) > 0 && raw.size(1) % bytes == 0,
           kind_name, " weights must be a uint8 CPU tensor [N, blocks * ", bytes, "] (GGUF's raw blocks), got ",
           raw.dim(), " dimensions");
  const torch::Tensor src = raw.contiguous();
  const int64_t N = raw.size(0), nb = raw.size(1) / bytes, nr = panel_width(), panels = (N + nr - 1) / nr;
  auto packed = torch::zeros({panels, nb * nr * bytes}, raw.options());  // features past N stay zero
  uint8_t* raw_p = src.data_ptr<uint8_t>();
  uint8_t* out = packed.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t b = 0; b < nb; ++b)
      move_block(kind, raw_p + (n * nb + b) * bytes, out + ((n / nr) * nb + b) * nr * bytes, nr, n % nr, true);
  return packed;
}

torch::Tensor ggml_unpack(const torch::Tensor& packed, const std::string& kind_name, int64_t N, int64_t K) {
  const GgmlWeights g = checked(packed, kind_name, N, K);
  const int64_t bytes = block_bytes(g.kind), nb = K / 32;
  auto raw = torch::empty({N, nb * bytes}, packed.options());
  uint8_t* in = g.packed.data_ptr<uint8_t>();
  uint8_t* out = raw.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t b = 0; b < nb; ++b)
      move_block(g.kind, out + (n * nb + b) * bytes, in + ((n / g.nr) * nb + b) * g.nr * bytes, g.nr, n % g.nr,
                 false);
  return raw;
}

torch::Tensor ggml_linear(const torch::Tensor& x, const torch::Tensor& packed, const std::string& kind, int64_t N,
                          int64_t K) {
  return run(checked(packed, kind, N, K), x);
}

std::function<torch::Tensor(const torch::Tensor&)> bind_ggml(const torch::Tensor& packed, const std::string& kind,
                                                             int64_t N, int64_t K) {
  GgmlWeights g = checked(packed, kind, N, K);
  return [g](const torch::Tensor& x) { return run(g, x); };
}

}  // namespace kvserve::linear
