// A projection's kernel as a plain function pointer, handed from one extension to the other in a Python capsule.
//
// The linear kernels (kvserve_qlinear) and the fused decode ops (kvserve_decode_ops) are two libraries. The
// decode ops' layer stack (decode_layers.cpp) runs every projection of a step without going back to Python, so
// it needs each kernel as something it can call: a ProjectionHandle. linear_ggml.cpp makes one per layer
// (ggml_handle), bound to its weights, and wraps it in a capsule named kCapsuleName; the decode ops read the
// pointer back out of the capsule. Both libraries are built by the same compiler from these headers, and the
// struct holds only a function pointer and plain integers, so its layout is the same on both sides.
#pragma once

#include <cstdint>

namespace kvserve {

struct ProjectionHandle {
  static constexpr const char* kCapsuleName = "kvserve.ProjectionHandle";
  int64_t N, K;  // y [M, N] = x [M, K] @ W^T
  // y <- x @ W^T for M rows (x and y contiguous float32, y not aliasing x), exactly the bits of the layer's bound
  // kernel (the same driver and micro-kernels, only the output buffer is the caller's); the GIL is not needed.
  void (*run)(const ProjectionHandle* self, const float* x, int64_t M, float* y);
};

}  // namespace kvserve
