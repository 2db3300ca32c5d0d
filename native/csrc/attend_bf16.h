// The bfloat16 KV cache's paged attention for one tile (attend_tile.h's TileQuery: the `group` query heads of one
// decode row, or of up to kTileRows consecutive rows of one prompt), for float32 queries over K and V stored as
// bfloat16 [blocks, block_size, H_kv, D]. The scores and the outputs are bfloat16 dot products with float32
// accumulation, vdpbf16ps' arithmetic (bf16_bits.h: the Intel SDM's VDPBF16PS, lane i: acc += a[2i+1] * b[2i+1],
// then acc += a[2i] * b[2i], each product exact, each product and sum flushed to zero if denormal, inputs
// denormal read as zero), the softmax in float32 as the float32 cache's (softmax_avx2).
//
// The order of every float operation, for one query vector q [D] attending to keys first .. len-1 (the reference;
// every path below reproduces it, so every path, tile make-up, batch and chunking gives the same bits):
//   qb       = bf16(q)                  (kv_float_to_bf16: vcvtneps2bf16's rounding, to nearest even)
//   score(t) = hsum8(lane[0..7] + lane[8..15]) * scale, where lane[l] starts at +0 and takes, for the pairs
//              p = l, l + 16, l + 32, ... < D / 2 in this order, the pair step
//                  acc = ftz(acc + ftz(x[2p+1] * y[2p+1])); acc = ftz(acc + ftz(x[2p] * y[2p]))
//              with x = qb, y = k_t (denormal inputs read as zero): vdpbf16ps over D / 32 vectors of 16 pairs;
//   w        = softmax_avx2(scores), then each weight rounded: wb(t) = bf16(w(t));
//   out[d]   = starts at +0 and takes, for the key pairs (2p, 2p + 1), p = floor(first / 2) .. ceil(len / 2) - 1
//              in this order, the pair step with x = (wb(2p), wb(2p+1)), y = (v_2p[d], v_2p+1[d]); a key outside
//              first .. len-1 (the even one before `first`, the odd one at `len`) has weight +0 and value +0.
// Pairs are by absolute position, so a prompt row computed alone, in a tile, in another chunk or as a decode row
// takes the same pair steps: on one path every row's bits are independent of batch, tile and chunking.
//
// Across paths the bits agree wherever no product or partial sum falls below float32's normal range (2^-126) other
// than by being zero, the case of every attention over model activations. In that range Zen 4's vdpbf16ps departs
// from the SDM's pseudo-code the reference follows (measured: it adds a denormal product or a denormal input's
// product instead of flushing it, and can give -0 where +0 + -0 is +0), so there the AVX-512 path's last bits may
// differ from the scalar and AVX2 paths'.
//
// Three paths: base (scalar, any even D), avx2 (AVX2 + FMA, D a multiple of 32: the pair steps in 8 float lanes
// with MXCSR's DAZ and FTZ doing the flushes), avx512 (AVX-512 F + BF16, D a multiple of 32: vdpbf16ps; the
// scores three query vectors at a time over 8 keys, or in a prefill tile with D known over 16 keys (32 at
// D = 64) transposed by pairs, a key a lane, which needs no shuffles to reduce a score's lanes; the softmax's
// scaling done as the weights are rounded and packed; keys' V rows interleaved two by two with vpunpck{l,h}wd
// once per chunk, then three query vectors at a time over them, so an output register's lanes are a
// fixed permutation of d, undone once per query).
#pragma once

#include "attend_tile.h"
#include "bf16_bits.h"
#include "cpu.h"
#include "decode_core.h"
#include "kv_attend.h"

#include <cstdint>
#include <vector>

namespace kvserve::bf16_attend {

using kvserve::decode::TileQuery;

// One tile's view of the pool: K and V bfloat16 bits [blocks, block_size, H_kv, D], KV head g.
struct Tile {
  const int64_t* table;
  const uint16_t* kp;
  const uint16_t* vp;
  int64_t bs, H_kv, g, D;
  float scale;
  // The AVX-512 path's current chunk: its K and V rows from key c0, looked up once for all the tile's queries
  const uint16_t* const* krows = nullptr;
  const uint16_t* const* vrows = nullptr;
  int64_t c0 = 0;

