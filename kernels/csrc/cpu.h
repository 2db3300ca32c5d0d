// The one place that decides which instruction-set path the native kernels run (linear_*.cpp, decode_ops.cpp).
//
// The kernels are compiled for every path with target attributes, so one build runs on any x86-64 CPU; at run
// time the best path the CPU supports (cpuid, through the compiler's __builtin_cpu_supports) is chosen, unless
// KVSERVE_ISA names a lesser one: `scalar` forces the portable loops on any CPU, so CI on an AVX2 machine tests
// both paths. A value the CPU cannot run falls back to the best it can (kernels/__init__.py warns and refuses
// unknown names before the extension loads).
#pragma once

#include <cstdlib>
#include <cstring>

namespace kvserve::cpu {

enum class Isa : int { kScalar = 0, kAvx2 = 1 };

// The best path this CPU supports. AVX2 here means AVX2 + FMA + F16C (every AVX2 CPU has all three; the int4
// and NF4 kernels convert float16 scales with F16C).
inline Isa detected() {
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return Isa::kAvx2;
#endif
  return Isa::kScalar;
}

// detected(), capped by KVSERVE_ISA (scalar | avx2); read once per process.
inline Isa chosen() {
  static const Isa isa = [] {
    const Isa best = detected();
    const char* env = std::getenv("KVSERVE_ISA");
    if (env != nullptr && std::strcmp(env, "scalar") == 0) return Isa::kScalar;
    return best;
  }();
  return isa;
}

inline bool avx2() { return chosen() >= Isa::kAvx2; }

inline const char* name(Isa isa) { return isa == Isa::kAvx2 ? "avx2" : "scalar"; }

}  // namespace kvserve::cpu
