// GGUF's own blocks served as they are (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K): packing (once, at load
// time) and the driver around the micro-kernels of ukernel_gguf.h (formats, layouts and the exact arithmetic).
//
// The driver quantizes the activations once per call (act_quant.h's Q8 blocks of 32, for Q4_K and Q5_K one scale
// per 256, plus xs = d_x * qsum per block, the sums per 16 as int16 for Q6_K, and per block as int16 for Q4_K and Q5_K; a
// prefill chunk's rows split over the threads) and threads over panels of output features (at::parallel_for: each
// thread a run of consecutive panels). A decode batch (up to MR rows) is one micro-kernel call per thread, its
// tiles covering several panels at once. More rows are blocked so that both operands stay in cache: chunks of
// panels (kPanelChunkBytes of weights) x slices of kRowSlice rows, each call reusing its panels for every tile of
// rows and its rows for every panel (the K-quants' calls on AMX tiles take all the rows and all of a thread's
// panels, blocking them themselves: ukernel_gguf_amx.h). Every output is
// computed in ukernel_gguf.h's fixed order, so a row's bits depend neither on the batch, nor on the tile, slice or
// chunk it falls in, nor on the threads.
#include "act_quant.h"
#include "huge_pages.h"
#include "projection_handle.h"
#include "ukernel_gguf.h"
#include "ukernel_gguf_amx.h"

#include <atomic>
#include <cstring>
#include <string>

