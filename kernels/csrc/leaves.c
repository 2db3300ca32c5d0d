/* Every GGUF micro-kernel (ukernel.h) in one C translation unit, compiled freestanding by kernels/leaves.py for
 * the CPU emulator; the extension includes the same headers from linear_ggml.cpp. */
#include "ukernel_q4_1.h"
#include "ukernel_q8_0.h"
