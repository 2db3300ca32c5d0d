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
//       table (no gathered copy, no mask tensor), with GQA; softmax in float32 (AVX2: vectorized exp).
//       The rows of one prompt (a prefill whose every token attends as a decode row) are attended in tiles of
//       up to kTileRows rows that read each K and V row once for the tile, each row with its own bits alone
//       (attend_tile.h: the AVX2 and AVX-512 tile kernels, one order of operations).
//   decode_attention_(qkv, ...)            RoPE, the KV write and paged decode attention for one layer
//   write_kv_quant, paged_decode_attention_quant    the int8 / int4 cache's (kv_quant.cpp; bound here)
//   A bfloat16 cache (KVPool.data bfloat16 under float32 activations) takes the same ops: write_kv rounds the
//   rows to bfloat16 (torch's rounding), paged_decode_attention and decode_attention_ run attend_bf16.h's tiles
//   (bfloat16 dot products, vdpbf16ps' arithmetic on every path); bf16_attention_path names the path.
//   silu_mul(gate, up)                     silu(gate) * up (SwiGLU), with torch's own kernels
//   greedy_pick(logits)                    per row: argmax and its log-softmax value, in three passes
//   log_softmax(logits)                    the same log-softmax for every token (sampled and top tokens)
//   token_logprobs(logits, tokens)         one token's value of it per row
//   sample_row(...), sample_rows(...)      sampled tokens (sample_row.cpp)
//   DecodeLayers                           every layer of an all-decode step in one call (decode_layers.cpp),
//                                          with these loops on raw rows (decode_rows.h)
//
// Each hot loop is compiled for AVX2+FMA and for plain x86-64; native/csrc/cpu.h chooses which runs.
#include <ATen/Parallel.h>

#include "attend_bf16.h"
#include "attend_tile.h"
#include "decode_common.h"
#include "decode_rows.h"

#include <atomic>
#include <vector>

namespace {

using kvserve::decode::check_f32;
using kvserve::decode::TileQuery;
#ifdef KV_X86
using kvserve::decode::exp8;
using kvserve::decode::hmax8;
using kvserve::decode::hsum8;
using kvserve::decode::softmax_avx2;
#endif

KV_BODY void rms_row_body(const float* x, const float* w, float eps, float* y, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] * inv) * w[i];
}
KV_TWO_PATHS(rms_row, (const float* x, const float* w, float eps, float* y, int64_t n), (x, w, eps, y, n))

KV_BODY void add_row_body(float* x, const float* r, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += r[i];
}
KV_TWO_PATHS(add_row, (float* x, const float* r, int64_t n), (x, r, n))

KV_BODY void rope_row_body(float* v, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = v[i], b = v[i + half];
    v[i] = a * cos[i] - b * sin[i];
    v[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}
KV_TWO_PATHS(rope_row, (float* v, const float* cos, const float* sin, int64_t half), (v, cos, sin, half))

// dot and axpy are inlined into the attention task (a call per key row through a dispatch cost
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
KV_BODY void attend_loops_body(const float* q, int64_t q_head_stride, const int64_t* table, int64_t first,
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
KV_TWO_PATHS(attend_loops,
             (const float* q, int64_t q_head_stride, const int64_t* table, int64_t first, int64_t len,
              const float* kp, const float* vp, int64_t bs, int64_t H_kv, int64_t g, int64_t D, int64_t group,
              float scale, float* scores, float* out),
             (q, q_head_stride, table, first, len, kp, vp, bs, H_kv, g, D, group, scale, scores, out))

#ifdef KV_X86

// sum of exp(x_i - mx) over x[0 .. 8k) (k as large as fits in n); *done = 8k.
__attribute__((target("avx2,fma"))) float sum_exp_avx2(const float* x, int64_t n, float mx, int64_t* done) {
  const __m256 m = _mm256_set1_ps(mx);
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_add_ps(s0, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), m)));
    s1 = _mm256_add_ps(s1, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), m)));
  }
  if (i + 8 <= n) {
    s0 = _mm256_add_ps(s0, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), m)));
    i += 8;
  }
  *done = i;
  return hsum8(_mm256_add_ps(s0, s1));
}


#endif

}  // namespace