  int64_t at(int64_t t) const { return ((table[t / bs] * bs + t % bs) * H_kv + g) * D; }
  const uint16_t* k_row(int64_t t) const { return krows != nullptr ? krows[t - c0] : kp + at(t); }
  const uint16_t* v_row(int64_t t) const { return vrows != nullptr ? vrows[t - c0] : vp + at(t); }
};

// Whether the vector paths take head size D (16 pairs a vector, whole vectors); else the scalar path runs.
inline bool vector_takes(int64_t D) { return D % 32 == 0; }

// The value row of a key outside a query's keys: +0 for every d (D <= 512). At namespace scope with internal
// linkage, so a leaf reaches it without a relocation (a function-local static of an inline function is a
// shared symbol, read through the GOT).
alignas(64) constexpr uint16_t kZeroRow[kvserve::kv_quant::kMaxChunks * 8] = {};

// Keys a tile reads as one chunk while all its query vectors run over them (even, so a key pair never straddles).
constexpr int64_t kChunk = 64;

// One pair step of the reference: x, y bfloat16 values as floats (denormals already read as zero).
inline float pair_half(float acc, float x, float y) { return kv_flush_denormal(acc + kv_flush_denormal(x * y)); }

// scores' weights rounded to bfloat16 in place (kept as floats whose low 16 bits are zero).
inline void round_weights(float* w, int64_t span) {
  for (int64_t i = 0; i < span; ++i) w[i] = kv_bits_f32(static_cast<uint32_t>(kv_float_to_bf16(w[i])) << 16);
}

// The weight pair of key pair p for a query: low half wb(2p) (0 before `first`), high half wb(2p+1) (0 at len).
inline uint32_t weight_pair(const TileQuery& query, int64_t p) {
  const float* w = query.scores - query.first;
  const uint32_t even = 2 * p >= query.first ? kv_f32_bits(w[2 * p]) >> 16 : 0u;
  const uint32_t odd = 2 * p + 1 < query.len ? kv_f32_bits(w[2 * p + 1]) >> 16 : 0u;
  return even | (odd << 16);
}

// ---- base: the reference, one float at a time ----
namespace base {

inline float score(const uint16_t* qb, const uint16_t* k, int64_t D, float scale) {
  float lane[16];
  for (int l = 0; l < 16; ++l) {
    float acc = 0.f;
    for (int64_t p = l; p < D / 2; p += 16) {
      acc = pair_half(acc, kv_bf16_to_float(qb[2 * p + 1]), kv_bf16_to_float(k[2 * p + 1]));
      acc = pair_half(acc, kv_bf16_to_float(qb[2 * p]), kv_bf16_to_float(k[2 * p]));
    }
    lane[l] = acc;
  }
  float x[8];
  for (int l = 0; l < 8; ++l) x[l] = lane[l] + lane[l + 8];
  return (((x[0] + x[4]) + (x[2] + x[6])) + ((x[1] + x[5]) + (x[3] + x[7]))) * scale;
}

inline void attend_tile(const TileQuery* qs, int64_t n, const Tile& tile, uint16_t* qb, bool scores_only) {
  const int64_t D = tile.D;
  for (int64_t j = 0; j < n; ++j) {
    const TileQuery& query = qs[j];
    for (int64_t i = 0; i < D; ++i) qb[i] = kv_float_to_bf16(query.q[i]);
    for (int64_t t = query.first; t < query.len; ++t)
      query.scores[t - query.first] = score(qb, tile.kp + tile.at(t), D, tile.scale);
    if (scores_only) continue;
    kvserve::kv_quant::base::softmax(query.scores, query.len - query.first);
    round_weights(query.scores, query.len - query.first);
    std::fill_n(query.out, D, 0.f);
    for (int64_t p = query.first / 2; p < (query.len + 1) / 2; ++p) {
      const uint32_t w = weight_pair(query, p);
      const float we = kv_bits_f32(w << 16), wo = kv_bits_f32(w & 0xFFFF0000u);
      const uint16_t* ve = 2 * p >= query.first ? tile.vp + tile.at(2 * p) : kZeroRow;
      const uint16_t* vo = 2 * p + 1 < query.len ? tile.vp + tile.at(2 * p + 1) : kZeroRow;
      for (int64_t d = 0; d < D; ++d) {
        float acc = pair_half(query.out[d], wo, kv_bf16_to_float(vo[d]));
        query.out[d] = pair_half(acc, we, kv_bf16_to_float(ve[d]));
      }
    }
  }
}

}  // namespace base

#ifdef KV_X86

// ---- avx2: the pair steps in 8 float lanes, denormals flushed by MXCSR ----
namespace avx2 {

#define KV_BF16_AVX2 __attribute__((target("avx2,fma"), always_inline)) inline

// MXCSR's denormals-are-zero (DAZ, bit 6) and flush-to-zero (FTZ, bit 15) set from construction to destruction,
// so every multiply and add in between does the reference's flushes itself: kv_flush_denormal on each input
// (DAZ), product and sum (FTZ), where spelled out they took four operations each. The same bits: x86 detects a
// tiny result after rounding (as SoftFloat's 8086 model has it), and the reference flushes the rounded result
// whose exponent field is zero; the two part only for an exact value within half a float32 ulp below 2^-126,
// which neither a product of two bfloat16 values (16 significant bits) nor a sum of two float32 values that are
// normal or zero (both multiples of 2^-149, so the sum is exact there) can be. The pair steps run in noinline
// functions between the two MXCSR writes (with memory barriers), so the compiler moves none of them across,
// nor anything else in: the reductions after the scores' lanes, the softmax and the weights' rounding do not
// flush.
struct FlushDenormals {
  unsigned saved;
  FlushDenormals() : saved(_mm_getcsr()) {
    _mm_setcsr(saved | 0x8040u);
    __asm__ volatile("" ::: "memory");
  }
  ~FlushDenormals() {
    __asm__ volatile("" ::: "memory");
    _mm_setcsr(saved);
  }
};

// 8 bfloat16 pairs (as uint32) -> their odd (high) and even (low) halves as floats (denormals as they are: DAZ
// reads them as zero).
KV_BF16_AVX2 __m256 odd_of(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(-65536)));
}
KV_BF16_AVX2 __m256 even_of(__m256i pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
KV_BF16_AVX2 __m256i load8(const uint16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
// 8 bfloat16 values -> floats.
KV_BF16_AVX2 __m256 widen(const uint16_t* p) {
  const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}
// One pair step of 8 lanes (under FlushDenormals): not an FMA, whose product is neither rounded nor flushed.
KV_BF16_AVX2 __m256 step(__m256 acc, __m256 x, __m256 y) { return _mm256_add_ps(acc, _mm256_mul_ps(x, y)); }

// Under FlushDenormals: the lanes (a0, a1: lanes 0-7, 8-15) of query qb's score with each of m keys (krows),
// into lanes[2 i], lanes[2 i + 1]; kD = D known at compile time (the query's halves then stay in registers), or 0.
template <int64_t kD>
__attribute__((target("avx2,fma"), noinline)) void score_lanes(const uint16_t* qb, const uint16_t* const* krows,
                                                               int64_t m, int64_t D_, __m256* lanes) {
  const int64_t D = kD > 0 ? kD : D_;
  constexpr int64_t kSteps = kD > 0 ? kD / 32 : 1;
  __m256 qo[kSteps][2], qe[kSteps][2];  // the query's odd and even halves of each 32-value step, with D known
  if constexpr (kD > 0)
    for (int64_t s = 0; s < kSteps; ++s)
      for (int h = 0; h < 2; ++h) {
        const __m256i q = load8(qb + 32 * s + 16 * h);
        qo[s][h] = odd_of(q);
        qe[s][h] = even_of(q);
      }
  for (int64_t t = 0; t < m; ++t) {
    const uint16_t* k = krows[t];
    __m256 a[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < D; i += 32)
      for (int h = 0; h < 2; ++h) {
        const __m256i kv = load8(k + i + 16 * h);
        if constexpr (kD > 0) {
          a[h] = step(step(a[h], qo[i / 32][h], odd_of(kv)), qe[i / 32][h], even_of(kv));
        } else {
          const __m256i q = load8(qb + i + 16 * h);
          a[h] = step(step(a[h], odd_of(q), odd_of(kv)), even_of(q), even_of(kv));
        }
      }
    lanes[2 * t] = a[0];
    lanes[2 * t + 1] = a[1];
  }
}

// Under FlushDenormals: out[8 kV floats] over key pairs p0 .. p1-1 of query (vrows: the chunk's V rows from key
// c0, offset to this block of the output), kV accumulators held over the keys.
template <int kV>
__attribute__((target("avx2,fma"), always_inline)) inline void output_block(const TileQuery& query,
                                                                          const uint16_t* const* vrows, int64_t c0,
                                                                          int64_t d0, int64_t p0, int64_t p1) {
  __m256 acc[kV];
  for (int r = 0; r < kV; ++r) acc[r] = _mm256_loadu_ps(query.out + d0 + 8 * r);
  for (int64_t p = p0; p < p1; ++p) {
    const uint32_t w = weight_pair(query, p);
    const __m256 wo = _mm256_set1_ps(kv_bits_f32(w & 0xFFFF0000u)), we = _mm256_set1_ps(kv_bits_f32(w << 16));
    const uint16_t* ve = 2 * p >= query.first ? vrows[2 * p - c0] + d0 : kZeroRow;
    const uint16_t* vo = 2 * p + 1 < query.len ? vrows[2 * p + 1 - c0] + d0 : kZeroRow;
    for (int r = 0; r < kV; ++r) acc[r] = step(step(acc[r], wo, widen(vo + 8 * r)), we, widen(ve + 8 * r));
  }
  for (int r = 0; r < kV; ++r) _mm256_storeu_ps(query.out + d0 + 8 * r, acc[r]);
}

// Under FlushDenormals: every query vector's output over the tile's keys lo .. hi-1 (lo even; weights rounded), a
// chunk of V rows at a time, 64 of a row's values (or 32) at a time in registers over the chunk's key pairs.
__attribute__((target("avx2,fma"), noinline)) inline void outputs(const TileQuery* qs, int64_t n, const Tile& tile,
                                                                  int64_t lo, int64_t hi) {
  const int64_t D = tile.D;
  const uint16_t* vrows[kChunk];
  for (int64_t c0 = lo; c0 < hi; c0 += kChunk) {
    const int64_t c1 = std::min(c0 + kChunk, hi);
    for (int64_t t = c0; t < c1; ++t) vrows[t - c0] = tile.vp + tile.at(t);
    for (int64_t j = 0; j < n; ++j) {
      const TileQuery& query = qs[j];
      const int64_t p0 = std::max(c0, query.first & ~int64_t{1}) / 2, p1 = std::min(c0 + kChunk, query.len + 1) / 2;
      int64_t d0 = 0;
      for (; d0 + 64 <= D; d0 += 64) output_block<8>(query, vrows, c0, d0, p0, p1);
      for (; d0 < D; d0 += 32) output_block<4>(query, vrows, c0, d0, p0, p1);
    }
  }
}

__attribute__((target("avx2,fma"))) inline void attend_tile(const TileQuery* qs, int64_t n, const Tile& tile,
                                                         uint16_t* qb, bool scores_only) {
  const int64_t D = tile.D;
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = 0; i < D; ++i) qb[j * D + i] = kv_float_to_bf16(qs[j].q[i]);
  int64_t lo, hi;
  kvserve::decode::tile_span(qs, n, &lo, &hi);
  lo &= ~int64_t{1};
  const uint16_t* krows[kChunk];
  __m256 lanes[2 * kChunk];
  for (int64_t c0 = lo; c0 < hi; c0 += kChunk) {  // scores, a chunk's K rows for every query vector
    const int64_t c1 = std::min(c0 + kChunk, hi);
    for (int64_t t = c0; t < c1; ++t) krows[t - c0] = tile.kp + tile.at(t);
    for (int64_t j = 0; j < n; ++j) {
      const TileQuery& query = qs[j];
      const int64_t t0 = std::max(c0, query.first), t1 = std::min(c1, query.len);
      if (t0 >= t1) continue;
      {
        FlushDenormals flushed;
        if (D == 64) score_lanes<64>(qb + j * D, krows + (t0 - c0), t1 - t0, D, lanes);
        else if (D == 128) score_lanes<128>(qb + j * D, krows + (t0 - c0), t1 - t0, D, lanes);
        else score_lanes<0>(qb + j * D, krows + (t0 - c0), t1 - t0, D, lanes);
      }
      float* out = query.scores - query.first;
      int64_t t = t0;
      for (; t + 8 <= t1; t += 8) {  // hsum8(a0 + a1) * scale, 8 keys at once
        __m256 v[8];
        for (int u = 0; u < 8; ++u) v[u] = _mm256_add_ps(lanes[2 * (t + u - t0)], lanes[2 * (t + u - t0) + 1]);
        _mm256_storeu_ps(out + t, kvserve::decode::scores8(v, tile.scale));
      }
      for (; t < t1; ++t)
        out[t] = kvserve::decode::hsum8(_mm256_add_ps(lanes[2 * (t - t0)], lanes[2 * (t - t0) + 1])) * tile.scale;
    }
  }
  if (scores_only) return;
  for (int64_t j = 0; j < n; ++j) {
    kvserve::decode::softmax_avx2(qs[j].scores, qs[j].len - qs[j].first);
    round_weights(qs[j].scores, qs[j].len - qs[j].first);
    std::fill_n(qs[j].out, D, 0.f);
  }
  FlushDenormals flushed;
  outputs(qs, n, tile, lo, hi);
}

#undef KV_BF16_AVX2
}  // namespace avx2

