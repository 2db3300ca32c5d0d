"""The GGUF micro-kernels (native/csrc/ukernel*.h) run as leaves: every vector kernel against the scalar one, bit
for bit, under the CPU emulator (a Sapphire Rapids core: AVX-512 on any x86-64 machine) and, where this CPU has
the instructions, natively too.

The shapes cover every tile remainder: 1..MR+1 and 2 MR + 3 activation rows, one panel a call and all panels in
one (tiles of several panels, the last one partial), features past a whole panel (the last panel padded), K of 1,
2 and 18 blocks (SmolLM2's 576) for the 32-weight formats and 1 and 2 super-blocks for the K-quants, and the
codes' extremes (all code bits set against activation codes of -127; Q8_0 -128; Q6_K's
(q - 32) sc = 32 * 128, the largest integer sum of its blocks).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvserve.native import emulate
from kvserve.native import ggml_leaves as leaves
from tests.ggmlutil import dequantize, magnitudes, quantized_activations, random_blocks
from tests.leafutil import leaf_runner

NEEDS = {"avx2": {"avx2", "fma", "f16c"}, "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}}
# (N, K): 40 = 2.5 AVX-512 panels, 5 AVX2 ones; 21 = 1 + 5/16, 2 + 5/8
SHAPES = {32: [(40, 32), (21, 64), (40, 576)], 256: [(40, 256), (21, 512)]}


@pytest.fixture(scope="module", params=["emulated", "native"])
def runner(request):
    """The leaves in the emulator, or on this CPU (ctypes)."""
    yield from leaf_runner(request.param, leaves.build)


def run(runner, symbol: str, packed: np.ndarray, nr: int, x: dict, N: int, K: int, together: bool,
        ahead: int = 0, unpack: int = 0) -> np.ndarray:
    """y float32 [M, N] from micro-kernel calls over all rows: one per panel, or (``together``) one for all panels;
    ``ahead``: kv_ggml_args.ahead (the bytes a K-quant tile of one or two rows prefetches ahead on AVX-512); ``unpack``:
    kv_ggml_args.unpack (AVX-512 calls of many rows: Q5_K / Q6_K groups unpacked once)."""
    M, nb, panels = x["xq"].shape[0], K // 32, packed.shape[0]
    runner.reset_heap()
    rows = {name: runner.put(array) for name, array in x.items()}
    w = runner.put(packed)
    y = runner.alloc(M * N * 4)
    for p in [0] if together else range(panels):
        last = panels - 1 if together else p
        args = leaves.Args(w=w + p * packed.shape[1], y=y + 4 * p * nr, ldq=K, ldb=nb, ldy=N, nb=nb, rows=M,
                           cols=min(nr, N - last * nr), nr=nr, ldw=packed.shape[1], panels=last - p + 1, ahead=ahead,
                           unpack=unpack, **rows)
        runner.call(symbol, runner.put_struct(args))
    return runner.get(y, M * N, np.float32).reshape(M, N)


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("kind", leaves.KINDS)
def test_vector_micro_kernels_give_the_scalar_bits_on_every_remainder(runner, kind, isa):
    if isinstance(runner, emulate.Native) and not NEEDS[isa] <= emulate.host_cpu_flags():
        pytest.skip(f"this CPU has no {isa}")
    rng = np.random.default_rng(0)
    nr, mr = leaves.NR[isa], leaves.MR[isa]
    for N, K in SHAPES[leaves.BLOCK_WEIGHTS[kind]]:
        raw = random_blocks(kind, N, K, rng)
        packed = leaves.pack_panels(raw, kind, nr)
        for M in (*range(1, mr + 2), 2 * mr + 3):
            x = quantized_activations(M, K, rng, leaves.ACT_GROUP[kind])
            scalar = run(runner, f"kv_{kind}_scalar", packed, nr, x, N, K, together=False)
            for together in (False, True):  # a panel a call, or every panel in one (tiles over several)
                # one or two rows (Q6_K's two: a tile of two panels, together): also with the prefetch ahead (a
                # group's bytes and past the call's last panel); more rows than a tile: also with groups unpacked
                for ahead, unpack in ((0, 0), (1024, 0), (1 << 20, 0)) if M <= 2 else ((0, 0), (0, 1)) if M > mr \
                        else ((0, 0),):
                    vector = run(runner, f"kv_{kind}_{isa}", packed, nr, x, N, K, together, ahead, unpack)
                    assert np.array_equal(vector.view(np.uint32), scalar.view(np.uint32)), \
                        (N, K, M, together, ahead, unpack)
    assert np.isfinite(scalar).all() and np.abs(scalar).max() > 0


def test_scalar_micro_kernel_matches_a_float64_reference(runner):
    """The reference itself: ukernel.h's operation sequence on gguf's own dequantization, against the exact sum
    (numpy, float64), within float32 rounding of each block's terms."""
    rng = np.random.default_rng(1)
    M = 3
    for kind in leaves.KINDS:
        N, K = (21, 576) if leaves.BLOCK_WEIGHTS[kind] == 32 else (21, 512)
        raw = random_blocks(kind, N, K, rng)
        x = quantized_activations(M, K, rng, leaves.ACT_GROUP[kind])
        y = run(runner, f"kv_{kind}_scalar", leaves.pack_panels(raw, kind, 8), 8, x, N, K, together=True)
        x_hat = (x["xq"].reshape(M, -1, 32) * x["xd"][..., None].astype(np.float64)).reshape(M, K)
        ref = x_hat @ dequantize(raw, kind).T
        scale = np.abs(x_hat) @ magnitudes(raw, kind).T
        assert (np.abs(y - ref) <= 1e-5 * scale).all(), kind
