// What decode_ops.cpp (the float32 and bfloat16 caches' ops) and kv_quant.cpp (the int8 / int4 cache's ops) share:
// the argument checks of paged decode attention and the cutting of a call into tiles run on the threads, on top
// of decode_core.h (torch-free, so the emulator's leaves compile it too): the call's raw arguments and the AVX2
// softmax every attention kernel runs (exp8 and the lane sums whose order the quantized cache's kernels reproduce
// on every path), and attend_tile.h's TileQuery.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "aligned_vector.h"
#include "attend_tile.h"
#include "check.h"
#include "cpu.h"
#include "decode_core.h"

#include <algorithm>
#include <atomic>
#include <vector>

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

// Rows of one prompt attended together in a tile (rows_alone prefill); each reads the context once per tile. A
// long context's K and V rows come from L3 or memory once per tile, so larger tiles run faster (the scores
// buffer, rows x heads x context floats, grows with them); a 512-token chunk still gives 16 tiles per KV head.
constexpr int64_t kTileRows = 32;
// The AVX-512 tile also transposes each chunk of K rows once per tile for all its rows, so it takes twice the rows
// (the transposition and the K and V reads shared by twice as many query vectors) where that still leaves every
// thread 4 tasks of the call to balance; the AVX2 tile gains nothing from more (measured on an AVX2-only AMD
// EPYC: 64 rows as fast as 32).
constexpr int64_t kTileRowsTransposed = 64;

// How many rows a prompt tile of this call takes on the AVX-512 path: kTileRowsTransposed where its prompt rows
// still make 4 tasks a thread (rows / tile x KV heads), else kTileRows.
inline int64_t tile_rows_avx512(const DecodeCall& call) {
  const int64_t tasks = call.B / kTileRowsTransposed * call.H_kv;
  return tasks >= 4 * at::get_num_threads() ? kTileRowsTransposed : kTileRows;
}

// The call's rows cut into tiles: starts of consecutive runs of at most `most` rows that belong to one prompt
// (q rows one after the other, context lengths growing by one, the same blocks up to the shorter context; the
// window, if any, is the call's), and the end B last. A decode step's rows are tiles of one row each.
inline std::vector<int64_t> prompt_tiles(const DecodeCall& call, int64_t most) {
  std::vector<int64_t> starts{0};
  int64_t run = 1;
  for (int64_t b = 1; b < call.B; ++b) {
    bool same = run < most && call.rows[b] == call.rows[b - 1] + 1 && call.lens[b] == call.lens[b - 1] + 1;
    const int64_t* prev = call.table_of(b - 1);
    const int64_t* cur = call.table_of(b);
    for (int64_t i = 0; same && i < (call.lens[b - 1] + call.block_size - 1) / call.block_size; ++i)
      same = prev[i] == cur[i];
    if (same) {
      ++run;
    } else {
      starts.push_back(b);
      run = 1;
    }
  }
  starts.push_back(call.B);
  return starts;
}

// The query vectors of rows b0 .. b1-1 of a call for KV head g (each row's `group` query heads), each with its
// share of `scores` (resized to hold them all).
inline void tile_queries(const DecodeCall& call, int64_t b0, int64_t b1, int64_t g,
                         kvserve::AlignedVector<float>& scores, std::vector<TileQuery>& queries) {
  int64_t total = 0;
  for (int64_t b = b0; b < b1; ++b) total += call.group * (call.lens[b] - call.first_of(b));
  scores.resize(total);
  queries.clear();
  float* next = scores.data();
  for (int64_t b = b0; b < b1; ++b)
    for (int64_t j = 0; j < call.group; ++j) {
      const int64_t first = call.first_of(b);
      queries.push_back({call.q_of(b, g) + j * call.q_head, call.out_of(b, g) + j * call.D, first, call.lens[b], next});
      next += call.lens[b] - first;
    }
}

// The (tile, KV head) tasks of a call cut into tiles (prompt_tiles' starts), on the threads: attend_task(task,
// scores, queries) with a scores buffer and a query list per thread.
template <class Task>
void run_tiles(const DecodeCall& call, const std::vector<int64_t>& tiles, Task&& attend_task) {
  const int64_t H_kv = call.H_kv;
  const int64_t num_tiles = static_cast<int64_t>(tiles.size()) - 1, num_tasks = num_tiles * H_kv;
  if (num_tiles == call.B) {  // decode rows only: tasks of about one size, split evenly
    at::parallel_for(0, num_tasks, 1, [&](int64_t begin, int64_t end) {
      kvserve::AlignedVector<float> scores;
      std::vector<TileQuery> queries;
      for (int64_t task = begin; task < end; ++task) attend_task(task, scores, queries);
    });
    return;
  }
  // Prompt tiles differ in work (a tile's keys grow with its rows: the first tiles of a prompt's first chunk see a
  // few keys, its last ones the whole chunk), so an even split of the task range leaves one thread with most of
  // it. The tasks go largest first, each to whichever thread is free next (the order of tasks changes no bits:
  // every row is computed alone).
  std::vector<int64_t> work(num_tiles, 0), order(num_tasks);
  for (int64_t tile = 0; tile < num_tiles; ++tile)
    for (int64_t b = tiles[tile]; b < tiles[tile + 1]; ++b) work[tile] += call.lens[b] - call.first_of(b);
  for (int64_t task = 0; task < num_tasks; ++task) order[task] = task;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return work[a / H_kv] > work[b / H_kv]; });
  std::atomic<int64_t> next_task{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    kvserve::AlignedVector<float> scores;
    std::vector<TileQuery> queries;
    for (int64_t i = next_task++; i < num_tasks; i = next_task++) attend_task(order[i], scores, queries);
  });
}

#ifdef KV_X86
// max of x[0 .. 8k) (k as large as fits in n), whether any was NaN, *done = 8k.
__attribute__((target("avx2,fma"))) inline float max_avx2(const float* x, int64_t n, int64_t* done, bool* nan) {
  __m256 m8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), bad = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    m8 = _mm256_max_ps(m8, v);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  *done = i;
  *nan = _mm256_movemask_ps(bad) != 0;
  return hmax8(m8);
}
#endif

// The maximum of x[0 .. V) and whether any x[i] is NaN (max_avx2, then the tail of fewer than 8 in order); where
// no x[i] is NaN the maximum is the same on every path (a max is exact).
inline float row_max(const float* x, int64_t V, bool* nan) {
  float mx = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  *nan = false;
#ifdef KV_X86
  if (cpu::avx2()) mx = max_avx2(x, V, &i, nan);
#endif
  for (; i < V; ++i) {
    mx = std::max(mx, x[i]);
    *nan = *nan || std::isnan(x[i]);
  }
  return mx;
}

#ifdef KV_X86
#define KV_AVX2 __attribute__((target("avx2,fma")))
#else
#define KV_AVX2
#endif

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

// KV_TWO_PATHS(name, (params), (args)): name's always-inline body compiled twice, for AVX2+FMA (the compiler
// vectorizes it) and for the baseline; name() runs the one native/csrc/cpu.h chose.
#define KV_TWO_PATHS(name, params, args)                          \
  KV_AVX2 void name##_avx2 params { name##_body args; }           \
  void name##_base params { name##_body args; }                   \
  inline void name params {                                       \
    if (::kvserve::cpu::avx2()) name##_avx2 args; else name##_base args; \
  }

#define KV_BODY inline __attribute__((always_inline))