// ---- avx512: vdpbf16ps ----
namespace avx512 {

#define KV_BF16_512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma"), always_inline)) inline

KV_BF16_512 __m512 dot(__m512 acc, __m512i x, __m512i y) { return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)y); }
KV_BF16_512 __m512i load32(const uint16_t* p) { return _mm512_loadu_si512(p); }

// kQ query vectors' scores against keys t0 .. t1-1 (each of them attends to all), 8 keys a pass over d so each K
// row loaded feeds kQ dot products (kQ x 8 accumulators: 24 of the 32 registers at kQ = 3), reduced together
// (scores_of); the keys left, fewer than 8, one at a time (score_of). Every score's operations are the same
// whichever block computes it. q[j]: query j's bfloat16 vector; s[j]: its scores, indexed by key.
template <int kQ>
KV_BF16_512 void scores_block(const uint16_t* const* q, const Tile& tile, int64_t t0, int64_t t1, float* const* s) {
  const int64_t D = tile.D;
  int64_t t = t0;
  for (; t + 8 <= t1; t += 8) {
    __m512 acc[kQ][8];
    const uint16_t* k[8];
    for (int r = 0; r < 8; ++r) {
      for (int j = 0; j < kQ; ++j) acc[j][r] = _mm512_setzero_ps();
      k[r] = tile.k_row(t + r);
    }
    for (int64_t i = 0; i < D; i += 32) {
      __m512i x[kQ];
      for (int j = 0; j < kQ; ++j) x[j] = load32(q[j] + i);
      if constexpr (kQ == 1) kvserve::decode::keep_in_register(*reinterpret_cast<__m512*>(&x[0]));
      for (int r = 0; r < 8; ++r) {
        __m512i kv = load32(k[r] + i);
        if constexpr (kQ > 1) kvserve::decode::keep_in_register(*reinterpret_cast<__m512*>(&kv));
        for (int j = 0; j < kQ; ++j) acc[j][r] = dot(acc[j][r], x[j], kv);
      }
    }
    for (int j = 0; j < kQ; ++j) _mm256_storeu_ps(s[j] + t, kvserve::decode::scores_of(acc[j], tile.scale));
  }
  for (; t < t1; ++t) {
    const uint16_t* k = tile.k_row(t);
    for (int j = 0; j < kQ; ++j) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t i = 0; i < D; i += 32) acc = dot(acc, load32(q[j] + i), load32(k + i));
      s[j][t] = kvserve::decode::score_of(acc, tile.scale);
    }
  }
}

