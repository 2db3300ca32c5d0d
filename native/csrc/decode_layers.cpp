// Every decoder layer of an all-decode float32 step in one call from Python (engine/fastpath.py's
// FastDecoder uses it where it applies; its per-layer loop stays for every other step and model).
//
// At batch 1 a SmolLM2 step runs 30 layers of eight small calls each (norm, q/k/v projection, attention, o
// projection, add + norm, gate/up projection, SwiGLU, down projection). From Python each call costs a frame,
// argument conversion, torch's dispatcher and a fresh output tensor: together about as long as the attention,
// norms and SwiGLU themselves compute. Here the same calls run from C++ in the same order on the same data, so
// a row's bits are those of the per-layer loop:
//
//   h = rms_norm(x, in_norm)                                  layer 0; later layers get h from the step below
//   per layer:
//     qkv = h @ W_qkv^T                                       [T, (H + 2 H_kv) D]  (ProjectionHandle)
//     qkv += b_qkv                                            where the layer has q/k/v biases (Qwen2)
//     q, k = rms_norm(q, q_norm), rms_norm(k, k_norm) per head   where it has q/k norms (Qwen3)
//     RoPE on q and k; k and v written at the slots; attn = paged decode attention        [T, H, D]
//     x += attn @ W_o^T;  h = rms_norm(x, post_norm)
//     gate_up = h @ W_gate_up^T                               [T, 2I]
//     x += (silu(gate) * up) @ W_down^T;  h = rms_norm(x, next layer's in_norm)   (the last layer: x only)
//
//   logits = lm_head(rms_norm(x[keep], final_norm))          decode() only: [K, vocab] (or the normed rows)
//
// forward() runs the layers on rows the caller embedded, with the caller's cos/sin. decode() runs the whole step
// from token ids: the embedding rows (a float32 table, or GGUF units of 32 or 256 weights dequantized as
// quant/ggml.py's dequantize_blocks does: exact products, one rounding where it adds a minimum), the rows of a
// cos/sin table at the positions (the RoPE table engine/rope.py's RopeTable fills), the layers, the final
// norm of the kept rows and the LM head's kernel, so a step's only tensors from Python are its int64 indices.
// Either of its inputs may still come from the caller (rows embedded in Python, cos/sin of positions past the
// table).
//
// x [T, hidden] is the residual stream, updated in place. The projections are the linear kernels' own entry
// points, reached through ProjectionHandle (projection_handle.h) without Python or torch's dispatcher; the
// norms, RoPE, KV write and attention are decode_ops.cpp's loops (decode_rows.h); SwiGLU is torch's silu
// kernel, as silu_mul computes it (see swiglu). Intermediate rows live in a workspace kept across steps (grown
// to the largest batch; the MLP's, the widest rows, to kMlpRows: a prefill chunk's MLP runs that many at a time).
// Under torch.profiler each part carries the label the per-layer loop's calls carry.
#include <ATen/record_function.h>
#include <c10/util/Half.h>

#include <pybind11/stl.h>  // std::optional arguments

#include "decode_common.h"
#include "decode_rows.h"
#include "gguf_layout.h"
#include "projection_handle.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace {

using kvserve::ProjectionHandle;
using kvserve::decode::check_f32;

// The ProjectionHandle in a capsule made by the linear kernels (e.g. ggml_handle), checked for its shape (N < 0:
// any number of outputs).
const ProjectionHandle* handle_of(const py::capsule& capsule, int64_t N, int64_t K, const char* what) {
  KV_CHECK(capsule.name() != nullptr && std::string(capsule.name()) == ProjectionHandle::kCapsuleName, what,
           " must be a projection handle (a capsule from the linear kernels, e.g. ggml_handle)");
  const auto* handle = capsule.get_pointer<ProjectionHandle>();
  KV_CHECK((N < 0 || handle->N == N) && handle->K == K, what, " computes [", handle->K, "] -> [", handle->N,
           "], the layer needs [", K, "] -> [", N < 0 ? std::string("any") : std::to_string(N), "]");
  return handle;
}

// y <- x @ W^T for T rows, under the projections' profiler label.
inline void project(const ProjectionHandle* p, const float* x, int64_t T, float* y) {
  RECORD_FUNCTION("kvserve::projection", c10::ArrayRef<const c10::IValue>{});
  p->run(p, x, T, y);
}

// A projection whose outputs are its parts' side by side: one handle where the weights could be fused, else one
// per part (a GGUF file may mix block kinds within a layer: llama.cpp's Q4_K_M mixture gives attn_v Q6_K beside a
// Q4_K attn_q and attn_k in some layers, and blocks of two kinds are not one kernel's).
struct Parts {
  std::vector<py::capsule> owners;  // keep the handles below alive
  std::vector<const ProjectionHandle*> handles;
  int64_t N = 0;  // the sum of the parts' outputs
};

// The handle or sequence of handles ``parts`` (a capsule, or a list/tuple of them), each [K] -> [any], together
// [K] -> [N].
Parts parts_of(const py::object& parts, int64_t N, int64_t K, const char* what) {
  Parts out;
  if (py::isinstance<py::capsule>(parts)) {
    out.owners.push_back(parts.cast<py::capsule>());
    out.handles.push_back(handle_of(out.owners.back(), N, K, what));
  } else if (py::isinstance<py::list>(parts) || py::isinstance<py::tuple>(parts)) {
    for (const py::handle& part : parts) {
      if (!py::isinstance<py::capsule>(part))
        throw py::type_error(std::string(what) + " must be projection handles (capsules from the linear kernels)");
      out.owners.push_back(part.cast<py::capsule>());
      out.handles.push_back(handle_of(out.owners.back(), -1, K, what));
    }
    KV_CHECK(!out.handles.empty(), what, " needs at least one projection handle");
  } else {
    throw py::type_error(std::string(what) + " must be a projection handle or a list of them");
  }
  for (const ProjectionHandle* h : out.handles) out.N += h->N;
  KV_CHECK(out.N == N, what, "'s parts compute [", K, "] -> [", out.N, "], the layer needs [", K, "] -> [", N, "]");
  return out;
}

