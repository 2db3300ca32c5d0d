/* Every micro-kernel (ukernel_gguf.h, ukernel_bf16.h) in one translation unit, compiled freestanding by
 * native/leaves.py for the CPU emulator; the extension includes the same headers from linear_ggml.cpp and
 * linear_bf16.cpp. C++: ukernel_gguf.h's kernels are templates over the format. */
#include "ukernel_gguf.h"
#include "ukernel_bf16.h"

#ifdef KV_UK_X86
/* ---- Roofline probes, not kernels (loadtest/kernelbench.py times them through ctypes, on the native build). */
extern "C" {

/* Reads `bytes` (a multiple of 256) at p with 32-byte loads into 8 independent chains, as a kernel streams its
 * weights; returns a lane of their OR so the loads cannot be dropped. */
__attribute__((target("avx2"))) uint32_t kv_read_bytes(const uint8_t* p, int64_t bytes) {
  __m256i acc[8];
  KV_UNROLL for (int c = 0; c < 8; ++c) acc[c] = _mm256_setzero_si256();
  for (int64_t i = 0; i < bytes; i += 256)
    KV_UNROLL for (int c = 0; c < 8; ++c)
      acc[c] = _mm256_or_si256(acc[c], _mm256_loadu_si256((const __m256i*)(p + i + 32 * c)));
  KV_UNROLL for (int c = 1; c < 8; ++c) acc[0] = _mm256_or_si256(acc[0], acc[c]);
  return (uint32_t)_mm256_extract_epi32(acc[0], 0);
}

/* `iterations` rounds of 16 independent vpdpbusd on registers (no loads), 16 * 64 int8 multiply-adds a round:
 * one core's int8 peak on the AVX-512 VNNI path. */
__attribute__((target(KV_AVX512_TARGET))) int32_t kv_vnni_peak(int64_t iterations) {
  __m512i acc[16];
  __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-5);
  __asm__("" : "+v"(a), "+v"(b));  /* opaque: the compiler cannot fold the rounds into one multiply */
  KV_UNROLL for (int c = 0; c < 16; ++c) {
    acc[c] = _mm512_set1_epi32(c);
    __asm__("" : "+v"(acc[c]));  /* 16 distinct chains: none may be merged with another */
  }
  for (int64_t i = 0; i < iterations; ++i) KV_UNROLL for (int c = 0; c < 16; ++c) acc[c] = _mm512_dpbusd_epi32(acc[c], a, b);
  KV_UNROLL for (int c = 1; c < 16; ++c) acc[0] = _mm512_add_epi32(acc[0], acc[c]);
  return _mm512_cvtsi512_si32(acc[0]);
}

/* `iterations` rounds of 16 independent float32 FMAs on zmm registers (no loads), 16 * 16 multiply-adds a round:
 * one core's float32 peak on the AVX-512 path (the float32 cache's attention tiles, attend_tile.h). Each chain is
 * acc = acc * 0.5 + 1, which settles at 2: no overflow, no denormal however many rounds. */
__attribute__((target(KV_AVX512_TARGET))) float kv_fma_peak_avx512(int64_t iterations) {
  __m512 acc[16];
  __m512 a = _mm512_set1_ps(0.5f), b = _mm512_set1_ps(1.f);
  __asm__("" : "+v"(a), "+v"(b));
  KV_UNROLL for (int c = 0; c < 16; ++c) {
    acc[c] = _mm512_set1_ps((float)c);
    __asm__("" : "+v"(acc[c]));
  }
  for (int64_t i = 0; i < iterations; ++i) KV_UNROLL for (int c = 0; c < 16; ++c) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
  KV_UNROLL for (int c = 1; c < 16; ++c) acc[0] = _mm512_add_ps(acc[0], acc[c]);
  return _mm512_cvtss_f32(acc[0]);
}

/* The same on the AVX2 path: 12 chains of 8 lanes (12 * 8 multiply-adds a round; 12 + the two operands fit the 16
 * ymm registers, and cover an FMA's latency times its issue rate on current cores). */
