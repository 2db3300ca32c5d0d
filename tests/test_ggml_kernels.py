"""GGUF Q4_1 / Q8_0 kernels (native/csrc/linear_ggml.cpp, ukernel*.h): against gguf's own dequantization, the
same bits on every ISA path this CPU runs natively and in every batch, exact pack/unpack, clear shape errors.

Paths other than the best are forced with KVSERVE_ISA in a child process (the choice is read once per process);
the AVX-512 micro-kernels are also run under the emulator (test_ggml_emulated.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from kvserve import native
from kvserve.native import ggml_leaves as leaves
from kvserve.quant.schemes import quantize_activations

ROOT = Path(__file__).resolve().parent.parent
KINDS = {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}
# (N, K): features below, at and past a 16-wide panel, K of 1, 2 and 18 blocks (SmolLM2's 576)
SHAPES = [(3, 32), (16, 64), (40, 576), (24, 64)]

pytestmark = pytest.mark.skipif(native.load() is None, reason="the kernels do not build on this machine")


def random_blocks(kind: str, N: int, K: int, seed: int = 0) -> torch.Tensor:
    """Raw GGUF blocks uint8 [N, K/32 * bytes] covering each format's full code range: Q4_1 codes 0..15 with a
    minimum of either sign, Q8_0 codes -128..127 with scales of either sign."""
    rng = np.random.default_rng(seed)
    nb = N * K // 32
    d = rng.uniform(-0.05, 0.05, nb).astype(np.float16).view(np.uint8).reshape(nb, 2)
    if kind == "q4_1":
        m = rng.uniform(-0.5, 0.5, nb).astype(np.float16).view(np.uint8).reshape(nb, 2)
        blocks = np.concatenate([d, m, rng.integers(0, 256, (nb, 16), dtype=np.uint8)], axis=1)
    else:
        blocks = np.concatenate([d, rng.integers(-128, 128, (nb, 32), dtype=np.int8).view(np.uint8)], axis=1)
    return torch.from_numpy(np.ascontiguousarray(blocks).reshape(N, -1))


def dequantize(raw: torch.Tensor, kind: str, K: int) -> torch.Tensor:
    """gguf's dequantization of raw blocks, float64 [N, K]."""
    return torch.from_numpy(quants.dequantize(raw.numpy(), KINDS[kind]).astype(np.float64)).reshape(-1, K)


