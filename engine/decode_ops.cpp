// Small fused CPU ops for the lean Llama-family forward (engine/fastpath.py), float32 only.
//
// At batch 1 a SmolLM2 decode step spends as long in ~1,200 small torch ops (RMSNorm as six ops, RoPE as
// four, the paged-attention gathers, masks and SDPA) as in its projections; each op costs 5-40 us of dispatch
// on this CPU. These functions do the same arithmetic in one call each:
//
//   rms_norm(x, w, eps)                   y = x / sqrt(mean(x^2) + eps) * w      (Zhang & Sennrich 2019)
//   add_rms_norm_(x, r, w, eps)           x += r (in place), then y = rms_norm(x)
//   rope_(qk, cos, sin)                   RoPE in place, transformers' rotate_half layout (Su et al. 2021)
//   write_kv(k_cache, v_cache, slots, k, v)          the step's K/V into the pool at the slot mapping
//   paged_decode_attention(q, rows, tables, lens, k_blocks, v_blocks, scale, window, out)
//       one query token per sequence against its cached context, read block by block through its block
//       table (no gathered copy, no mask tensor), with GQA; softmax in float32.
//
// target_clones compiles each hot loop for AVX2+FMA and for plain x86-64 and picks one at load time.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "../quant/kvcheck.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#define KV_CLONES __attribute__((target_clones("avx2,fma", "default")))
#else
#define KV_CLONES
#endif

namespace {

void check_f32(const torch::Tensor& t, const char* name) {
  KV_CHECK(t.scalar_type() == torch::kFloat32 && t.is_cpu(), name, " must be a float32 CPU tensor");
}

KV_CLONES void rms_row(const float* x, const float* w, float eps, float* y, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] * inv) * w[i];
}

KV_CLONES void add_row(float* x, const float* r, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += r[i];
}

KV_CLONES void rope_row(float* v, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = v[i], b = v[i + half];
    v[i] = a * cos[i] - b * sin[i];
    v[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

// dot and axpy are inlined into the attention task (a call per key row through target_clones' dispatch cost
// more than the 64-wide product itself).
inline __attribute__((always_inline)) float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline __attribute__((always_inline)) void axpy(float alpha, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// The `group` query heads (rows q, q + q_head_stride, ...) that share KV head g, against keys first..len-1 of
// one sequence read through its block table; out: `group` rows of D (contiguous).
KV_CLONES void attend_kv_head(const float* q, int64_t q_head_stride, const int64_t* table, int64_t first,
                              int64_t len, const float* kp, const float* vp, int64_t bs, int64_t H_kv, int64_t g,
                              int64_t D, int64_t group, float scale, float* scores, float* out) {
  const int64_t span = len - first;
  for (int64_t j = 0; j < group; ++j) {
    const float* qh = q + j * q_head_stride;
    float* sj = scores + j * span;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t t = first; t < len; ++t) {
      const int64_t slot = table[t / bs] * bs + t % bs;
      sj[t - first] = dot(qh, kp + (slot * H_kv + g) * D, D) * scale;
      mx = std::max(mx, sj[t - first]);
    }
    float sum = 0.f;
    for (int64_t i = 0; i < span; ++i) {
      sj[i] = std::exp(sj[i] - mx);
      sum += sj[i];
    }
    float* oh = out + j * D;
    std::fill_n(oh, D, 0.f);
    const float inv = 1.f / sum;
    for (int64_t t = first; t < len; ++t) {
      const int64_t slot = table[t / bs] * bs + t % bs;
      axpy(sj[t - first] * inv, vp + (slot * H_kv + g) * D, oh, D);
    }
  }
}

}  // namespace

// y [T, H] = rms_norm(x [T, H]) * w [H].
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check_f32(x, "x");
  check_f32(w, "w");
  KV_CHECK(x.dim() == 2 && x.is_contiguous() && w.is_contiguous() && w.numel() == x.size(1),
           "x must be contiguous [T, H] and w [H]");
  auto y = torch::empty_like(x);
  const int64_t n = x.size(1);
  for (int64_t t = 0; t < x.size(0); ++t)
    rms_row(x.data_ptr<float>() + t * n, w.data_ptr<float>(), static_cast<float>(eps), y.data_ptr<float>() + t * n, n);
  return y;
}

// x += r in place (the residual stream), then return rms_norm(x) * w.
torch::Tensor add_rms_norm_(torch::Tensor& x, const torch::Tensor& r, const torch::Tensor& w, double eps) {
  check_f32(x, "x");
  check_f32(r, "r");
  KV_CHECK(x.dim() == 2 && x.is_contiguous() && r.is_contiguous() && r.sizes() == x.sizes(),
           "x and r must be contiguous [T, H]");
  const int64_t n = x.size(1);
  for (int64_t t = 0; t < x.size(0); ++t) add_row(x.data_ptr<float>() + t * n, r.data_ptr<float>() + t * n, n);
  return rms_norm(x, w, eps);
}

// RoPE in place on qk [T, heads, D] (any row/head strides, D contiguous) with cos, sin [T, D] as transformers'
// rotary embedding returns them: out[:h] = a cos - b sin, out[h:] = b cos + a sin for a = x[:h], b = x[h:].
void rope_(torch::Tensor& qk, const torch::Tensor& cos, const torch::Tensor& sin) {
  check_f32(qk, "qk");
  KV_CHECK(qk.dim() == 3 && qk.stride(2) == 1 && qk.size(2) % 2 == 0, "qk must be [T, heads, D], D contiguous");
  KV_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.dim() == 2 &&
               cos.size(0) == qk.size(0) && cos.size(1) == qk.size(2),
           "cos and sin must be contiguous [T, D]");
  const int64_t T = qk.size(0), heads = qk.size(1), D = qk.size(2);
  float* base = qk.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < heads; ++h)
      rope_row(base + t * qk.stride(0) + h * qk.stride(1), cos.data_ptr<float>() + t * D,
               sin.data_ptr<float>() + t * D, D / 2);
}