namespace kvserve::linear {
namespace {

using gguf::Kind;
using Ukernel = void (*)(const kv_ggml_args*);

// Rows of a call beyond a decode batch, and weights per call: an L2's share each (activation codes 64 x K bytes,
// panels up to 256 KB), so a call's second pass over either reads the cache.
constexpr int64_t kRowSlice = 64;
constexpr int64_t kPanelChunkBytes = 256 << 10;

// Calls of at least this many rows (decode batches of 32, prefill chunks) of the 32-weight formats may take AMX
// tiles (cpu::amx()): a panel's codes made ready for the tiles serve every tile of 16 rows, two at 32 rows (the
// tiles won there once the panel sat on cache lines, aligned_vector.h); at 16 or 24 rows they were no faster than
// the AVX-512 kernel.
constexpr int64_t kAmxRows = 32;
// Q4_K's and Q5_K's from 8 rows: their tiles take a call of fewer than 32 rows as one unit of tiles of as many
// rows (ukernel_gguf_amx.h), whose super-blocks' pieces cost less than the AVX-512 kernel's vpdpbusd from 8 rows
// on a Sapphire Rapids VM (2 threads, one Llama-3.2-1B projection, tiles against that kernel in 3 alternating
// rounds: Q4_K 0.96-0.98x at 6 rows, 1.10x at 8, 1.4x at 12, 1.5-1.7x at 20-28; Q5_K 1.04x at 6, 1.09x at 8,
// 1.3-1.5x at 12-28).
constexpr int64_t kKquantAmxRows = 8;
// Q6_K's from 16: its pieces cost more to make (0.66-0.71x at 6 and 8 rows, 0.95x at 12, 1.04x at 16, 1.1-1.3x at
// 20-28, 1.9-2.1x at 32).
constexpr int64_t kQ6kAmxRows = 16;

struct KindInfo {
  const char* name;
  Ukernel scalar, avx2, avx512;
  Ukernel amx;  // calls of amx_min_rows(kind) or more on a CPU with AMX; nullptr: none (the AVX-512 kernel was as fast)
};

#ifdef KV_UK_X86
#define KV_KIND(name) {#name, kv_##name##_scalar, kv_##name##_avx2, kv_##name##_avx512, nullptr}
#define KV_KIND_AMX(name) {#name, kv_##name##_scalar, kv_##name##_avx2, kv_##name##_avx512, kv_##name##_amx}
#else
#define KV_KIND(name) {#name, kv_##name##_scalar, kv_##name##_scalar, kv_##name##_scalar, nullptr}
#define KV_KIND_AMX(name) KV_KIND(name)
#endif
// Indexed by gguf::Kind.
// AMX leaves where they measured faster than the AVX-512 kernel (a Sapphire Rapids VM, 2 threads, 512 rows, the
// two alternating in one process, docs/kernels.md): not Q4_1 (0.95-1.11x at SmolLM2's shapes).
const KindInfo kKinds[gguf::kKinds] = {KV_KIND_AMX(q4_0), KV_KIND(q4_1),     KV_KIND_AMX(q5_0), KV_KIND_AMX(q5_1),
                                       KV_KIND_AMX(q8_0), KV_KIND_AMX(q4_k), KV_KIND_AMX(q5_k), KV_KIND_AMX(q6_k)};
#undef KV_KIND
#undef KV_KIND_AMX

Kind parse_kind(const std::string& name) {
  std::string names;
  for (int k = 0; k < gguf::kKinds; ++k) {
    if (name == kKinds[k].name) return static_cast<Kind>(k);
    names += std::string(k ? ", " : "") + "\"" + kKinds[k].name + "\"";
  }
  KV_CHECK(false, "kind must be one of ", names, "; got \"", name, "\"");
  return gguf::kQ4_0;
}

const gguf::UnitLayout& layout(Kind kind) { return gguf::kLayouts[kind]; }

// The panel width and register tile rows of the chosen ISA (the scalar path reads AVX2's panels).
int64_t panel_width() { return cpu::chosen() == cpu::Isa::kAvx512 ? KV_NR_AVX512 : KV_NR_AVX2; }
int64_t tile_rows() { return cpu::chosen() == cpu::Isa::kAvx512 ? KV_MR_AVX512 : KV_MR_AVX2; }

Ukernel ukernel_for(Kind kind) {
  switch (cpu::chosen()) {
    case cpu::Isa::kAvx512: return kKinds[kind].avx512;
    case cpu::Isa::kAvx2: return kKinds[kind].avx2;
    case cpu::Isa::kScalar: break;
  }
  return kKinds[kind].scalar;
}

// The rows from which a call of `kind` takes AMX tiles where it has them.
int64_t amx_min_rows(Kind kind) {
  return kind == gguf::kQ6_K ? kQ6kAmxRows : kind == gguf::kQ4_K || kind == gguf::kQ5_K ? kKquantAmxRows : kAmxRows;
}

// The micro-kernel of the calls of amx_min_rows(kind) rows or more: AMX tiles where cpu::amx() says they run and the kind has
// them, else nullptr (ukernel_for's).
Ukernel amx_for(Kind kind) { return cpu::amx() ? kKinds[kind].amx : nullptr; }

// A weight matrix in the layout of the chosen ISA, checked once.
struct GgmlWeights {
  torch::Tensor packed;
  Kind kind;
  int64_t N, K, nr;
  Ukernel ukernel;
  Ukernel amx;  // calls of amx_min_rows(kind) or more (nullptr: ukernel)
};

GgmlWeights checked(const torch::Tensor& packed, const std::string& kind_name, int64_t N, int64_t K) {
  const Kind kind = parse_kind(kind_name);
  const int64_t weights = layout(kind).weights;
  KV_CHECK(N > 0 && K > 0 && K % weights == 0, kind_name, " weights need N > 0 and K a positive multiple of ",
           weights, "; got N = ", N, ", K = ", K);
  const int64_t nr = panel_width(), panels = (N + nr - 1) / nr, row = K / weights * nr * layout(kind).bytes;
  KV_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() && packed.is_cpu() && packed.dim() == 2,
           "packed ggml weights must be a contiguous uint8 CPU tensor [panels, bytes] (from ggml_pack)");
  KV_CHECK(packed.size(0) == panels && packed.size(1) == row, "packed ", kind_name, " weights for N = ", N,
           ", K = ", K, " on the ", cpu::name(cpu::chosen()), " path must be [", panels, ", ", row, "], got [",
           packed.size(0), ", ", packed.size(1), "] (packed for another shape or ISA?)");
  return {packed, kind, N, K, nr, ukernel_for(kind), amx_for(kind)};
}

// Q6_K's code sums per 16 as int16 [M, K / 16] (|qsum16| <= 16 * 127), read in pairs against its scales' pairs
// (its offset on the activation side, ukernel_gguf.h). Reused across calls (per thread).
const int16_t* sums16_per16(const QuantizedX& qx, int64_t M, int64_t K) {
  thread_local AlignedVector<int16_t> out;
  out.resize(M * K / 16);
  const int8_t* q = qx.q.data();
  for (int64_t i = 0; i < M * K / 16; ++i) {
    int32_t sum = 0;
    for (int k = 0; k < 16; ++k) sum += q[16 * i + k];
    out[i] = static_cast<int16_t>(sum);
  }
  return out.data();
}

// Q4_K and Q5_K's code sums per block of 32 as int16 [M, K / 32] (|qsum| <= 32 * 127), read in pairs against their
// minimums' pairs (vpdpwssd). Reused across calls (per thread).
const int16_t* sums16(const QuantizedX& qx, int64_t M, int64_t K) {
  thread_local AlignedVector<int16_t> out;
  out.resize(M * K / 32);
  for (int64_t i = 0; i < M * K / 32; ++i) out[i] = static_cast<int16_t>(qx.qsum[i]);
  return out.data();
}

// Rows per thread, at least, of a chunk's activation quantization: fewer are quantized by the calling thread
// alone (waking the others would cost about what they save).
constexpr int64_t kQuantizeRows = 32;

// The Q8 activations of a call of many rows (a prefill chunk) and their xs = d_x * qsum [M, K / 32], made by the
// kernels' threads, a run of rows each, rather than by the calling thread while the others wait: each block
// through act_quant.h's block quantizer and xs as group_shifts(.., 32) forms it (fma(d, qsum, 0): the bits of
// quantize_x and group_shifts, which serve the calls of few rows). Reused across calls (per calling thread).
const QuantizedX& quantize_rows(const float* x, int64_t M, int64_t K, int64_t group, const float*& xs) {
  thread_local QuantizedX out;
  thread_local AlignedVector<float> shifts;
  const int64_t nb = K / 32;
  out.q.resize(M * K);
  out.d.resize(M * nb);
  out.qsum.resize(M * nb);
  shifts.resize(M * nb);
  // the calling thread's buffers, by pointer: inside the lambda, another thread's `out` would be its own
  int8_t* const q = out.q.data();
  float* const d = out.d.data();
  int32_t* const qsum = out.qsum.data();
  float* const s = shifts.data();
  at::parallel_for(0, M, kQuantizeRows, [=](int64_t m0, int64_t m1) {
    quantize_groups(x + m0 * K, m1 - m0, K, group, q + m0 * K, d + m0 * nb, qsum + m0 * nb);
    for (int64_t i = m0 * nb; i < m1 * nb; ++i) s[i] = std::fma(d[i], static_cast<float>(qsum[i]), 0.f);
  });
  xs = s;
  return out;
}

// kv_ggml_args.ahead of a call of one or two rows (cpu.h's gguf_prefetch_default until set_gguf_prefetch changes it).
std::atomic<int> prefetch_bytes{cpu::gguf_prefetch_default()};
// kv_ggml_args.unpack of a call of many rows (cpu.h's gguf_unpack_default until set_gguf_unpack changes it).
std::atomic<bool> unpack_groups{cpu::gguf_unpack_default()};
// Whether calls of amx_min_rows(kind) or more take AMX tiles where they run (set_gguf_amx; on from the start).
std::atomic<bool> amx_tiles{true};

// y [M, N] <- x [M, K] @ W^T (x and y contiguous float32, checked by the caller).
void run_into(const GgmlWeights& g, const float* x, int64_t M, float* yp) {
  const int64_t nb = g.K / 32, panels = g.packed.size(0), panel_bytes = g.packed.size(1);
  if (M == 0) return;
  const float* xs = nullptr;
  // The K-quants: activations per super-block of 256 (ukernel_gguf.h: their sub-blocks' scales (and minimums)
  // then fold in integer, one or two float steps per super-block)
  const bool super = layout(g.kind).weights == 256, minimums = g.kind == gguf::kQ4_K || g.kind == gguf::kQ5_K;
  const int64_t group = super ? 256 : 32;
  const QuantizedX& qx = M > kQuantizeRows ? quantize_rows(x, M, g.K, group, xs) : quantize_x(x, M, g.K, group);
  if (xs == nullptr) xs = group_shifts(qx, M, g.K, 32);  // groups of one block: xs = d_x * qsum
  const int16_t* xsum16h = g.kind == gguf::kQ6_K ? sums16_per16(qx, M, g.K) : nullptr;
  const int16_t* xsum16 = minimums ? sums16(qx, M, g.K) : nullptr;
  const uint8_t* wp = g.packed.data_ptr<uint8_t>();
  const bool decode = M <= tile_rows();
  const bool tiles = M >= amx_min_rows(g.kind) && g.amx != nullptr &&
                     amx_tiles.load(std::memory_order_relaxed);
  const Ukernel ukernel = tiles ? g.amx : g.ukernel;
  // The K-quants' AMX calls take all the rows and all of the thread's panels: a panel's super-block made ready for
  // the tiles once serves all the rows (its pieces cost about two tiles' work per super-block to make, Q6_K's
  // more), and the kernel takes the panels in groups that share each super-block's activations in L2
  const bool all_rows = decode || (super && ukernel == g.amx);
  const int64_t rows_per_call = all_rows ? M : kRowSlice;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    const int64_t chunk = all_rows ? p1 - p0 : std::max<int64_t>(1, kPanelChunkBytes / panel_bytes);
    kv_ggml_args a;
    a.ldq = g.K;
    a.ldb = nb;
    a.ldy = g.N;
    a.nb = static_cast<int32_t>(nb);
    a.nr = static_cast<int32_t>(g.nr);
    a.ldw = panel_bytes;
    a.ahead = M <= 2 ? prefetch_bytes.load(std::memory_order_relaxed) : 0;
    a.unpack = unpack_groups.load(std::memory_order_relaxed) ? 1 : 0;
    for (int64_t p = p0; p < p1; p += chunk) {
      const int64_t n = std::min(chunk, p1 - p);
      a.w = wp + p * panel_bytes;
      a.panels = static_cast<int32_t>(n);
      a.cols = static_cast<int32_t>(std::min(g.nr, g.N - (p + n - 1) * g.nr));
      for (int64_t m = 0; m < M; m += rows_per_call) {
        a.rows = static_cast<int32_t>(std::min(rows_per_call, M - m));
        a.xq = qx.q.data() + m * g.K;
        a.xd = qx.d.data() + m * nb;
        a.xs = xs + m * nb;
        a.xsum = qx.qsum.data() + m * nb;
        a.xsum16 = xsum16 == nullptr ? nullptr : xsum16 + m * nb;
        a.xsum16h = xsum16h == nullptr ? nullptr : xsum16h + 2 * m * nb;
        a.y = yp + m * g.N + p * g.nr;
        ukernel(&a);
      }
    }
  });
}