// The scores of query vectors qs[0 .. kQ) (bfloat16 vectors qb[j * D ..]) over the chunk's keys c0 .. c1-1:
// kQ at a time (scores_block) over the keys all of them attend, each alone over its others, in key order.
template <int kQ>
KV_BF16_512 void scores_group(const TileQuery* qs, const uint16_t* qb, const Tile& chunk, int64_t c0, int64_t c1) {
  const uint16_t* q[kQ];
  float* s[kQ];
  int64_t t0[kQ], t1[kQ], s0 = c0, s1 = c1;
  for (int j = 0; j < kQ; ++j) {
    q[j] = qb + j * chunk.D;
    s[j] = qs[j].scores - qs[j].first;
    t0[j] = std::max(c0, qs[j].first);
    t1[j] = std::min(c1, qs[j].len);
    s0 = std::max(s0, t0[j]);
    s1 = std::min(s1, t1[j]);
  }
  s1 = std::max(s0, s1);
  for (int j = 0; j < kQ; ++j) scores_block<1>(q + j, chunk, t0[j], std::min(t1[j], s0), s + j);
  scores_block<kQ>(q, chunk, s0, s1, s);
  for (int j = 0; j < kQ; ++j) scores_block<1>(q + j, chunk, std::max(t0[j], s1), t1[j], s + j);
}

// The K rows of keys c0 .. c0 + 16 m - 1 (m groups of 16; rows through chunk.krows) transposed by bfloat16 pairs:
// kt[p * kChunk + i] = pair p (32 bits) of key c0 + i, so one zmm load at kt + p * kChunk + 16 b is pair p of the
// 16 keys of group b. 16 x 16 blocks of 32-bit elements: unpack 32, unpack 64, then two 128-bit lane shuffles.
template <int64_t kD>
KV_BF16_512 void transpose_pairs(const Tile& chunk, int64_t c0, int64_t m, uint32_t* kt) {
  for (int64_t i0 = 0; i0 < 16 * m; i0 += 16)
    for (int64_t p0 = 0; p0 < kD / 2; p0 += 16) {
      __m512i r[16], t[16], u[16];
      for (int i = 0; i < 16; ++i) r[i] = load32(chunk.k_row(c0 + i0 + i) + 2 * p0);
      for (int i = 0; i < 16; i += 2) {  // 128-bit lane k: [a4k, b4k, a4k+1, b4k+1], [a4k+2, b4k+2, ...]
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
      }
      for (int g = 0; g < 4; ++g) {  // u[4g + e], lane k: element 4k + e of rows 4g .. 4g + 3
        u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
      }
      for (int e = 0; e < 4; ++e) {  // column 4k + e: lane k of u[e], u[4 + e], u[8 + e], u[12 + e]
        const __m512i v0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x88), v1 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xDD);
        const __m512i w0 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x88);
        const __m512i w1 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xDD);
        uint32_t* col = kt + (p0 + e) * kChunk + i0;
        _mm512_store_si512(col, _mm512_shuffle_i32x4(v0, w0, 0x88));                 // k = 0
        _mm512_store_si512(col + 4 * kChunk, _mm512_shuffle_i32x4(v1, w1, 0x88));    // k = 1
        _mm512_store_si512(col + 8 * kChunk, _mm512_shuffle_i32x4(v0, w0, 0xDD));    // k = 2
        _mm512_store_si512(col + 12 * kChunk, _mm512_shuffle_i32x4(v1, w1, 0xDD));   // k = 3
      }
    }
}

