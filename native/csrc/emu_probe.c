/* Probe leaves for the emulator harness's own tests (native/emulate.py, tests/test_emulate.py).
 *
 * Each exercises one AVX-512 behaviour a micro-kernel relies on, in the shape kvserve's micro-kernels have: a leaf
 * (no libc, no allocation) that takes ONE pointer to an argument struct. The tests run them emulated and, where the
 * CPU has these instructions, natively, and compare both with numpy bit for bit. Target attributes (not -m flags)
 * select the instructions, as in the real kernels, so one build serves the emulator and a native ctypes load. */
#include <stdint.h>
#include <immintrin.h>

#define EMU_PROBE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16")))

/* 16 lane sums of a[i] * b[i]: lane j accumulates the elements whose index mod 64 (vpdpbusd: 4 bytes a lane) or
 * mod 32 (vdpbf16ps: 2 bfloat16 a lane) falls in lane j. */
struct emu_probe_dot {
  const void* a;   /* uint8[n] (vpdpbusd) or bfloat16 bits, uint16[n] (vdpbf16ps) */
  const void* b;   /* int8[n] or uint16[n] */
  void* out;       /* int32[16] or float32[16] */
  int64_t n;       /* a multiple of 64 (vpdpbusd) or 32 (vdpbf16ps) */
};

/* dst[i] = src[i] + add for i < n, with a masked load and store for the tail: dst[n..] stays as it was. */
struct emu_probe_masked {
  const int32_t* src;
  int32_t* dst;
  int64_t n;
  int32_t add;
};

/* u8 x s8 dot products accumulated in int32, wrapping around on overflow as the hardware does. */
EMU_PROBE_AVX512 void emu_probe_dpbusd(const struct emu_probe_dot* args) {
  const uint8_t* a = (const uint8_t*)args->a;
  const int8_t* b = (const int8_t*)args->b;
  __m512i acc = _mm512_setzero_si512();
  for (int64_t i = 0; i < args->n; i += 64)
    acc = _mm512_dpbusd_epi32(acc, _mm512_loadu_si512(a + i), _mm512_loadu_si512(b + i));
  _mm512_storeu_si512(args->out, acc);
}

/* bfloat16 pair products accumulated in float32 (denormal inputs and results flushed, as the instruction does). */
EMU_PROBE_AVX512 void emu_probe_dpbf16(const struct emu_probe_dot* args) {
  const uint16_t* a = (const uint16_t*)args->a;
  const uint16_t* b = (const uint16_t*)args->b;
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < args->n; i += 32)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(a + i), (__m512bh)_mm512_loadu_si512(b + i));
  _mm512_storeu_ps(args->out, acc);
}

EMU_PROBE_AVX512 void emu_probe_masked_add(const struct emu_probe_masked* args) {
  const __m512i add = _mm512_set1_epi32(args->add);
  for (int64_t i = 0; i < args->n; i += 16) {
    const int64_t left = args->n - i;
    const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
    const __m512i v = _mm512_maskz_loadu_epi32(mask, args->src + i);
    _mm512_mask_storeu_epi32(args->dst + i, mask, _mm512_add_epi32(v, add));
  }
}

/* Plain integer arguments in the six System V registers, each weighted so a swapped pair changes the result. */
int64_t emu_probe_weighted_sum(int64_t a, int64_t b, int64_t c, int64_t d, int64_t e, int64_t f) {
  return a + 2 * b + 3 * c + 4 * d + 5 * e + 6 * f;
}

/* *target = value: with a null target the harness must report a page fault at address 0. */
void emu_probe_store(int64_t* target, int64_t value) { *target = value; }
