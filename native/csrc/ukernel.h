/* What the micro-kernels share: the GGUF kernels' call (kv_ggml_args; ukernel_gguf.h has the formats, layouts
 * and arithmetic) and the helpers of every micro-kernel (ukernel_gguf.h, ukernel_bf16.h).
 *
 * A micro-kernel is a leaf: an extern "C" function of one pointer to its argument struct that calls nothing (no
 * libc, no OpenMP, no allocation, no C++ runtime), reads no global data but constants and has no jump tables, so
 * the same source compiles into the extension (linear_*.cpp: packing, threads, activation quantization) and
 * freestanding (native/leaves.py) for the CPU emulator (native/emulate.py). This header is C and C++.
 */
#ifndef KVSERVE_UKERNEL_H
#define KVSERVE_UKERNEL_H

#include <stdint.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define KV_UK_X86 1
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Register tiles: KV_MR_* activation rows x KV_NR_* output features (one vector of float32 lanes). The scalar
 * kernels read panels of any width (nr). */
#define KV_NR_AVX2 8
#define KV_MR_AVX2 4
#define KV_NR_AVX512 16
#define KV_MR_AVX512 8

/* One GGUF micro-kernel call: `rows` activation rows x `panels` panels of `nr` features (ukernel_gguf.h's packed
 * layout), the activations quantized per block of 32 (act_quant.h), or for Q4_K and Q5_K per super-block of 256
 * (their d_x in each of its blocks' xd). */
typedef struct kv_ggml_args {
  const uint8_t* w;     /* the first panel: nb / blocks-per-unit units of nr * unit bytes */
  const int8_t* xq;     /* activation codes [rows][ldq] (the first nb * 32 of each row are read) */
  const float* xd;      /* activation block scales d_x [rows][ldb] */
  const float* xs;      /* d_x * (float)qsum [rows][ldb] (read by the formats with a minimum) */
  const int32_t* xsum;  /* qsum [rows][ldb] (read by the formats with an offset) */
  float* y;             /* outputs [rows][ldy]: panel p's features at y + p * nr */
  int64_t ldq, ldb, ldy;
  int32_t nb;           /* blocks of 32 along K */
  int32_t rows;         /* any */
  int32_t cols;         /* 1..nr: the last panel's features stored (the others store nr) */
  int32_t nr;           /* panel width: KV_NR_AVX2 or KV_NR_AVX512 (the vector kernels assume their own) */
  int64_t ldw;           /* bytes from one panel to the next */
  int32_t panels;        /* panels of the call, >= 1 */
  int32_t ahead;         /* AVX-512 K-quant tiles of one or two rows: bytes ahead of the group being read that each
                          * group prefetches towards L1 in each panel of the tile (within the call's panels), or 0:
                          * the hardware prefetchers alone */
  int32_t unpack;        /* AVX-512, calls of more than KV_MR_AVX512 rows: 1 takes Q5_K's and Q6_K's groups unpacked
                          * once for every tile of rows, 0 makes the codes per tile */
  const int16_t* xsum16; /* qsum [rows][ldb] as int16 (read by Q4_K and Q5_K: their minimums' sums, in pairs) */
  const int16_t* xsum16h; /* qsum per 16 codes [rows][2 * ldb] as int16 (read by Q6_K: its offset's sums, in
                           * pairs) */
} kv_ggml_args;

/* IEEE half -> float, exactly, by bit manipulation (the scalar kernels' twin of vcvtph2ps, NaNs quieted as
 * it does). */
static inline float kv_half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  uint32_t mantissa = h & 0x3FFu;
  uint32_t bits;
  if (exponent == 0x1Fu) {
    bits = sign | 0x7F800000u | (mantissa << 13) | (mantissa ? 0x00400000u : 0u);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else { /* subnormal: mantissa * 2^-24, normalized */
    uint32_t e = 113u;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --e;
    }
    bits = sign | (e << 23) | ((mantissa & 0x3FFu) << 13);
  }
  union {
    uint32_t u;
    float f;
  } pun;
  pun.u = bits;
  return pun.f;
}

static inline uint16_t kv_load_u16(const uint8_t* p) { return (uint16_t)(p[0] | (p[1] << 8)); }


/* ---- Helpers of the micro-kernels (inlined into them; no calls, no data). */
#define KV_UNROLL _Pragma("GCC unroll 16")
#define KV_AVX512_TARGET "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"

/* 4 activation codes as one int32 (an unaligned load the compiler turns into one move). */
static inline int32_t kv_load_i32(const int8_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return v;
}

#ifdef KV_UK_X86
/* The first `cols` (1..8) lanes of v to y. */
static inline __attribute__((always_inline, target("avx2,fma,f16c"))) void kv_store_avx2(float* y, __m256 v,
                                                                                         int cols) {
  if (cols >= KV_NR_AVX2) {
    _mm256_storeu_ps(y, v);
    return;
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  _mm256_maskstore_ps(y, _mm256_cmpgt_epi32(_mm256_set1_epi32(cols), lane), v);
}

/* The first `cols` (1..16) lanes of v to y. */
static inline __attribute__((always_inline, target(KV_AVX512_TARGET))) void kv_store_avx512(float* y, __m512 v,
                                                                                            int cols) {
  _mm512_mask_storeu_ps(y, (__mmask16)((1u << cols) - 1u), v);
}

/* tile(a, R) with R = a->rows as a constant (so the tile's row loops unroll into registers), 1..8: an if chain,
 * not a switch, so no jump table (data with relocations) is made. */
#define KV_AVX512_ROWS(tile, a)          \
  do {                                   \
    const int rows_ = (a)->rows;         \
    if (rows_ >= 8) tile(a, 8);          \
    else if (rows_ == 7) tile(a, 7);     \
    else if (rows_ == 6) tile(a, 6);     \
    else if (rows_ == 5) tile(a, 5);     \
    else if (rows_ == 4) tile(a, 4);     \
    else if (rows_ == 3) tile(a, 3);     \
    else if (rows_ == 2) tile(a, 2);     \
    else tile(a, 1);                     \
  } while (0)
#endif

#ifdef __cplusplus
}
#endif

#endif /* KVSERVE_UKERNEL_H */
