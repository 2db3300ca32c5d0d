// Quantized (and float32) linear layers for CPU decode: y = x @ W_hat^T, reading the packed weights once.
//
// Decode at batch 1 is a matrix-vector product bound by the bytes of W, so the kernels stream the int8 or
// packed 4-bit codes and never write a float copy of W.
//   int8:        activations are quantized per block of 64 (or 32) to int16 and multiplied with the widened
//                codes by AVX2 16-bit dot products (vpmaddwd): y = W_hat @ Q16(x) up to float summation order.
//                Q16's step is 1/32767 of a block's max, ~250x finer than the weights' own int8 grid, so the
//                layer is as accurate as weight-only int8 (Q8 activations had cost 1.6 points of greedy
//                agreement on SmolLM2); widening int8 codes to floats instead capped the kernel at ~10 GB/s.
//   int4:        activations quantized per block of 32 to int8 (llama.cpp's Q8_0), AVX2 8-bit dot products
//                (vpmaddubsw) over panels of 8 weight rows: y = W_hat @ Q8(x) up to float summation order.
//   NF4:         float32 activations; the codes are widened through the 16-level table (lut4_linear).
//   float32:     f32_linear, register tiles of 3 activation rows x 4 weight rows.
//   GGUF Q4_1 / Q8_0: the file's own blocks, repacked into panels (ggml_pack), activations as Q8 blocks of 32,
//                micro-kernels per ISA (ukernel.h: scalar, AVX2, AVX-512 VNNI) giving the same bits on every
//                path and batch size (linear_ggml.cpp).
//   bfloat16:    an unquantized bf16 model's weights, repacked into panels of 32 (bf16_pack), float32 activations
//                rounded to bf16, AVX512-BF16 dot products (vdpbf16ps) accumulated in float32 in K order
//                (ukernel_bf16.h; linear_bf16.cpp). Runs where bf16_native() is true, else the scalar reference.
//
// Layouts (see quant/schemes.py):
//   int8:  w int8 [N, K], scales float32 [N]                     w_hat[n,k] = w[n,k] * s[n]
//   int8 panels (int8_linear with panels): w int8 [N, K] holding N/16 panels of 16 rows, each 16 * K contiguous
//          bytes in k pairs: byte 2r + j of pair i = w[16p + r, 2i + j] (quant.panels.pack_int8_panels)
//   4-bit: w uint8 [N, K/2] (k even: low nibble, k odd: high),   w_hat[n,k] = lut[code] * s[k/G, n]
//          scales float16 [K/G, N], lut float32 [16]            (int4: lut[c] = c - 8; NF4: the NF4 levels)
//   int4 panels (int4_linear): w uint8 [N, K/2] holding N/8 panels of 8 rows, each K * 4 contiguous bytes in
//          chunks of 8 k: byte 4r + i of chunk t = code(r, 8t + i) | code(r, 8t + 4 + i) << 4
//          (quant.panels.pack_nibble_panels), scales float16 [K/G, N]  w_hat[n,k] = (code - offset) * s[k/G, n]
//
// Each family has its own file (linear_f32/int8/int4/lut4.cpp, activation quantizers in act_quant.h); this file
// binds them. The AVX2+FMA paths are compiled with target attributes and chosen at run time by cpu.h, so one
// build runs on any x86-64 CPU; elsewhere (or with KVSERVE_ISA=scalar) the scalar loops run.
#include "huge_pages.h"
#include "linear_common.h"

using namespace kvserve::linear;

bool vectorized() { return kvserve::cpu::avx2(); }

std::string isa() { return kvserve::cpu::name(kvserve::cpu::chosen()); }

bool bf16_native() { return kvserve::cpu::bf16(); }

