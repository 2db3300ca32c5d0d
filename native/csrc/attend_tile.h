// The float32 cache's paged attention for one tile: `n` query vectors that share one KV head and one block table
// (the `group` query heads of one decode row, or of up to kTileRows consecutive rows of one prompt: a prefill
// tile), torch-free. decode_ops.cpp's paged_decode_attention cuts a call into tiles and runs attend_tile on each.
//
// Two vector paths, one order of operations, so one set of bits:
//
//   attend_tile_avx2<kD>     AVX2 + FMA: per (query, key) a dot product in two 8-lane FMA chains (even and odd
//                            8-float blocks of d), hsum8, times scale, 8 keys' hsum8 done together by shuffles
//                            across registers; one query vector at a time over a chunk for the scores; a
//                            prefill tile reads a chunk's K and V rows from a contiguous copy and forms the
//                            outputs 3 query vectors at a time (so a V vector loaded feeds 3).
//   attend_tile_avx512<kD>   AVX-512 F: the same two chains as the two halves of one zmm register (lanes 8-15
//                            are the odd blocks), register-blocked: 3 query vectors x 8 keys per pass over d,
//                            so a K row loaded feeds 3 FMAs and a q vector 8, and the 8 keys' lane sums reduced
//                            together in hsum8's order by shuffles across registers; the outputs 3 query
//                            vectors at a time, so a V row loaded feeds 3.
//
// Whichever path and however the tile is made up, each query vector goes through exactly the operations, in the
// order, of a decode row alone (the invariance the exactness tests rest on: a row's bits do not depend on its
// neighbours, on being a prefill or a decode row, or on the ISA path chosen, AVX2 or AVX-512):
//   score(t)   = hsum8(a0 + a1) * scale, a0 (a1) the FMA chain over the even (odd) 8-float blocks of q * k_t
//                in block order from zero, hsum8's order ((0+4) + (2+6)) + ((1+5) + (3+7));
//   weights    = softmax_avx2 over the query's own keys (decode_core.h; the AVX-512 path runs softmax_avx512,
//                the same operations on each float, exponentials 16 lanes wide and four queries interleaved);
//   out        = one FMA per key, fma(weight_t, v_t, acc) over t in order from zero, lanes over d.
// The quantized cache's kernels (kv_quant_body.h) reproduce this order over dequantized codes.
#pragma once

#include "decode_core.h"

#include <cstdint>

namespace kvserve::decode {

// One query vector of a tile: a query head's row q (D floats) attending to keys first..len-1, its scores
// buffer (len - first floats) and its output row (D floats).
struct TileQuery {
  const float* q;
  float* out;
  int64_t first, len;
  float* scores;
};

// Keys whose K (then V) rows a tile reads as one chunk while every query vector of the tile runs over them:
// 64 rows of D = 64 floats are 16 KB, which stay in L1 across the tile's query vectors.
constexpr int64_t kChunk = 64;

#ifdef KV_X86

// The K or V rows of keys c0 .. c1-1 (at most kChunk) of KV head g, through the block table (float32 or, for
// attend_bf16.h, bfloat16 bits). One division for the chunk's first key, then block and offset stepped: a division
// per key (bs is known only at run time) cost more than a decode row's arithmetic on the key.
template <class T>
inline void chunk_rows(const T* base, const int64_t* table, int64_t bs, int64_t H_kv, int64_t g, int64_t D,
                       int64_t c0, int64_t c1, const T** rows) {
  int64_t block = c0 / bs, offset = c0 % bs;
  for (int64_t t = c0; t < c1; ++t) {
    rows[t - c0] = base + ((table[block] * bs + offset) * H_kv + g) * D;
    if (++offset == bs) offset = 0, ++block;
  }
}

// Asks for the K or V rows of keys c0 .. c1-1 (the next chunk, at most kChunk) to be brought into L2 while the
// current chunk runs: a long context's rows come from L3 or memory, a block table's blocks anywhere, and a decode
// row's keys are one head's D elements every H_kv D, which the hardware prefetchers do not follow.
// Always inlined: called out of line from the bfloat16 cache's AVX-512 tile it made that tile 1.3-1.4x slower.
template <class T>
__attribute__((target("avx2,fma"), always_inline)) inline void prefetch_rows(const T* base, const int64_t* table, int64_t bs,
                                                              int64_t H_kv, int64_t g, int64_t D, int64_t c0,
                                                              int64_t c1) {
  const T* rows[kChunk];
  chunk_rows(base, table, bs, H_kv, g, D, c0, c1, rows);
  for (int64_t t = c0; t < c1; ++t)
    for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rows[t - c0]) + b, _MM_HINT_T1);
}