namespace kvserve::decode {

void rms_norm_rows(const float* x, const float* w, float eps, float* y, int64_t T, int64_t n) {
  for (int64_t t = 0; t < T; ++t) rms_row(x + t * n, w, eps, y + t * n, n);
}

void add_rows(float* x, const float* r, int64_t T, int64_t n) {
  for (int64_t t = 0; t < T; ++t) add_row(x + t * n, r + t * n, n);
}

void rope_rows(float* qk, int64_t T, int64_t heads, int64_t D, int64_t row_stride, int64_t head_stride,
               const float* cos, const float* sin) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < heads; ++h)
      rope_row(qk + t * row_stride + h * head_stride, cos + t * D, sin + t * D, D / 2);
}

}  // namespace kvserve::decode

using kvserve::decode::add_rows;
using kvserve::decode::attend_decode;
using kvserve::decode::rms_norm_rows;
using kvserve::decode::rope_rows;

// y [T, H] = rms_norm(x [T, H]) * w [H].
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check_f32(x, "x");
  check_f32(w, "w");
  KV_CHECK(x.dim() == 2 && x.is_contiguous() && w.is_contiguous() && w.numel() == x.size(1),
           "x must be contiguous [T, H] and w [H]");
  auto y = torch::empty_like(x);
  rms_norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), static_cast<float>(eps), y.data_ptr<float>(), x.size(0),
                x.size(1));
  return y;
}

// x += r in place (the residual stream), then return rms_norm(x) * w.
torch::Tensor add_rms_norm_(torch::Tensor& x, const torch::Tensor& r, const torch::Tensor& w, double eps) {
  check_f32(x, "x");
  check_f32(r, "r");
  KV_CHECK(x.dim() == 2 && x.is_contiguous() && r.is_contiguous() && r.sizes() == x.sizes(),
           "x and r must be contiguous [T, H]");
  add_rows(x.data_ptr<float>(), r.data_ptr<float>(), x.size(0), x.size(1));
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
  rope_rows(qk.data_ptr<float>(), qk.size(0), qk.size(1), qk.size(2), qk.stride(0), qk.stride(1),
            cos.data_ptr<float>(), sin.data_ptr<float>());
}

// k_cache, v_cache [slots, H_kv, D] (contiguous) <- k, v [T, H_kv, D] (any row/head strides) at slots [T].
// A bfloat16 cache takes the rows rounded to bfloat16 as torch's .to(torch.bfloat16) rounds (to nearest even).
void write_kv(torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slots, const torch::Tensor& k,
              const torch::Tensor& v) {
  const bool bf16 = k_cache.scalar_type() == torch::kBFloat16;
  KV_CHECK((bf16 || k_cache.scalar_type() == torch::kFloat32) && v_cache.scalar_type() == k_cache.scalar_type() &&
               k_cache.is_cpu() && v_cache.is_cpu(),
           "k_cache and v_cache must be float32 or bfloat16 CPU tensors");
  check_f32(k, "k");
  check_f32(v, "v");
  KV_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
           "caches must be contiguous [slots, H_kv, D]");
  KV_CHECK(slots.scalar_type() == torch::kLong && slots.is_contiguous() && slots.numel() == k.size(0),
           "slots must be int64 [T]");
  KV_CHECK(k.sizes() == v.sizes() && k.size(1) == k_cache.size(1) && k.size(2) == k_cache.size(2) &&
               k.stride(2) == 1 && v.stride(2) == 1,
           "k and v must be [T, H_kv, D] with D contiguous");
  kvserve::decode::check_slots(slots, k_cache.size(0));
  if (bf16) {
    kvserve::decode::write_kv_rows_bf16(
        reinterpret_cast<uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
        reinterpret_cast<uint16_t*>(v_cache.data_ptr<at::BFloat16>()), slots.data_ptr<int64_t>(),
        k.data_ptr<float>(), v.data_ptr<float>(), k.size(0), k.size(1), k.size(2), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1));
    return;
  }
  kvserve::decode::write_kv_rows(k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), slots.data_ptr<int64_t>(),
                                 k.data_ptr<float>(), v.data_ptr<float>(), k.size(0), k.size(1), k.size(2),
                                 k.stride(0), k.stride(1), v.stride(0), v.stride(1));
}

