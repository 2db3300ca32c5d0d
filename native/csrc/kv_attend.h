// The int8 / int4 KV cache's paged decode attention for one (sequence, KV head), torch-free, for every ISA path:
// the arguments (QuantAttend), the code layout (Chunk), and three namespaces that each define a path's lanes and
// then include the one body (kv_quant_body.h):
//
//   base     8 floats in an array, std::fma per lane, an exact float16 -> float in integer operations
//   avx2     AVX2 + FMA + F16C, 8 lanes in a ymm register
//   avx512   AVX-512 F, 16 lanes in a zmm register (G a multiple of 16, of 32 for int4: avx512_takes)
//
// Two translation units include it, so the shipped kernel and the tested leaves are one source: kv_quant.cpp
// (the extension: checks, threads, a scores buffer per thread) and kv_leaves.cpp (freestanding leaves for the CPU
// emulator and ctypes, native/kv_leaves.py, tests/test_kv_quant_emulated.py). Hence no torch, no libc or libm
// call in the leaf build (decode_core.h says how), no allocation: the caller hands in the scores buffer.
#pragma once

#include "attend_tile.h"
#include "decode_core.h"

#include <cstdint>
#include <type_traits>

namespace kvserve::kv_quant {

using kvserve::decode::DecodeCall;

// One paged_decode_attention_quant call: codes [num_blocks * block_size, H_kv, D * bits / 8] (int8, or int4
// packed two to a byte), scales [num_blocks * block_size, H_kv, D / G] float16 bits.
struct QuantAttend {
  DecodeCall call;
  const uint8_t* k_codes;
  const uint16_t* k_scales;
  const uint8_t* v_codes;
  const uint16_t* v_scales;
  int bits;
  int64_t G;  // elements per scale
};

constexpr int64_t kMaxChunks = 64;  // Vecs per head vector: D <= 512

// The codes of dims [c * kW, (c + 1) * kW) of a head vector (kW: a path's lanes): the byte they start at, whether
// they are high nibbles (int4: group byte j holds code j low and code j + G / 2 high), and their scale's index.
struct Chunk {
  int32_t offset;
  int32_t high;
  int32_t group;
};

// Whether the AVX-512 path takes G elements per scale: it needs 16 codes of one scale per Vec (G a multiple of
// 16; of 32 for int4, whose bytes hold a group's two halves). Otherwise the AVX2 path runs (the same bits).
inline bool avx512_takes(int bits, int64_t G) { return G % (bits == 8 ? 16 : 32) == 0; }

// ---- The baseline path: 8 float lanes in an array, one std::fma per lane (no FMA instruction needed) ----
namespace base {

constexpr int kW = 8;
struct Vec {
  float v[8];
};

inline Vec zero() { return Vec{}; }
// Loops, not std::memcpy: that is a libc call in the freestanding leaf build.
inline Vec load(const float* p) {
  Vec r;
  for (int l = 0; l < 8; ++l) r.v[l] = p[l];
  return r;
}
inline void store(float* p, const Vec& a) {
  for (int l = 0; l < 8; ++l) p[l] = a.v[l];
}
inline Vec bcast(float x) {
  Vec r;
  for (float& f : r.v) f = x;
  return r;
}
inline Vec mul(const Vec& a, const Vec& b) {
  Vec r;
  for (int l = 0; l < 8; ++l) r.v[l] = a.v[l] * b.v[l];
  return r;
}
inline Vec fma(const Vec& a, const Vec& b, const Vec& c) {
  Vec r;
  for (int l = 0; l < 8; ++l) r.v[l] = std::fma(a.v[l], b.v[l], c.v[l]);
  return r;
}
template <int Bits>
inline Vec codes_of(const uint8_t* row, const Chunk& chunk) {
  Vec r;
  for (int l = 0; l < 8; ++l) {
    const uint8_t byte = row[chunk.offset + l];
    r.v[l] = Bits == 8 ? static_cast<float>(static_cast<int8_t>(byte))
                       : static_cast<float>((chunk.high ? byte >> 4 : byte & 15) - 8);
  }
  return r;
}
// hsum8's order on the lanes of parts[0] + parts[1].
inline float reduce16(const Vec* parts) {
  float x[8];
  for (int l = 0; l < 8; ++l) x[l] = parts[0].v[l] + parts[1].v[l];
  return ((x[0] + x[4]) + (x[2] + x[6])) + ((x[1] + x[5]) + (x[3] + x[7]));
}
// float16 bits -> float, exactly, in integer operations (vcvtph2ps's result, as the vector paths convert; no
// c10::Half, no table): normals rebias the exponent, subnormals are normalised, infinities and NaNs keep their
// payload (a NaN quieted, as vcvtph2ps does).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 31u;
  uint32_t mantissa = h & 0x3FFu, bits;
  if (exponent == 31) {
    bits = sign | 0x7F800000u | (mantissa << 13) | (mantissa != 0 ? 0x400000u : 0u);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);  // 127 - 15 = 112
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // mantissa * 2^-24: shift the leading one up to bit 10, one exponent step per shift
    uint32_t e = 113;  // 2^-14's biased float exponent
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --e;
    }
    bits = sign | (e << 23) | ((mantissa & 0x3FFu) << 13);
  }
  return __builtin_bit_cast(float, bits);
}
inline void prefetch(const void* p) { __builtin_prefetch(p); }