// The scores of kQ query vectors (qp[j]: query j's bfloat16 pairs as 32-bit words) against kG groups of 16
// keys transposed by pairs (kt: the first group's column 0, the others 16 columns apart), lanes over the keys.
// Lane partial l of a key (the vdpbf16ps chain over pairs p = l, l + 16, ... from zero) is one register's lane
// here, built with the same pair steps in the same order; then, as scores_of, x_l = partial l + partial l + 8,
// hsum8's ((x0 + x4) + (x2 + x6)) + ((x1 + x5) + (x3 + x7)), times scale: every addition of a row's score, done for
// 16 keys at once with no shuffles. Each query pair is broadcast once for the kG groups and each K register loaded
// once for the kQ queries (kQ + kG loads for kQ kG dot products); the x_l go through xs (L1), kQ kG registers at a
// time.
// kScoreGroups: two groups for D = 64 (measured on a Zen 5 EPYC, the attention of a 512-row prefill chunk with
// SmolLM2's and Llama-3.2-1B's heads: 1.09-1.1x with the scale folded into pack_pairs, four groups slower: the
// registers spill); D = 128's longer chains gained nothing (one group).
template <int64_t kD>
constexpr int kScoreGroups = kD == 64 ? 2 : 1;

template <int64_t kD, int kQ, int kG>
KV_BF16_512 void scores_transposed_groups(const uint32_t* const* qp, const uint32_t* kt, float scale,
                                          float* const* out) {
  __m512 xs[8][kQ][kG];
  for (int l = 0; l < 8; ++l) {
    __m512 x[kQ][kG];
    for (int half = 0; half < 2; ++half) {
      __m512 acc[kQ][kG];
      for (int j = 0; j < kQ; ++j)
        for (int g = 0; g < kG; ++g) acc[j][g] = _mm512_setzero_ps();
      for (int64_t p = l + 8 * half; p < kD / 2; p += 16) {
        __m512i k[kG];
        for (int g = 0; g < kG; ++g) {
          k[g] = _mm512_load_si512(kt + p * kChunk + 16 * g);
          kvserve::decode::keep_in_register(*reinterpret_cast<__m512*>(&k[g]));
        }
        for (int j = 0; j < kQ; ++j) {
          __m512i w = _mm512_set1_epi32(static_cast<int>(qp[j][p]));
          kvserve::decode::keep_in_register(*reinterpret_cast<__m512*>(&w));
          for (int g = 0; g < kG; ++g) acc[j][g] = dot(acc[j][g], w, k[g]);
        }
      }
      for (int j = 0; j < kQ; ++j)
        for (int g = 0; g < kG; ++g) x[j][g] = half == 0 ? acc[j][g] : _mm512_add_ps(x[j][g], acc[j][g]);
    }
    for (int j = 0; j < kQ; ++j)
      for (int g = 0; g < kG; ++g) xs[l][j][g] = x[j][g];
  }
  const __m512 sv = _mm512_set1_ps(scale);
  for (int j = 0; j < kQ; ++j)
    for (int g = 0; g < kG; ++g) {
      const __m512 z0 = _mm512_add_ps(_mm512_add_ps(xs[0][j][g], xs[4][j][g]), _mm512_add_ps(xs[2][j][g], xs[6][j][g]));
      const __m512 z1 = _mm512_add_ps(_mm512_add_ps(xs[1][j][g], xs[5][j][g]), _mm512_add_ps(xs[3][j][g], xs[7][j][g]));
      _mm512_storeu_ps(out[j] + 16 * g, _mm512_mul_ps(_mm512_add_ps(z0, z1), sv));
    }
}

// scores_group over a chunk whose first `groups` groups of 16 keys are transposed in kt: kQ at a time over the
// whole groups all of them attend (scores_transposed_groups, kScoreGroups groups at a time, then one), each alone
// (scores_block) over its other keys.
template <int64_t kD, int kQ>
KV_BF16_512 void scores_group_transposed(const TileQuery* qs, const uint16_t* qb, const Tile& chunk, int64_t c0,
                                         int64_t c1, const uint32_t* kt, int64_t groups) {
  const uint16_t* q[kQ];
  float* s[kQ];
  int64_t t0[kQ], t1[kQ], s0 = c0, s1 = c1;
  for (int j = 0; j < kQ; ++j) {
    q[j] = qb + j * kD;
    s[j] = qs[j].scores - qs[j].first;
    t0[j] = std::max(c0, qs[j].first);
    t1[j] = std::min(c1, qs[j].len);
    s0 = std::max(s0, t0[j]);
    s1 = std::min(s1, t1[j]);
  }
  const int64_t b0 = c0 + std::min(groups, (s0 - c0 + 15) / 16) * 16;
  const int64_t b1 = std::max(b0, c0 + std::min(groups, std::max<int64_t>(0, s1 - c0) / 16) * 16);
  const uint32_t* qp[kQ];
  for (int j = 0; j < kQ; ++j) qp[j] = reinterpret_cast<const uint32_t*>(q[j]);
  int64_t t = b0;
  if constexpr (kScoreGroups<kD> > 1)
    for (; t + 16 * kScoreGroups<kD> <= b1; t += 16 * kScoreGroups<kD>) {
      float* out[kQ];
      for (int j = 0; j < kQ; ++j) out[j] = s[j] + t;
      scores_transposed_groups<kD, kQ, kScoreGroups<kD>>(qp, kt + (t - c0), chunk.scale, out);
    }
  for (; t < b1; t += 16) {
    float* out[kQ];
    for (int j = 0; j < kQ; ++j) out[j] = s[j] + t;
    scores_transposed_groups<kD, kQ, 1>(qp, kt + (t - c0), chunk.scale, out);
  }
  for (int j = 0; j < kQ; ++j) {
    if (b1 > b0) {
      scores_block<1>(q + j, chunk, t0[j], b0, s + j);
      scores_block<1>(q + j, chunk, std::max(t0[j], b1), t1[j], s + j);
    } else {
      scores_block<1>(q + j, chunk, t0[j], t1[j], s + j);
    }
  }
}