void kvserve::decode::write_kv_rows_bf16(uint16_t* k_cache, uint16_t* v_cache, const int64_t* slots, const float* k,
                                         const float* v, int64_t T, int64_t H, int64_t D, int64_t k_row,
                                         int64_t k_head, int64_t v_row, int64_t v_head) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d) {
        k_cache[(slots[t] * H + h) * D + d] = c10::BFloat16(k[t * k_row + h * k_head + d]).x;
        v_cache[(slots[t] * H + h) * D + d] = c10::BFloat16(v[t * v_row + h * v_head + d]).x;
      }
}

void kvserve::decode::check_slots(const torch::Tensor& slots, int64_t num_slots) {
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.numel(); ++t)
    KV_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot ", sp[t], " out of range");
}

void kvserve::decode::write_kv_rows(float* k_cache, float* v_cache, const int64_t* slots, const float* k,
                                    const float* v, int64_t T, int64_t H, int64_t D, int64_t k_row, int64_t k_head,
                                    int64_t v_row, int64_t v_head) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      std::copy_n(k + t * k_row + h * k_head, D, k_cache + (slots[t] * H + h) * D);
      std::copy_n(v + t * v_row + h * v_head, D, v_cache + (slots[t] * H + h) * D);
    }
}


// Decode attention over the paged pool. q [T, H, D] (any row/head strides); rows [B]: the decode rows of q;
// tables [B, max_blocks] int64 block tables; lens [B] context lengths (the query is the last position);
// k_blocks, v_blocks [num_blocks, block_size, H_kv, D] contiguous; window: sliding window (tokens) or <= 0;
// out [T, H, D] contiguous: rows[b] is written. Query head h reads KV head h / (H / H_kv) (GQA).
void paged_decode_attention(const torch::Tensor& q, const torch::Tensor& rows, const torch::Tensor& tables,
                            const torch::Tensor& lens, const torch::Tensor& k_blocks, const torch::Tensor& v_blocks,
                            double scale, int64_t window, torch::Tensor& out) {
  const bool bf16 = k_blocks.scalar_type() == torch::kBFloat16;
  KV_CHECK((bf16 || k_blocks.scalar_type() == torch::kFloat32) && v_blocks.scalar_type() == k_blocks.scalar_type() &&
               k_blocks.is_cpu() && v_blocks.is_cpu(),
           "k_blocks and v_blocks must be float32 or bfloat16 CPU tensors");
  KV_CHECK(k_blocks.dim() == 4 && k_blocks.is_contiguous() && v_blocks.is_contiguous() &&
               k_blocks.sizes() == v_blocks.sizes() && q.dim() == 3 && k_blocks.size(3) == q.size(2),
           "k_blocks and v_blocks must be contiguous [blocks, block_size, H_kv, D]");
  const kvserve::decode::DecodeCall call = kvserve::decode::check_decode_call(
      q, rows, tables, lens, out, k_blocks.size(0), k_blocks.size(1), k_blocks.size(2), scale, window);
  if (bf16) {
    KV_CHECK(call.D % 2 == 0 && call.D <= 512, "a bfloat16 cache's head size must be even and at most 512");
    attend_decode_bf16(call, reinterpret_cast<const uint16_t*>(k_blocks.data_ptr<at::BFloat16>()),
                       reinterpret_cast<const uint16_t*>(v_blocks.data_ptr<at::BFloat16>()));
    return;
  }
  attend_decode(call, k_blocks.data_ptr<float>(), v_blocks.data_ptr<float>());
}

// The path the bfloat16 cache's attention runs for head size D (attend_bf16.h's path): avx512, avx2 or scalar.
std::string bf16_attention_path(int64_t D) { return kvserve::cpu::name(kvserve::bf16_attend::path(D)); }

