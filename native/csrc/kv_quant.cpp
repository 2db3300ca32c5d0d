// The int8 / int4 KV cache's ops (--kv-cache-dtype int8 | int4; kvcache/pool.py has the rule and the layout):
//
//   write_kv_quant(k_codes, k_scales, v_codes, v_scales, slots, k, v, bits)
//       the step's K/V quantized into the pool at the slot mapping, each head vector once (pool.quantize's bits)
//   paged_decode_attention_quant(q, rows, tables, lens, k_codes, k_scales, v_codes, v_scales, bits, scale,
//                                window, out)
//       paged decode attention (decode_ops.cpp's paged_decode_attention) straight on the codes: each code row is
//       widened to floats and scaled in registers, then fused multiply-adds, never a float copy of the cache.
//
// The attention is one body (kv_quant_body.h) compiled for three lane types in kv_attend.h: AVX-512 (16 floats),
// AVX2 + FMA (8) and the baseline (8 floats in an array, std::fma); native/csrc/cpu.h chooses. All three perform
// the same float operations in the same order (the body says which), so they give the same bits, and the same
// bits as the float32 cache's AVX2 kernel over the dequantized cache; tests/test_isa.py and
// tests/test_decode_ops.py check both on the paths this CPU runs. kv_attend.h is torch-free, so kv_leaves.cpp
// compiles the same three paths as freestanding leaves (native/kv_leaves.py: no libc, no relocations, checked),
// and tests/test_kv_quant_emulated.py runs them under the CPU emulator (a Sapphire Rapids core, so the AVX-512
// path runs on any x86-64 machine) and natively, each vector path against the scalar one bit for bit, and the
// native leaves against this file's op. A prompt's consecutive rows (rows_alone prefill) are attended in tiles on
// the vector paths: each chunk of code rows dequantized once for the tile (kv_attend.h's QuantPool) and read by the
// float32 cache's tiles (attend_tile.h), the same bits as each row alone. At long contexts the per-row kernels
// (decode rows) are bound by the bytes they read: an int8 row is 64 B per head where a float32 row is 256 B, and
// its loads are prefetched kRowsAhead rows ahead (blocks are scattered, which the hardware prefetcher does not
// follow).
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include "decode_common.h"
#include "kv_attend.h"

#include <vector>

namespace {

using kvserve::decode::check_f32;
namespace kvq = kvserve::kv_quant;

// One head vector x [D] -> codes (int8 [D], or int4 [D / 2] packed) and D / G float16 scales, kvcache/pool.py's
// rule: scale = fp16(max|x_group| / qmax), code = clamp(round_half_even(x / scale), -qmax, qmax), 0 where the
// scale is 0. Exact float operations only, so the codes are torch's (pool.quantize) on every path.
void quantize_head(const float* x, int bits, int64_t D, int64_t G, uint8_t* codes, c10::Half* scales) {
  const float qmax = bits == 8 ? 127.f : 7.f;
  for (int64_t start = 0, k = 0; start < D; start += G, ++k) {
    float amax = 0.f;
    for (int64_t i = start; i < start + G; ++i) amax = std::max(amax, std::fabs(x[i]));
    scales[k] = c10::Half(amax / qmax);
    const float s = static_cast<float>(scales[k]);
    for (int64_t i = 0; i < G; ++i) {
      const float code = s > 0.f ? std::min(qmax, std::max(-qmax, std::nearbyint(x[start + i] / s))) : 0.f;
      if (bits == 8) {
        codes[start + i] = static_cast<uint8_t>(static_cast<int8_t>(code));
      } else if (i < G / 2) {
        codes[start / 2 + i] = static_cast<uint8_t>(code + 8.f);  // the low nibble of byte i
      } else {
        codes[start / 2 + i - G / 2] |= static_cast<uint8_t>(static_cast<int>(code + 8.f) << 4);
      }
    }
  }
}

}  // namespace