// Output lane m of the unpacklo (unpackhi) register of a 32-value block holds d = 8 (m / 4) + m % 4 (+ 4).
inline int64_t lane_d(int64_t m) { return m < 16 ? 8 * (m / 4) + m % 4 : 8 * ((m - 16) / 4) + (m - 16) % 4 + 4; }

// Key pairs p0 .. p1-1 of one query into its output row (in lane order), kD = D known (<= 256) or looped.
// A query's softmax weights rounded to bfloat16 (vcvtneps2bf16: kv_float_to_bf16's rounding) and packed in place
// into its key pairs' weight pairs (weight_pair's), pair p at index p - floor(first / 2): the bfloat16 weights in
// key order are those pairs' halves, after a zero (the even key before an odd `first`) and before one (the odd key
// at an odd end). The writes land at or below what is still to be read (2 bytes a weight written, 4 read).
// The weights are the softmax's exponentials, scaled here (inv: 1 / their sum, softmax_avx512's Unscaled), each
// x * inv as scale_scores would have stored it, then rounded: one pass over the weights instead of two.
KV_BF16_512 void pack_pairs(const TileQuery& query, float inv) {
  const int64_t span = query.len - query.first, off = query.first & 1;
  float* w = query.scores;
  auto* out = reinterpret_cast<uint16_t*>(w);
  const __m512 invv = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < span; i += 16) {
    const __mmask16 mask = span - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (span - i)) - 1u);
    const __m256bh b = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_maskz_loadu_ps(mask, w + i), invv));
    if (i == 0 && off) out[0] = 0;  // after the load of the first weights, whose bytes it overwrites
    _mm256_mask_storeu_epi16(out + off + i, mask, (__m256i)b);
  }
  if ((off + span) % 2) out[off + span] = 0;
}

// The V rows of key pairs pb .. pe-1 interleaved two by two, once per tile for all its query vectors: vi[(p - pb)
// * D / 16 + r] is register r (unpacklo, unpackhi per 32 values) of pair p; a key past the tile's last, hi, is 0.
template <int64_t kD>
KV_BF16_512 void interleave_pairs(const Tile& tile, int64_t pb, int64_t pe, int64_t hi, __m512i* vi) {
  for (int64_t p = pb; p < pe; ++p) {
    const uint16_t* ve = tile.v_row(2 * p);
    for (int64_t b = 0; b < kD / 32; ++b) {
      const __m512i e = load32(ve + 32 * b);
      const __m512i o = 2 * p + 1 < hi ? load32(tile.v_row(2 * p + 1) + 32 * b) : _mm512_setzero_si512();
      vi[(p - pb) * (kD / 16) + 2 * b] = _mm512_unpacklo_epi16(e, o);
      vi[(p - pb) * (kD / 16) + 2 * b + 1] = _mm512_unpackhi_epi16(e, o);
    }
  }
}

// Key pairs p0 .. p1-1 of one query into its output row (in lane order). kD known: a pair whose two keys the query
// attends comes from vi (interleave_pairs from pair pb), its edge pairs (the even key before `first`, the odd one
// at `len`) are interleaved here with a zero row; kD = 0: every pair interleaved here, a loop over D.
template <int64_t kD>
KV_BF16_512 void outputs_range(const TileQuery& query, const Tile& tile, int64_t p0, int64_t p1, const __m512i* vi,
                               int64_t pb, float* out) {
  const int64_t D = kD > 0 ? kD : tile.D;
  constexpr int64_t kRegs = kD > 0 ? kD / 16 : 2;
  if constexpr (kD > 0) {
    __m512 acc[kRegs];
    for (int64_t r = 0; r < kRegs; ++r) acc[r] = _mm512_loadu_ps(out + 16 * r);
    for (int64_t p = p0; p < p1; ++p) {
      const __m512i w = _mm512_set1_epi32(static_cast<int>(kv_f32_bits(query.scores[p - query.first / 2])));
      if (vi != nullptr && 2 * p >= query.first && 2 * p + 1 < query.len) {
        const __m512i* v = vi + (p - pb) * kRegs;
        for (int64_t r = 0; r < kRegs; ++r) acc[r] = dot(acc[r], w, v[r]);
        continue;
      }
      const uint16_t* ve = 2 * p >= query.first ? tile.v_row(2 * p) : kZeroRow;
      const uint16_t* vo = 2 * p + 1 < query.len ? tile.v_row(2 * p + 1) : kZeroRow;
      for (int64_t b = 0; b < kD / 32; ++b) {
        const __m512i e = load32(ve + 32 * b), o = load32(vo + 32 * b);
        acc[2 * b] = dot(acc[2 * b], w, _mm512_unpacklo_epi16(e, o));
        acc[2 * b + 1] = dot(acc[2 * b + 1], w, _mm512_unpackhi_epi16(e, o));
      }
    }
    for (int64_t r = 0; r < kRegs; ++r) _mm512_storeu_ps(out + 16 * r, acc[r]);
  } else {
    for (int64_t b = 0; b < D / 32; ++b) {
      __m512 lo = _mm512_loadu_ps(out + 32 * b), hi = _mm512_loadu_ps(out + 32 * b + 16);
      for (int64_t p = p0; p < p1; ++p) {
        const __m512i w = _mm512_set1_epi32(static_cast<int>(kv_f32_bits(query.scores[p - query.first / 2])));
        const uint16_t* ve = 2 * p >= query.first ? tile.v_row(2 * p) : kZeroRow;
        const uint16_t* vo = 2 * p + 1 < query.len ? tile.v_row(2 * p + 1) : kZeroRow;
        const __m512i e = load32(ve + 32 * b), o = load32(vo + 32 * b);
        lo = dot(lo, w, _mm512_unpacklo_epi16(e, o));
        hi = dot(hi, w, _mm512_unpackhi_epi16(e, o));
      }
      _mm512_storeu_ps(out + 32 * b, lo);
      _mm512_storeu_ps(out + 32 * b + 16, hi);
    }
  }
}