torch::Tensor run(const GgmlWeights& g, const torch::Tensor& x) {
  check_x(x, g.K);
  auto y = torch::empty({x.size(0), g.N}, x.options());
  run_into(g, x.data_ptr<float>(), x.size(0), y.data_ptr<float>());
  return y;
}

// A ProjectionHandle (projection_handle.h) that owns its checked weights; the capsule's destructor frees it.
struct GgmlHandle : ProjectionHandle {
  GgmlWeights g;
};

void run_handle(const ProjectionHandle* self, const float* x, int64_t M, float* y) {
  run_into(static_cast<const GgmlHandle*>(self)->g, x, M, y);
}

}  // namespace

int64_t gguf_prefetch() { return prefetch_bytes.load(); }

int64_t set_gguf_prefetch(int64_t bytes) {
  KV_CHECK(bytes >= 0 && bytes <= (1 << 20), "prefetch distance must be 0..1048576 bytes, got ", bytes);
  return prefetch_bytes.exchange(static_cast<int>(bytes));
}

bool gguf_unpack() { return unpack_groups.load(); }

bool set_gguf_unpack(bool unpack) { return unpack_groups.exchange(unpack); }

bool gguf_amx() { return cpu::amx() && amx_tiles.load(); }

int64_t gguf_amx_rows() { return kKquantAmxRows; }

