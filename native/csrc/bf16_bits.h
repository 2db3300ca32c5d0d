/* bfloat16 bits as vdpbf16ps and vcvtneps2bf16 read and write them (the Intel SDM's pseudo-code): the helpers the
 * bfloat16-weight micro-kernels (ukernel_bf16.h) and the bfloat16 KV cache's attention (attend_bf16.h) share, so
 * both take one convention for denormals (read as zero, written as zero) and for rounding. Header-only, C and C++,
 * no libc call (the freestanding leaf builds include it). */
#ifndef KVSERVE_BF16_BITS_H
#define KVSERVE_BF16_BITS_H

#include <stdint.h>

static inline uint32_t kv_f32_bits(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  return u;
}

static inline float kv_bits_f32(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

/* A float32 with a zero exponent field (zero or denormal) becomes the zero of its sign: vdpbf16ps' DAZ on its
 * inputs and FTZ on its products and sums. On the bits, so no multiply and add can fuse across it. */
static inline float kv_flush_denormal(float f) {
  const uint32_t u = kv_f32_bits(f);
  return (u & 0x7F800000u) == 0 ? kv_bits_f32(u & 0x80000000u) : f;
}

static inline float kv_bf16_to_float(uint16_t b) { return kv_flush_denormal(kv_bits_f32((uint32_t)b << 16)); }

/* float32 -> bfloat16 as vcvtneps2bf16 converts (the SDM's convert_fp32_to_bfloat16). */
static inline uint16_t kv_float_to_bf16(float f) {
  const uint32_t u = kv_f32_bits(f), exponent = u & 0x7F800000u;
  if (exponent == 0) return (uint16_t)((u >> 16) & 0x8000u);
  if (exponent == 0x7F800000u) return (uint16_t)((u >> 16) | ((u & 0x007FFFFFu) ? 0x0040u : 0u));
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#endif /* KVSERVE_BF16_BITS_H */