// Key pairs p0 .. p1-1 of kQ query vectors qs[0 .. kQ) that each attend to both keys of every one of these pairs,
// from vi (interleave_pairs from pair pb), into their output rows (in lane order): per pair each interleaved V
// register is loaded once for kQ dot products (kQ x kD / 16 accumulators: 24 at kQ = 3, kD = 128), each output
// lane taking its pairs in order as outputs_range's.
template <int64_t kD, int kQ>
KV_BF16_512 void outputs_shared(const TileQuery* qs, int64_t p0, int64_t p1, const __m512i* vi, int64_t pb) {
  constexpr int64_t kRegs = kD / 16;
  __m512 acc[kQ][kRegs];
  const float* w[kQ];
  for (int j = 0; j < kQ; ++j) {
    w[j] = qs[j].scores - qs[j].first / 2;
    for (int64_t r = 0; r < kRegs; ++r) acc[j][r] = _mm512_loadu_ps(qs[j].out + 16 * r);
  }
  for (int64_t p = p0; p < p1; ++p) {
    __m512i wp[kQ];
    for (int j = 0; j < kQ; ++j) wp[j] = _mm512_set1_epi32(static_cast<int>(kv_f32_bits(w[j][p])));
    const __m512i* v = vi + (p - pb) * kRegs;
    for (int64_t r = 0; r < kRegs; ++r) {
      __m512i x = _mm512_load_si512(v + r);
      kvserve::decode::keep_in_register(*reinterpret_cast<__m512*>(&x));
      for (int j = 0; j < kQ; ++j) acc[j][r] = dot(acc[j][r], wp[j], x);
    }
  }
  for (int j = 0; j < kQ; ++j)
    for (int64_t r = 0; r < kRegs; ++r) _mm512_storeu_ps(qs[j].out + 16 * r, acc[j][r]);
}

// The chunk's key pairs (from c0) of query vectors qs[0 .. kQ) into their output rows: kQ at a time
// (outputs_shared) over the pairs whose two keys all of them attend, each alone (outputs_range) over its others,
// in pair order.
template <int64_t kD, int kQ>
KV_BF16_512 void outputs_group(const TileQuery* qs, const Tile& chunk, int64_t c0, const __m512i* vi, int64_t pb) {
  int64_t p0[kQ], p1[kQ], f0 = c0 / 2, f1 = (c0 + kChunk) / 2;
  for (int j = 0; j < kQ; ++j) {
    p0[j] = std::max(c0, qs[j].first & ~int64_t{1}) / 2;
    p1[j] = std::min(c0 + kChunk, qs[j].len + 1) / 2;
    f0 = std::max(f0, std::max(p0[j], (qs[j].first + 1) / 2));  // pairs 2p >= first
    f1 = std::min(f1, std::min(p1[j], qs[j].len / 2));           // pairs 2p + 1 < len
  }
  f1 = std::max(f0, f1);
  for (int j = 0; j < kQ; ++j)
    if (p0[j] < std::min(p1[j], f0)) outputs_range<kD>(qs[j], chunk, p0[j], std::min(p1[j], f0), vi, pb, qs[j].out);
  if (f0 < f1) outputs_shared<kD, kQ>(qs, f0, f1, vi, pb);
  for (int j = 0; j < kQ; ++j)
    if (std::max(p0[j], f1) < p1[j]) outputs_range<kD>(qs[j], chunk, std::max(p0[j], f1), p1[j], vi, pb, qs[j].out);
}

// attend_tile.h's row lookups and prefetches, on the tile's pool (base: its kp or vp) from key c0 (the chunk's).
KV_BF16_512 void chunk_rows(const Tile& tile, const uint16_t* base, int64_t c0, int64_t c1, const uint16_t** rows) {
  kvserve::decode::chunk_rows(base, tile.table, tile.bs, tile.H_kv, tile.g, tile.D, c0, c1, rows);
}
KV_BF16_512 void prefetch_rows(const Tile& tile, const uint16_t* base, int64_t c0, int64_t c1) {
  kvserve::decode::prefetch_rows(base, tile.table, tile.bs, tile.H_kv, tile.g, tile.D, c0, c1);
}