// k_cache, v_cache [slots, H_kv, D] (contiguous) <- k, v [T, H_kv, D] (any row/head strides) at slots [T].
void write_kv(torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slots, const torch::Tensor& k,
              const torch::Tensor& v) {
  check_f32(k_cache, "k_cache");
  check_f32(v_cache, "v_cache");
  check_f32(k, "k");
  check_f32(v, "v");
  KV_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
           "caches must be contiguous [slots, H_kv, D]");
  KV_CHECK(slots.scalar_type() == torch::kLong && slots.is_contiguous() && slots.numel() == k.size(0),
           "slots must be int64 [T]");
  KV_CHECK(k.sizes() == v.sizes() && k.size(1) == k_cache.size(1) && k.size(2) == k_cache.size(2) &&
               k.stride(2) == 1 && v.stride(2) == 1,
           "k and v must be [T, H_kv, D] with D contiguous");
  const int64_t T = k.size(0), H = k.size(1), D = k.size(2), num_slots = k_cache.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    KV_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot ", sp[t], " out of range");
    for (int64_t h = 0; h < H; ++h) {
      std::copy_n(k.data_ptr<float>() + t * k.stride(0) + h * k.stride(1), D,
                  k_cache.data_ptr<float>() + (sp[t] * H + h) * D);
      std::copy_n(v.data_ptr<float>() + t * v.stride(0) + h * v.stride(1), D,
                  v_cache.data_ptr<float>() + (sp[t] * H + h) * D);
    }
  }
}

// Decode attention over the paged pool. q [T, H, D] (any row/head strides); rows [B]: the decode rows of q;
// tables [B, max_blocks] int64 block tables; lens [B] context lengths (the query is the last position);
// k_blocks, v_blocks [num_blocks, block_size, H_kv, D] contiguous; window: sliding window (tokens) or <= 0;
// out [T, H, D] contiguous: rows[b] is written. Query head h reads KV head h / (H / H_kv) (GQA).
void paged_decode_attention(const torch::Tensor& q, const torch::Tensor& rows, const torch::Tensor& tables,
                            const torch::Tensor& lens, const torch::Tensor& k_blocks, const torch::Tensor& v_blocks,
                            double scale, int64_t window, torch::Tensor& out) {
  check_f32(q, "q");
  check_f32(k_blocks, "k_blocks");
  check_f32(v_blocks, "v_blocks");
  check_f32(out, "out");
  KV_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [T, H, D] with D contiguous");
  KV_CHECK(k_blocks.dim() == 4 && k_blocks.is_contiguous() && v_blocks.is_contiguous() &&
               k_blocks.sizes() == v_blocks.sizes() && k_blocks.size(3) == q.size(2),
           "k_blocks and v_blocks must be contiguous [blocks, block_size, H_kv, D]");
  KV_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out must be contiguous like q");
  KV_CHECK(rows.scalar_type() == torch::kLong && tables.scalar_type() == torch::kLong &&
               lens.scalar_type() == torch::kLong && rows.is_contiguous() && tables.is_contiguous() &&
               lens.is_contiguous() && tables.dim() == 2 && tables.size(0) == rows.numel() &&
               lens.numel() == rows.numel(),
           "rows [B], tables [B, max_blocks], lens [B] must be contiguous int64");
  const int64_t B = rows.numel(), H = q.size(1), D = q.size(2);
  const int64_t num_blocks = k_blocks.size(0), bs = k_blocks.size(1), H_kv = k_blocks.size(2);
  KV_CHECK(H % H_kv == 0, "query heads ", H, " not a multiple of KV heads ", H_kv);
  const int64_t group = H / H_kv, width = tables.size(1);
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    KV_CHECK(lp[b] >= 1 && lp[b] <= width * bs, "context length ", lp[b], " does not fit its block table");
    KV_CHECK(rp[b] >= 0 && rp[b] < q.size(0), "row ", rp[b], " out of range");
    for (int64_t i = 0; i < (lp[b] + bs - 1) / bs; ++i)
      KV_CHECK(tp[b * width + i] >= 0 && tp[b * width + i] < num_blocks, "block id out of range");
  }
  const float* kp = k_blocks.data_ptr<float>();
  const float* vp = v_blocks.data_ptr<float>();
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  // one task per (sequence, KV head): its `group` query heads share each K and V row read
  at::parallel_for(0, B * H_kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / H_kv, g = task % H_kv, len = lp[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      scores.resize(group * (len - first));
      attend_kv_head(qp + rp[b] * q.stride(0) + g * group * q.stride(1), q.stride(1), tp + b * width, first, len,
                     kp, vp, bs, H_kv, g, D, group, sc, scores.data(), op + (rp[b] * H + g * group) * D);
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "x [T,H] f32, w [H], eps -> rms_norm(x) * w");
  m.def("add_rms_norm_", &add_rms_norm_, "x += r in place; returns rms_norm(x) * w");
  m.def("rope_", &rope_, "RoPE in place on qk [T, heads, D] with cos, sin [T, D]");
  m.def("write_kv", &write_kv, "k_cache/v_cache [slots, H_kv, D] <- k/v [T, H_kv, D] at slots [T]");
  m.def("paged_decode_attention", &paged_decode_attention,
        "q [T,H,D], rows [B], tables [B,nb], lens [B], k_blocks/v_blocks [nb,bs,H_kv,D], scale, window, out [T,H,D]");
}