using kvserve::decode::exp1;
using kvserve::decode::max_like_sse;

// softmax_avx2's operations in its order (decode_core.h), exp1 being one lane of exp8.
inline void softmax(float* s, int64_t span) {
  float m8[8], sum8[8] = {};
  for (float& m : m8) m = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  for (; i + 8 <= span; i += 8)
    for (int l = 0; l < 8; ++l) m8[l] = max_like_sse(m8[l], s[i + l]);
  float m4[4];
  for (int l = 0; l < 4; ++l) m4[l] = max_like_sse(m8[l], m8[l + 4]);
  float mx = max_like_sse(max_like_sse(m4[0], m4[2]), max_like_sse(m4[1], m4[3]));
  for (; i < span; ++i) mx = std::max(mx, s[i]);
  for (i = 0; i + 8 <= span; i += 8)
    for (int l = 0; l < 8; ++l) {
      s[i + l] = exp1(s[i + l] - mx);
      sum8[l] = sum8[l] + s[i + l];
    }
  float sum = ((sum8[0] + sum8[4]) + (sum8[2] + sum8[6])) + ((sum8[1] + sum8[5]) + (sum8[3] + sum8[7]));
  for (; i < span; ++i) {
    s[i] = exp1(s[i] - mx);
    sum += s[i];
  }
  const float inv = 1.f / sum;
  for (i = 0; i < span; ++i) s[i] *= inv;
}

#include "kv_quant_body.h"

}  // namespace base

#ifdef KV_X86

// ---- AVX2 + FMA: 8 lanes in a ymm register ----
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {

constexpr int kW = 8;
using Vec = __m256;

inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, Vec a) { _mm256_storeu_ps(p, a); }
inline Vec bcast(float x) { return _mm256_set1_ps(x); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
template <int Bits>
inline Vec codes_of(const uint8_t* row, const Chunk& chunk) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + chunk.offset));
  if (Bits == 8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  __m256i n = _mm256_cvtepu8_epi32(bytes);
  n = chunk.high ? _mm256_srli_epi32(n, 4) : _mm256_and_si256(n, _mm256_set1_epi32(15));
  return _mm256_cvtepi32_ps(_mm256_sub_epi32(n, _mm256_set1_epi32(8)));
}
inline float reduce16(const Vec* parts) { return kvserve::decode::hsum8(_mm256_add_ps(parts[0], parts[1])); }
inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
inline void softmax(float* s, int64_t span) { kvserve::decode::softmax_avx2(s, span); }

#include "kv_quant_body.h"

}  // namespace avx2
#pragma GCC pop_options

// ---- AVX-512 (F): 16 lanes in a zmm register; lanes 8-15 are the AVX2 path's second accumulator ----
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
namespace avx512 {

constexpr int kW = 16;
using Vec = __m512;

inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, Vec a) { _mm512_storeu_ps(p, a); }
inline Vec bcast(float x) { return _mm512_set1_ps(x); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
template <int Bits>
inline Vec codes_of(const uint8_t* row, const Chunk& chunk) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + chunk.offset));
  if (Bits == 8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
  __m512i n = _mm512_cvtepu8_epi32(bytes);
  n = chunk.high ? _mm512_srli_epi32(n, 4) : _mm512_and_si512(n, _mm512_set1_epi32(15));
  return _mm512_cvtepi32_ps(_mm512_sub_epi32(n, _mm512_set1_epi32(8)));
}
inline float reduce16(const Vec* parts) {
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(parts[0]), 1));
  return kvserve::decode::hsum8(_mm256_add_ps(_mm512_castps512_ps256(parts[0]), hi));
}
inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
inline void softmax(float* s, int64_t span) { kvserve::decode::softmax_avx2(s, span); }