// y [T, parts.N] <- the parts' outputs side by side (the bits of each part's kernel, as torch.cat of their calls
// gives them). One row, or one part, writes y directly; more rows go through scratch, a part at a time.
void project_parts(const Parts& parts, const float* x, int64_t T, float* y, kvserve::AlignedVector<float>& scratch) {
  if (parts.handles.size() == 1 || T == 1) {
    int64_t offset = 0;
    for (const ProjectionHandle* p : parts.handles) {
      project(p, x, T, y + offset);
      offset += p->N;
    }
    return;
  }
  int64_t offset = 0;
  for (const ProjectionHandle* p : parts.handles) {
    scratch.resize(std::max<size_t>(scratch.size(), static_cast<size_t>(T * p->N)));
    project(p, x, T, scratch.data());
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(y + t * parts.N + offset, scratch.data() + t * p->N, sizeof(float) * p->N);
    offset += p->N;
  }
}

// SwiGLU as silu_mul computes it: act = silu(gate) * up, [T, I] each, in act's workspace rows. The silu is
// torch's own (at::silu_out on the layouts silu_mul's at::silu sees, so Sleef's exp at this CPU's vector width:
// torch's bits); the product is one correctly rounded multiply per element, so a plain loop gives mul_'s bits
// without a second dispatch.
void swiglu(torch::Tensor& act, const torch::Tensor& gate, const float* up, int64_t up_stride) {
  RECORD_FUNCTION("kvserve::silu_mul", c10::ArrayRef<const c10::IValue>{});
  at::silu_out(act, gate);
  const int64_t T = act.size(0), I = act.size(1);
  float* a = act.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < I; ++i) a[t * I + i] *= up[t * up_stride + i];
}

// The token embedding's formats decode() looks rows up in: a float32 table, GGUF units of 32 weights, or the
// K-quants' super-blocks of 256.
enum class Table { kF32, kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ8_0, kQ4_K, kQ5_K, kQ6_K };

struct TableFormat {
  const char* name;  // quant/ggml.py's GGMLKind value ("f32": a float32 nn.Embedding weight)
  Table table;
  int64_t unit_bytes;    // bytes per unit (0: float32 rows)
  int64_t unit_weights;  // weights per unit: 32, or 256 for the K-quants
  int layout;            // its gguf::Kind (the kernels' panel layout, gguf_layout.h); -1 for float32
};

constexpr TableFormat kTableFormats[] = {
    {"f32", Table::kF32, 0, 1, -1},
    {"q4_0", Table::kQ4_0, 18, 32, kvserve::gguf::kQ4_0},
    {"q4_1", Table::kQ4_1, 20, 32, kvserve::gguf::kQ4_1},
    {"q5_0", Table::kQ5_0, 22, 32, kvserve::gguf::kQ5_0},
    {"q5_1", Table::kQ5_1, 24, 32, kvserve::gguf::kQ5_1},
    {"q8_0", Table::kQ8_0, 34, 32, kvserve::gguf::kQ8_0},
    {"q4_k", Table::kQ4_K, 144, 256, kvserve::gguf::kQ4_K},
    {"q5_k", Table::kQ5_K, 176, 256, kvserve::gguf::kQ5_K},
    {"q6_k", Table::kQ6_K, 210, 256, kvserve::gguf::kQ6_K}};

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));  // exact
}

// One unit of 32 weights as quant/ggml.py's dequantize_blocks computes it, the same float32 operations in the
// same order (this file is built without FMA contraction): codes 0-15 are the low nibbles, 16-31 the high ones,
// Q5's fifth bit j is bit j of a little-endian word; d q, (q - 8) d and (q - 16) d are exact, + m rounds once.
void dequantize_unit(Table table, const uint8_t* u, float* w) {
  const float d = half_at(u);
  if (table == Table::kQ8_0) {
    for (int j = 0; j < 32; ++j) w[j] = static_cast<float>(static_cast<int8_t>(u[2 + j])) * d;
    return;
  }
  const bool has_min = table == Table::kQ4_1 || table == Table::kQ5_1;
  const bool fifth = table == Table::kQ5_0 || table == Table::kQ5_1;
  const int head = has_min ? 4 : 2;  // after d (and m)
  const uint8_t* qs = u + head + (fifth ? 4 : 0);
  uint32_t qh = 0;
  if (fifth) std::memcpy(&qh, u + head, 4);
  const float m = has_min ? half_at(u + 2) : 0.f;
  const float offset = table == Table::kQ4_0 ? 8.f : table == Table::kQ5_0 ? 16.f : 0.f;
  for (int j = 0; j < 32; ++j) {
    int code = j < 16 ? qs[j] & 0x0F : qs[j - 16] >> 4;
    if (fifth) code |= static_cast<int>((qh >> j) & 1u) << 4;
    const float q = static_cast<float>(code);
    if (has_min) {
      const float dq = q * d;
      w[j] = dq + m;
    } else {
      w[j] = (q - offset) * d;
    }
  }
}