def activations(M: int, K: int, seed: int = 1) -> torch.Tensor:
    """float32 [M, K] with blocks of very different scales (and an all-zero block), as hidden states have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.logspace(-3, 2, K // 32).repeat_interleave(32)
    x[0, :32] = 0.0
    return x


def test_kernel_agrees_with_gguf_dequantization_in_float64():
    module = native.load()
    for kind in KINDS:
        for N, K in SHAPES:
            raw = random_blocks(kind, N, K)
            x = activations(7, K)
            y = module.ggml_linear(x, module.ggml_pack(raw, kind), kind, N, K)  # [7, N]
            x_hat = quantize_activations(x, 32, 127).double()
            w = dequantize(raw, kind, K)
            ref = x_hat @ w.T
            bound = 1e-5 * (x_hat.abs() @ w.abs().T) + 1e-30  # float32 rounding of 2 operations per block
            assert ((y.double() - ref).abs() <= bound).all(), (kind, N, K, (y.double() - ref).abs().max())


def test_the_embedded_models_own_blocks_round_trip_and_multiply_as_gguf_dequantizes_them():
    from gguf import GGUFReader

    from kvserve.engine.loader import default_gguf_path

    module = native.load()
    tensors = {t.name: t for t in GGUFReader(default_gguf_path()).tensors}
    for name, kind, rows in (("blk.0.ffn_down.weight", "q4_1", 576), ("token_embd.weight", "q8_0", 1000)):
        tensor = tensors[name]
        assert tensor.tensor_type is KINDS[kind]
        raw = torch.from_numpy(np.array(tensor.data[:rows]))  # [rows, K/32 * bytes], the file's bytes
        N, K = rows, raw.shape[1] // (20 if kind == "q4_1" else 34) * 32
        packed = module.ggml_pack(raw, kind)
        assert torch.equal(module.ggml_unpack(packed, kind, N, K), raw)
        x = activations(4, K)
        x_hat = quantize_activations(x, 32, 127).double()
        w = dequantize(raw, kind, K)
        error = (module.ggml_linear(x, packed, kind, N, K).double() - x_hat @ w.T).abs()
        assert (error <= 1e-5 * (x_hat.abs() @ w.abs().T)).all(), (name, error.max())


def test_pack_unpack_round_trips_the_raw_bytes():
    module = native.load()
    for kind in KINDS:
        for N, K in SHAPES:
            raw = random_blocks(kind, N, K, seed=N)
            packed = module.ggml_pack(raw, kind)
            assert torch.equal(module.ggml_unpack(packed, kind, N, K), raw)
            # each byte where the micro-kernels read it (leaves.pack_panels: ukernel.h's layout in numpy)
            nr = leaves.NR.get(native.load().isa(), 8)
            assert np.array_equal(packed.numpy(), leaves.pack_panels(raw.numpy(), kind, nr))


def test_bound_kernel_gives_the_bits_of_the_call():
    module = native.load()
    raw = random_blocks("q4_1", 40, 64)
    packed = module.ggml_pack(raw, "q4_1")
    x = activations(5, 64)
    assert torch.equal(module.bind_ggml(packed, "q4_1", 40, 64)(x), module.ggml_linear(x, packed, "q4_1", 40, 64))
    with pytest.raises(RuntimeError, match="x has 32 features, the weight 64"):
        module.bind_ggml(packed, "q4_1", 40, 64)(torch.randn(2, 32))


def test_bad_shapes_and_kinds_raise_clear_errors():
    module = native.load()
    raw = random_blocks("q8_0", 16, 64)
    packed = module.ggml_pack(raw, "q8_0")
    with pytest.raises(RuntimeError, match="kind must be"):
        module.ggml_pack(raw, "q4_0")
    with pytest.raises(RuntimeError, match=r"blocks \* 20"):
        module.ggml_pack(raw, "q4_1")  # 68 bytes a row: not whole Q4_1 blocks
    with pytest.raises(RuntimeError, match="multiple of 32"):
        module.ggml_linear(torch.randn(1, 48), packed, "q8_0", 16, 48)
    with pytest.raises(RuntimeError, match="packed for another shape"):
        module.ggml_linear(torch.randn(1, 64), packed, "q8_0", 32, 64)
    with pytest.raises(RuntimeError, match="packed for another shape"):
        module.ggml_unpack(packed, "q4_1", 16, 64)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        module.ggml_linear(torch.randn(64, 2).T, packed, "q8_0", 16, 64)


def worker(out: str) -> None:
    """In a child process (on the ISA KVSERVE_ISA forces): every shape's outputs at 1..9 and 33 rows, checking that
    each row's bits are the same alone, in every batch of 1..64 and in a 512-row call; saved to ``out``."""
    module = native.load()
    results = {"isa": module.isa()}
    for kind in KINDS:
        for N, K in SHAPES:
            packed = module.ggml_pack(random_blocks(kind, N, K), kind)
            for M in (*range(1, 10), 33):
                results[kind, N, K, M] = module.ggml_linear(activations(M, K), packed, kind, N, K)
        N, K = 40, 576
        packed = module.ggml_pack(random_blocks(kind, N, K), kind)
        x = activations(512, K)
        full = module.ggml_linear(x, packed, kind, N, K)  # [512, N]
        for M in range(1, 65):
            start = (7 * M) % (512 - M)
            assert torch.equal(module.ggml_linear(x[start:start + M], packed, kind, N, K), full[start:start + M]), M
        alone = torch.cat([module.ggml_linear(x[m:m + 1], packed, kind, N, K) for m in range(0, 512, 37)])
        assert torch.equal(alone, full[0:512:37])
        results[kind, "prefill"] = full
    torch.save(results, out)


def test_every_native_path_gives_the_scalar_bits_in_every_batch(tmp_path):
    results = {}
    for isa in native.native_isas():
        out = tmp_path / f"{isa}.pt"
        code = f"from tests.test_ggml_kernels import worker; worker({str(out)!r})"
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "KVSERVE_ISA": isa},
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        results[isa] = torch.load(out)
        assert results[isa].pop("isa") == isa
    scalar = results.pop("scalar")
    for isa, got in results.items():
        assert got.keys() == scalar.keys()
        for key, y in scalar.items():
            assert torch.equal(got[key], y), (isa, key)