void kvserve::decode::attend_decode(const DecodeCall& call, const float* kp, const float* vp) {
  const int64_t D = call.D, H_kv = call.H_kv, group = call.group, bs = call.block_size;
#ifdef KV_X86
  const bool avx2 = kvserve::cpu::avx2() && D % 8 == 0;
  const bool avx512 = kvserve::cpu::chosen() == kvserve::cpu::Isa::kAvx512;  // attend_tile: D % 16 == 0 too
#endif
  // One task per (tile, KV head). A tile is one decode row, or up to kTileRows (AVX-512: tile_rows_avx512)
  // consecutive rows of one prompt (rows_alone prefill: consecutive q rows, context lengths growing by one, the
  // same blocks): its R x `group` query heads share each K and V row read. The portable path runs one row a task.
#ifdef KV_X86
  const std::vector<int64_t> tiles =
      prompt_tiles(call, avx512 && D % 16 == 0 ? tile_rows_avx512(call) : avx2 ? kTileRows : 1);
#else
  const std::vector<int64_t> tiles = prompt_tiles(call, 1);
#endif
  auto attend_task = [&](int64_t task, kvserve::AlignedVector<float>& scores, std::vector<TileQuery>& queries) {
    const int64_t tile = task / H_kv, g = task % H_kv, b0 = tiles[tile], b1 = tiles[tile + 1];
#ifdef KV_X86
    if (avx2) {
      tile_queries(call, b0, b1, g, scores, queries);
      kvserve::decode::attend_tile(avx512, queries.data(), static_cast<int64_t>(queries.size()),
                                   call.table_of(b1 - 1), kp, vp, bs, H_kv, g, D, call.scale);
      return;
    }
#endif
    const int64_t b = b0, len = call.lens[b], first = call.first_of(b);
    scores.resize(group * (len - first));
    attend_loops(call.q_of(b, g), call.q_head, call.table_of(b), first, len, kp, vp, bs, H_kv, g, D, group,
                 call.scale, scores.data(), call.out_of(b, g));
  };
  run_tiles(call, tiles, attend_task);
}


// attend_decode over a bfloat16 pool (attend_bf16.h): the same tiles and threads, every path tiled (the tile's
// order of operations is the one order; its scalar path included).
void kvserve::decode::attend_decode_bf16(const DecodeCall& call, const uint16_t* kp, const uint16_t* vp) {
  const int64_t D = call.D;
  const kvserve::cpu::Isa isa = kvserve::bf16_attend::path(D);
  const std::vector<int64_t> tiles = prompt_tiles(call, kTileRows);
  run_tiles(call, tiles, [&](int64_t task, kvserve::AlignedVector<float>& scores, std::vector<TileQuery>& queries) {
    const int64_t tile = task / call.H_kv, g = task % call.H_kv, b0 = tiles[tile], b1 = tiles[tile + 1];
    tile_queries(call, b0, b1, g, scores, queries);
    const kvserve::bf16_attend::Tile view{call.table_of(b1 - 1), kp, vp, call.block_size, call.H_kv, g, D, call.scale};
    kvserve::bf16_attend::attend_tile(isa, queries.data(), static_cast<int64_t>(queries.size()), view);
  });
}

// One layer's attention for an all-decode step in one call, the calls above in the same order: RoPE on q and k
// in place, k and v written into the pool at `slots`, paged decode attention. qkv [T, (H + 2 H_kv) * D] is the
// fused q/k/v projection's output (contiguous); k_blocks, v_blocks [blocks, block_size, H_kv, D]. Returns
// out [T, H, D]. At batch 1 this replaces ~10 Python-level tensor calls per layer (slices, views, three ops;
// ~2-4 us each on this CPU) with C++ views.
torch::Tensor decode_attention_(torch::Tensor& qkv, int64_t heads, int64_t kv_heads, const torch::Tensor& cos,
                                const torch::Tensor& sin, const torch::Tensor& slots, torch::Tensor& k_blocks,
                                torch::Tensor& v_blocks, const torch::Tensor& rows, const torch::Tensor& tables,
                                const torch::Tensor& lens, double scale, int64_t window) {
  check_f32(qkv, "qkv");
  KV_CHECK(k_blocks.dim() == 4 && k_blocks.is_contiguous() && v_blocks.is_contiguous() &&
               k_blocks.size(2) == kv_heads,
           "k_blocks and v_blocks must be contiguous [blocks, block_size, H_kv, D]");
  const int64_t T = qkv.size(0), D = k_blocks.size(3);
  KV_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.size(1) == (heads + 2 * kv_heads) * D,
           "qkv must be contiguous [T, (H + 2 H_kv) * D]");
  auto x = qkv.view({T, heads + 2 * kv_heads, D});
  auto qk = x.narrow(1, 0, heads + kv_heads);
  rope_(qk, cos, sin);
  auto k_cache = k_blocks.view({-1, kv_heads, D});
  auto v_cache = v_blocks.view({-1, kv_heads, D});
  write_kv(k_cache, v_cache, slots, x.narrow(1, heads, kv_heads), x.narrow(1, heads + kv_heads, kv_heads));
  auto out = torch::empty({T, heads, D}, qkv.options());
  paged_decode_attention(x.narrow(1, 0, heads), rows, tables, lens, k_blocks, v_blocks, scale, window, out);
  return out;
}