// The shapes of one layer's quantized K or V (codes [..., H_kv, D * bits / 8] int8 or uint8, scales
// [..., H_kv, S] float16, the same leading sizes) for head_dim D: returns G = D / S, the elements per scale.
static int64_t check_quant_cache(const torch::Tensor& codes, const torch::Tensor& scales, int64_t bits, int64_t D,
                                 const char* name) {
  KV_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4, got ", bits);
  KV_CHECK(codes.scalar_type() == (bits == 8 ? torch::kInt8 : torch::kUInt8) && codes.is_cpu() &&
               codes.is_contiguous() && codes.size(-1) == D * bits / 8,
           name, " codes must be contiguous ", bits == 8 ? "int8" : "uint8", " [..., H_kv, D * bits / 8]");
  KV_CHECK(scales.scalar_type() == torch::kHalf && scales.is_contiguous() && scales.dim() == codes.dim() &&
               scales.size(-1) >= 1 && D % scales.size(-1) == 0,
           name, " scales must be contiguous float16 [..., H_kv, S] with S dividing D");
  for (int64_t i = 0; i + 1 < codes.dim(); ++i)
    KV_CHECK(scales.size(i) == codes.size(i), name, " scales and codes disagree in dimension ", i);
  const int64_t G = D / scales.size(-1);
  KV_CHECK(G % (bits == 8 ? 8 : 16) == 0, name, ": ", G, " elements per scale is not a multiple of ",
           bits == 8 ? 8 : 16);
  return G;
}

// k, v [T, H_kv, D] float32 (any row/head strides, D contiguous) quantized into codes/scales [slots, H_kv, ...]
// at slots [T] (check_quant_cache's shapes), pool.quantize's rule.
void write_kv_quant(torch::Tensor& k_codes, torch::Tensor& k_scales, torch::Tensor& v_codes, torch::Tensor& v_scales,
                    const torch::Tensor& slots, const torch::Tensor& k, const torch::Tensor& v, int64_t bits) {
  check_f32(k, "k");
  check_f32(v, "v");
  KV_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
           "k and v must be [T, H_kv, D] with D contiguous");
  const int64_t T = k.size(0), H = k.size(1), D = k.size(2);
  const int64_t G = check_quant_cache(k_codes, k_scales, bits, D, "k");
  KV_CHECK(check_quant_cache(v_codes, v_scales, bits, D, "v") == G && v_codes.sizes() == k_codes.sizes(),
           "k and v caches must have the same shapes");
  KV_CHECK(k_codes.dim() == 3 && k_codes.size(1) == H, "caches must be [slots, H_kv, row] with k's H_kv");
  KV_CHECK(slots.scalar_type() == torch::kLong && slots.is_contiguous() && slots.numel() == T,
           "slots must be int64 [T]");
  const int64_t num_slots = k_codes.size(0), row = D * bits / 8, S = D / G;
  const int64_t* sp = slots.data_ptr<int64_t>();
  struct Side {
    const torch::Tensor& x;
    torch::Tensor& codes;
    torch::Tensor& scales;
  };
  for (const Side& side : {Side{k, k_codes, k_scales}, Side{v, v_codes, v_scales}}) {
    auto* codes = static_cast<uint8_t*>(side.codes.data_ptr());
    auto* scales = side.scales.data_ptr<c10::Half>();
    const float* x = side.x.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) {
      KV_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot ", sp[t], " out of range");
      for (int64_t h = 0; h < H; ++h) {
        uint8_t* c = codes + (sp[t] * H + h) * row;
        if (bits == 4) std::fill_n(c, row, uint8_t{0});  // the high nibbles are or-ed in
        quantize_head(x + t * side.x.stride(0) + h * side.x.stride(1), static_cast<int>(bits), D, G, c,
                      scales + (sp[t] * H + h) * S);
      }
    }
  }
}

// The path paged_decode_attention_quant runs for `bits` and G elements per scale: the one cpu.h chose, except
// that the AVX2 path runs where the AVX-512 one does not take G (kv_attend.h's avx512_takes; the same bits).
static kvserve::cpu::Isa attention_path(int64_t bits, int64_t G) {
  using kvserve::cpu::Isa;
  const Isa isa = kvserve::cpu::chosen();
  if (isa == Isa::kAvx512 && !kvq::avx512_takes(static_cast<int>(bits), G)) return Isa::kAvx2;
  return isa;
}

std::string kv_quant_path(int64_t bits, int64_t group) {
  KV_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4, got ", bits);
  return kvserve::cpu::name(attention_path(bits, group));
}

