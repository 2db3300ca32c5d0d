// The one place that decides which instruction-set path the native kernels run (linear_*.cpp, decode_ops.cpp).
//
// The kernels are compiled for every path with target attributes, so one build runs on any x86-64 CPU; at run
// time the best path the CPU supports (cpuid, through the compiler's __builtin_cpu_supports) is chosen, unless
// KVSERVE_ISA names a lesser one: `scalar` forces the portable loops on any CPU and `avx2` the AVX2 loops on an
// AVX-512 CPU, so one machine tests every path it can run (native/emulate.py runs the AVX-512 micro-kernels
// where the CPU lacks them). A value the CPU cannot run falls back to the best it can (native/__init__.py warns and refuses
// unknown names before the extension loads).
#pragma once

#include <cstdlib>
#include <cstring>

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace kvserve::cpu {

// Ordered: a path may use every lesser one's instructions (the AVX-512 path runs the AVX2 kernels of the
// families that have no AVX-512 micro-kernel).
enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// The best path this CPU supports. AVX2 here means AVX2 + FMA + F16C (every AVX2 CPU has all three; the int4
// and NF4 kernels convert float16 scales with F16C). AVX-512 means F + BW + VL + VNNI (vpdpbusd: the GGUF
// micro-kernels, ukernel.h), as on Ice Lake, Sapphire Rapids and Zen 4 and later. AVX512-BF16 (vdpbf16ps, the
// bfloat16-weight micro-kernel of ukernel_bf16.h) is not required for it: Ice Lake lacks it; bf16() says whether
// that kernel runs.
inline Isa detected() {
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
      return Isa::kAvx512;
    return Isa::kAvx2;
  }
#endif
  return Isa::kScalar;
}

// detected(), capped by KVSERVE_ISA (scalar | avx2 | avx512); read once per process.
inline Isa chosen() {
  static const Isa isa = [] {
    const Isa best = detected();
    const char* env = std::getenv("KVSERVE_ISA");
    if (env != nullptr && std::strcmp(env, "scalar") == 0) return Isa::kScalar;
    if (env != nullptr && std::strcmp(env, "avx2") == 0) return best < Isa::kAvx2 ? best : Isa::kAvx2;
    return best;
  }();
  return isa;
}

inline bool avx2() { return chosen() >= Isa::kAvx2; }

// Whether the bfloat16-weight kernel (ukernel_bf16.h) runs: the AVX-512 path is chosen (so KVSERVE_ISA=avx2 or
// scalar turns it off) and the CPU has AVX512-BF16, as Sapphire Rapids and Zen 4 do.
inline bool bf16() {
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
  static const bool has = chosen() == Isa::kAvx512 && __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

// Whether the AVX-512 path runs on an Intel CPU: the GGUF kernels' settings below differ by vendor.
inline bool intel_avx512() {
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
  static const bool intel = chosen() == Isa::kAvx512 && __builtin_cpu_is("intel");
  return intel;
#else
  return false;
#endif
}

// The CPU's family as cpuid leaf 1 gives it (base family, plus the extended family where the base is 0xF): AMD's
// Zen 4 is 0x19, Zen 5 0x1A. 0 where cpuid is not available.
inline unsigned cpu_family() {
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
  const unsigned base = (a >> 8) & 0xFu;
  return base == 0xFu ? base + ((a >> 20) & 0xFFu) : base;
#else
  return 0;
#endif
}

// Whether the AVX-512 path runs on an AMD Zen 5 or later (family 0x1A+). The EPYC (Turin) of the measurements below
// has 512-bit vector units, where Zen 4 splits each 512-bit operation into two 256-bit halves, so its kernels
// consume the weights' stream about twice as fast; the laptop parts of the family (Strix Point) keep 256-bit units
// and were not measured.
inline bool amd_zen5_avx512() {
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
  static const bool full = chosen() == Isa::kAvx512 && __builtin_cpu_is("amd") && cpu_family() >= 0x1Au;
  return full;
#else
  return false;
#endif
}

// The GGUF K-quant kernels' prefetch for a decode step of one or two rows on the AVX-512 path (kv_ggml_args.ahead):
// bytes ahead in the panel stream, 1024 on Intel CPUs and AMD's Zen 5 and later, 0 (the hardware prefetchers alone)
// elsewhere. Measured with `python -m kvserve.loadtest kernelbench --ggml-model`, which times both side by side: a
// Q4_K_M Llama-3.2-1B step's projections at 1 row 1.08-1.12x with it on a Sapphire Rapids VM (2 rows level); on a
// Zen 5 EPYC 1 row 1.3x (1.6x on the served model's fused projections) and 2 rows 1.35x, its tiles reading the
// stream faster than the hardware prefetchers alone bring it; 2048 bytes or more ahead no faster; Q4_1 and the AVX2
// path no faster or slower; on a Zen 4 EPYC prefetching a one-row tile's groups lost. linear_ggml.cpp starts from
// this value (set_gguf_prefetch changes it).
inline int gguf_prefetch_default() { return intel_avx512() || amd_zen5_avx512() ? 1024 : 0; }

// Whether the GGUF kernels' calls of many rows (prefill chunks, decode batches past a register tile) take Q5_K's and
// Q6_K's groups unpacked once for every tile of rows on the AVX-512 path (kv_ggml_args.unpack): on Intel CPUs, where
// the bitwise operations that make the codes share ports 0 and 5 with vpdpbusd and the float steps (measured on a
// Sapphire Rapids VM: Q6_K 1.16-1.17x, Q5_K 1.05-1.17x at 32 and 64 rows); not on an AMD EPYC (Zen 4), where they
// go to other pipes and the tiles that make their codes ran 1.25x the unpacked ones (docs/kernels.md).
// linear_ggml.cpp starts from this value (set_gguf_unpack changes it).
inline bool gguf_unpack_default() { return intel_avx512(); }

// Whether the GGUF kernels' calls of many rows (prefill chunks, decode batches) may run on AMX-INT8 tiles (ukernel_gguf_amx.h, the
// AVX-512 kernels' bits): the AVX-512 path is chosen, KVSERVE_AMX is not 0, the CPU has
// AMX-TILE and AMX-INT8 (cpuid leaf 7: EDX bits 24, 25; Sapphire Rapids and later), the OS saves the tile state
// (XCR0 bits 17, 18) and Linux grants this process its use (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA,
// Linux 5.16+). A virtual machine may list the flags without the state: the first tile instruction would then
// fault, so each condition is checked before any runs. Read once per process.
inline bool amx() {
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__) && defined(__linux__)
  static const bool on = [] {
    if (chosen() != Isa::kAvx512) return false;
    const char* env = std::getenv("KVSERVE_AMX");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || ((d >> 24) & 3u) != 3u) return false;
    if (!__get_cpuid(1, &a, &b, &c, &d) || ((c >> 27) & 1u) == 0) return false;  // OSXSAVE: xgetbv may run
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if (((lo >> 17) & 3u) != 3u) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return on;
#else
  return false;
#endif
}

inline const char* name(Isa isa) {
  return isa == Isa::kAvx512 ? "avx512" : isa == Isa::kAvx2 ? "avx2" : "scalar";
}

}  // namespace kvserve::cpu
