// Shared pieces of the linear kernels (linear_*.cpp): includes, tiling helpers, the AVX2 horizontal sums, the
// input check. The instruction set is chosen once, in cpu.h. Layouts and arithmetic: linear_module.cpp.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include "aligned_vector.h"
#include "check.h"
#include "cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <limits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define QL_X86 1
#endif

namespace kvserve::linear {

constexpr int64_t kRowsPerTask = 8;  // output rows per parallel task: small enough to split N=192 over cores

#ifdef QL_X86
// ---------------------------------------------------------------- AVX2 + FMA
// The sum of v's 8 lanes in hsum4's order, ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)), so a row's bits do
// not depend on whether it was summed alone (the tail of a thread's rows) or in a group of 4.
__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(v, v), v);  // lane 0: v0 + v1 + v2 + v3 (as pairs), lane 4: v4..v7
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}

// The four sums of a0..a3 in one vector (hadd tree).
__attribute__((target("avx2,fma"))) inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));  // [sum a0, .., sum a3]
}
#endif

// Every (activation tile, weight tile) of rows [n0, n1): weight tiles of NT rows (then single rows), each
// paired with activation tiles of MTMAX, .., 1 rows; a weight tile stays in L1 while the activations stream.
template <int MTMAX, int NT, typename Fn>
void for_tiles(int64_t M, int64_t n0, int64_t n1, Fn&& fn) {
  auto rows = [&](int64_t n, auto nt) {
    int64_t m = 0;
    if constexpr (MTMAX >= 3)
      for (; m + 3 <= M; m += 3) fn(m, n, std::integral_constant<int, 3>{}, nt);
    if constexpr (MTMAX >= 2)
      for (; m + 2 <= M; m += 2) fn(m, n, std::integral_constant<int, 2>{}, nt);
    for (; m < M; ++m) fn(m, n, std::integral_constant<int, 1>{}, nt);
  };
  int64_t n = n0;
  for (; n + NT <= n1; n += NT) rows(n, std::integral_constant<int, NT>{});
  for (; n < n1; ++n) rows(n, std::integral_constant<int, 1>{});
}

// How far ahead of the weight bytes being read the int8 tiles and int4 panels prefetch. A task's weight rows
// (panels) are contiguous (at::parallel_for hands each thread one run of them), so an address a few KB on is one
// this thread reads soon. Chosen by interleaved A/Bs of a decode step's projections (SmolLM2's 30 layers, 2
// threads): 256 bytes (less than one row) was the slowest distance tried at 1 activation row; the int8 tile
// gained at 2 KB at 32 rows as well; the int4 panels were level or slightly faster at 4 KB than at 1 KB.
constexpr int64_t kInt8Ahead = 2048;
constexpr int64_t kInt8PanelAhead = 1024;
constexpr int64_t kInt4Ahead = 4096;

// Weight rows a tile (activation rows from m, weight rows from n, in a task ending at n1) prefetches: the NT rows
// of the tile after next, during a weight tile's first activation tile, when there are several (f32_tile_avx2).
inline int64_t rows_ahead(int64_t m, int64_t M, int64_t n, int64_t n1, int64_t NT) {
  return m == 0 && M > 1 ? std::max<int64_t>(std::min(n1 - (n + 2 * NT), NT), 0) : 0;
}

inline void check_x(const torch::Tensor& x, int64_t K) {
  KV_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.is_cpu(),
           "x must be a contiguous float32 CPU tensor [M, K]");
  KV_CHECK(x.size(1) == K, "x has ", x.size(1), " features, the weight ", K);
}

// run(std::integral_constant<int, QB>{}) for an activation block QB of 64 or 32 (a template argument of the tiles).
template <typename Fn>
inline void with_block(int64_t block, Fn&& run) {
  if (block == 64)
    run(std::integral_constant<int, 64>{});
  else
    run(std::integral_constant<int, 32>{});
}

// The kernel families (one source file each), as the module binds them.
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales,
                          int64_t block, bool panels);
torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales,
                          int64_t group, int64_t offset);
torch::Tensor lut4_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales,
                          int64_t group, const torch::Tensor& lut);
torch::Tensor f32_linear(const torch::Tensor& x, const torch::Tensor& w);
// GGUF blocks (linear_ggml.cpp; kind "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k" or "q6_k"): raw
// [N, K / weights-per-unit * bytes] <-> packed panels.
torch::Tensor ggml_pack(const torch::Tensor& raw, const std::string& kind);
torch::Tensor ggml_unpack(const torch::Tensor& packed, const std::string& kind, int64_t N, int64_t K);
torch::Tensor ggml_rows(const torch::Tensor& packed, const std::string& kind, const torch::Tensor& ids, int64_t N,
                        int64_t K);
torch::Tensor ggml_linear(const torch::Tensor& x, const torch::Tensor& packed, const std::string& kind, int64_t N,
                          int64_t K);
std::function<torch::Tensor(const torch::Tensor&)> bind_ggml(const torch::Tensor& packed, const std::string& kind,
                                                             int64_t N, int64_t K);
// ggml_linear bound to its weights as a ProjectionHandle (projection_handle.h) in a capsule, for the decode ops.
py::capsule ggml_handle(const torch::Tensor& packed, const std::string& kind, int64_t N, int64_t K);
// Sets the bytes ahead that a GGUF call of one or two rows prefetches towards L1 (kv_ggml_args.ahead; 0: none) for every
// call from now on, and returns the previous value (at start cpu.h's gguf_prefetch_default). Raises c10::Error
// outside 0..1 MiB.
int64_t set_gguf_prefetch(int64_t bytes);
// The bytes a GGUF call of one or two rows prefetches ahead now (set_gguf_prefetch's last value or cpu.h's default).
int64_t gguf_prefetch();
// Sets whether the GGUF calls of many rows take Q5_K's and Q6_K's groups unpacked once for every tile of rows
// (kv_ggml_args.unpack; the AVX-512 path) from now on, and returns the previous value (at start cpu.h's
// gguf_unpack_default). The bits are the same either way.
bool set_gguf_unpack(bool unpack);
// Whether they do now.
bool gguf_unpack();
// Sets whether the GGUF calls of many rows (Q4_K and Q5_K from 8, Q6_K from 16, the others from 32: decode batches,
// prefill chunks) take AMX-INT8 tiles where the CPU runs them (cpu.h's amx(); the kinds linear_ggml.cpp's table names) from now on, and returns
// whether they did. The bits are the same either way.
bool set_gguf_amx(bool on);
// Whether they do now: the CPU runs AMX tiles (cpu::amx()) and set_gguf_amx has not turned them off.
bool gguf_amx();
// The fewest rows of a GGUF call that takes the AMX tiles: Q4_K's and Q5_K's (linear_ggml.cpp's kKquantAmxRows).
int64_t gguf_amx_rows();
// bfloat16 weights (linear_bf16.cpp): w [N, K] <-> packed panels of 32 features.
torch::Tensor bf16_pack(const torch::Tensor& w);
torch::Tensor bf16_unpack(const torch::Tensor& packed, int64_t N, int64_t K);
torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t N, int64_t K);
std::function<torch::Tensor(const torch::Tensor&)> bind_bf16(const torch::Tensor& packed, int64_t N, int64_t K);

}  // namespace kvserve::linear