// One Q4_K / Q5_K super-block of 256 weights as dequantize_blocks computes it (ggml's block_q4_K / block_q5_K):
// per sub-block s of 32, a 6-bit scale and minimum (get_scale_min_k4's packing in bytes 4-15), w = (d sc) q -
// (dmin m); d sc and (d sc) q are exact (at most 22 significant bits), the subtraction rounds once. Sub-block s
// takes the low nibbles (s even) or the high ones (s odd) of the 32 bytes at 32 (s / 2); Q5_K's fifth bit of
// weight l of sub-block s is bit s of byte l of the 32 bytes after the scales.
void dequantize_k45(bool q5, const uint8_t* u, float* w) {
  const float d = half_at(u), dmin = half_at(u + 2);
  const uint8_t* sc = u + 4;
  const uint8_t* qh = u + 16;
  const uint8_t* qs = u + (q5 ? 48 : 16);
  for (int s = 0; s < 8; ++s) {
    const int scale = s < 4 ? sc[s] & 63 : (sc[s + 4] & 15) | ((sc[s - 4] >> 2) & 48);
    const int minimum = s < 4 ? sc[s + 4] & 63 : (sc[s + 4] >> 4) | ((sc[s] >> 2) & 48);
    const float ds = d * static_cast<float>(scale), dm = dmin * static_cast<float>(minimum);
    const uint8_t* bytes = qs + 32 * (s / 2);
    for (int l = 0; l < 32; ++l) {
      int code = s % 2 ? bytes[l] >> 4 : bytes[l] & 0x0F;
      if (q5) code |= ((qh[l] >> s) & 1) << 4;
      const float dq = static_cast<float>(code) * ds;
      w[32 * s + l] = dq - dm;
    }
  }
}

// One Q6_K super-block of 256 weights as dequantize_blocks computes it (ggml's block_q6_K): weight 128 h + 32 s +
// l has its low 4 bits in ql[64 h + 32 (s % 2) + l] (the high nibble for s >= 2) and its high 2 bits at 2 s of
// qh[32 h + l]; w = (d sc) (q - 32) with an int8 scale per 16 weights, d sc exact, the product rounded once.
void dequantize_q6_k(const uint8_t* u, float* w) {
  const uint8_t *ql = u, *qh = u + 128;
  const auto* scales = reinterpret_cast<const int8_t*>(u + 192);
  const float d = half_at(u + 208);
  for (int h = 0; h < 2; ++h)
    for (int s = 0; s < 4; ++s)
      for (int l = 0; l < 32; ++l) {
        const int j = 128 * h + 32 * s + l;
        const uint8_t low = ql[64 * h + 32 * (s % 2) + l];
        const int code = ((s < 2 ? low & 0x0F : low >> 4) | (((qh[32 * h + l] >> (2 * s)) & 3) << 4)) - 32;
        w[j] = static_cast<float>(code) * (d * static_cast<float>(scales[j / 16]));
      }
}

// One unit of any table format but float32 (unit_weights weights at w).
void dequantize_any(Table table, const uint8_t* u, float* w) {
  if (table == Table::kQ6_K)
    dequantize_q6_k(u, w);
  else if (table == Table::kQ4_K || table == Table::kQ5_K)
    dequantize_k45(table == Table::kQ5_K, u, w);
  else
    dequantize_unit(table, u, w);
}

