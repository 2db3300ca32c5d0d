"""The GGUF micro-kernels (native/csrc/ukernel*.h) run as leaves: every vector kernel against the scalar one, bit
for bit, under the CPU emulator (a Sapphire Rapids core: AVX-512 on any x86-64 machine) and, where this CPU has
the instructions, natively too.

The shapes cover every tile remainder: 1..MR+1 activation rows, features past a whole panel (the last panel
padded), K of 1, 2 and 18 blocks (SmolLM2's 576), and the codes' extremes (Q4_1 15 x 127, Q8_0 -128 x -127).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvserve.native import emulate
from kvserve.native import ggml_leaves as leaves
from tests.leafutil import leaf_runner

NEEDS = {"avx2": {"avx2", "fma", "f16c"}, "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}}
SHAPES = [(40, 32), (21, 64), (40, 576)]  # (N, K): 40 = 2.5 AVX-512 panels, 5 AVX2 ones; 21 = 1 + 5/16, 2 + 5/8


@pytest.fixture(scope="module", params=["emulated", "native"])
def runner(request):
    """The leaves in the emulator, or on this CPU (ctypes)."""
    yield from leaf_runner(request.param, leaves.build)


def random_blocks(kind: str, N: int, K: int, rng: np.random.Generator) -> np.ndarray:
    """Raw GGUF blocks uint8 [N, K/32 * bytes]: scales of either sign, every code; feature 0's first block at the
    extreme (Q4_1 codes 15, Q8_0 codes -128)."""
    nb = N * K // 32
    d = rng.uniform(-0.05, 0.05, nb).astype(np.float16).view(np.uint8).reshape(nb, 2)
    if kind == "q4_1":
        m = rng.uniform(-0.5, 0.5, nb).astype(np.float16).view(np.uint8).reshape(nb, 2)
        codes = rng.integers(0, 256, (nb, 16), dtype=np.uint8)
        codes[0] = 0xFF
        blocks = np.concatenate([d, m, codes], axis=1)
    else:
        codes = rng.integers(-128, 128, (nb, 32), dtype=np.int8)
        codes[0] = -128
        blocks = np.concatenate([d, codes.view(np.uint8)], axis=1)
    return blocks.reshape(N, -1)


def random_activations(M: int, K: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Quantized activations as the driver hands them over: q int8 [M, K], d and xs float32 [M, K/32], qsum int32
    [M, K/32]; row 0's first block at the extreme (q = -127 where the Q4_1 codes are 15 and Q8_0's -128)."""
    nb = K // 32
    q = rng.integers(-127, 128, (M, K), dtype=np.int8)
    q[0, :32] = -127
    d = rng.uniform(0.0, 0.1, (M, nb)).astype(np.float32)
    qsum = q.reshape(M, nb, 32).astype(np.int32).sum(-1, dtype=np.int32)
    return {"xq": q, "xd": d, "xs": d * qsum.astype(np.float32), "xsum": qsum}


def run(runner, symbol: str, packed: np.ndarray, nr: int, mr: int, x: dict, N: int, K: int) -> np.ndarray:
    """y float32 [M, N] from one micro-kernel call per (panel, tile of mr rows), as linear_ggml.cpp walks them."""
    M, nb = x["xq"].shape[0], K // 32
    runner.reset_heap()
    where = {name: runner.put(array) for name, array in x.items()}
    w = runner.put(packed)
    y = runner.alloc(M * N * 4)
    item = {"xq": 1, "xd": 4, "xs": 4, "xsum": 4}
    for p in range(packed.shape[0]):
        for m in range(0, M, mr):
            rows = {name: where[name] + m * (K if name == "xq" else nb) * item[name] for name in where}
            args = leaves.Args(w=w + p * packed.shape[1], y=y + 4 * (m * N + p * nr), ldq=K, ldb=nb, ldy=N, nb=nb,
                               rows=min(mr, M - m), cols=min(nr, N - p * nr), nr=nr, **rows)
            runner.call(symbol, runner.put_struct(args))
    return runner.get(y, M * N, np.float32).reshape(M, N)


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("kind", leaves.KINDS)
def test_vector_micro_kernels_give_the_scalar_bits_on_every_remainder(runner, kind, isa):
    if isinstance(runner, emulate.Native) and not NEEDS[isa] <= emulate.host_cpu_flags():
        pytest.skip(f"this CPU has no {isa}")
    rng = np.random.default_rng(0)
    nr, mr = leaves.NR[isa], leaves.MR[isa]
    for N, K in SHAPES:
        raw = random_blocks(kind, N, K, rng)
        packed = leaves.pack_panels(raw, kind, nr)
        for M in range(1, mr + 2):
            x = random_activations(M, K, rng)
            scalar = run(runner, f"kv_{kind}_scalar", packed, nr, M, x, N, K)  # all rows in one call
            vector = run(runner, f"kv_{kind}_{isa}", packed, nr, mr, x, N, K)
            assert np.array_equal(vector.view(np.uint32), scalar.view(np.uint32)), (N, K, M)
    assert np.isfinite(scalar).all() and np.abs(scalar).max() > 0


def test_scalar_micro_kernel_matches_a_float64_reference(runner):
    """The reference itself: ukernel.h's operation sequence against the exact sum (numpy, float64)."""
    rng = np.random.default_rng(1)
    N, K, M = 21, 576, 3
    for kind in leaves.KINDS:
        raw = random_blocks(kind, N, K, rng)
        x = random_activations(M, K, rng)
        y = run(runner, f"kv_{kind}_scalar", leaves.pack_panels(raw, kind, 8), 8, M, x, N, K)
        blocks = raw.reshape(N, K // 32, -1)
        d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)  # [N, nb]
        if kind == "q4_1":
            m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
            nibbles = blocks[..., 4:]
            codes = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).astype(np.float64)  # [N, nb, 32]
            w = d[..., None] * codes + m[..., None]
        else:
            w = d[..., None] * blocks[..., 2:].view(np.int8).astype(np.float64)
        x_hat = x["xq"].reshape(M, -1, 32) * x["xd"][..., None].astype(np.float64)  # [M, nb, 32]
        ref = np.einsum("mbk,nbk->mn", x_hat, w)
        scale = np.einsum("mbk,nbk->mn", np.abs(x_hat), np.abs(w))
        assert (np.abs(y - ref) <= 1e-5 * scale).all(), kind
