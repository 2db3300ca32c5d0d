/* GEMM micro-kernels for bfloat16 weights x float32 activations (an unquantized bfloat16 model), one per ISA:
 * the scalar reference and AVX512-BF16 (vdpbf16ps). Leaves as in ukernel.h (one struct argument, no calls, no
 * data), compiled into the extension (linear_bf16.cpp: packing, activation conversion, tiles, threads) and
 * freestanding for the CPU emulator (native/bf16_leaves.py). Header-only, C and C++; include it in exactly one
 * translation unit of each build (linear_bf16.cpp, leaves.cpp).
 *
 * ---- Weights: w bfloat16 [N, K] packed once at load time into panels of KV_NR_BF16 = 32 output features; a
 *   panel is kp = ceil(K / 2) pairs in K order, pair t = 32 features x 2 bfloat16 (128 bytes): element 2n + j of
 *   pair t = w[32p + n, 2t + j]. So one 32-bit lane holds one feature's weights k = 2t (low half) and 2t + 1 (high
 *   half), the operand order of vdpbf16ps; a 512-bit vector is 16 features, two of them a panel. Features past N
 *   and the weight k = K of an odd K are zero.
 * ---- Activations: x float32 [M, K] converted once per call to bfloat16 pairs [M, kp] (uint32: low half k = 2t,
 *   high half k = 2t + 1; k = K of an odd K is zero) by kv_bf16_convert_* (vcvtneps2bf16's rounding).
 *
 * ---- The arithmetic, the same bits on every path, tile position, remainder and batch size (the Intel SDM's
 *   VDPBF16PS, lane i: srcdest.fp32[i] += src1.bf16[2i+1] * src2.bf16[2i+1], then += src1.bf16[2i] * src2.bf16[2i],
 *   with denormal inputs read as zero (DAZ), denormal results written as zero (FTZ), round to nearest even,
 *   MXCSR not consulted):
 *   for each output (row r, feature n): acc = +0.0f; then for t = 0, 1, .., kp - 1 in this order:
 *       acc = ftz(acc + ftz(daz(w[2t+1]) * daz(x[2t+1])))     (the product of two bfloat16 is exact in float32
 *       acc = ftz(acc + ftz(daz(w[2t])   * daz(x[2t])))        unless it overflows or underflows)
 *   y = acc. One chain per output, in K order: a row's bits never depend on the other rows of its call.
 *   NaN payloads are not modelled (the reference and the hardware may quiet a different NaN).
 * ---- The activation conversion (the SDM's convert_fp32_to_bfloat16 of VCVTNEPS2BF16): zero and denormal ->
 *   signed zero; infinity -> its upper half; NaN -> its upper half with the quiet bit set; else round to nearest
 *   even by the integer add bits + 0x7FFF + bit 16 (which may carry into infinity).
 */
#ifndef KVSERVE_UKERNEL_BF16_H
#define KVSERVE_UKERNEL_BF16_H

#include "bf16_bits.h"
#include "ukernel.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KV_NR_BF16 32 /* features per panel: two vectors of 16 float32 lanes */
#define KV_MR_BF16 8  /* activation rows per register tile: 8 x 2 accumulators, 2 weight vectors */
/* the AVX-512 path's target (its helpers inline here) plus BF16; cpu::bf16() asks for both */
#define KV_BF16_TARGET KV_AVX512_TARGET ",avx512bf16"

/* One micro-kernel call: `rows` activation rows x one panel, the first `cols` features stored. */
typedef struct kv_bf16_args {
  const uint16_t* w; /* the panel: kp pairs of KV_NR_BF16 x 2 bfloat16 (the packed layout above) */
  const uint32_t* x; /* activation bfloat16 pairs [rows][ldx] (the first kp of each row are read) */
  float* y;          /* outputs [rows][ldy]: features 0..cols-1 of the panel */
  int64_t ldx, ldy;
  int32_t kp;        /* pairs along K */
  int32_t rows;      /* 1..KV_MR_BF16 for the vector kernel (any for scalar) */
  int32_t cols;      /* 1..KV_NR_BF16 */
} kv_bf16_args;

/* One conversion call: n float32 values to n bfloat16 (n any; the driver pads an odd row). */
typedef struct kv_bf16_convert_args {
  const float* x;
  uint16_t* out;
  int64_t n;
} kv_bf16_convert_args;

void kv_bf16_scalar(const kv_bf16_args* a);
void kv_bf16_avx512(const kv_bf16_args* a); /* AVX512-BF16 (+ F/BW/VL); rows <= KV_MR_BF16 */
void kv_bf16_convert_scalar(const kv_bf16_convert_args* a);
void kv_bf16_convert_avx512(const kv_bf16_convert_args* a);
/* The roofline's peak, not a kernel: `iterations` rounds of 16 independent vdpbf16ps on registers (no loads),
 * 16 * 32 multiply-adds a round; returns a lane of the sum so the work cannot be dropped
 * (loadtest/kernelbench.py times it through ctypes). */
