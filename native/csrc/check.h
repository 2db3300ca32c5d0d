// KV_CHECK(cond, parts...): TORCH_CHECK whose message is built with std::string and std::to_string, never
// an iostream. Included by quant/qlinear.cpp and engine/decode_ops.cpp.
//
// Why: where the toolchain links libstdc++ statically into an extension (seen on an H200 host's Xeon with
// gcc 13 and torch 2.11), the extension's own copy of the stream facets is not set up. TORCH_CHECK's
// message, formatted through std::ostringstream inside the extension, then crashed on the first number
// (SIGSEGV in ostream::_M_insert<long>) instead of raising; built here with -static-libstdc++ it cut the
// message at the number. TORCH_CHECK with one std::string argument formats nothing itself (c10::str
// passes a lone string through) and c10::Error is built in libc10, so this path touches no stream.
#pragma once

#include <c10/util/Exception.h>

#include <string>
#include <type_traits>

namespace kvserve {

inline std::string msg_part(const char* s) { return s; }
inline std::string msg_part(const std::string& s) { return s; }
template <typename T>
std::enable_if_t<std::is_arithmetic_v<T>, std::string> msg_part(T v) {
  return std::to_string(v);
}

template <typename... Args>
std::string cat(const Args&... args) {
  std::string out;
  ((out += msg_part(args)), ...);
  return out;
}

}  // namespace kvserve

// The message is built only when the check fails (TORCH_CHECK evaluates it in the failing branch).
#define KV_CHECK(cond, ...) TORCH_CHECK(cond, ::kvserve::cat(__VA_ARGS__))