class DecodeLayers {
 public:
  // H query heads and H_kv KV heads of D, hidden width, MLP width I (the model's geometry, checked per layer).
  DecodeLayers(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t hidden, int64_t intermediate)
      : H_(heads), H_kv_(kv_heads), D_(head_dim), hidden_(hidden), I_(intermediate) {
    KV_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim > 0 && head_dim % 2 == 0 && hidden > 0 &&
                 intermediate > 0,
             "bad geometry: heads ", heads, ", kv_heads ", kv_heads, ", head_dim ", head_dim, ", hidden ", hidden,
             ", intermediate ", intermediate);
  }

  // Appends the next layer: its RMSNorm weights [hidden] and eps, its four projections' handles (q/k/v, o,
  // gate/up, down; q/k/v and gate/up each one handle of the parts fused side by side, or a list of the parts'
  // handles in that order), its softmax scale and sliding window (tokens; <= 0: none); optionally the q/k/v
  // projection's bias [(H + 2 H_kv) D] (Qwen2; its handles add none), and q and k RMSNorm weights [D] with their
  // eps (Qwen3's q_norm and k_norm, over each head before RoPE).
  void add_layer(const torch::Tensor& in_norm, double in_eps, const torch::Tensor& post_norm, double post_eps,
                 const py::object& qkv, const py::capsule& o_proj, const py::object& gate_up,
                 const py::capsule& down, double scale, int64_t window, const std::optional<torch::Tensor>& qkv_bias,
                 const std::optional<torch::Tensor>& q_norm, const std::optional<torch::Tensor>& k_norm,
                 double qk_eps) {
    for (const torch::Tensor* w : {&in_norm, &post_norm}) {
      check_f32(*w, "norm weight");
      KV_CHECK(w->is_contiguous() && w->numel() == hidden_, "norm weights must be contiguous [", hidden_, "]");
    }
    if (qkv_bias.has_value()) {
      check_f32(*qkv_bias, "the q/k/v bias");
      KV_CHECK(qkv_bias->is_contiguous() && qkv_bias->numel() == (H_ + 2 * H_kv_) * D_,
               "the q/k/v bias must be contiguous [", (H_ + 2 * H_kv_) * D_, "]");
    }
    KV_CHECK(q_norm.has_value() == k_norm.has_value(), "give both q_norm and k_norm, or neither");
    for (const std::optional<torch::Tensor>* w : {&q_norm, &k_norm}) {
      if (!w->has_value()) continue;
      check_f32(**w, "a q/k norm weight");
      KV_CHECK((*w)->is_contiguous() && (*w)->numel() == D_, "q/k norm weights must be contiguous [", D_, "]");
    }
    layers_.push_back({in_norm, post_norm, static_cast<float>(in_eps), static_cast<float>(post_eps),
                       {o_proj, down}, parts_of(qkv, (H_ + 2 * H_kv_) * D_, hidden_, "qkv"),
                       handle_of(o_proj, hidden_, H_ * D_, "o_proj"), parts_of(gate_up, 2 * I_, hidden_, "gate_up"),
                       handle_of(down, hidden_, I_, "down"), scale, window,
                       qkv_bias.value_or(torch::Tensor()), q_norm.value_or(torch::Tensor()),
                       k_norm.value_or(torch::Tensor()), static_cast<float>(qk_eps)});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // decode()'s token embedding: a float32 table [vocab, hidden] ("f32", contiguous) or GGUF units uint8 [vocab,
  // hidden / unit weights * unit bytes] of kind "q4_0", "q4_1", "q5_0", "q5_1", "q8_0" (units of 32 weights),
  // "q4_k", "q5_k" or "q6_k" (super-blocks of 256) (GGMLEmbedding's weight_blocks). panel_rows > 0: the table is
  // a tied LM head's units in the kernels' panels of panel_rows features (linear_ggml.cpp's ggml_pack: uint8
  // [ceil(vocab / panel_rows), units * panel_rows * unit bytes]) and vocab its rows; each row's units are taken
  // out of its panel (gguf::move_unit) before they are dequantized, so one copy of the table serves both.
  void set_embedding(const torch::Tensor& table, const std::string& kind, int64_t panel_rows, int64_t vocab) {
    const TableFormat* format = nullptr;
    for (const TableFormat& f : kTableFormats)
      if (kind == f.name) format = &f;
    KV_CHECK(format != nullptr, "embedding kind ", kind,
             " (the stack looks up f32, q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q5_k, q6_k)");
    KV_CHECK(table.is_cpu() && table.is_contiguous() && table.dim() == 2 && table.size(0) > 0,
             "the embedding must be a contiguous CPU table [vocab, row]");
    KV_CHECK(panel_rows >= 0 && (panel_rows == 0 || format->table != Table::kF32),
             "panel_rows must be 0, or > 0 for GGUF units, got ", panel_rows, " for ", kind);
    if (format->table == Table::kF32) {
      check_f32(table, "an f32 embedding");
      KV_CHECK(table.size(1) == hidden_, "an f32 embedding must be [vocab, ", hidden_, "]");
    } else {
      const int64_t units = hidden_ / format->unit_weights, width = panel_rows > 0 ? panel_rows : 1;
      KV_CHECK(table.scalar_type() == torch::kUInt8 && hidden_ % format->unit_weights == 0 &&
                   table.size(1) == units * format->unit_bytes * width,
               kind, " embedding rows must be uint8 [", panel_rows > 0 ? "panels" : "vocab", ", ",
               units * format->unit_bytes * width, "] of whole units of ", format->unit_weights, " weights");
      KV_CHECK(panel_rows == 0 || (vocab > (table.size(0) - 1) * panel_rows && vocab <= table.size(0) * panel_rows),
               "a table of ", table.size(0), " panels of ", panel_rows, " holds more or fewer rows than ", vocab);
    }
    std::lock_guard<std::mutex> lock(mutex_);
    embedding_ = table;
    embedding_format_ = *format;
    embedding_panel_rows_ = panel_rows;
    embedding_vocab_ = panel_rows > 0 ? vocab : table.size(0);
  }

  // decode()'s RoPE: cos and sin [P, D] per position 0..P-1 (contiguous float32).
  void set_rope(const torch::Tensor& cos, const torch::Tensor& sin) {
    for (const torch::Tensor* t : {&cos, &sin}) {
      check_f32(*t, "the cos and sin tables");
      KV_CHECK(t->is_contiguous() && t->dim() == 2 && t->size(1) == D_ && t->size(0) == cos.size(0),
               "the cos and sin tables must be contiguous [positions, ", D_, "]");
    }
    std::lock_guard<std::mutex> lock(mutex_);
    cos_table_ = cos;
    sin_table_ = sin;
  }

  // decode()'s last part: the final RMSNorm's weights [hidden] and eps, and the LM head's projection handle (None:
  // decode returns the normed rows and the caller applies its head).
  void set_head(const torch::Tensor& norm, double eps, const py::object& head) {
    check_f32(norm, "the final norm weight");
    KV_CHECK(norm.is_contiguous() && norm.numel() == hidden_, "the final norm weight must be contiguous [", hidden_,
             "]");
    const ProjectionHandle* handle = nullptr;
    py::capsule owner;
    if (!head.is_none()) {
      owner = head.cast<py::capsule>();
      handle = handle_of(owner, -1, hidden_, "lm_head");
    }
    std::lock_guard<std::mutex> lock(mutex_);
    final_norm_ = norm;
    final_eps_ = static_cast<float>(eps);
    head_owner_ = owner;
    head_ = handle;
  }

  // Runs every layer on x [T, hidden] (contiguous float32, updated in place). cos, sin [T, D]: the rows' RoPE
  // (contiguous); slots [T]: where each row's K/V goes; rows, tables, lens: the paged attention's decode rows
  // (every row, in order), block tables and context lengths (paged_decode_attention); kv [2, layers, blocks,
  // block_size, H_kv, D]: the pool's K and V (KVPool.data), float32 or bfloat16.
  void forward(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& slots,
               const torch::Tensor& rows, const torch::Tensor& tables, const torch::Tensor& lens, torch::Tensor& kv) {
    RECORD_FUNCTION("kvserve::decode_layers", c10::ArrayRef<const c10::IValue>{});
    std::lock_guard<std::mutex> lock(mutex_);  // one step at a time: the workspace is shared
    c10::InferenceMode inference;  // the workspace's in-place ops need no autograd record, whoever calls
    const int64_t T = x.size(0);
    check_f32(x, "x");
    KV_CHECK(num_layers() > 0 && x.dim() == 2 && x.is_contiguous() && x.size(1) == hidden_,
             "x must be contiguous [T, ", hidden_, "]");
    check_cos_sin(cos, sin, T);
    check_pool(kv, slots, T);
    if (T == 0) return;
    reserve(T);
    run_layers(x.data_ptr<float>(), T, cos.data_ptr<float>(), sin.data_ptr<float>(), slots, rows, tables, lens, kv);
  }

  // A whole all-decode step: ids [T] (int64 token ids) and positions [T] (int64) in, the kept rows' logits
  // [K, vocab] out (a fresh tensor; the normed rows [K, hidden] where no head is set). slots, rows, tables, lens,
  // kv: as forward; keep [K]: int64 rows whose logits are wanted, in [0, T). Optional x [T, hidden]: rows the
  // caller embedded (else the embedding set_embedding gave looks up ids); optional cos, sin [T, D]: the rows'
  // RoPE (else rows of set_rope's tables at the positions). Needs set_head. Every row's bits are forward's
  // followed by rms_norm (decode_ops) and the head's kernel on the kept rows.
  torch::Tensor decode(const torch::Tensor& ids, const torch::Tensor& positions, const torch::Tensor& slots,
                       const torch::Tensor& rows, const torch::Tensor& tables, const torch::Tensor& lens,
                       torch::Tensor& kv, const torch::Tensor& keep, const std::optional<torch::Tensor>& x,
                       const std::optional<torch::Tensor>& cos, const std::optional<torch::Tensor>& sin) {
    RECORD_FUNCTION("kvserve::decode_layers", c10::ArrayRef<const c10::IValue>{});
    std::lock_guard<std::mutex> lock(mutex_);
    c10::InferenceMode inference;
    KV_CHECK(num_layers() > 0 && final_norm_.defined(), "decode needs the layers and set_head");
    for (const torch::Tensor* t : {&ids, &positions, &keep})
      KV_CHECK(t->scalar_type() == torch::kLong && t->is_cpu() && t->is_contiguous() && t->dim() == 1,
               "ids, positions and keep must be contiguous int64 CPU vectors");
    const int64_t T = ids.numel(), K = keep.numel();
    KV_CHECK(positions.numel() == T, "ids and positions must both be [T]");
    check_pool(kv, slots, T);
    const int64_t* kp = keep.data_ptr<int64_t>();
    for (int64_t k = 0; k < K; ++k) KV_CHECK(kp[k] >= 0 && kp[k] < T, "keep row ", kp[k], " out of range");
    reserve(std::max<int64_t>(T, 1));
    float* xp = x_.data_ptr<float>();
    if (x.has_value()) {
      check_f32(*x, "x");
      KV_CHECK(x->dim() == 2 && x->is_contiguous() && x->size(0) == T && x->size(1) == hidden_,
               "x must be contiguous [T, ", hidden_, "]");
      if (T > 0) std::memcpy(xp, x->data_ptr<float>(), sizeof(float) * T * hidden_);
    } else {
      embed(ids, xp);
    }
    const float *cosp = cos_.data_ptr<float>(), *sinp = sin_.data_ptr<float>();
    KV_CHECK(cos.has_value() == sin.has_value(), "give both cos and sin, or neither");
    if (cos.has_value()) {
      check_cos_sin(*cos, *sin, T);
      cosp = cos->data_ptr<float>();
      sinp = sin->data_ptr<float>();
    } else {
      gather_rope(positions, T);
    }
    const int64_t vocab = head_ != nullptr ? head_->N : hidden_;
    auto out = torch::empty({K, vocab}, torch::TensorOptions().dtype(torch::kFloat32));
    if (T == 0) return out;
    run_layers(xp, T, cosp, sinp, slots, rows, tables, lens, kv);
    // the kept rows normed into h (free once the layers ran), then the head
    float* hp = h_.data_ptr<float>();
    float* normed = head_ != nullptr ? hp : out.data_ptr<float>();
    {
      RECORD_FUNCTION("kvserve::rms_norm", c10::ArrayRef<const c10::IValue>{});
      for (int64_t k = 0; k < K; ++k)
        kvserve::decode::rms_norm_rows(xp + kp[k] * hidden_, final_norm_.data_ptr<float>(), final_eps_,
                                       normed + k * hidden_, 1, hidden_);
    }
    if (head_ != nullptr && K > 0) project(head_, hp, K, out.data_ptr<float>());
    return out;
  }

  // A workspace of at least T rows now, so steps of up to T rows never make it again (the caller's largest step,
  // the scheduler's token budget: a workspace grown step by step, 1 row, then a prompt's 501, then 512, leaves
  // the freed smaller ones as holes in the C heap that the resident set keeps).
  void reserve_rows(int64_t T) {
    KV_CHECK(T > 0, "reserve takes a positive number of rows, got ", T);
    std::lock_guard<std::mutex> lock(mutex_);
    reserve(T);
  }

  // Rows of the workspace as it stands (0 before any step or reserve).
  int64_t workspace_rows() {
    std::lock_guard<std::mutex> lock(mutex_);
    return h_.defined() ? h_.size(0) : 0;
  }

 private:
  struct Layer {
    torch::Tensor in_norm, post_norm;
    float in_eps, post_eps;
    py::capsule owners[2];  // keep o_proj and down alive
    Parts qkv;
    const ProjectionHandle* o_proj;
    Parts gate_up;
    const ProjectionHandle* down;
    double scale;
    int64_t window;
    torch::Tensor qkv_bias, q_norm, k_norm;  // undefined where the layer has none
    float qk_eps;
  };

  static void rms_norm(const float* x, const torch::Tensor& w, float eps, float* y, int64_t T) {
    RECORD_FUNCTION("kvserve::rms_norm", c10::ArrayRef<const c10::IValue>{});
    kvserve::decode::rms_norm_rows(x, w.data_ptr<float>(), eps, y, T, w.numel());
  }

  void check_cos_sin(const torch::Tensor& cos, const torch::Tensor& sin, int64_t T) const {
    for (const torch::Tensor* t : {&cos, &sin}) {
      check_f32(*t, "cos and sin");
      KV_CHECK(t->is_contiguous() && t->dim() == 2 && t->size(0) == T && t->size(1) == D_,
               "cos and sin must be contiguous [T, D]");
    }
  }

  // kv: the pool, one K and one V block array per layer; slots [T] inside it.
  void check_pool(const torch::Tensor& kv, const torch::Tensor& slots, int64_t T) const {
    KV_CHECK((kv.scalar_type() == torch::kFloat32 || kv.scalar_type() == torch::kBFloat16) && kv.is_cpu(),
             "kv must be a float32 or bfloat16 CPU tensor");
    KV_CHECK(kv.is_contiguous() && kv.dim() == 6 && kv.size(0) == 2 && kv.size(1) == num_layers() &&
                 kv.size(4) == H_kv_ && kv.size(5) == D_,
             "kv must be the contiguous pool [2, ", num_layers(), ", blocks, block_size, ", H_kv_, ", ", D_, "]");
    KV_CHECK(slots.scalar_type() == torch::kLong && slots.is_contiguous() && slots.numel() == T,
             "slots must be int64 [T]");
    kvserve::decode::check_slots(slots, kv.size(2) * kv.size(3));
  }

  // x [T, hidden] <- the embedding's rows of ids (GGMLEmbedding / nn.Embedding's bits).
  void embed(const torch::Tensor& ids, float* x) const {
    RECORD_FUNCTION("kvserve::embedding", c10::ArrayRef<const c10::IValue>{});
    KV_CHECK(embedding_.defined(), "decode without x needs set_embedding");
    const int64_t T = ids.numel(), vocab = embedding_vocab_, row_bytes = embedding_.size(1) *
                                                                embedding_.element_size();
    const int64_t* id = ids.data_ptr<int64_t>();
    auto* table = static_cast<uint8_t*>(embedding_.data_ptr());
    const TableFormat& f = embedding_format_;
    const int64_t nr = embedding_panel_rows_, units = f.table == Table::kF32 ? 0 : hidden_ / f.unit_weights;
    uint8_t unit[256];  // one unit out of its panel (the largest, Q6_K's, is 210 bytes)
    for (int64_t t = 0; t < T; ++t) {
      KV_CHECK(id[t] >= 0 && id[t] < vocab, "token id ", id[t], " out of range for a vocabulary of ", vocab);
      float* out = x + t * hidden_;
      if (f.table == Table::kF32) {
        std::memcpy(out, table + id[t] * row_bytes, sizeof(float) * hidden_);
        continue;
      }
      for (int64_t u = 0; u < units; ++u) {
        if (nr > 0) {  // panel id / nr holds unit u of its nr rows side by side, field by field
          uint8_t* panel = table + (id[t] / nr) * row_bytes + u * nr * f.unit_bytes;
          kvserve::gguf::move_unit(kvserve::gguf::kLayouts[f.layout], unit, panel, nr, id[t] % nr, false);
          dequantize_any(f.table, unit, out + f.unit_weights * u);
        } else {
          dequantize_any(f.table, table + id[t] * row_bytes + u * f.unit_bytes, out + f.unit_weights * u);
        }
      }
    }
  }

  // cos_, sin_ [T, D] <- rows of the RoPE tables at positions.
  void gather_rope(const torch::Tensor& positions, int64_t T) {
    KV_CHECK(cos_table_.defined(), "decode without cos and sin needs set_rope");
    const int64_t P = cos_table_.size(0);
    const int64_t* pos = positions.data_ptr<int64_t>();
    const float *cos = cos_table_.data_ptr<float>(), *sin = sin_table_.data_ptr<float>();
    float *cos_out = cos_.data_ptr<float>(), *sin_out = sin_.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) {
      KV_CHECK(pos[t] >= 0 && pos[t] < P, "position ", pos[t], " is past the RoPE table's ", P, " positions");
      std::memcpy(cos_out + t * D_, cos + pos[t] * D_, sizeof(float) * D_);
      std::memcpy(sin_out + t * D_, sin + pos[t] * D_, sizeof(float) * D_);
    }
  }

  // Every layer on x [T, hidden] (the caller holds the lock, checked the pool and reserved T rows).
  void run_layers(float* xp, int64_t T, const float* cosp, const float* sinp, const torch::Tensor& slots,
                  const torch::Tensor& rows, const torch::Tensor& tables, const torch::Tensor& lens,
                  torch::Tensor& kv) {
    const int64_t layers = num_layers(), width = (H_ + 2 * H_kv_) * D_;
    const int64_t blocks = kv.size(2), block_size = kv.size(3), layer_floats = blocks * block_size * H_kv_ * D_;
    Views& v = views(T);
    kvserve::decode::DecodeCall call =
        kvserve::decode::check_decode_call(v.q, rows, tables, lens, v.attn, blocks, block_size, H_kv_, 1.0, 0);
    KV_CHECK(call.B == T, "every row must be a decode row");
    float* hp = h_.data_ptr<float>();
    float* qkvp = qkv_.data_ptr<float>();
    float* gate_upp = gate_up_.data_ptr<float>();
    const float* actp = act_.data_ptr<float>();
    const int64_t* sp = slots.data_ptr<int64_t>();
    // a float32 pool, or a bfloat16 one (attend_bf16.h's attention): one layer's K or V is layer_floats elements
    const bool bf16 = kv.scalar_type() == torch::kBFloat16;
    auto* kvp = static_cast<char*>(kv.data_ptr());
    const int64_t layer_bytes = layer_floats * kv.element_size();
    rms_norm(xp, layers_[0].in_norm, layers_[0].in_eps, hp, T);
    for (int64_t l = 0; l < layers; ++l) {
      const Layer& layer = layers_[l];
      void* k_blocks = kvp + l * layer_bytes;
      void* v_blocks = kvp + (layers + l) * layer_bytes;
      project_parts(layer.qkv, hp, T, qkvp, scratch_);
      if (layer.qkv_bias.defined()) {  // the bits of the layer loop's y + bias: one rounded add per element
        const float* b = layer.qkv_bias.data_ptr<float>();
        for (int64_t t = 0; t < T; ++t) kvserve::decode::add_rows(qkvp + t * width, b, 1, width);
      }
      if (layer.q_norm.defined()) {  // each head of q, then of k, normed in place (rms_norm's rows)
        RECORD_FUNCTION("kvserve::rms_norm", c10::ArrayRef<const c10::IValue>{});
        for (int64_t t = 0; t < T; ++t) {
          float* row = qkvp + t * width;
          kvserve::decode::rms_norm_rows(row, layer.q_norm.data_ptr<float>(), layer.qk_eps, row, H_, D_);
          kvserve::decode::rms_norm_rows(row + H_ * D_, layer.k_norm.data_ptr<float>(), layer.qk_eps, row + H_ * D_,
                                         H_kv_, D_);
        }
      }
      {
        RECORD_FUNCTION("kvserve::decode_attention", c10::ArrayRef<const c10::IValue>{});
        kvserve::decode::rope_rows(qkvp, T, H_ + H_kv_, D_, width, D_, cosp, sinp);
        call.scale = static_cast<float>(layer.scale);
        call.window = layer.window;
        if (bf16) {
          auto *kb = static_cast<uint16_t*>(k_blocks), *vb = static_cast<uint16_t*>(v_blocks);
          kvserve::decode::write_kv_rows_bf16(kb, vb, sp, qkvp + H_ * D_, qkvp + (H_ + H_kv_) * D_, T, H_kv_, D_,
                                              width, D_, width, D_);
          kvserve::decode::attend_decode_bf16(call, kb, vb);
        } else {
          auto *kb = static_cast<float*>(k_blocks), *vb = static_cast<float*>(v_blocks);
          kvserve::decode::write_kv_rows(kb, vb, sp, qkvp + H_ * D_, qkvp + (H_ + H_kv_) * D_, T, H_kv_, D_, width,
                                         D_, width, D_);
          kvserve::decode::attend_decode(call, kb, vb);
        }
      }
      // o_proj's and down's rows go to h (the normed rows, each read before its row is written), not a buffer
      // of their own: the workspace holds one [T, hidden] less
      project(layer.o_proj, call.out, T, hp);
      kvserve::decode::add_rows(xp, hp, T, hidden_);
      rms_norm(xp, layer.post_norm, layer.post_eps, hp, T);
      // the MLP kMlpRows rows at a time: its gate/up and activation rows (3 I floats a row, most of a row's
      // intermediates) need a workspace of one run, not of a whole prefill chunk; every row has its bits alone
      for (int64_t r0 = 0; r0 < T; r0 += kMlpRows) {
        const int64_t n = std::min(kMlpRows, T - r0);
        project_parts(layer.gate_up, hp + r0 * hidden_, n, gate_upp, scratch_);
        if (n == v.act.size(0)) {
          swiglu(v.act, v.gate, gate_upp + I_, 2 * I_);
        } else {
          torch::Tensor act = act_.narrow(0, 0, n);
          swiglu(act, gate_up_.narrow(0, 0, n).narrow(1, 0, I_), gate_upp + I_, 2 * I_);
        }
        project(layer.down, actp, n, hp + r0 * hidden_);  // after gate_up read these rows of h
      }
      kvserve::decode::add_rows(xp, hp, T, hidden_);
      if (l + 1 < layers) rms_norm(xp, layers_[l + 1].in_norm, layers_[l + 1].in_eps, hp, T);
    }
  }

  // The workspace's first T rows as the attention and SwiGLU take them, made again only when T changes (a
  // handful of tensor ops, where a run of steps of one batch size makes none).
  struct Views {
    int64_t T = -1;
    torch::Tensor q, attn, act, gate;  // [T, H, D] (in qkv's rows), [T, H, D], [T, I], [T, I] (in gate_up's rows)
  };

  Views& views(int64_t T) {
    if (views_.T != T) {
      views_.q = qkv_.narrow(0, 0, T).view({T, H_ + 2 * H_kv_, D_}).narrow(1, 0, H_);
      views_.attn = attn_.narrow(0, 0, T);
      views_.act = act_.narrow(0, 0, std::min(T, kMlpRows));
      views_.gate = gate_up_.narrow(0, 0, std::min(T, kMlpRows)).narrow(1, 0, I_);
      views_.T = T;
    }
    return views_;
  }

  // A workspace of at least T rows (intermediate results; kept across steps).
  void reserve(int64_t T) {
    if (h_.defined() && h_.size(0) >= T) return;
    views_.T = -1;  // the views below are of the old workspace
    const auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
    x_ = torch::empty({T, hidden_}, f32);
    cos_ = torch::empty({T, D_}, f32);
    sin_ = torch::empty({T, D_}, f32);
    h_ = torch::empty({T, hidden_}, f32);
    qkv_ = torch::empty({T, (H_ + 2 * H_kv_) * D_}, f32);
    attn_ = torch::empty({T, H_, D_}, f32);
    gate_up_ = torch::empty({std::min(T, kMlpRows), 2 * I_}, f32);
    act_ = torch::empty({std::min(T, kMlpRows), I_}, f32);
  }

  // Rows of the MLP's gate/up and activation at a time (run_layers): a decode batch runs in one; a prefill chunk
  // keeps a workspace of 3 I floats a row for kMlpRows rows instead of all its rows (on a 1B Llama: 6 MB, not 48
  // for 512 rows). The kernels cut their calls into runs of this size anyway.
  static constexpr int64_t kMlpRows = 64;

  const int64_t H_, H_kv_, D_, hidden_, I_;
  std::vector<Layer> layers_;
  torch::Tensor embedding_, cos_table_, sin_table_, final_norm_;  // decode()'s per-model inputs
  TableFormat embedding_format_ = kTableFormats[0];
  int64_t embedding_panel_rows_ = 0, embedding_vocab_ = 0;  // set_embedding's
  float final_eps_ = 0.f;
  py::capsule head_owner_;  // keeps head_ alive
  const ProjectionHandle* head_ = nullptr;
  torch::Tensor x_, cos_, sin_, h_, qkv_, attn_, gate_up_, act_;  // [rows, ...] workspace
  kvserve::AlignedVector<float> scratch_;  // one part's rows of a projection made of parts (project_parts)
  Views views_;
  std::mutex mutex_;
};

}  // namespace