// Where a tile's K and V rows come from (the tiles' Pool): the float32 cache's pool, read in place through the block
// table. A Pool gives a chunk's rows (rows(rows, buf, v, c0, c1): K, or V where v, of keys c0 .. c1-1, at most
// kChunk, as row pointers; kInBuffer: always written into buf, kChunk rows of D floats, else pointers into the
// pool) and brings a chunk's rows towards L2 (prefetch). kv_attend.h's QuantPool dequantizes an int8 / int4
// cache's rows into buf.
struct F32Pool {
  static constexpr bool kInBuffer = false;
  const int64_t* table;
  const float* kp;
  const float* vp;
  int64_t bs, H_kv, g, D;

  void rows(const float** rows, float*, bool v, int64_t c0, int64_t c1) const {
    chunk_rows(v ? vp : kp, table, bs, H_kv, g, D, c0, c1, rows);
  }
  __attribute__((target("avx2,fma"), always_inline)) void prefetch(bool v, int64_t c0, int64_t c1) const {
    prefetch_rows(v ? vp : kp, table, bs, H_kv, g, D, c0, c1);
  }
};

// The keys lo .. hi-1 that any query vector of the tile reads.
inline void tile_span(const TileQuery* qs, int64_t n, int64_t* lo, int64_t* hi) {
  *lo = qs[0].first;
  *hi = qs[0].len;
  for (int64_t j = 1; j < n; ++j) {
    *lo = std::min(*lo, qs[j].first);
    *hi = std::max(*hi, qs[j].len);
  }
}

// The keys of chunk [c0, c1) that every one of qs[0 .. m) reads: [*s0, *s1), empty where *s0 >= *s1.
inline void shared_keys(const TileQuery* qs, int64_t m, int64_t c0, int64_t c1, int64_t* s0, int64_t* s1) {
  *s0 = c0;
  *s1 = c1;
  for (int64_t j = 0; j < m; ++j) {
    *s0 = std::max(*s0, qs[j].first);
    *s1 = std::min(*s1, qs[j].len);
  }
}

// Between a tile's two passes: each query vector's scores to their softmax (softmax_avx2, decode_core.h), its
// output row to zero for the FMAs over the keys.
__attribute__((target("avx2,fma"))) inline void softmax_tile(const TileQuery* qs, int64_t n, int64_t D) {
  for (int64_t j = 0; j < n; ++j) {
    softmax_avx2(qs[j].scores, qs[j].len - qs[j].first);
    std::fill_n(qs[j].out, D, 0.f);
  }
}

// softmax_avx2 over each of qs[0 .. n)'s scores, with its bits (softmax_avx512): four query vectors at a time.
__attribute__((target("avx512f,avx2,fma"))) inline void softmax_queries_avx512(const TileQuery* qs, int64_t n) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    float* const s[4] = {qs[j].scores, qs[j + 1].scores, qs[j + 2].scores, qs[j + 3].scores};
    const int64_t span[4] = {qs[j].len - qs[j].first, qs[j + 1].len - qs[j + 1].first,
                             qs[j + 2].len - qs[j + 2].first, qs[j + 3].len - qs[j + 3].first};
    softmax_avx512<4>(s, span);
  }
  for (; j < n; ++j) {
    const int64_t span = qs[j].len - qs[j].first;
    softmax_avx512<1>(&qs[j].scores, &span);
  }
}

// The rows of keys c0 .. c1-1 (at most kChunk) copied one after the other into buf (D floats each), rows[]
// pointed at the copies. A chunk's K rows lie H_kv D floats apart: with Llama-3.2-1B's 8 KV heads that is 2 KB, so
// the 64 rows of a chunk fall into an eighth of L1's sets and evict each other before the tile's next query
// vector reads them again; copied they stay in L1 (16 KB for D = 64).
__attribute__((target("avx2,fma"))) inline void copy_rows(const float** rows, int64_t m, int64_t D, float* buf) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t d = 0; d < D; d += 8) _mm256_store_ps(buf + i * D + d, _mm256_loadu_ps(rows[i] + d));
    rows[i] = buf + i * D;
  }
}

