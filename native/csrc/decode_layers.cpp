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
//     RoPE on q and k; k and v written at the slots; attn = paged decode attention        [T, H, D]
//     x += attn @ W_o^T;  h = rms_norm(x, post_norm)
//     gate_up = h @ W_gate_up^T                               [T, 2I]
//     x += (silu(gate) * up) @ W_down^T;  h = rms_norm(x, next layer's in_norm)   (the last layer: x only)
//
// x [T, hidden] is the residual stream, updated in place. The projections are the linear kernels' own entry
// points, reached through ProjectionHandle (projection_handle.h) without Python or torch's dispatcher; the norms,
// RoPE, KV write and attention are decode_ops.cpp's loops (decode_rows.h); SwiGLU is torch's silu kernel, as
// silu_mul computes it (see swiglu). Intermediate rows live in a workspace kept across steps (grown to the largest
// batch).
// Under torch.profiler each part carries the label the per-layer loop's calls carry.
#include <ATen/record_function.h>

#include "decode_common.h"
#include "decode_rows.h"
#include "projection_handle.h"

#include <mutex>
#include <vector>

namespace {

using kvserve::ProjectionHandle;
using kvserve::decode::check_f32;

// The ProjectionHandle in a capsule made by the linear kernels (e.g. ggml_handle), checked for its shape.
const ProjectionHandle* handle_of(const py::capsule& capsule, int64_t N, int64_t K, const char* what) {
  KV_CHECK(capsule.name() != nullptr && std::string(capsule.name()) == ProjectionHandle::kCapsuleName, what,
           " must be a projection handle (a capsule from the linear kernels, e.g. ggml_handle)");
  const auto* handle = capsule.get_pointer<ProjectionHandle>();
  KV_CHECK(handle->N == N && handle->K == K, what, " computes [", handle->K, "] -> [", handle->N,
           "], the layer needs [", K, "] -> [", N, "]");
  return handle;
}

// y <- x @ W^T for T rows, under the projections' profiler label.
inline void project(const ProjectionHandle* p, const float* x, int64_t T, float* y) {
  RECORD_FUNCTION("kvserve::projection", c10::ArrayRef<const c10::IValue>{});
  p->run(p, x, T, y);
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

  // Appends the next layer: its RMSNorm weights [hidden] and eps, its four projections' handles (q/k/v fused, o,
  // gate/up fused side by side, down), its softmax scale and sliding window (tokens; <= 0: none).
  void add_layer(const torch::Tensor& in_norm, double in_eps, const torch::Tensor& post_norm, double post_eps,
                 const py::capsule& qkv, const py::capsule& o_proj, const py::capsule& gate_up,
                 const py::capsule& down, double scale, int64_t window) {
    for (const torch::Tensor* w : {&in_norm, &post_norm}) {
      check_f32(*w, "norm weight");
      KV_CHECK(w->is_contiguous() && w->numel() == hidden_, "norm weights must be contiguous [", hidden_, "]");
    }
    layers_.push_back({in_norm, post_norm, static_cast<float>(in_eps), static_cast<float>(post_eps),
                       {qkv, o_proj, gate_up, down}, handle_of(qkv, (H_ + 2 * H_kv_) * D_, hidden_, "qkv"),
                       handle_of(o_proj, hidden_, H_ * D_, "o_proj"), handle_of(gate_up, 2 * I_, hidden_, "gate_up"),
                       handle_of(down, hidden_, I_, "down"), scale, window});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // Runs every layer on x [T, hidden] (contiguous float32, updated in place). cos, sin [T, D]: the rows' RoPE
  // (contiguous); slots [T]: where each row's K/V goes; rows, tables, lens: the paged attention's decode rows
  // (every row, in order), block tables and context lengths (paged_decode_attention); kv [2, layers, blocks,
  // block_size, H_kv, D]: the pool's float32 K and V (KVPool.data).
  void forward(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& slots,
               const torch::Tensor& rows, const torch::Tensor& tables, const torch::Tensor& lens, torch::Tensor& kv) {
    RECORD_FUNCTION("kvserve::decode_layers", c10::ArrayRef<const c10::IValue>{});
    std::lock_guard<std::mutex> lock(mutex_);  // one step at a time: the workspace is shared
    c10::InferenceMode inference;  // the workspace's in-place ops need no autograd record, whoever calls
    const int64_t layers = num_layers(), T = x.size(0), width = (H_ + 2 * H_kv_) * D_;
    check_f32(x, "x");
    KV_CHECK(layers > 0 && x.dim() == 2 && x.is_contiguous() && x.size(1) == hidden_, "x must be contiguous [T, ",
             hidden_, "]");
    for (const torch::Tensor* t : {&cos, &sin}) {
      check_f32(*t, "cos and sin");
      KV_CHECK(t->is_contiguous() && t->dim() == 2 && t->size(0) == T && t->size(1) == D_,
               "cos and sin must be contiguous [T, D]");
    }
    check_f32(kv, "kv");
    KV_CHECK(kv.is_contiguous() && kv.dim() == 6 && kv.size(0) == 2 && kv.size(1) == layers && kv.size(4) == H_kv_ &&
                 kv.size(5) == D_,
             "kv must be the contiguous pool [2, ", layers, ", blocks, block_size, ", H_kv_, ", ", D_, "]");
    KV_CHECK(slots.scalar_type() == torch::kLong && slots.is_contiguous() && slots.numel() == T,
             "slots must be int64 [T]");
    const int64_t blocks = kv.size(2), block_size = kv.size(3), layer_floats = blocks * block_size * H_kv_ * D_;
    kvserve::decode::check_slots(slots, blocks * block_size);
    if (T == 0) return;
    reserve(T);
    // this step's views of the workspace (a few tensor ops per step, none per layer)
    auto qkv = qkv_.narrow(0, 0, T), attn = attn_.narrow(0, 0, T), gate_up = gate_up_.narrow(0, 0, T);
    auto act = act_.narrow(0, 0, T), gate = gate_up.narrow(1, 0, I_);
    kvserve::decode::DecodeCall call = kvserve::decode::check_decode_call(
        qkv.view({T, H_ + 2 * H_kv_, D_}).narrow(1, 0, H_), rows, tables, lens, attn, blocks, block_size, H_kv_, 1.0,
        0);
    KV_CHECK(call.B == T, "every row must be a decode row");
    float* xp = x.data_ptr<float>();
    float* hp = h_.data_ptr<float>();
    float* qkvp = qkv_.data_ptr<float>();
    float* outp = out_.data_ptr<float>();
    float* gate_upp = gate_up_.data_ptr<float>();
    const float* actp = act_.data_ptr<float>();
    const int64_t* sp = slots.data_ptr<int64_t>();
    float* kvp = kv.data_ptr<float>();
    rms_norm(xp, layers_[0].in_norm, layers_[0].in_eps, hp, T);
    for (int64_t l = 0; l < layers; ++l) {
      const Layer& layer = layers_[l];
      float* k_blocks = kvp + l * layer_floats;
      float* v_blocks = kvp + (layers + l) * layer_floats;
      project(layer.qkv, hp, T, qkvp);
      {
        RECORD_FUNCTION("kvserve::decode_attention", c10::ArrayRef<const c10::IValue>{});
        kvserve::decode::rope_rows(qkvp, T, H_ + H_kv_, D_, width, D_, cos.data_ptr<float>(), sin.data_ptr<float>());
        kvserve::decode::write_kv_rows(k_blocks, v_blocks, sp, qkvp + H_ * D_, qkvp + (H_ + H_kv_) * D_, T, H_kv_, D_,
                                       width, D_, width, D_);
        call.scale = static_cast<float>(layer.scale);
        call.window = layer.window;
        kvserve::decode::attend_decode(call, k_blocks, v_blocks);
      }
      project(layer.o_proj, call.out, T, outp);
      kvserve::decode::add_rows(xp, outp, T, hidden_);
      rms_norm(xp, layer.post_norm, layer.post_eps, hp, T);
      project(layer.gate_up, hp, T, gate_upp);
      swiglu(act, gate, gate_upp + I_, 2 * I_);
      project(layer.down, actp, T, outp);
      kvserve::decode::add_rows(xp, outp, T, hidden_);
      if (l + 1 < layers) rms_norm(xp, layers_[l + 1].in_norm, layers_[l + 1].in_eps, hp, T);
    }
  }

 private:
  struct Layer {
    torch::Tensor in_norm, post_norm;
    float in_eps, post_eps;
    py::capsule owners[4];  // keep the handles below alive
    const ProjectionHandle *qkv, *o_proj, *gate_up, *down;
    double scale;
    int64_t window;
  };

  static void rms_norm(const float* x, const torch::Tensor& w, float eps, float* y, int64_t T) {
    RECORD_FUNCTION("kvserve::rms_norm", c10::ArrayRef<const c10::IValue>{});
    kvserve::decode::rms_norm_rows(x, w.data_ptr<float>(), eps, y, T, w.numel());
  }

  // A workspace of at least T rows (intermediate results; kept across steps).
  void reserve(int64_t T) {
    if (h_.defined() && h_.size(0) >= T) return;
    const auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
    h_ = torch::empty({T, hidden_}, f32);
    qkv_ = torch::empty({T, (H_ + 2 * H_kv_) * D_}, f32);
    attn_ = torch::empty({T, H_, D_}, f32);
    out_ = torch::empty({T, hidden_}, f32);
    gate_up_ = torch::empty({T, 2 * I_}, f32);
    act_ = torch::empty({T, I_}, f32);
  }

  const int64_t H_, H_kv_, D_, hidden_, I_;
  std::vector<Layer> layers_;
  torch::Tensor h_, qkv_, attn_, out_, gate_up_, act_;  // [rows, ...] workspace
  std::mutex mutex_;
};

}  // namespace

void bind_decode_layers(py::module& m) {
  py::class_<DecodeLayers>(m, "DecodeLayers",
                           "Every decoder layer of an all-decode float32 step in one call (decode_layers.cpp)")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t>(), py::arg("heads"), py::arg("kv_heads"),
           py::arg("head_dim"), py::arg("hidden"), py::arg("intermediate"))
      .def("add_layer", &DecodeLayers::add_layer,
           "in_norm [hidden], in_eps, post_norm [hidden], post_eps, qkv, o_proj, gate_up, down (projection handles), "
           "scale, window (<= 0: none)")
      .def("num_layers", &DecodeLayers::num_layers)
      .def("forward", &DecodeLayers::forward, py::call_guard<py::gil_scoped_release>(),
           "x [T, hidden] (updated in place), cos/sin [T, D], slots [T], rows [T], tables [T, nb], lens [T], "
           "kv [2, layers, blocks, block_size, H_kv, D]");
}
