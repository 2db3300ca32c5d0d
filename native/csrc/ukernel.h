/* GEMM micro-kernels for GGUF's Q4_1 and Q8_0 weight blocks (llama.cpp's ggml formats), one per (format, ISA).
 *
 * Each is a leaf: an extern "C" function of one pointer to kv_ggml_args that calls nothing (no libc, no OpenMP,
 * no allocation, no C++ runtime), reads no global data (constants come from _mm*_set1 inside the function) and
 * has no jump tables, so the same source compiles into the extension (linear_ggml.cpp, which walks the tiles,
 * threads and quantizes) and freestanding (native/leaves.py) for the CPU emulator (native/emulate.py). This
 * header is C and C++.
 *
 * ---- Weights, as in a GGUF file (ggml's block_q4_1 / block_q8_0), blocks of 32 weights along K:
 *   Q4_1 (20 bytes): fp16 d, fp16 m, 16 bytes qs (byte j: low nibble = weight j, high nibble = weight j + 16),
 *                    w = d * q + m, q in 0..15;
 *   Q8_0 (34 bytes): fp16 d, 32 int8 q, w = d * q.
 * ---- Packed (the micro-kernels' order; linear_ggml.cpp packs once at load time): panels of NR output features;
 *   a panel is nb = K / 32 blocks in K order, each NR * bytes-per-block contiguous bytes:
 *   Q4_1: NR fp16 d, NR fp16 m, then 4 chunks of NR * 4 bytes: bytes 4n..4n+3 of chunk t = qs bytes 4t..4t+3 of
 *         feature n (low nibbles: weights 4t..4t+3, high nibbles: weights 16+4t..16+4t+3);
 *   Q8_0: NR fp16 d, then 8 chunks of NR * 4 bytes: bytes 4n..4n+3 of chunk t = codes 4t..4t+3 of feature n.
 *   So one 32-bit lane of a chunk is one feature's 4 consecutive codes: a vector lane is an output feature, and
 *   4 activation codes broadcast as one int32 meet it in one vpmaddubsw / vpdpbusd (no horizontal sums).
 *   Features past N in the last panel are zero bytes (their outputs are computed and not stored).
 * ---- Activations: per row and block of 32, q int8 = round(x / d_x) clamped to +-127, d_x = max|x| / 127
 *   (act_quant.h, llama.cpp's Q8_0), qsum = sum(q) (int32), xs = d_x * (float)qsum (Q4_1's minimum term).
 *
 * ---- The arithmetic, the same bits on every path, tile position, remainder and batch size:
 *   for each output (row r, feature n): acc = 0.0f; then for b = 0, 1, .., nb - 1 in this order:
 *       dot = sum_k q_w[k] * q_x[k]            (int32, exact: |dot| <= 32 * 255 * 127 < 2^24, so exact in float)
 *       s   = (float)dot * d_x[b]              (one float32 multiply, rounded)
 *       acc = fmaf(d_w[b], s, acc)             (fused, one rounding)
 *       acc = fmaf(m_w[b], xs[b], acc)         (Q4_1 only: the minimum's share, m * d_x * sum(q_x))
 *   y = acc. d_w, m_w are the block's fp16 values widened exactly to float32.
 *   The integer dot is exact however it is formed: Q4_1 codes are unsigned (u8 x s8 directly); Q8_0 on AVX2 moves
 *   the sign of w onto x (|w| x sign(x, w), vpmaddubsw pairs <= 2 * 128 * 127 < 2^15) and on AVX-512 VNNI adds
 *   128 to w (u8 w + 128 in vpdpbusd) and subtracts 128 * qsum afterwards.
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
 * kernel reads panels of any width (nr) and serves any number of rows. */
#define KV_NR_AVX2 8
#define KV_MR_AVX2 4
#define KV_NR_AVX512 16
#define KV_MR_AVX512 8
#define KV_Q4_1_BYTES 20 /* bytes per block of 32 weights */
#define KV_Q8_0_BYTES 34

/* One micro-kernel call: `rows` activation rows x one panel of `nr` features, the first `cols` stored. */
typedef struct kv_ggml_args {
  const uint8_t* w;     /* the panel: nb blocks of nr * bytes-per-block (the packed layout above) */
  const int8_t* xq;     /* activation codes [rows][ldq] (the first nb * 32 of each row are read) */
  const float* xd;      /* activation block scales d_x [rows][ldb] */
  const float* xs;      /* d_x * (float)qsum [rows][ldb] (read by Q4_1) */
  const int32_t* xsum;  /* qsum [rows][ldb] (read by the AVX-512 Q8_0 kernel) */
  float* y;             /* outputs [rows][ldy]: features 0..cols-1 of the panel */
  int64_t ldq, ldb, ldy;
  int32_t nb;           /* blocks along K */
  int32_t rows;         /* 1..MR of the ISA (any for scalar) */
  int32_t cols;         /* 1..nr */
  int32_t nr;           /* panel width: KV_NR_AVX2 or KV_NR_AVX512 (the vector kernels assume their own) */
} kv_ggml_args;

void kv_q4_1_scalar(const kv_ggml_args* a);
void kv_q4_1_avx2(const kv_ggml_args* a);   /* AVX2 + FMA + F16C; nr = 8, rows <= 4 */
void kv_q4_1_avx512(const kv_ggml_args* a); /* AVX-512 F/BW/VL/VNNI; nr = 16, rows <= 8 */
void kv_q8_0_scalar(const kv_ggml_args* a);
void kv_q8_0_avx2(const kv_ggml_args* a);
void kv_q8_0_avx512(const kv_ggml_args* a);

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

/* tile(a, R) with R = a->rows (1..4) as a constant, as KV_AVX512_ROWS. */
#define KV_AVX2_ROWS(tile, a)            \
  do {                                   \
    const int rows_ = (a)->rows;         \
    if (rows_ >= 4) tile(a, 4);          \
    else if (rows_ == 3) tile(a, 3);     \
    else if (rows_ == 2) tile(a, 2);     \
    else tile(a, 1);                     \
  } while (0)

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