// Eight keys' a0 + a1 (v[t], t = 0..7) reduced to their 8 scores in key order, each hsum8(v[t]) * scale with
// hsum8's additions for the 8 keys at once: (1) lanes j + (j + 4) of two keys per register, (2) j + (j + 2),
// (3) lane 0 + lane 1, then the keys put back in order.
__attribute__((target("avx2,fma"), always_inline)) inline __m256 scores8(const __m256* v, float scale) {
  __m256 u[4];
  for (int p = 0; p < 4; ++p)  // [u of key 2p | u of key 2p + 1], u_j = v_j + v_{j+4}
    u[p] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * p], v[2 * p + 1], 0x20),
                         _mm256_permute2f128_ps(v[2 * p], v[2 * p + 1], 0x31));
  __m256 w[2];
  for (int p = 0; p < 2; ++p)  // 128-bit half h: [y0, y1 of key 4p + h, y0, y1 of key 4p + 2 + h], y_i = u_i + u_{i+2}
    w[p] = _mm256_add_ps(_mm256_shuffle_ps(u[2 * p], u[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(u[2 * p], u[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // y0 + y1 of keys [0, 2, 4, 6 | 1, 3, 5, 7]
  const __m256 s = _mm256_add_ps(_mm256_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm256_mul_ps(_mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)),
                       _mm256_set1_ps(scale));
}

// a0 + a1 of one key k (kRegs 8-float vectors) against the query vector q held in registers: a0 (a1) the FMA chain
// over the even (odd) vectors from zero.
template <int64_t kRegs>
__attribute__((target("avx2,fma"), always_inline)) inline __m256 key_sum(const __m256* q, const float* k) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (int64_t r = 0; r + 1 < kRegs; r += 2) {
    a0 = _mm256_fmadd_ps(q[r], _mm256_loadu_ps(k + 8 * r), a0);
    a1 = _mm256_fmadd_ps(q[r + 1], _mm256_loadu_ps(k + 8 * r + 8), a1);
  }
  if (kRegs % 2) a0 = _mm256_fmadd_ps(q[kRegs - 1], _mm256_loadu_ps(k + 8 * (kRegs - 1)), a0);
  return _mm256_add_ps(a0, a1);
}

// out_j += w_j[t] v_t over keys t0 .. t1-1 in order for kQ query vectors at once, kH of each output's 8-float
// vectors at a time (kRegs / kH passes over the keys), so that a V vector loaded feeds kQ FMAs and kQ x kH
// accumulators, each taking one FMA a key, cover the FMA's latency.
template <int64_t kRegs, int kQ, int kH>
__attribute__((target("avx2,fma"), always_inline)) inline void outputs_avx2(const TileQuery* qs,
                                                                          const float* const* rows, int64_t c0,
                                                                          int64_t t0, int64_t t1) {
  const float* w[kQ];
  for (int j = 0; j < kQ; ++j) w[j] = qs[j].scores - qs[j].first;
  for (int64_t h = 0; h < kRegs; h += kH) {
    __m256 o[kQ][kH];
    for (int j = 0; j < kQ; ++j)
      for (int r = 0; r < kH; ++r) o[j][r] = _mm256_loadu_ps(qs[j].out + 8 * (h + r));
    for (int64_t t = t0; t < t1; ++t) {
      const float* v = rows[t - c0] + 8 * h;
      __m256 wt[kQ];
      for (int j = 0; j < kQ; ++j) wt[j] = _mm256_set1_ps(w[j][t]);
      for (int r = 0; r < kH; ++r) {
        const __m256 vv = _mm256_loadu_ps(v + 8 * r);
        for (int j = 0; j < kQ; ++j) o[j][r] = _mm256_fmadd_ps(wt[j], vv, o[j][r]);
      }
    }
    for (int j = 0; j < kQ; ++j)
      for (int r = 0; r < kH; ++r) _mm256_storeu_ps(qs[j].out + 8 * (h + r), o[j][r]);
  }
}

// The outputs of query vectors qs[0 .. kQ) over the chunk's keys c0 .. c1-1: together over the keys all of them
// read, each alone over its others (before or after those), so every output still takes its keys in order.
template <int64_t kRegs, int kQ, int kH>
__attribute__((target("avx2,fma"), always_inline)) inline void outputs_of_avx2(const TileQuery* qs,
                                                                             const float* const* rows, int64_t c0,
                                                                             int64_t c1) {
  int64_t s0, s1;
  shared_keys(qs, kQ, c0, c1, &s0, &s1);
  if (s0 >= s1) {
    for (int j = 0; j < kQ; ++j)
      outputs_avx2<kRegs, 1, kRegs>(qs + j, rows, c0, std::max(c0, qs[j].first), std::min(c1, qs[j].len));
    return;
  }
  for (int j = 0; j < kQ; ++j) outputs_avx2<kRegs, 1, kRegs>(qs + j, rows, c0, std::max(c0, qs[j].first), s0);
  outputs_avx2<kRegs, kQ, kH>(qs, rows, c0, s0, s1);
  for (int j = 0; j < kQ; ++j) outputs_avx2<kRegs, 1, kRegs>(qs + j, rows, c0, s1, std::min(c1, qs[j].len));
}

// The AVX2 path, for D a multiple of 8 (D = 64 and 128 compiled with D known, so a query row stays in registers).
// The keys are taken in chunks of kChunk: each chunk's K rows are read for every query vector of the tile while
// they are in L1 (a prefill tile of R rows reads the context from memory R times less often than R decode rows
// would), then, after each vector's softmax, the V rows likewise. A prefill tile reads the chunk's rows from a
// copy (copy_rows) and, with D known, forms its outputs 3 query vectors at a time (outputs_of_avx2); a query
// vector's scores are reduced 8 keys at a time (scores8). The next chunk's rows are prefetched as the AVX-512
// path does.
template <int64_t kD, class Pool>
__attribute__((target("avx2,fma"))) void attend_tile_avx2(const TileQuery* qs, int64_t n, const Pool& pool,
                                                          int64_t D_, float scale) {
  const int64_t D = kD > 0 ? kD : D_;
  constexpr int64_t kRegs = kD > 0 ? kD / 8 : 1;  // 8-float lanes of a row kept in registers
  // the outputs: 3 query vectors x 4 of their 8-float vectors at a time (12 accumulators; 8 left the FMAs
  // waiting on each other, 2 x 4 and 4 x 2 were slower)
  constexpr int kQout = 3, kOutRegs = 4;
  static_assert(kD % 32 == 0, "kOutRegs vectors at a time");
  int64_t lo, hi;
  tile_span(qs, n, &lo, &hi);
  const float* rows[kChunk];
  // a prefill tile reads the chunk's rows from a copy (a decode row's few query vectors would not repay it);
  // D <= 256 for the buffer; a pool that writes its rows into the buffer anyway (kInBuffer) is read from it
  const bool copied = Pool::kInBuffer || (n >= 8 && D <= 256);
  alignas(32) float buf[kChunk * 256];
  for (int64_t c0 = lo; c0 < hi; c0 += kChunk) {  // scores
    const int64_t c1 = std::min(hi, c0 + kChunk);
    pool.rows(rows, buf, false, c0, c1);
    if (c1 < hi) pool.prefetch(false, c1, std::min(hi, c1 + kChunk));
    else pool.prefetch(true, lo, std::min(hi, lo + kChunk));
    if (copied && !Pool::kInBuffer) copy_rows(rows, c1 - c0, D, buf);
    for (int64_t j = 0; j < n; ++j) {
      const TileQuery& query = qs[j];
      const int64_t t0 = std::max(c0, query.first), t1 = std::min(c1, query.len);
      float* out = query.scores - query.first;
      if constexpr (kD > 0) {
        __m256 q[kRegs];
        for (int64_t r = 0; r < kRegs; ++r) q[r] = _mm256_loadu_ps(query.q + 8 * r);
        int64_t t = t0;
        for (; t + 8 <= t1; t += 8) {
          __m256 v[8];
          for (int u = 0; u < 8; ++u) v[u] = key_sum<kRegs>(q, rows[t + u - c0]);
          _mm256_storeu_ps(out + t, scores8(v, scale));
        }
        for (; t < t1; ++t) out[t] = hsum8(key_sum<kRegs>(q, rows[t - c0])) * scale;
      } else {
        const float* qh = query.q;
        for (int64_t t = t0; t < t1; ++t) {
          const float* k = rows[t - c0];
          __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
          int64_t i = 0;
          for (; i + 16 <= D; i += 16) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i), _mm256_loadu_ps(k + i), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i + 8), _mm256_loadu_ps(k + i + 8), a1);
          }
          if (i < D) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i), _mm256_loadu_ps(k + i), a0);
          out[t] = hsum8(_mm256_add_ps(a0, a1)) * scale;
        }
      }
    }
  }
  softmax_tile(qs, n, D);
  for (int64_t c0 = lo; c0 < hi; c0 += kChunk) {  // outputs
    const int64_t c1 = std::min(hi, c0 + kChunk);
    pool.rows(rows, buf, true, c0, c1);
    if (c1 < hi) pool.prefetch(true, c1, std::min(hi, c1 + kChunk));
    if (copied && !Pool::kInBuffer) copy_rows(rows, c1 - c0, D, buf);
    int64_t j = 0;
    // a prefill tile's query vectors kQout at a time sharing each V vector read, then the rest alone (a decode
    // row's V rows come from memory: one pass over each, kRegs accumulators, as fast)
    if constexpr (kD > 0)
      if (copied)
        for (; j + kQout <= n; j += kQout) outputs_of_avx2<kRegs, kQout, kOutRegs>(qs + j, rows, c0, c1);
    for (; j < n; ++j) {
      const TileQuery& query = qs[j];
      const int64_t t0 = std::max(c0, query.first), t1 = std::min(c1, query.len);
      if constexpr (kD > 0) {
        outputs_avx2<kRegs, 1, kRegs>(&query, rows, c0, t0, t1);
      } else {
        const float* w = query.scores - query.first;
        for (int64_t t = t0; t < t1; ++t) {
          const __m256 wt = _mm256_set1_ps(w[t]);
          const float* v = rows[t - c0];
          for (int64_t i = 0; i < D; i += 8)
            _mm256_storeu_ps(query.out + i, _mm256_fmadd_ps(wt, _mm256_loadu_ps(v + i), _mm256_loadu_ps(query.out + i)));
        }
      }
    }
  }
}

