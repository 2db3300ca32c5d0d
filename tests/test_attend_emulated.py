"""The float32 KV cache's attention tile (native/csrc/attend_tile.h) run as leaves: its AVX-512 path against its
AVX2 path, bit for bit, under the CPU emulator (a Sapphire Rapids core: AVX-512 on any x86-64 machine) and, where
this CPU has the instructions, natively; every leaf against the extension's paged_decode_attention over the same
prompt rows (so the leaf is the shipped tile) and against a float64 softmax. (tests/test_isa.py compares the
extension's two paths where the CPU has AVX-512; this runs on every x86-64 CPU.)

The tiles reach every branch of the AVX-512 path: prompt tiles of 12 query vectors or more (each 64-key chunk's
K rows transposed, 16 keys a register; the keys a block of 3 vectors does not share run alone), outputs 6 vectors
at a time for D = 64 and 3 for others, with 3, 2 and 1 left over; head sizes 64 and 128 (known at compile time),
96 (looped), 320 (past the transposition's buffer), 72 (not a multiple of 16: the AVX-512 branch hands it to the
AVX2 tile, as the extension does); a decode row of 4 heads over 3 chunks (the last partial); sliding windows whose
first key moves each row; scattered blocks of 8 and 16 keys.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import attendutil
from tests.attendutil import runner, same_bits  # noqa: F401 (runner: the leaves fixture)

ISAS = ("avx2", "avx512")
# prompt rows, cached prefix, heads, kv heads, head size, window, block size
TILES = [
    (5, 70, 6, 2, 64, 0, 16),
    (4, 40, 8, 2, 128, 0, 16),
    (3, 33, 4, 2, 96, 0, 8),
    (6, 100, 6, 2, 64, 37, 16),
    (1, 150, 4, 1, 64, 0, 16),
    (2, 20, 4, 2, 72, 0, 16),
    (4, 30, 4, 1, 320, 0, 16),
    (7, 20, 2, 2, 128, 0, 16),
]


def runs(runner, isa: str) -> bool:
    return attendutil.runs(runner, f"f32_{isa}")


def tile_case(shape, seed: int) -> dict:
    """attendutil.tile_case over a float32 pool: each element's magnitude spread over 2^-6 .. 2^1, so that float32
    sums round (sums of like magnitudes would hide a change of order), while scores stay a few units."""
    def values(rng, name, shape):
        x = rng.standard_normal(shape) * np.exp2(rng.integers(-6, 2, shape).astype(np.float64))
        return x.astype(np.float32)

    return attendutil.tile_case(shape, seed, values)


def run_leaf(runner, isa: str, case: dict) -> tuple[int, np.ndarray]:
    return attendutil.run_leaf(runner, f"f32_{isa}", case)


def test_the_avx512_path_gives_the_avx2_bits(runner):
    if not runs(runner, "avx512"):
        pytest.skip("this CPU has no avx512 (the emulated run covers it)")
    for index, shape in enumerate(TILES):
        case = tile_case(shape, index)
        done, avx2 = run_leaf(runner, "avx2", case)
        assert done == 0 and np.isfinite(avx2).all() and np.abs(avx2).max() > 0, shape
        done, avx512 = run_leaf(runner, "avx512", case)
        assert done == 0 and same_bits(avx512, avx2), shape


def test_each_leaf_is_a_softmax_over_its_keys(runner):
    """Against float64: out_j = sum_t softmax(scale q_j . k_t)_t v_t over vector j's keys, within float32 rounding
    of its terms (relative to sum_t w_t |v_t|)."""
    for index, shape in enumerate(TILES):
        case = tile_case(shape, 30 + index)
        dim = case["k"].shape[-1]

        def keys(pool):  # the KV head's rows in key order, through the block table
            return pool[case["table"]].reshape(-1, pool.shape[2], dim)[:, case["g"]].astype(np.float64)

        k, v = keys(case["k"]), keys(case["v"])
        for isa in ISAS:
            if not runs(runner, isa):
                continue
            done, out = run_leaf(runner, isa, case)
            assert done == 0, (isa, shape)
            for j, q in enumerate(case["tile_q"].astype(np.float64)):
                t = slice(case["first"][j], case["length"][j])
                s = k[t] @ q * case["scale"]
                w = np.exp(s - s.max())
                w /= w.sum()
                assert np.abs(out[j] - w @ v[t]).max() <= 1e-5 * (w @ np.abs(v[t])).max(), (isa, shape, j)


def test_the_leaves_are_the_extensions_tile(runner):
    """Every leaf this runner runs gives paged_decode_attention's bits over the same rows (the extension runs the
    path native/csrc/cpu.h chose here, one tile per 32 rows and KV head)."""
    torch = pytest.importorskip("torch")
    from kvserve import native

    ops = native.load_ops()
    if ops is None:
        pytest.skip("the native extension is not built here")
    module = native.load()
    if module is None or module.isa() == "scalar":
        pytest.skip("the extension's float32 attention runs no tile on the scalar path (KVSERVE_ISA=scalar or no "
                    "AVX2): its portable loops, with std::exp, have their own order")
    for index, shape in enumerate(TILES):
        case = tile_case(shape, 10 + index)
        theirs = attendutil.extension_tile(ops, case, torch.from_numpy(case["k"]), torch.from_numpy(case["v"]))
        for isa in ISAS:
            if runs(runner, isa):
                done, ours = run_leaf(runner, isa, case)
                assert done == 0 and same_bits(ours, theirs), (isa, shape)


def test_each_leaf_refuses_a_shape_the_extension_does_not_give_it(runner):
    case = tile_case(TILES[0], 0)
    narrow = dict(case, tile_q=case["tile_q"][:, :60].copy(), k=case["k"][..., :60].copy(),
                  v=case["v"][..., :60].copy())
    for isa in ISAS:
        if not runs(runner, isa):
            continue
        for odd in (dict(case, length=case["first"]), narrow):  # a vector with no keys; D = 60, not a multiple of 8
            done, out = run_leaf(runner, isa, odd)
            assert done == 1 and np.isnan(out).all(), isa