bool set_gguf_amx(bool on) {
  const bool before = gguf_amx();
  amx_tiles.store(on);
  return before;
}

torch::Tensor ggml_pack(const torch::Tensor& raw, const std::string& kind_name) {
  const Kind kind = parse_kind(kind_name);
  const gguf::UnitLayout& unit = layout(kind);
  KV_CHECK(raw.scalar_type() == torch::kUInt8 && raw.dim() == 2 && raw.is_cpu() && raw.size(0) > 0 &&
               raw.size(1) > 0 && raw.size(1) % unit.bytes == 0,
           kind_name, " weights must be a uint8 CPU tensor [N, units * ", unit.bytes, "] (GGUF's raw blocks), got ",
           raw.dim(), " dimensions");
  const torch::Tensor src = raw.contiguous();
  const int64_t N = raw.size(0), nu = raw.size(1) / unit.bytes, nr = panel_width(), panels = (N + nr - 1) / nr;
  auto packed = torch::empty({panels, nu * nr * unit.bytes}, raw.options());
  kvserve::advise_huge_pages(packed.data_ptr(), packed.nbytes());  // before its first write (huge_pages.h)
  packed.zero_();  // features past N stay zero
  uint8_t* raw_p = src.data_ptr<uint8_t>();
  uint8_t* out = packed.data_ptr<uint8_t>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t u = 0; u < nu; ++u)
        gguf::move_unit(unit, raw_p + (n * nu + u) * unit.bytes, out + ((n / nr) * nu + u) * nr * unit.bytes, nr,
                        n % nr, true);
  });
  return packed;
}

