/* Every micro-kernel (ukernel_q4_1.h, ukernel_q8_0.h, ukernel_bf16.h) in one C translation unit, compiled
 * freestanding by native/leaves.py for the CPU emulator; the extension includes the same headers from
 * linear_ggml.cpp and linear_bf16.cpp. */
#include "ukernel_q4_1.h"
#include "ukernel_q8_0.h"
#include "ukernel_bf16.h"
