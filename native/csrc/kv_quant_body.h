// The quantized cache's attention for one (sequence, KV head): one body, included by kv_attend.h once per ISA
// path inside a namespace that first defines the path's lanes (no include guard: that is the point):
//
//   kW                      floats per Vec (8 or 16)
//   Vec zero(), load(p), bcast(x), mul(a, b), fma(a, b, c) = a * b + c rounded once, store(p, v)
//   Vec codes_of<Bits>(row, chunk)  kW codes of one head vector as floats (exact small integers)
//   float reduce16(parts)         the 16 lanes' sum of parts[0 .. 16 / kW) in hsum8's order of (lanes 0-7 +
//                                 lanes 8-15): ((0+4) + (2+6)) + ((1+5) + (3+7))
//   float half_to_float(h)        float16 bits (uint16_t) -> float, exactly
//   void softmax(s, span) (softmax_avx2's operations), void prefetch(p)
//
// The order of every float operation is the float32 cache's AVX2 kernel's (attend_tile_avx2) run on the
// dequantized cache: a key value is code * scale (exact: a 4- or 8-bit code times a float16 scale fits a
// float's 24 bits); a score is 16 lane-sums of fused multiply-adds over d = l, l + 16, l + 32, ... reduced as
// hsum8 does, times the softmax scale; an output element is fma(weight_t, value_t, acc) over t in order from 0.
// So every path gives the same bits, and the same bits as paged_decode_attention over dequantize(codes).
// Nothing in the order depends on the batch, the thread or another sequence.
//
// Torch-free and leaf-safe (no libc or libm call, no allocation: scores come from the caller), so the extension
// (kv_quant.cpp) and the freestanding leaves (kv_leaves.cpp, built by native/kv_leaves.py) compile this same
// body; tests/test_kv_quant_emulated.py runs every path's leaf under the CPU emulator and natively, the vector
// paths against the scalar one bit for bit, and the native leaves against the extension's op.

// One (sequence, KV head) task of a quantized pool: codes [slots, H_kv, row_bytes], scales [slots, H_kv, S].
struct HeadTask {
  const int64_t* table;
  int64_t first, len, block_size, H_kv, g;
  int64_t row_bytes, S, nchunks;
  const Chunk* map;  // [nchunks], chunk_map's
};

// Positions t, t + 1, ... of a task as (slot * H_kv + g) indices, without a division per step.
struct Rows {
  const HeadTask& task;
  int64_t block, offset;

  Rows(const HeadTask& task, int64_t t) : task(task), block(t / task.block_size), offset(t % task.block_size) {}
  int64_t at() const { return (task.table[block] * task.block_size + offset) * task.H_kv + task.g; }
  void next() {
    if (++offset == task.block_size) {
      offset = 0;
      ++block;
    }
  }
};

constexpr int kMaxScales = 64;   // scales per head vector (kv_quant.cpp checks D / G against it)
constexpr int64_t kRowsAhead = 8;  // code rows prefetched this many positions ahead (a row is one or two lines)

inline void chunk_map(int bits, int64_t D, int64_t G, Chunk* map) {
  for (int64_t d = 0, c = 0; d < D; d += kW, ++c) {
    const int64_t group = d / G, within = d % G, half = G / 2;
    if (bits == 8)
      map[c] = {static_cast<int32_t>(d), 0, static_cast<int32_t>(group)};
    else
      map[c] = {static_cast<int32_t>(group * half + within % half), within >= half ? 1 : 0,
                static_cast<int32_t>(group)};
  }
}

// Row `at`'s scales as floats, s [S], and its codes; the row of `ahead` (kRowsAhead positions on, or nullptr)
// brought towards the cache.
inline const uint8_t* open_row(const HeadTask& task, const uint8_t* codes, const uint16_t* scales, int64_t at,
                               const Rows* ahead, float* s) {
  if (ahead != nullptr) {
    const uint8_t* next = codes + ahead->at() * task.row_bytes;
    for (int64_t i = 0; i < task.row_bytes; i += 64) prefetch(next + i);
  }
  for (int64_t i = 0; i < task.S; ++i) s[i] = half_to_float(scales[at * task.S + i]);
  return codes + at * task.row_bytes;
}

// fn(t, codes of row t, its scales s) for t = first .. len - 1 in order.
template <class Fn>
inline void for_rows(const HeadTask& task, const uint8_t* codes, const uint16_t* scales, Fn&& fn) {
  float s[kMaxScales];
  Rows row(task, task.first), ahead(task, std::min(task.first + kRowsAhead, task.len - 1));
  for (int64_t t = task.first; t < task.len; ++t, row.next()) {
    const bool prefetching = t + kRowsAhead < task.len;
    fn(t, open_row(task, codes, scales, row.at(), prefetching ? &ahead : nullptr, s), s);
    if (prefetching) ahead.next();
  }
}