// One row's log-softmax normalizer: m = max_j x_j and log(sum_j exp(x_j - m)), so that log_softmax(x)_j =
// (x_j - m) - log_sum (log_softmax's formula); nan: some x_j is NaN (then every logprob is NaN, as in torch).
// greedy_pick and log_softmax below both use it, so a token's logprob has the same bits from either.
struct Normalizer {
  float mx;
  float log_sum;
  bool nan;
};

static Normalizer row_normalizer(const float* x, int64_t V) {
  bool nan = false;
  const float mx = kvserve::decode::row_max(x, V, &nan);
  if (nan) return {mx, std::numeric_limits<float>::quiet_NaN(), true};
  float sum = 0.f;
  int64_t i = 0;
#ifdef KV_X86
  if (kvserve::cpu::avx2()) {
    sum = sum_exp_avx2(x, V, mx, &i);
    for (; i < V; ++i) sum += std::exp(x[i] - mx);  // the tail of fewer than 8
    return {mx, std::log(sum), false};
  }
#endif
  // The portable path sums in double: one float accumulator over a 49,152-token vocabulary drifts ~2e-5 from
  // torch's log_softmax, where the vector path's 8 lanes stay within 1e-6.
  double total = 0.0;
  for (; i < V; ++i) total += std::exp(x[i] - mx);
  return {mx, std::log(static_cast<float>(total)), false};
}

// Per row of logits [R, V]: the greedy token, the first index of the row's maximum (torch.argmax's pick; a NaN
// counts as the maximum, as there), and its logprob (x_t - m) - log_sum. Vectorized passes for the maximum
// and the sum, a scan for its first index; torch's CPU argmax is not vectorized.
static void greedy_row(const float* x, int64_t V, int64_t* token, float* logprob) {
  const Normalizer n = row_normalizer(x, V);
  if (n.nan) {
    *token = std::find_if(x, x + V, [](float v) { return std::isnan(v); }) - x;
    *logprob = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  *token = std::find(x, x + V, n.mx) - x;
  *logprob = (x[*token] - n.mx) - n.log_sum;
}

// logits [R, V] float32 (contiguous) -> log_softmax over V, with greedy_pick's normalizer (same bits for a
// token from either; within ~1e-5 of torch's log_softmax, whose exponentials and sum order differ).
torch::Tensor log_softmax(const torch::Tensor& logits) {
  check_f32(logits, "logits");
  KV_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0, "logits must be contiguous [R, V]");
  const int64_t R = logits.size(0), V = logits.size(1);
  auto out = torch::empty_like(logits);
  const float* x = logits.data_ptr<float>();
  float* y = out.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const Normalizer n = row_normalizer(x + r * V, V);
      for (int64_t j = 0; j < V; ++j)
        y[r * V + j] = n.nan ? std::numeric_limits<float>::quiet_NaN() : (x[r * V + j] - n.mx) - n.log_sum;
    }
  });
  return out;
}

// logits [R, V] float32 (contiguous), tokens int64 [R] -> each row's log_softmax value at its token, float32 [R]:
// log_softmax's bits for that token, without writing the other V - 1 (sampled rows that asked for no alternatives).
torch::Tensor token_logprobs(const torch::Tensor& logits, const torch::Tensor& tokens) {
  check_f32(logits, "logits");
  KV_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0, "logits must be contiguous [R, V]");
  const int64_t R = logits.size(0), V = logits.size(1);
  KV_CHECK(tokens.scalar_type() == torch::kLong && tokens.is_contiguous() && tokens.numel() == R,
           "tokens must be int64 [R]");
  const int64_t* tp = tokens.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) KV_CHECK(tp[r] >= 0 && tp[r] < V, "token out of range");
  auto out = torch::empty({R}, logits.options());
  const float* x = logits.data_ptr<float>();
  float* lp = out.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const Normalizer n = row_normalizer(x + r * V, V);
      lp[r] = n.nan ? std::numeric_limits<float>::quiet_NaN() : (x[r * V + tp[r]] - n.mx) - n.log_sum;
    }
  });
  return out;
}