torch::Tensor ggml_unpack(const torch::Tensor& packed, const std::string& kind_name, int64_t N, int64_t K) {
  const GgmlWeights g = checked(packed, kind_name, N, K);
  const gguf::UnitLayout& unit = layout(g.kind);
  const int64_t nu = K / unit.weights;
  auto raw = torch::empty({N, nu * unit.bytes}, packed.options());
  uint8_t* in = g.packed.data_ptr<uint8_t>();
  uint8_t* out = raw.data_ptr<uint8_t>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t u = 0; u < nu; ++u)
        gguf::move_unit(unit, out + (n * nu + u) * unit.bytes, in + ((n / g.nr) * nu + u) * g.nr * unit.bytes, g.nr,
                        n % g.nr, false);
  });
  return raw;
}

torch::Tensor ggml_rows(const torch::Tensor& packed, const std::string& kind_name, const torch::Tensor& ids,
                        int64_t N, int64_t K) {
  const GgmlWeights g = checked(packed, kind_name, N, K);
  KV_CHECK(ids.scalar_type() == torch::kLong && ids.dim() == 1 && ids.is_cpu(), "ids must be a CPU int64 [n], got ",
           ids.dim(), " dimensions");
  const gguf::UnitLayout& unit = layout(g.kind);
  const int64_t nu = K / unit.weights, n_ids = ids.size(0);
  const torch::Tensor idc = ids.contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < n_ids; ++i)
    KV_CHECK(id[i] >= 0 && id[i] < N, "row ", id[i], " out of range for ", N, " rows");
  auto raw = torch::empty({n_ids, nu * unit.bytes}, packed.options());
  uint8_t* in = g.packed.data_ptr<uint8_t>();
  uint8_t* out = raw.data_ptr<uint8_t>();
  for (int64_t i = 0; i < n_ids; ++i)
    for (int64_t u = 0; u < nu; ++u)
      gguf::move_unit(unit, out + (i * nu + u) * unit.bytes, in + ((id[i] / g.nr) * nu + u) * g.nr * unit.bytes,
                      g.nr, id[i] % g.nr, false);
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

py::capsule ggml_handle(const torch::Tensor& packed, const std::string& kind, int64_t N, int64_t K) {
  auto* owned = new GgmlHandle{{N, K, &run_handle}, checked(packed, kind, N, K)};
  return py::capsule(static_cast<const ProjectionHandle*>(owned), ProjectionHandle::kCapsuleName, [](PyObject* c) {
    auto* handle = static_cast<ProjectionHandle*>(PyCapsule_GetPointer(c, ProjectionHandle::kCapsuleName));
    delete static_cast<GgmlHandle*>(handle);
  });
}

}  // namespace kvserve::linear