// ---- AVX-512 ----
#define KV_AVX512_TILE __attribute__((target("avx512f,avx2,fma"), always_inline)) inline

// A value loaded once for several FMAs stays in a register: without this the compiler folds the load into each
// FMA as a memory operand, which on cores that split 512-bit loads (Zen 4) makes the loads, not the FMAs, the
// bound.
KV_AVX512_TILE void keep_in_register(__m512& v) { __asm__("" : "+v"(v)); }

// The zmm register [a0 | a1] of one (query, key) pair reduced to its score, as the AVX2 path does:
// hsum8(a0 + a1) * scale.
KV_AVX512_TILE float score_of(__m512 acc, float scale) {
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1));
  return hsum8(_mm256_add_ps(_mm512_castps512_ps256(acc), hi)) * scale;
}

// Eight (query, key) registers [a0 | a1] of keys 0..7 reduced to their 8 scores in key order, each one
// hsum8(a0 + a1) * scale with hsum8's additions, done for the 8 keys at once: (1) a0 + a1 of two keys per
// register, (2) lanes j + (j + 4), (3) then j + (j + 2), (4) then lane 0 + lane 1.
KV_AVX512_TILE __m256 scores_of(const __m512* acc, float scale) {
  __m512 v[4], w[2];
  for (int p = 0; p < 4; ++p)  // [a0 + a1 of key 2p | of key 2p + 1]
    v[p] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * p], acc[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(acc[2 * p], acc[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int p = 0; p < 2; ++p)  // 128-bit lane i: key 4p + i's (j) + (j + 4), j = 0..3
    w[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  // 128-bit lane i: [x0, x1] of key i, then of key 4 + i, where x0 = w0 + w2 and x1 = w1 + w3
  const __m512 x = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 s = _mm512_add_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(2, 3, 0, 1)));  // lane 2m: x0 + x1
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm256_mul_ps(_mm512_castps512_ps256(_mm512_permutexvar_ps(order, s)), _mm256_set1_ps(scale));
}

