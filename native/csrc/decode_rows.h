// decode_ops.cpp's loops on raw float32 rows, without tensors: the ops bound there check their tensors and call
// these; decode_layers.cpp's layer stack calls them on its own workspace (checked once per step). Each computes
// exactly what its op computes (the same code: the same bits).
#pragma once

#include <torch/extension.h>

#include "decode_core.h"

namespace kvserve::decode {

// y[t] = rms_norm(x[t]) * w for T rows of n floats (rms_norm's op).
void rms_norm_rows(const float* x, const float* w, float eps, float* y, int64_t T, int64_t n);

// x[t] += r[t] for T rows of n floats (add_rms_norm_'s add).
void add_rows(float* x, const float* r, int64_t T, int64_t n);

// RoPE in place on T rows of `heads` heads of D floats at the given strides (floats), cos and sin [T, D] (rope_).
void rope_rows(float* qk, int64_t T, int64_t heads, int64_t D, int64_t row_stride, int64_t head_stride,
               const float* cos, const float* sin);

// Every slot of int64 `slots` in [0, num_slots), else an error naming the first that is not.
void check_slots(const torch::Tensor& slots, int64_t num_slots);

// k_cache, v_cache [slots, H, D] <- rows t of k and v (T rows of H heads of D floats at the given strides) at
// slots[t], each slot already checked (write_kv).
void write_kv_rows(float* k_cache, float* v_cache, const int64_t* slots, const float* k, const float* v, int64_t T,
                   int64_t H, int64_t D, int64_t k_row, int64_t k_head, int64_t v_row, int64_t v_head);

// write_kv_rows for a bfloat16 cache (bfloat16 bits), each value rounded to nearest even (torch's rounding).
void write_kv_rows_bf16(uint16_t* k_cache, uint16_t* v_cache, const int64_t* slots, const float* k, const float* v,
                        int64_t T, int64_t H, int64_t D, int64_t k_row, int64_t k_head, int64_t v_row, int64_t v_head);

// Paged decode attention of a checked call (check_decode_call) over float32 K and V blocks [blocks, block_size,
// H_kv, D] (paged_decode_attention).
void attend_decode(const DecodeCall& call, const float* k_blocks, const float* v_blocks);

// The same over bfloat16 K and V blocks (bits), attend_bf16.h's arithmetic; D even, at most 512.
void attend_decode_bf16(const DecodeCall& call, const uint16_t* k_blocks, const uint16_t* v_blocks);

}  // namespace kvserve::decode