// paged_decode_attention over a quantized pool: k_codes/v_codes [num_blocks, block_size, H_kv, D * bits / 8],
// k_scales/v_scales [num_blocks, block_size, H_kv, S] float16; the rest as there (D: q's head size); runs
// attention_path's path.
void paged_decode_attention_quant(const torch::Tensor& q, const torch::Tensor& rows, const torch::Tensor& tables,
                                  const torch::Tensor& lens, const torch::Tensor& k_codes,
                                  const torch::Tensor& k_scales, const torch::Tensor& v_codes,
                                  const torch::Tensor& v_scales, int64_t bits, double scale, int64_t window,
                                  torch::Tensor& out) {
  KV_CHECK(q.dim() == 3, "q must be [T, H, D] with D contiguous");
  const int64_t D = q.size(2);
  const int64_t G = check_quant_cache(k_codes, k_scales, bits, D, "k");
  KV_CHECK(check_quant_cache(v_codes, v_scales, bits, D, "v") == G && v_codes.sizes() == k_codes.sizes(),
           "k and v caches must have the same shapes");
  KV_CHECK(k_codes.dim() == 4, "codes must be [blocks, block_size, H_kv, row]");
  KV_CHECK(kvq::shape_fits(D, G), "head size ", D, " or its ", D / G,
           " scales per head vector is more than the kernel holds");
  // the kernels read float16 scales as their bits (kv_attend.h is torch-free: it converts them per path)
  const kvq::QuantAttend a{kvserve::decode::check_decode_call(q, rows, tables, lens, out, k_codes.size(0),
                                                              k_codes.size(1), k_codes.size(2), scale, window),
                           static_cast<const uint8_t*>(k_codes.data_ptr()),
                           reinterpret_cast<const uint16_t*>(k_scales.data_ptr<c10::Half>()),
                           static_cast<const uint8_t*>(v_codes.data_ptr()),
                           reinterpret_cast<const uint16_t*>(v_scales.data_ptr<c10::Half>()),
                           static_cast<int>(bits), G};
  const kvserve::cpu::Isa isa = attention_path(bits, G);
#ifdef KV_X86
  // A prompt's rows (rows_alone prefill) in tiles of consecutive rows, as paged_decode_attention's: each chunk of
  // code rows dequantized once for the tile (kv_attend.h's QuantPool) and read by the float32 cache's tile, the
  // same bits as each row alone; decode rows, one a tile, run the per-row kernels below.
  if (isa != kvserve::cpu::Isa::kScalar && D % 8 == 0 && D <= kvq::QuantPool::kMaxD) {
    using namespace kvserve::decode;
    const bool avx512 = kvserve::cpu::chosen() == kvserve::cpu::Isa::kAvx512;  // attend_tile: D % 16 == 0 too
    const std::vector<int64_t> tiles =
        prompt_tiles(a.call, avx512 && D % 16 == 0 ? tile_rows_avx512(a.call) : kTileRows);
    if (static_cast<int64_t>(tiles.size()) - 1 < a.call.B) {
      run_tiles(a.call, tiles, [&](int64_t task, kvserve::AlignedVector<float>& scores,
                                   std::vector<TileQuery>& queries) {
        const int64_t tile = task / a.call.H_kv, g = task % a.call.H_kv, b0 = tiles[tile], b1 = tiles[tile + 1];
        if (b1 - b0 == 1) {
          scores.resize(a.call.group * (a.call.lens[b0] - a.call.first_of(b0)));
          if (isa == kvserve::cpu::Isa::kAvx512) kvq::avx512::attend_head(a, b0, g, scores.data());
          else kvq::avx2::attend_head(a, b0, g, scores.data());
          return;
        }
        tile_queries(a.call, b0, b1, g, scores, queries);
        const kvq::QuantPool pool(a, a.call.table_of(b1 - 1), g);
        attend_tile(avx512, queries.data(), static_cast<int64_t>(queries.size()), pool, D, a.call.scale);
      });
      return;
    }
  }
#endif
  // one task per (sequence, KV head), as paged_decode_attention
  at::parallel_for(0, a.call.B * a.call.H_kv, 1, [&](int64_t begin, int64_t end) {
    kvserve::AlignedVector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / a.call.H_kv, g = task % a.call.H_kv;
      scores.resize(a.call.group * (a.call.lens[b] - a.call.first_of(b)));
#ifdef KV_X86
      if (isa == kvserve::cpu::Isa::kAvx512) {
        kvq::avx512::attend_head(a, b, g, scores.data());
        continue;
      }
      if (isa == kvserve::cpu::Isa::kAvx2) {
        kvq::avx2::attend_head(a, b, g, scores.data());
        continue;
      }
#endif
      kvq::base::attend_head(a, b, g, scores.data());
    }
  });
}