float kv_bf16_peak(int64_t iterations);

/* The reference: one output at a time in the order above, for any number of rows. */
void kv_bf16_scalar(const kv_bf16_args* a) {
  for (int r = 0; r < a->rows; ++r)
    for (int n = 0; n < a->cols; ++n) {
      const uint32_t* x = a->x + r * a->ldx;
      float acc = 0.0f;
      for (int t = 0; t < a->kp; ++t) {
        const uint16_t* w = a->w + (int64_t)t * (2 * KV_NR_BF16) + 2 * n;
        const float odd = kv_bf16_to_float(w[1]) * kv_bf16_to_float((uint16_t)(x[t] >> 16));
        acc = kv_flush_denormal(acc + kv_flush_denormal(odd));
        const float even = kv_bf16_to_float(w[0]) * kv_bf16_to_float((uint16_t)(x[t] & 0xFFFFu));
        acc = kv_flush_denormal(acc + kv_flush_denormal(even));
      }
      a->y[r * a->ldy + n] = acc;
    }
}

void kv_bf16_convert_scalar(const kv_bf16_convert_args* a) {
  for (int64_t i = 0; i < a->n; ++i) a->out[i] = kv_float_to_bf16(a->x[i]);
}

#ifdef KV_UK_X86
/* `rows` rows x 32 features: per pair t, the panel's two weight vectors meet each row's activation pair,
 * broadcast as one int32, in one vdpbf16ps each; 2 * rows independent accumulator chains hide its latency. */
static inline __attribute__((always_inline, target(KV_BF16_TARGET))) void kv_bf16_avx512_tile(const kv_bf16_args* a,
                                                                                            const int rows) {
  __m512 lo[KV_MR_BF16], hi[KV_MR_BF16];
  KV_UNROLL for (int r = 0; r < rows; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  const uint16_t* w = a->w;
  for (int t = 0; t < a->kp; ++t, w += 2 * KV_NR_BF16) {
    const __m512bh w_lo = (__m512bh)_mm512_loadu_si512((const void*)w);
    const __m512bh w_hi = (__m512bh)_mm512_loadu_si512((const void*)(w + KV_NR_BF16));
    KV_UNROLL for (int r = 0; r < rows; ++r) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32((int)a->x[r * a->ldx + t]);
      lo[r] = _mm512_dpbf16_ps(lo[r], w_lo, x);
      hi[r] = _mm512_dpbf16_ps(hi[r], w_hi, x);
    }
  }
  const int cols_lo = a->cols < 16 ? a->cols : 16, cols_hi = a->cols - cols_lo;
  KV_UNROLL for (int r = 0; r < rows; ++r) {
    kv_store_avx512(a->y + r * a->ldy, lo[r], cols_lo);
    if (cols_hi > 0) kv_store_avx512(a->y + r * a->ldy + 16, hi[r], cols_hi);
  }
}

__attribute__((target(KV_BF16_TARGET))) void kv_bf16_avx512(const kv_bf16_args* a) {
  KV_AVX512_ROWS(kv_bf16_avx512_tile, a);
}

/* 16 values a vcvtneps2bf16, the tail through masks. (Not the two-source vcvtne2ps2bf16: the same rounding, but
 * the emulator, bochscpu 0.4.0, fills both halves of its result from the second source, so it could not be
 * tested where the CPU lacks BF16.) */
__attribute__((target(KV_BF16_TARGET))) void kv_bf16_convert_avx512(const kv_bf16_convert_args* a) {
  int64_t i = 0;
  for (; i + 16 <= a->n; i += 16)
    _mm256_storeu_si256((__m256i*)(a->out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(a->x + i)));
  const int64_t left = a->n - i;
  if (left > 0) {
    const __mmask16 mask = (__mmask16)((1u << left) - 1u);
    const __m256bh b = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, a->x + i));
    _mm256_mask_storeu_epi16((void*)(a->out + i), mask, (__m256i)b);
  }
}

__attribute__((target(KV_BF16_TARGET))) float kv_bf16_peak(int64_t iterations) {
  __m512 acc[16];  /* 16: KV_UNROLL's count, so the chains stay in registers */
  const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3F803F80), b = (__m512bh)_mm512_set1_epi32(0x3C003C00);
  /* distinct starts the compiler cannot see through: 16 equal chains would be merged into one, whose latency, not
   * the unit's throughput, would be measured */
  KV_UNROLL for (int c = 0; c < 16; ++c) {
    acc[c] = _mm512_set1_ps((float)c);
    __asm__("" : "+v"(acc[c]));
  }
  for (int64_t i = 0; i < iterations; ++i) KV_UNROLL for (int c = 0; c < 16; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
  __m512 sum = acc[0];
  KV_UNROLL for (int c = 1; c < 16; ++c) sum = _mm512_add_ps(sum, acc[c]);
  return _mm512_cvtss_f32(sum);
}
#endif /* KV_UK_X86 */

#ifdef __cplusplus
}
#endif

#endif /* KVSERVE_UKERNEL_BF16_H */