__attribute__((target("avx2,fma"))) float kv_fma_peak_avx2(int64_t iterations) {
  __m256 acc[12];
  __m256 a = _mm256_set1_ps(0.5f), b = _mm256_set1_ps(1.f);
  __asm__("" : "+x"(a), "+x"(b));
  KV_UNROLL for (int c = 0; c < 12; ++c) {
    acc[c] = _mm256_set1_ps((float)c);
    __asm__("" : "+x"(acc[c]));
  }
  for (int64_t i = 0; i < iterations; ++i) KV_UNROLL for (int c = 0; c < 12; ++c) acc[c] = _mm256_fmadd_ps(acc[c], a, b);
  KV_UNROLL for (int c = 1; c < 12; ++c) acc[0] = _mm256_add_ps(acc[0], acc[c]);
  return _mm256_cvtss_f32(acc[0]);
}

/* `iterations` rounds of 8 vpmaddubsw (u8 x s8 pairs into int16), each added into its own int16 sum, as the AVX2
 * path's GGUF dots sum their pairs (ukernel_gguf.h; the vpmaddwd that widens them comes once per several blocks),
 * 8 * 32 int8 multiply-adds a round: one core's int8 peak on the AVX2 path. The multiplies take fixed registers,
 * so only the one-cycle vpaddw chains on the sums: what bounds the round is the multiplies' issue rate, not their
 * latency (each sum feeding its own next multiply, as this probe first did, measured 0.8-0.9x this rate on an AMD
 * EPYC: latency-bound). In asm, so the compiler neither hoists the loop-invariant multiplies nor spills the sums. */
__attribute__((target("avx2"))) int32_t kv_int8_peak_avx2(int64_t iterations) {
  __m256i acc[8], t0, t1;
  const __m256i x0 = _mm256_set1_epi8(3), x1 = _mm256_set1_epi8(5), x2 = _mm256_set1_epi8(7), x3 = _mm256_set1_epi8(9);
  const __m256i b = _mm256_set1_epi8(-5);
  KV_UNROLL for (int c = 0; c < 8; ++c) acc[c] = _mm256_set1_epi16((short)(c + 1));
  for (int64_t i = 0; i < iterations; ++i)
    __asm__("vpmaddubsw %[b], %[x0], %[t0]\n\tvpaddw %[t0], %[a0], %[a0]\n\t"
            "vpmaddubsw %[b], %[x1], %[t1]\n\tvpaddw %[t1], %[a1], %[a1]\n\t"
            "vpmaddubsw %[b], %[x2], %[t0]\n\tvpaddw %[t0], %[a2], %[a2]\n\t"
            "vpmaddubsw %[b], %[x3], %[t1]\n\tvpaddw %[t1], %[a3], %[a3]\n\t"
            "vpmaddubsw %[b], %[x0], %[t0]\n\tvpaddw %[t0], %[a4], %[a4]\n\t"
            "vpmaddubsw %[b], %[x1], %[t1]\n\tvpaddw %[t1], %[a5], %[a5]\n\t"
            "vpmaddubsw %[b], %[x2], %[t0]\n\tvpaddw %[t0], %[a6], %[a6]\n\t"
            "vpmaddubsw %[b], %[x3], %[t1]\n\tvpaddw %[t1], %[a7], %[a7]"
            : [a0] "+x"(acc[0]), [a1] "+x"(acc[1]), [a2] "+x"(acc[2]), [a3] "+x"(acc[3]), [a4] "+x"(acc[4]),
              [a5] "+x"(acc[5]), [a6] "+x"(acc[6]), [a7] "+x"(acc[7]), [t0] "=&x"(t0), [t1] "=&x"(t1)
            : [x0] "x"(x0), [x1] "x"(x1), [x2] "x"(x2), [x3] "x"(x3), [b] "x"(b));
  KV_UNROLL for (int c = 1; c < 8; ++c) acc[0] = _mm256_add_epi16(acc[0], acc[c]);
  return _mm256_extract_epi32(acc[0], 0);
}

}  // extern "C"
#endif