// The scores of kQ query vectors against 8 keys (rows k[0..7]) into out[j][0..7]: one pass over d with
// kQ x 8 accumulators, each K row load feeding kQ FMAs.
template <int64_t kD, int kQ>
KV_AVX512_TILE void scores_block(const float* const* q, const float* const* k, int64_t D_, float scale,
                                 float* const* out) {
  const int64_t D = kD > 0 ? kD : D_;
  __m512 acc[kQ][8];
  for (int j = 0; j < kQ; ++j)
    for (int t = 0; t < 8; ++t) acc[j][t] = _mm512_setzero_ps();
  for (int64_t i = 0; i < D; i += 16) {
    __m512 qv[kQ];
    for (int j = 0; j < kQ; ++j) qv[j] = _mm512_loadu_ps(q[j] + i);
    for (int t = 0; t < 8; ++t) {
      __m512 kv = _mm512_loadu_ps(k[t] + i);
      keep_in_register(kv);
      for (int j = 0; j < kQ; ++j) acc[j][t] = _mm512_fmadd_ps(qv[j], kv, acc[j][t]);
    }
  }
  for (int j = 0; j < kQ; ++j) _mm256_storeu_ps(out[j], scores_of(acc[j], scale));
}

// K rows of keys c0 .. c0 + 16 m - 1 (m groups of 16) transposed: kt[d * kChunk + i] = rows[i][d], so one zmm
// load at kt + d * kChunk + 16 b is d of the 16 keys of group b. 8 x 8 blocks, in AVX2 shuffles.
KV_AVX512_TILE void transpose_keys(const float* const* rows, int64_t m, int64_t D, float* kt) {
  for (int64_t i0 = 0; i0 < 16 * m; i0 += 8)
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
      __m256 r[8], u[8], s[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(rows[i0 + i] + d0);
      for (int i = 0; i < 8; i += 2) {
        u[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        u[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
      }
      for (int i = 0; i < 8; i += 4) {
        s[i] = _mm256_shuffle_ps(u[i], u[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        s[i + 1] = _mm256_shuffle_ps(u[i], u[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        s[i + 2] = _mm256_shuffle_ps(u[i + 1], u[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        s[i + 3] = _mm256_shuffle_ps(u[i + 1], u[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
      }
      for (int i = 0; i < 4; ++i) {  // d0 + i from s[i] (rows 0-3 low, 4-7 high), d0 + 4 + i likewise
        _mm256_storeu_ps(kt + (d0 + i) * kChunk + i0, _mm256_permute2f128_ps(s[i], s[i + 4], 0x20));
        _mm256_storeu_ps(kt + (d0 + 4 + i) * kChunk + i0, _mm256_permute2f128_ps(s[i], s[i + 4], 0x31));
      }
    }
}

// The scores of kQ query vectors against the 16 keys of one transposed group (kt: its column 0), lanes over
// the keys: lane partial l of a key (the FMA chain over d = l, l + 16, ... from zero, as the AVX2 path's a0
// for l < 8 and a1 for l >= 8) is register P_l, then the same additions as hsum8(a0 + a1): v_l = P_l + P_{l+8},
// w_l = v_l + v_{l+4}, (w_0 + w_2) + (w_1 + w_3); no shuffle, 16 scores stored in key order.
template <int64_t kD, int kQ>
KV_AVX512_TILE void scores_transposed(const float* const* q, const float* kt, int64_t D_, float scale,
                                      float* const* out) {
  const int64_t D = kD > 0 ? kD : D_;
  __m512 w[kQ][4];
  for (int l = 0; l < 4; ++l) {
    __m512 p[kQ][4];  // P_l, P_{l+4}, P_{l+8}, P_{l+12}
    for (int j = 0; j < kQ; ++j)
      for (int m = 0; m < 4; ++m) p[j][m] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16)
      for (int m = 0; m < 4; ++m) {
        __m512 k = _mm512_loadu_ps(kt + (d + l + 4 * m) * kChunk);
        keep_in_register(k);
        for (int j = 0; j < kQ; ++j) p[j][m] = _mm512_fmadd_ps(_mm512_set1_ps(q[j][d + l + 4 * m]), k, p[j][m]);
      }
    for (int j = 0; j < kQ; ++j)
      w[j][l] = _mm512_add_ps(_mm512_add_ps(p[j][0], p[j][2]), _mm512_add_ps(p[j][1], p[j][3]));
  }
  for (int j = 0; j < kQ; ++j) {
    const __m512 s = _mm512_add_ps(_mm512_add_ps(w[j][0], w[j][2]), _mm512_add_ps(w[j][1], w[j][3]));
    _mm512_storeu_ps(out[j], _mm512_mul_ps(s, _mm512_set1_ps(scale)));
  }
}

// One query vector's scores for keys t0 .. t1-1 of the chunk starting at c0: 8 keys a pass, then one by one.
template <int64_t kD>
KV_AVX512_TILE void scores_alone(const TileQuery& query, const float* const* rows, int64_t c0, int64_t t0,
                                 int64_t t1, int64_t D_, float scale) {
  const int64_t D = kD > 0 ? kD : D_;
  float* s = query.scores - query.first;
  int64_t t = t0;
  for (; t + 8 <= t1; t += 8) {
    float* out = s + t;
    scores_block<kD, 1>(&query.q, rows + (t - c0), D, scale, &out);
  }
  for (; t < t1; ++t) {
    const float* k = rows[t - c0];
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < D; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(query.q + i), _mm512_loadu_ps(k + i), acc);
    s[t] = score_of(acc, scale);
  }
}

// out_j += w_j[t] v_t over keys t0 .. t1-1 in order, for kQ query vectors at once (each V row load feeds kQ
// FMAs); kZ = D / 16 registers a row, the kQ x kZ accumulators held over the keys.
template <int64_t kD, int kQ>
KV_AVX512_TILE void outputs_block(const TileQuery* qs, const float* const* rows, int64_t c0, int64_t t0, int64_t t1,
                                  int64_t D_) {
  if constexpr (kD > 0) {
    constexpr int64_t kZ = kD / 16;
    __m512 o[kQ][kZ];
    const float* w[kQ];
    for (int j = 0; j < kQ; ++j) {
      w[j] = qs[j].scores - qs[j].first;
      for (int64_t r = 0; r < kZ; ++r) o[j][r] = _mm512_loadu_ps(qs[j].out + 16 * r);
    }
    for (int64_t t = t0; t < t1; ++t) {
      const float* v = rows[t - c0];
      __m512 vv[kZ];
      for (int64_t r = 0; r < kZ; ++r) vv[r] = _mm512_loadu_ps(v + 16 * r);
      for (int j = 0; j < kQ; ++j) {
        const __m512 wt = _mm512_set1_ps(w[j][t]);
        for (int64_t r = 0; r < kZ; ++r) o[j][r] = _mm512_fmadd_ps(wt, vv[r], o[j][r]);
      }
    }
    for (int j = 0; j < kQ; ++j)
      for (int64_t r = 0; r < kZ; ++r) _mm512_storeu_ps(qs[j].out + 16 * r, o[j][r]);
  } else {
    for (int j = 0; j < kQ; ++j) {
      const float* w = qs[j].scores - qs[j].first;
      for (int64_t t = t0; t < t1; ++t) {
        const __m512 wt = _mm512_set1_ps(w[t]);
        const float* v = rows[t - c0];
        for (int64_t i = 0; i < D_; i += 16)
          _mm512_storeu_ps(qs[j].out + i, _mm512_fmadd_ps(wt, _mm512_loadu_ps(v + i), _mm512_loadu_ps(qs[j].out + i)));
      }
    }
  }
}

// The outputs of query vectors qs[0 .. kK) over the chunk's keys c0 .. c1-1: kK at a time (outputs_block) over the
// keys all of them read, each alone over its others, so every output still takes its keys in order.
template <int64_t kD, int kK>
KV_AVX512_TILE void outputs_of(const TileQuery* qs, const float* const* rows, int64_t c0, int64_t c1, int64_t D) {
  int64_t s0, s1;
  shared_keys(qs, kK, c0, c1, &s0, &s1);
  if (s0 >= s1) {
    for (int j = 0; j < kK; ++j)
      outputs_block<kD, 1>(qs + j, rows, c0, std::max(c0, qs[j].first), std::min(c1, qs[j].len), D);
    return;
  }
  for (int j = 0; j < kK; ++j) outputs_block<kD, 1>(qs + j, rows, c0, std::max(c0, qs[j].first), s0, D);
  outputs_block<kD, kK>(qs, rows, c0, s0, s1, D);
  for (int j = 0; j < kK; ++j) outputs_block<kD, 1>(qs + j, rows, c0, s1, std::min(c1, qs[j].len), D);
}

// The AVX-512 path, for D a multiple of 16 (D = 64 and 128 compiled with D known). Chunks of kChunk keys as the
// AVX2 path; within a chunk the query vectors go kQ at a time for the scores (kQ = 3: a row's three query heads
// for 9 query and 3 KV heads) and kQout at a time for the outputs (6 for D = 64, 3 for D = 128: 24 accumulators,
// each taking one FMA per key, so that enough independent FMAs cover their latency; docs/kernels.md). A block
// runs blocked over the keys every one of its vectors reads; the keys only some read (the causal edge of a prompt's last rows, a sliding window's start)
// each vector runs alone, before (scores: anywhere) or after the shared ones, so every output still takes its
// keys in order.
template <int64_t kD, class Pool>
__attribute__((target("avx512f,avx2,fma"))) void attend_tile_avx512(const TileQuery* qs, int64_t n, const Pool& pool,
                                                                    int64_t D_, float scale) {
  constexpr int kQ = 3;
  constexpr int kQout = kD == 64 ? 6 : 3;
  const int64_t D = kD > 0 ? kD : D_;
  int64_t lo, hi;
  tile_span(qs, n, &lo, &hi);
  const float* rows[kChunk];
  // a tile of several prompt rows reads each chunk's K rows transposed (a decode row's few query vectors would
  // not repay the transposition); D <= 256 for the buffer
  const bool transposed = n >= 4 * kQ && D <= 256;
  alignas(64) float kt[kChunk * 256];
  alignas(64) float buf[Pool::kInBuffer ? kChunk * 256 : 1];  // a kInBuffer pool's rows (D <= 256)
  for (int64_t c0 = lo; c0 < hi; c0 += kChunk) {  // scores
    const int64_t c1 = std::min(hi, c0 + kChunk);
    pool.rows(rows, buf, false, c0, c1);
    if (c1 < hi) pool.prefetch(false, c1, std::min(hi, c1 + kChunk));
    else pool.prefetch(true, lo, std::min(hi, lo + kChunk));
    // a prefill tile transposes the chunk's whole groups of 16 keys once for all its query vectors
    const int64_t groups = transposed ? (c1 - c0) / 16 : 0;
    if (groups > 0) transpose_keys(rows, groups, D, kt);
    int64_t j0 = 0;
    for (; j0 + kQ <= n; j0 += kQ) {
      int64_t s0, s1, b0, b1;  // shared keys [s0, s1); run blocked: [b0, b1)
      shared_keys(qs + j0, kQ, c0, c1, &s0, &s1);
      const float* q[kQ];
      float* s[kQ];
      for (int j = 0; j < kQ; ++j) {
        q[j] = qs[j0 + j].q;
        s[j] = qs[j0 + j].scores - qs[j0 + j].first;
      }
      if (groups > 0) {
        b0 = c0 + std::min(groups, (s0 - c0 + 15) / 16) * 16;
        b1 = std::max(b0, c0 + std::min(groups, (s1 - c0) / 16) * 16);
        for (int64_t t = b0; t < b1; t += 16) {
          float* out[kQ];
          for (int j = 0; j < kQ; ++j) out[j] = s[j] + t;
          scores_transposed<kD, kQ>(q, kt + (t - c0), D, scale, out);
        }
      } else {
        b0 = s0;
        b1 = s0 + std::max<int64_t>(0, (s1 - s0) / 8 * 8);
        for (int64_t t = b0; t < b1; t += 8) {
          float* out[kQ];
          for (int j = 0; j < kQ; ++j) out[j] = s[j] + t;
          scores_block<kD, kQ>(q, rows + (t - c0), D, scale, out);
        }
      }
      for (int64_t j = j0; j < j0 + kQ; ++j) {  // the keys outside the blocked ones
        const int64_t t0 = std::max(c0, qs[j].first), t1 = std::min(c1, qs[j].len);
        if (b1 > b0) {
          scores_alone<kD>(qs[j], rows, c0, t0, b0, D, scale);
          scores_alone<kD>(qs[j], rows, c0, b1, t1, D, scale);
        } else {
          scores_alone<kD>(qs[j], rows, c0, t0, t1, D, scale);
        }
      }
    }
    for (; j0 < n; ++j0)
      scores_alone<kD>(qs[j0], rows, c0, std::max(c0, qs[j0].first), std::min(c1, qs[j0].len), D, scale);
  }
  softmax_queries_avx512(qs, n);
  for (int64_t j = 0; j < n; ++j) std::fill_n(qs[j].out, D, 0.f);
  for (int64_t c0 = lo; c0 < hi; c0 += kChunk) {  // outputs
    const int64_t c1 = std::min(hi, c0 + kChunk);
    pool.rows(rows, buf, true, c0, c1);
    if (c1 < hi) pool.prefetch(true, c1, std::min(hi, c1 + kChunk));
    // kQout query vectors at a time, then the rest (a decode row's group heads, or a prompt tile's last vectors)
    // 3 and 2 at a time, so a group of 3 or 4 heads still shares its V rows
    int64_t j0 = 0;
    for (; j0 + kQout <= n; j0 += kQout) outputs_of<kD, kQout>(qs + j0, rows, c0, c1, D);
    for (; j0 + 3 <= n; j0 += 3) outputs_of<kD, 3>(qs + j0, rows, c0, c1, D);
    for (; j0 + 2 <= n; j0 += 2) outputs_of<kD, 2>(qs + j0, rows, c0, c1, D);
    for (; j0 < n; ++j0)
      outputs_block<kD, 1>(qs + j0, rows, c0, std::max(c0, qs[j0].first), std::min(c1, qs[j0].len), D);
  }
}
#undef KV_AVX512_TILE

// The tile over `pool`'s rows on the path cpu.h chose for this D: AVX-512 for D a multiple of 16, else AVX2 (D a
// multiple of 8; the same bits either way); each compiled for D = 64 and 128 with D known, looped over D otherwise.
template <class Pool>
inline void attend_tile(bool avx512, const TileQuery* qs, int64_t n, const Pool& pool, int64_t D, float scale) {
  if (avx512 && D % 16 == 0) {
    if (D == 64) return attend_tile_avx512<64>(qs, n, pool, D, scale);
    if (D == 128) return attend_tile_avx512<128>(qs, n, pool, D, scale);
    return attend_tile_avx512<0>(qs, n, pool, D, scale);
  }
  if (D == 64) return attend_tile_avx2<64>(qs, n, pool, D, scale);
  if (D == 128) return attend_tile_avx2<128>(qs, n, pool, D, scale);
  attend_tile_avx2<0>(qs, n, pool, D, scale);
}

// The float32 cache's tile (F32Pool: kp, vp [blocks, bs, H_kv, D] through `table`, KV head g).
inline void attend_tile(bool avx512, const TileQuery* qs, int64_t n, const int64_t* table, const float* kp,
                        const float* vp, int64_t bs, int64_t H_kv, int64_t g, int64_t D, float scale) {
  attend_tile(avx512, qs, n, F32Pool{table, kp, vp, bs, H_kv, g, D}, D, scale);
}

#endif

}  // namespace kvserve::decode