void bind_decode_layers(py::module& m) {
  py::class_<DecodeLayers>(m, "DecodeLayers",
                           "Every decoder layer of an all-decode float32 step in one call (decode_layers.cpp)")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t>(), py::arg("heads"), py::arg("kv_heads"),
           py::arg("head_dim"), py::arg("hidden"), py::arg("intermediate"))
      .def("add_layer", &DecodeLayers::add_layer, py::arg("in_norm"), py::arg("in_eps"), py::arg("post_norm"),
           py::arg("post_eps"), py::arg("qkv"), py::arg("o_proj"), py::arg("gate_up"), py::arg("down"),
           py::arg("scale"), py::arg("window"), py::arg("qkv_bias") = py::none(), py::arg("q_norm") = py::none(),
           py::arg("k_norm") = py::none(), py::arg("qk_eps") = 0.0,
           "in_norm [hidden], in_eps, post_norm [hidden], post_eps, qkv, o_proj, gate_up, down (projection handles; "
           "qkv and gate_up: one, or a list of their parts' handles side by side), scale, window (<= 0: none); "
           "optional qkv_bias [(H + 2 H_kv) D], q_norm and k_norm [D] with qk_eps (over each head, before RoPE)")
      .def("num_layers", &DecodeLayers::num_layers)
      .def("reserve", &DecodeLayers::reserve_rows, py::arg("rows"),
           "make the workspace for steps of up to rows rows now (the largest step's; larger steps still grow it)")
      .def("workspace_rows", &DecodeLayers::workspace_rows, "rows of the workspace now (0 before any step)")
      .def("set_embedding", &DecodeLayers::set_embedding, py::arg("table"), py::arg("kind"),
           py::arg("panel_rows") = 0, py::arg("vocab") = 0,
           "table (float32 [vocab, hidden], or GGUF units uint8 [vocab, bytes]), kind (f32, q4_0, q4_1, q5_0, q5_1, "
           "q8_0, q4_k, q5_k, q6_k), panel_rows (> 0: the units in the kernels' panels of that many rows, ggml_pack's) "
           "and vocab (the rows then): decode's token embedding")
      .def("set_rope", &DecodeLayers::set_rope, "cos, sin [positions, D]: decode's RoPE tables")
      .def("set_head", &DecodeLayers::set_head, py::arg("norm"), py::arg("eps"), py::arg("head").none(true),
           "final norm [hidden], eps, the LM head's projection handle or None: decode's last part")
      .def("forward", &DecodeLayers::forward, py::call_guard<py::gil_scoped_release>(),
           "x [T, hidden] (updated in place), cos/sin [T, D], slots [T], rows [T], tables [T, nb], lens [T], "
           "kv [2, layers, blocks, block_size, H_kv, D]")
      .def("decode", &DecodeLayers::decode, py::call_guard<py::gil_scoped_release>(), py::arg("ids"),
           py::arg("positions"), py::arg("slots"), py::arg("rows"), py::arg("tables"), py::arg("lens"), py::arg("kv"),
           py::arg("keep"), py::arg("x") = py::none(), py::arg("cos") = py::none(), py::arg("sin") = py::none(),
           "ids [T], positions [T], slots [T], rows [T], tables [T, nb], lens [T], kv, keep [K], optional x [T, "
           "hidden], cos/sin [T, D] -> logits [K, vocab] (normed rows [K, hidden] without a head)");
}