template <int64_t kD>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma"))) void attend_tile_d(const TileQuery* qs, int64_t n,
                                                                                   const Tile& tile, uint16_t* qb,
                                                                                   bool scores_only) {
  const int64_t D = tile.D;
  for (int64_t j = 0; j < n; ++j)  // vcvtneps2bf16: kv_float_to_bf16's rounding
    for (int64_t i = 0; i < D; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + j * D + i),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(qs[j].q + i)));
  int64_t lo, hi;
  kvserve::decode::tile_span(qs, n, &lo, &hi);
  lo &= ~int64_t{1};
  const uint16_t* krows[kChunk];
  const uint16_t* vrows[kChunk];
  // a prefill tile (D known) reads each chunk's whole groups of 16 keys transposed, once for all its query vectors
  // (a decode row's few vectors would not repay the transposition)
  const bool transposed = kD > 0 && n >= 12;
  alignas(64) uint32_t kt[kD > 0 ? kChunk * kD / 2 : 1];
  for (int64_t c0 = lo; c0 < hi; c0 += kChunk) {  // scores, a chunk's K rows for every query vector
    const int64_t c1 = std::min(c0 + kChunk, hi);
    Tile chunk = tile;
    chunk_rows(tile, tile.kp, c0, c1, krows);
    if (c1 < hi) prefetch_rows(tile, tile.kp, c1, std::min(c1 + kChunk, hi));
    else if (!scores_only) prefetch_rows(tile, tile.vp, lo, std::min(lo + kChunk, hi));
    chunk.krows = krows;
    chunk.c0 = c0;
    const int64_t groups = transposed ? (c1 - c0) / 16 : 0;
    int64_t j = 0;  // three query vectors at a time, then the two or one left
    if constexpr (kD > 0) {
      if (groups > 0) {
        transpose_pairs<kD>(chunk, c0, groups, kt);
        for (; j + 3 <= n; j += 3) scores_group_transposed<kD, 3>(qs + j, qb + j * D, chunk, c0, c1, kt, groups);
      }
    }
    for (; j + 3 <= n; j += 3) scores_group<3>(qs + j, qb + j * D, chunk, c0, c1);
    if (n - j == 2) scores_group<2>(qs + j, qb + j * D, chunk, c0, c1);
    if (n - j == 1) scores_group<1>(qs + j, qb + j * D, chunk, c0, c1);
  }
  if (scores_only) return;
  // the softmax four query vectors at a time (softmax_queries_avx512's), each one's weights scaled as they are
  // packed
  for (int64_t j = 0; j < n;) {
    const int m = n - j >= 4 ? 4 : 1;
    float* s[4];
    int64_t span[4];
    float inv[4];
    for (int r = 0; r < m; ++r) {
      s[r] = qs[j + r].scores;
      span[r] = qs[j + r].len - qs[j + r].first;
    }
    if (m == 4) kvserve::decode::softmax_avx512<4, true>(s, span, inv);
    else kvserve::decode::softmax_avx512<1, true>(s, span, inv);
    for (int r = 0; r < m; ++r) {
      pack_pairs(qs[j + r], inv[r]);
      std::fill_n(qs[j + r].out, D, 0.f);
    }
    j += m;
  }
  // outputs (in lane order): a chunk's V rows interleaved once (D known, two query vectors or more), then every
  // query vector over them
  const bool shared = kD > 0 && n >= 2;
  alignas(64) __m512i vi[kChunk / 2 * (kD > 0 ? kD / 16 : 1)];
  for (int64_t c0 = lo; c0 < hi; c0 += kChunk) {
    const int64_t pb = c0 / 2, pe = (std::min(c0 + kChunk, hi) + 1) / 2;
    Tile chunk = tile;
    chunk_rows(tile, tile.vp, c0, std::min(c0 + kChunk, hi), vrows);
    if (c0 + kChunk < hi) prefetch_rows(tile, tile.vp, c0 + kChunk, std::min(c0 + 2 * kChunk, hi));
    chunk.vrows = vrows;
    chunk.c0 = c0;
    if (shared) interleave_pairs<kD>(chunk, pb, pe, hi, vi);
    int64_t j = 0;
    if constexpr (kD > 0) {  // D known: three query vectors at a time over the pairs they all attend
      if (shared) {
        for (; j + 3 <= n; j += 3) outputs_group<kD, 3>(qs + j, chunk, c0, vi, pb);
        if (n - j == 2) {
          outputs_group<kD, 2>(qs + j, chunk, c0, vi, pb);
          j += 2;
        }
      }
    }
    for (; j < n; ++j) {
      const TileQuery& query = qs[j];
      const int64_t p0 = std::max(c0, query.first & ~int64_t{1}) / 2, p1 = std::min(c0 + kChunk, query.len + 1) / 2;
      if (p0 < p1) outputs_range<kD>(query, chunk, p0, p1, shared ? vi : nullptr, pb, query.out);
    }
  }
  float lanes[512];
  for (int64_t j = 0; j < n; ++j) {  // lane order -> d order (loops, not std::copy_n: no memmove in a leaf)
    for (int64_t d = 0; d < D; ++d) lanes[d] = qs[j].out[d];
    for (int64_t b = 0; b < D; b += 32)
      for (int64_t m = 0; m < 32; ++m) qs[j].out[b + lane_d(m)] = lanes[b + m];
  }
}

inline void attend_tile(const TileQuery* qs, int64_t n, const Tile& tile, uint16_t* qb, bool scores_only) {
  if (tile.D == 64) return attend_tile_d<64>(qs, n, tile, qb, scores_only);
  if (tile.D == 128) return attend_tile_d<128>(qs, n, tile, qb, scores_only);
  attend_tile_d<0>(qs, n, tile, qb, scores_only);
}

#undef KV_BF16_512
}  // namespace avx512

#endif

// The path the bfloat16 cache's attention runs for head size D: avx512 where cpu.h chose it and the CPU has
// AVX512-BF16 (cpu::bf16()), avx2 where chosen, else the scalar one; the vector paths for D a multiple of 32.
inline kvserve::cpu::Isa path(int64_t D) {
  using kvserve::cpu::Isa;
  if (!vector_takes(D)) return Isa::kScalar;
  if (kvserve::cpu::bf16()) return Isa::kAvx512;
  return kvserve::cpu::avx2() ? Isa::kAvx2 : Isa::kScalar;
}

// One tile on path isa (path()'s choice, or a lesser one), with the caller's scratch qb: n * D bfloat16 values,
// overwritten (the query vectors rounded). No allocation, no thread-local state: the emulator's leaves
// (attend_leaves.cpp) run this. scores_only: stop after the scores (each query's scores, times scale, in
// key order; out untouched), so a test can compare every score's bits, which the weights' rounding to bfloat16
// would mostly hide in the outputs.
inline void attend_tile(kvserve::cpu::Isa isa, const TileQuery* qs, int64_t n, const Tile& tile, uint16_t* qb,
                        bool scores_only = false) {
#ifdef KV_X86
  if (isa == kvserve::cpu::Isa::kAvx512) return avx512::attend_tile(qs, n, tile, qb, scores_only);
  if (isa == kvserve::cpu::Isa::kAvx2) return avx2::attend_tile(qs, n, tile, qb, scores_only);
#endif
  base::attend_tile(qs, n, tile, qb, scores_only);
}

// The same with a scratch of this thread's own, kept across calls.
inline void attend_tile(kvserve::cpu::Isa isa, const TileQuery* qs, int64_t n, const Tile& tile) {
  static thread_local std::vector<uint16_t> qb;
  qb.resize(n * tile.D);
  attend_tile(isa, qs, n, tile, qb.data());
}

}  // namespace kvserve::bf16_attend