// logits [R, V] float32 (contiguous) -> (tokens int64 [R], logprobs float32 [R]); see greedy_row.
std::tuple<torch::Tensor, torch::Tensor> greedy_pick(const torch::Tensor& logits) {
  check_f32(logits, "logits");
  KV_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0, "logits must be contiguous [R, V]");
  const int64_t R = logits.size(0), V = logits.size(1);
  auto tokens = torch::empty({R}, logits.options().dtype(torch::kInt64));
  auto logprobs = torch::empty({R}, logits.options());
  const float* x = logits.data_ptr<float>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  float* lp = logprobs.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) greedy_row(x + r * V, V, tp + r, lp + r);
  });
  return {tokens, logprobs};
}

// SwiGLU's gate (Shazeer 2020): silu(gate) * up, gate and up [T, I] (any row stride, e.g. the two halves of a
// fused gate/up projection's output). torch's own silu and mul kernels, so the bits are torch's; one call from
// Python where silu, mul and the activation module's call were three.
torch::Tensor silu_mul(const torch::Tensor& gate, const torch::Tensor& up) {
  check_f32(gate, "gate");
  check_f32(up, "up");
  KV_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes(), "gate and up must both be [T, I]");
  auto y = at::silu(gate);
  y.mul_(up);
  return y;
}

// Without the GIL, as torch's own ops (see quant/qlinear.cpp).
using NoGil = py::call_guard<py::gil_scoped_release>;

// DecodeLayers, the whole layer stack of an all-decode step in one call (decode_layers.cpp).
void bind_decode_layers(py::module& m);
// sample_row, a sampled token without a sort or torch.multinomial (sample_row.cpp).
void bind_sample_row(py::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, NoGil(), "x [T,H] f32, w [H], eps -> rms_norm(x) * w");
  m.def("add_rms_norm_", &add_rms_norm_, NoGil(), "x += r in place; returns rms_norm(x) * w");
  m.def("rope_", &rope_, NoGil(), "RoPE in place on qk [T, heads, D] with cos, sin [T, D]");
  m.def("write_kv", &write_kv, NoGil(), "k_cache/v_cache [slots, H_kv, D] <- k/v [T, H_kv, D] at slots [T]");
  m.def("paged_decode_attention", &paged_decode_attention, NoGil(),
        "q [T,H,D], rows [B], tables [B,nb], lens [B], k_blocks/v_blocks [nb,bs,H_kv,D], scale, window, out [T,H,D]");
  m.def("decode_attention_", &decode_attention_, NoGil(),
        "qkv [T,(H+2H_kv)D], H, H_kv, cos/sin [T,D], slots [T], k_blocks/v_blocks, rows, tables, lens, scale, window "
        "-> out [T,H,D] (RoPE in place, K/V written, paged decode attention)");
  m.def("write_kv_quant", &write_kv_quant, NoGil(),
        "k_codes, k_scales, v_codes, v_scales [slots, H_kv, ...] <- k/v [T, H_kv, D] f32 quantized at slots [T]; bits");
  m.def("paged_decode_attention_quant", &paged_decode_attention_quant, NoGil(),
        "q [T,H,D], rows [B], tables [B,nb], lens [B], k_codes, k_scales, v_codes, v_scales [nb,bs,H_kv,...], bits, "
        "scale, window, out [T,H,D]");
  m.def("bf16_attention_path", &bf16_attention_path, "head_dim -> the ISA path a bfloat16 cache's attention runs");
  m.def("kv_quant_path", &kv_quant_path, "bits, group -> the ISA path paged_decode_attention_quant runs");
  m.def("silu_mul", &silu_mul, NoGil(), "gate, up [T,I] f32 -> silu(gate) * up [T,I]");
  m.def("greedy_pick", &greedy_pick, NoGil(),
        "logits [R,V] f32 -> (argmax tokens int64 [R], their log-softmax f32 [R])");
  m.def("log_softmax", &log_softmax, NoGil(), "logits [R,V] f32 -> log_softmax [R,V] (greedy_pick's normalizer)");
  m.def("token_logprobs", &token_logprobs, NoGil(),
        "logits [R,V] f32, tokens int64 [R] -> log_softmax(logits)[r, tokens[r]] f32 [R]");
  bind_decode_layers(m);
  bind_sample_row(m);
}