// scores[h * span + t - first] = (q_h . k_t) * scale for NH query heads q + h * q_head against every key.
template <int Bits, int NH>
inline void key_scores(const HeadTask& task, const uint8_t* codes, const uint16_t* scales, const float* q,
                       int64_t q_head, float scale, float* scores, int64_t span) {
  constexpr int kParts = 16 / kW;  // Vecs per 16 lanes
  for_rows(task, codes, scales, [&](int64_t t, const uint8_t* row, const float* s) {
    Vec acc[NH][kParts];
    for (int h = 0; h < NH; ++h)
      for (int p = 0; p < kParts; ++p) acc[h][p] = zero();
    for (int64_t c = 0; c < task.nchunks; c += kParts) {
      for (int p = 0; p < kParts; ++p) {
        if (c + p == task.nchunks) break;  // D % 16 == 8: the last 8 lanes add into the first part
        const Chunk& chunk = task.map[c + p];
        const Vec k = mul(codes_of<Bits>(row, chunk), bcast(s[chunk.group]));
        for (int h = 0; h < NH; ++h) acc[h][p] = fma(load(q + h * q_head + (c + p) * kW), k, acc[h][p]);
      }
    }
    for (int h = 0; h < NH; ++h) scores[h * span + (t - task.first)] = reduce16(acc[h]) * scale;
  });
}

// out[h * D + d] = sum over t of w[h * span + t - first] * v_t[d], fused multiply-adds from 0 in t's order, for
// NH heads, in tiles of kTile Vecs per head held in registers.
template <int Bits, int NH>
inline void weighted_values(const HeadTask& task, const uint8_t* codes, const uint16_t* scales, const float* w,
                            int64_t span, float* out, int64_t D) {
  constexpr int kTile = 4;
  for (int64_t c0 = 0; c0 < task.nchunks; c0 += kTile) {
    const int64_t nc = std::min<int64_t>(kTile, task.nchunks - c0);
    Vec acc[NH][kTile];
    for (int h = 0; h < NH; ++h)
      for (int c = 0; c < kTile; ++c) acc[h][c] = zero();
    for_rows(task, codes, scales, [&](int64_t t, const uint8_t* row, const float* s) {
      Vec wt[NH];
      for (int h = 0; h < NH; ++h) wt[h] = bcast(w[h * span + (t - task.first)]);
      for (int c = 0; c < kTile; ++c) {
        if (c == nc) break;
        const Chunk& chunk = task.map[c0 + c];
        const Vec v = mul(codes_of<Bits>(row, chunk), bcast(s[chunk.group]));
        for (int h = 0; h < NH; ++h) acc[h][c] = fma(wt[h], v, acc[h][c]);
      }
    });
    for (int h = 0; h < NH; ++h)
      for (int c = 0; c < nc; ++c) store(out + h * D + (c0 + c) * kW, acc[h][c]);
  }
}

// fn(j0, std::integral_constant<int, n>) for the query heads j0 .. j0 + n - 1 of `group`, n <= 3 (so a tile's
// accumulators, 3 x 4 Vecs, stay in registers).
template <class Fn>
inline void in_head_blocks(int64_t group, Fn&& fn) {
  for (int64_t j0 = 0; j0 < group; j0 += 3) {
    const int64_t n = std::min<int64_t>(3, group - j0);
    if (n == 1) fn(j0, std::integral_constant<int, 1>{});
    else if (n == 2) fn(j0, std::integral_constant<int, 2>{});
    else fn(j0, std::integral_constant<int, 3>{});
  }
}

template <int Bits>
inline void attend_head_bits(const QuantAttend& a, int64_t b, int64_t g, float* scores) {
  Chunk map[kMaxChunks];
  chunk_map(Bits, a.call.D, a.G, map);
  const DecodeCall& call = a.call;
  const HeadTask task{call.table_of(b), call.first_of(b), call.lens[b], call.block_size, call.H_kv, g,
                      call.D * Bits / 8, call.D / a.G, call.D / kW, map};
  const int64_t span = task.len - task.first;
  const float* q = call.q_of(b, g);
  float* out = call.out_of(b, g);
  in_head_blocks(call.group, [&](int64_t j0, auto nh) {
    key_scores<Bits, decltype(nh)::value>(task, a.k_codes, a.k_scales, q + j0 * call.q_head, call.q_head, call.scale,
                                          scores + j0 * span, span);
  });
  for (int64_t j = 0; j < call.group; ++j) softmax(scores + j * span, span);
  in_head_blocks(call.group, [&](int64_t j0, auto nh) {
    weighted_values<Bits, decltype(nh)::value>(task, a.v_codes, a.v_scales, scores + j0 * span, span,
                                               out + j0 * call.D, call.D);
  });
}

// The task (sequence b, KV head g) of a paged_decode_attention_quant call; scores: group * span floats.
inline void attend_head(const QuantAttend& a, int64_t b, int64_t g, float* scores) {
  if (a.bits == 8)
    attend_head_bits<8>(a, b, g, scores);
  else
    attend_head_bits<4>(a, b, g, scores);
}
