"""The bfloat16-weight kernel (native/csrc/linear_bf16.cpp, ukernel_bf16.h) through the extension: against float64
products of the bf16-rounded operands, batch invariance, the AVX512-BF16 path's bits against the scalar path's
(forced with KVSERVE_ISA in a child process), exact pack/unpack, clear shape errors, and which path runs.

The micro-kernels themselves are run bit for bit against the scalar reference, emulated and native, in
test_bf16_emulated.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvserve import native
from kvserve.native import bf16_leaves as leaves
from kvserve.native.emulate import host_cpu_flags
from kvserve.quant.bf16 import BF16Linear, kernel_runs

ROOT = Path(__file__).resolve().parent.parent
SHAPES = [(21, 7), (49, 64), (40, 1), (64, 576), (192, 1536)]  # (N, K): panel and pair remainders, SmolLM2's sizes
NATIVE_BF16 = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"} <= host_cpu_flags()

pytestmark = pytest.mark.skipif(native.load() is None, reason="the kernels do not build on this machine")


def weights(N: int, K: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(N, K, generator=g) * 0.05).bfloat16()


def activations(M: int, K: int, seed: int = 1) -> torch.Tensor:
    """float32 [M, K] with columns of very different scales, as hidden states have."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(M, K, generator=g) * torch.logspace(-2, 2, K)[torch.randperm(K, generator=g)]


def test_the_layer_is_the_product_of_the_bf16_rounded_operands():
    module = native.load()
    for N, K in SHAPES:
        w, x = weights(N, K), activations(9, K)
        y = module.bf16_linear(x, module.bf16_pack(w), N, K)
        x_bf16 = torch.from_numpy(leaves.to_bf16(x.numpy()).view(np.int16)).view(torch.bfloat16)
        assert torch.equal(x_bf16, x.bfloat16())  # torch rounds to nearest even as the kernel does (no denormals)
        products = x_bf16.double()[:, None, :] * w.double()[None, :, :]  # [M, N, K], exact
        exact, scale = products.sum(-1), products.abs().sum(-1)
        # float32 summation of K exact products, one chain: |error| <= K u sum|p| (u = 2^-24; Higham, ch. 4)
        assert ((y.double() - exact).abs() <= K * 2.0**-24 * scale).all(), (N, K)
        assert ((y.double() - exact).abs() <= 1e-5 * scale).all()  # and, at these sizes, far tighter in practice


def test_a_rows_bits_are_the_same_alone_and_in_every_batch():
    module = native.load()
    N, K = 96, 576
    packed, x = module.bf16_pack(weights(N, K)), activations(512, K)
    full = module.bf16_linear(x, packed, N, K)  # [512, N]
    for M in range(1, 65):
        start = (7 * M) % (512 - M)
        assert torch.equal(module.bf16_linear(x[start:start + M], packed, N, K), full[start:start + M]), M
    alone = torch.cat([module.bf16_linear(x[m:m + 1], packed, N, K) for m in range(0, 512, 37)])
    assert torch.equal(alone, full[0:512:37])


def test_pack_is_the_micro_kernels_order_and_unpack_inverts_it():
    module = native.load()
    for N, K in SHAPES:
        w = weights(N, K)
        packed = module.bf16_pack(w)
        assert np.array_equal(packed.view(torch.int16).numpy().view(np.uint16),
                              leaves.pack_panels(w.view(torch.int16).numpy().view(np.uint16)))
        assert torch.equal(module.bf16_unpack(packed, N, K).view(torch.int16), w.view(torch.int16))


def test_shape_and_dtype_errors_are_clear():
    module = native.load()
    packed = module.bf16_pack(weights(40, 64))
    with pytest.raises(RuntimeError, match=r"must be \[2, 4096\], got \[2, 2048\]"):
        module.bf16_linear(activations(2, 64), packed, 40, 64 * 2)
    with pytest.raises(RuntimeError, match="x has 32 features, the weight 64"):
        module.bf16_linear(activations(2, 32), packed, 40, 64)
    with pytest.raises(RuntimeError, match="bfloat16 CPU tensor"):
        module.bf16_pack(weights(4, 8).float())


def worker(out: str) -> None:
    """In a child process (on the ISA KVSERVE_ISA forces): whether the AVX512-BF16 kernel runs, and every shape's
    outputs at 1..9, 33 and 200 rows; saved to ``out``."""
    module = native.load()
    results = {"isa": module.isa(), "bf16": module.bf16_native(), "kernel_runs": kernel_runs()}
    for N, K in SHAPES:
        packed = module.bf16_pack(weights(N, K))
        for M in (*range(1, 10), 33, 200):
            results[N, K, M] = module.bf16_linear(activations(M, K), packed, N, K)
    torch.save(results, out)


def child(isa: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{isa}.pt"
    code = f"from tests.test_bf16_kernels import worker; worker({str(out)!r})"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "KVSERVE_ISA": isa},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out)


def test_the_avx512_bf16_path_gives_the_scalar_paths_bits_and_lesser_paths_turn_it_off(tmp_path):
    results = {isa: child(isa, tmp_path) for isa in native.native_isas()}
    for isa, got in results.items():
        assert got.pop("isa") == isa
        runs = isa == "avx512" and NATIVE_BF16
        assert got.pop("bf16") is runs and got.pop("kernel_runs") is runs, isa
    scalar = results.pop("scalar")
    for isa, got in results.items():
        for key, y in scalar.items():
            assert torch.equal(got[key], y), (isa, key)
    if not NATIVE_BF16:
        pytest.skip("this CPU has no AVX512-BF16: only the scalar path ran here (the emulator runs the other)")


def test_the_layer_serves_every_call_through_the_kernel_and_keeps_its_weights():
    module = native.load()
    w, bias = weights(70, 64), torch.randn(70)
    layer = BF16Linear(w, bias)
    assert layer.kernel_max_rows is None and layer.decode_kernel() is not None
    x = activations(300, 64)
    expected = module.bf16_linear(x, layer.weight, 70, 64) + bias
    assert torch.equal(layer(x), expected)  # 300 rows: still the kernel, not the reference
    assert torch.equal(layer(x.view(3, 100, 64)), expected.view(3, 100, 70))
    assert torch.equal(layer.weights().view(torch.int16), w.view(torch.int16))
    layer.float()  # a model's .float() leaves the packed weights alone
    assert layer.weight.dtype is torch.bfloat16 and torch.equal(layer(x), expected)
    layer.use_kernel = False  # the reference: the same products of the rounded operands, torch's summation order
    assert torch.allclose(layer(x), expected, rtol=1e-5, atol=1e-4)