using NoGil = py::call_guard<py::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels run without the GIL, as torch's own ops do: a server's event loop thread (SSE, HTTP) can run
  // its Python while a step's projections compute, instead of waiting for the step's Python to yield the GIL.
  m.def("int8_linear", &int8_linear, NoGil(),
        "x [M,K] f32, w int8 [N,K] (rows or panels of 16), scales f32 [N], block (32 or 64), panels -> [M,N] "
        "(x as Q16 blocks)");
  m.def("int4_linear", &int4_linear, NoGil(),
        "x [M,K] f32, w u8 [N,K/2], scales f16 [K/G,N], G, offset -> [M,N] (x as Q8 blocks of 32)");
  m.def("lut4_linear", &lut4_linear, NoGil(),
        "x [M,K] f32, w u8 [N,K/2], scales f16 [K/G,N], G, lut f32 [16] -> [M,N]");
  m.def("f32_linear", &f32_linear, NoGil(), "x [M,K] f32, w f32 [N,K] -> [M,N] (small M)");
  m.def("advise_huge_pages", [](const torch::Tensor& t) {
    KV_CHECK(t.is_cpu() && t.is_contiguous(), "advise_huge_pages takes a contiguous CPU tensor");
    return kvserve::advise_huge_pages(t.data_ptr(), t.nbytes());
  }, "t (contiguous, CPU, not yet written) -> bytes of it advised for transparent huge pages (huge_pages.h)");
  m.def("ggml_pack", &ggml_pack,
        "raw u8 [N, K/32 * bytes] (GGUF blocks), kind 'q4_1'|'q8_0' -> u8 [panels, bytes] (the chosen ISA's layout)");
  m.def("ggml_unpack", &ggml_unpack, "packed, kind, N, K -> the raw u8 [N, K/32 * bytes] (ggml_pack's inverse)");
  m.def("ggml_rows", &ggml_rows,
        "packed, kind, ids int64 [n], N, K -> the raw u8 [n, K/32 * bytes] of rows ids (ggml_unpack's, those only)");
  m.def("ggml_linear", &ggml_linear, NoGil(),
        "x [M,K] f32, packed, kind, N, K -> [M,N] f32 (x as Q8 blocks of 32; no bias)");
  m.def("bind_ggml", [](const torch::Tensor& packed, const std::string& kind, int64_t N, int64_t K) {
    return py::cpp_function(bind_ggml(packed, kind, N, K), NoGil());
  }, "ggml_linear bound to (packed, kind, N, K), checked once");
  m.def("ggml_handle", &ggml_handle,
        "ggml_linear bound to (packed, kind, N, K) as a capsule the decode ops' layer stack calls without Python");
  m.def("gguf_prefetch", &gguf_prefetch, "how far ahead a GGUF K-quant call of one or two rows prefetches (bytes; 0: none)");
  m.def("set_gguf_prefetch", &set_gguf_prefetch,
        "bytes -> the previous value: how far ahead a GGUF K-quant call of one or two rows prefetches (AVX-512; 0: none)");
  m.def("gguf_amx", &gguf_amx,
        "whether GGUF calls of many rows (from gguf_amx_rows()) take AMX-INT8 tiles (where the CPU runs them)");
  m.def("set_gguf_amx", &set_gguf_amx,
        "on -> whether they did: GGUF calls of many rows (from gguf_amx_rows()) take AMX-INT8 tiles where the CPU runs them");
  m.def("gguf_amx_rows", &gguf_amx_rows, "the fewest rows of a GGUF call that takes the AMX-INT8 tiles (Q4_K, Q5_K; Q6_K from 16, the others from 32)");
  m.def("gguf_unpack", &gguf_unpack, "whether GGUF Q5_K / Q6_K calls of many rows unpack each group once (AVX-512)");
  m.def("set_gguf_unpack", &set_gguf_unpack,
        "unpack -> the previous value: whether GGUF Q5_K / Q6_K calls of many rows unpack each group once (AVX-512)");
  m.def("bf16_pack", &bf16_pack, "w bf16 [N,K] -> bf16 [panels, kp * 64] (ukernel_bf16.h's panel order)");
  m.def("bf16_unpack", &bf16_unpack, "packed, N, K -> w bf16 [N,K] (bf16_pack's inverse)");
  m.def("bf16_linear", &bf16_linear, NoGil(),
        "x [M,K] f32, packed bf16 panels, N, K -> [M,N] f32 (x rounded to bf16; float32 sums in K order; no bias)");
  m.def("bind_bf16", [](const torch::Tensor& packed, int64_t N, int64_t K) {
    return py::cpp_function(bind_bf16(packed, N, K), NoGil());
  }, "bf16_linear bound to (packed, N, K), checked once");
  m.def("bf16_native", &bf16_native,
        "True when bf16_linear runs the AVX512-BF16 micro-kernel (the avx512 path is chosen and the CPU has BF16)");
  m.def("vectorized", &vectorized, "True when the AVX2+FMA path runs on this CPU");
  m.def("isa", &isa, "The instruction-set path the kernels run (native/csrc/cpu.h): avx512, avx2 or scalar");
  // A layer's kernel bound to its weights once: f(x) -> y. A call then converts one argument and runs no
  // Python frame (a Python lambda around the kernel cost both, on each of a decode step's ~120-210 calls).
  m.def("bind_int8", [](torch::Tensor w, torch::Tensor scales, int64_t block, bool panels) {
    return py::cpp_function(
        [w, scales, block, panels](const torch::Tensor& x) { return int8_linear(x, w, scales, block, panels); },
        NoGil());
  }, "int8_linear bound to (w, scales, block, panels)");
  m.def("bind_int4", [](torch::Tensor w, torch::Tensor scales, int64_t group, int64_t offset) {
    return py::cpp_function(
        [w, scales, group, offset](const torch::Tensor& x) { return int4_linear(x, w, scales, group, offset); },
        NoGil());
  }, "int4_linear bound to (w, scales, group, offset)");
  m.def("bind_lut4", [](torch::Tensor w, torch::Tensor scales, int64_t group, torch::Tensor lut) {
    return py::cpp_function(
        [w, scales, group, lut](const torch::Tensor& x) { return lut4_linear(x, w, scales, group, lut); },
        NoGil());
  }, "lut4_linear bound to (w, scales, group, lut)");
  m.def("bind_f32", [](torch::Tensor w) {
    return py::cpp_function([w](const torch::Tensor& x) { return f32_linear(x, w); }, NoGil());
  }, "f32_linear bound to w");
}
