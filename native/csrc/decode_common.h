// What decode_ops.cpp (the float32 cache's ops) and kv_quant.cpp (the int8 / int4 cache's ops) share: the
// argument checks of paged decode attention, on top of decode_core.h (torch-free, so the emulator's leaves compile
// it too): the call's raw arguments and the AVX2 softmax both attention kernels run (exp8 and the lane sums whose
// order the quantized cache's kernels reproduce on every path).
#pragma once

#include <torch/extension.h>

#include "aligned_vector.h"
#include "check.h"
#include "cpu.h"
#include "decode_core.h"

namespace kvserve::decode {

inline void check_f32(const torch::Tensor& t, const char* name) {
  KV_CHECK(t.scalar_type() == torch::kFloat32 && t.is_cpu(), name, " must be a float32 CPU tensor");
}

// q [T, H, D] float32 (D contiguous), out contiguous like q; rows [B], tables [B, max_blocks], lens [B]
// contiguous int64, each row inside q, each context inside its table, each block inside a pool of num_blocks
// blocks of block_size slots with H_kv heads dividing H.
inline DecodeCall check_decode_call(const torch::Tensor& q, const torch::Tensor& rows, const torch::Tensor& tables,
                                    const torch::Tensor& lens, torch::Tensor& out, int64_t num_blocks,
                                    int64_t block_size, int64_t H_kv, double scale, int64_t window) {
  check_f32(q, "q");
  check_f32(out, "out");
  KV_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [T, H, D] with D contiguous");
  KV_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out must be contiguous like q");
  KV_CHECK(rows.scalar_type() == torch::kLong && tables.scalar_type() == torch::kLong &&
               lens.scalar_type() == torch::kLong && rows.is_contiguous() && tables.is_contiguous() &&
               lens.is_contiguous() && tables.dim() == 2 && tables.size(0) == rows.numel() &&
               lens.numel() == rows.numel(),
           "rows [B], tables [B, max_blocks], lens [B] must be contiguous int64");
  const int64_t H = q.size(1);
  KV_CHECK(H_kv >= 1 && H % H_kv == 0, "query heads ", H, " not a multiple of KV heads ", H_kv);
  const DecodeCall call{q.data_ptr<float>(), q.stride(0), q.stride(1), out.data_ptr<float>(),
                        rows.data_ptr<int64_t>(), tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                        rows.numel(), H, q.size(2), H_kv, H / H_kv, tables.size(1), block_size,
                        static_cast<float>(scale), window};
  for (int64_t b = 0; b < call.B; ++b) {
    KV_CHECK(call.lens[b] >= 1 && call.lens[b] <= call.width * block_size, "context length ", call.lens[b],
             " does not fit its block table");
    KV_CHECK(call.rows[b] >= 0 && call.rows[b] < q.size(0), "row ", call.rows[b], " out of range");
    for (int64_t i = 0; i < (call.lens[b] + block_size - 1) / block_size; ++i)
      KV_CHECK(call.table_of(b)[i] >= 0 && call.table_of(b)[i] < num_blocks, "block id out of range");
  }
  return call;
}

}  // namespace kvserve::decode

// The int8 / int4 cache's ops (kv_quant.cpp), bound with the others in decode_ops.cpp.
void write_kv_quant(torch::Tensor& k_codes, torch::Tensor& k_scales, torch::Tensor& v_codes, torch::Tensor& v_scales,
                    const torch::Tensor& slots, const torch::Tensor& k, const torch::Tensor& v, int64_t bits);
void paged_decode_attention_quant(const torch::Tensor& q, const torch::Tensor& rows, const torch::Tensor& tables,
                                  const torch::Tensor& lens, const torch::Tensor& k_codes,
                                  const torch::Tensor& k_scales, const torch::Tensor& v_codes,
                                  const torch::Tensor& v_scales, int64_t bits, double scale, int64_t window,
                                  torch::Tensor& out);
// The ISA path paged_decode_attention_quant runs for `bits` and `group` elements per scale: avx512, avx2, scalar.
std::string kv_quant_path(int64_t bits, int64_t group);