#include "kv_quant_body.h"

}  // namespace avx512
#pragma GCC pop_options

#endif

#ifdef KV_X86

// A prompt tile's K and V rows from a quantized pool, for the float32 cache's tiles (attend_tile.h's Pool): each
// chunk's rows dequantized once into the tile's buffer, code times scale (exact: the values the per-row kernels
// above form in registers), for every query vector of the tile to read. Over those values the float32 tiles run
// exactly the per-row kernels' operations in their order (kv_quant_body.h), so a prompt row's bits are the same
// in a tile or alone; the rows of a prompt share each code row's read and widening instead of each row making
// its own (kv_quant.cpp takes it for tiles of several prompt rows, D <= 256 for the buffer).
struct QuantPool {
  static constexpr bool kInBuffer = true;
  static constexpr int64_t kMaxD = 256;
  const QuantAttend* a;
  const int64_t* table;
  int64_t g;
  Chunk map[kMaxD / 8];  // avx2::chunk_map's: 8 codes a chunk

  QuantPool(const QuantAttend& attend, const int64_t* table, int64_t g) : a(&attend), table(table), g(g), map{} {
    avx2::chunk_map(attend.bits, attend.call.D, attend.G, map);
  }

  // The rows of keys c0 .. c1-1 dequantized into buf (D floats each), rows[] pointed at them. Not inlined into
  // the tiles: one call a chunk of 64 keys.
  __attribute__((target("avx2,fma,f16c"), noinline)) void rows(const float** rows, float* buf, bool v, int64_t c0,
                                                               int64_t c1) const {
    const uint8_t* codes = v ? a->v_codes : a->k_codes;
    const uint16_t* scales = v ? a->v_scales : a->k_scales;
    const int64_t D = a->call.D, S = D / a->G, row_bytes = D * a->bits / 8;
    Rows at(*this, c0);
    for (int64_t t = c0; t < c1; ++t, at.next()) {
      const int64_t slot = at.slot();
      const uint8_t* row = codes + slot * row_bytes;
      float* out = buf + (t - c0) * D;
      for (int64_t c = 0; c < D / 8; ++c) {
        const Chunk& chunk = map[c];
        const __m256 s = _mm256_set1_ps(_cvtsh_ss(scales[slot * S + chunk.group]));
        const __m256 x = a->bits == 8 ? avx2::codes_of<8>(row, chunk) : avx2::codes_of<4>(row, chunk);
        _mm256_storeu_ps(out + 8 * c, _mm256_mul_ps(x, s));
      }
      rows[t - c0] = out;
    }
  }

  // Each code row (and its scales) of keys c0 .. c1-1 towards L2, as the float32 pool's rows (attend_tile.h).
  __attribute__((target("avx2,fma"), always_inline)) void prefetch(bool v, int64_t c0, int64_t c1) const {
    const uint8_t* codes = v ? a->v_codes : a->k_codes;
    const uint16_t* scales = v ? a->v_scales : a->k_scales;
    const int64_t S = a->call.D / a->G, row_bytes = a->call.D * a->bits / 8;
    Rows at(*this, c0);
    for (int64_t t = c0; t < c1; ++t, at.next()) {
      const int64_t slot = at.slot();
      for (int64_t b = 0; b < row_bytes; b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(codes + slot * row_bytes + b), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(scales + slot * S), _MM_HINT_T1);
    }
  }

 private:
  // Keys t, t + 1, ... as (slot * H_kv + g), stepping through the block table without a division per key.
  struct Rows {
    const QuantPool& pool;
    int64_t block, offset;
    Rows(const QuantPool& pool, int64_t t)
        : pool(pool), block(t / pool.a->call.block_size), offset(t % pool.a->call.block_size) {}
    int64_t slot() const {
      return (pool.table[block] * pool.a->call.block_size + offset) * pool.a->call.H_kv + pool.g;
    }
    void next() {
      if (++offset == pool.a->call.block_size) offset = 0, ++block;
    }
  };
};

#endif

// Whether the kernels hold a head vector of D elements with G per scale (D <= 512, at most kMaxScales scales).
inline bool shape_fits(int64_t D, int64_t G) { return D <= 8 * kMaxChunks && G >= 1 && D / G <= base::kMaxScales; }

}  // namespace kvserve::kv_quant
