"""The bfloat16 KV cache's attention tile (native/csrc/attend_bf16.h) run as leaves: its AVX-512 BF16 path
(vdpbf16ps) and its AVX2 path against the scalar path, bit for bit, under the CPU emulator (a Sapphire Rapids
core: AVX512-BF16 on any x86-64 machine) and, where this CPU has the instructions, natively; and every leaf
against the extension's paged_decode_attention over the same prompt rows, so the leaf is the shipped tile (the
extension's own paths give the scalar path's bits: tests/test_bf16_cache.py forces each).

The tiles reach every branch of the AVX-512 path: a prompt's consecutive rows times a GQA group of 2, 3 and 4 (the
query vectors three at a time, and two or one left over), contexts of several scattered blocks over more than one
64-key chunk (the last one partial), key counts ending on odd positions and below 8 (the 8-key blocks' tail),
a sliding window whose first key is odd on every other row, head sizes 64 and 128 (known at compile time: the
V pairs interleaved once per chunk, and in tiles of 12 vectors or more the K rows transposed by pairs, 16 keys a
register) and 96 (looped), a lone decode vector. Values stay in float32's normal range,
where vdpbf16ps and the scalar reference agree (attend_bf16.h says where they part).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvserve.native import emulate
from tests import attendutil
from tests.attendutil import runner, same_bits  # noqa: F401 (runner: the leaves fixture)

ISAS = ("scalar", "avx2", "avx512")
# prompt rows, cached prefix, heads, kv heads, head size, window, block size
TILES = [
    (4, 70, 6, 2, 64, 0, 16),
    (3, 40, 4, 1, 128, 0, 16),
    (3, 33, 4, 2, 96, 0, 8),
    (5, 100, 3, 3, 64, 45, 16),
    (1, 8, 1, 1, 64, 0, 16),
    (6, 100, 6, 2, 64, 37, 16),
    (7, 20, 4, 2, 128, 0, 16),
]


def runs(runner, isa: str) -> bool:
    return attendutil.runs(runner, f"bf16_{isa}")


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, rounded to nearest even (torch's rounding; no NaNs here)."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def tile_case(shape, seed: int, q_k_v_exponents=((-8, 3), (-8, 3), (-8, 3))) -> dict:
    """attendutil.tile_case over a bfloat16 pool. q_k_v_exponents: the range of powers of two each of q, k and v's
    elements are scaled by (ends excluded). By default each element's magnitude spread over 2^-8 .. 2^2, so that
    float32 sums of bfloat16 products round (sums of products of like magnitude are mostly exact and would hide a
    change of order), while scores stay a few units (no weight near float32's underflow)."""
    exponents = dict(zip("qkv", q_k_v_exponents))

    def values(rng, name, shape):
        x = rng.standard_normal(shape) * np.exp2(rng.integers(*exponents[name], shape).astype(np.float64))
        return x if name == "q" else to_bf16_bits(x)

    return attendutil.tile_case(shape, seed, values)


def run_leaf(runner, isa: str, case: dict, scores_only: bool = False) -> tuple[int, np.ndarray]:
    return attendutil.run_leaf(runner, f"bf16_{isa}", case, scores_only)


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("scores_only", [False, True], ids=["outputs", "scores"])
def test_vector_paths_give_the_scalar_bits(runner, isa, scores_only):
    """The outputs, and the scores alone (the weights' rounding to bfloat16 hides most of a score's last bits
    from the outputs, so each score's lane order is checked on the scores themselves)."""
    if not runs(runner, isa):
        pytest.skip(f"this CPU has no {isa} (the emulated run covers it)")
    for index, shape in enumerate(TILES):
        case = tile_case(shape, index)
        done, scalar = run_leaf(runner, "scalar", case, scores_only)
        assert done == 0 and np.isfinite(scalar).all() and np.abs(scalar).max() > 0, shape
        done, vector = run_leaf(runner, isa, case, scores_only)
        assert done == 0 and same_bits(vector, scalar), shape


@pytest.mark.parametrize("scores_only", [False, True], ids=["outputs", "scores"])
def test_the_avx2_path_flushes_as_the_scalar_path_where_products_and_sums_underflow(runner, scores_only):
    """Below float32's normal range: q and k of 2^-70 .. 2^-50 (products of 2^-140 .. 2^-100, many of them and
    of their partial sums under 2^-126), v of 2^-140 .. 2^-110 (bfloat16 denormals among them, and weight times
    value products under 2^-126). The scalar path flushes every input, product and sum (kv_flush_denormal), the
    AVX2 path leaves it to MXCSR's DAZ and FTZ: the same bits. (Not AVX-512: Zen 4's vdpbf16ps departs from the
    SDM there, attend_bf16.h.) Natively only: the AVX2 path runs natively on every x86-64 machine we serve on."""
    if not isinstance(runner, emulate.Native):
        pytest.skip("the emulator's DAZ and FTZ are not the hardware's: under it the AVX2 leaf departed from the "
                    "scalar bits here (3 of 768 outputs), natively on an AMD EPYC it does not")
    if not runs(runner, "avx2"):
        pytest.skip("this CPU has no avx2")
    exponents = ((-70, -49), (-70, -49), (-140, -109))
    for index, shape in enumerate(TILES):
        case = tile_case(shape, 20 + index, exponents)
        v_exponent = (case["v"] >> 7) & 0xFF
        assert (v_exponent == 0).any() and (v_exponent > 0).any(), "denormal and normal values in v"
        done, scalar = run_leaf(runner, "scalar", case, scores_only)
        assert done == 0 and np.isfinite(scalar).all() and (scalar != 0).any(), shape
        done, vector = run_leaf(runner, "avx2", case, scores_only)
        assert done == 0 and same_bits(vector, scalar), shape


def test_the_leaves_are_the_extensions_tile(runner):
    """Every leaf this runner runs gives paged_decode_attention's bits over the same rows (the extension runs the
    path native/csrc/cpu.h chose here, one tile per 32 rows and KV head)."""
    torch = pytest.importorskip("torch")
    from kvserve import native

    ops = native.load_ops()
    if ops is None:
        pytest.skip("the native extension is not built here")
    as_bf16 = lambda bits: torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)  # noqa: E731
    for index, shape in enumerate(TILES):
        case = tile_case(shape, 10 + index)
        theirs = attendutil.extension_tile(ops, case, as_bf16(case["k"]), as_bf16(case["v"]))
        for isa in ISAS:
            if runs(runner, isa):
                done, ours = run_leaf(runner, isa, case)
                assert done == 0 and same_bits(ours, theirs), (isa, shape)


def test_each_leaf_refuses_a_shape_its_path_does_not_take(runner):
    case = tile_case(TILES[0], 0)
    for isa in ISAS:
        if not runs(runner, isa):
            continue
        odd = dict(case, length=case["first"])  # a vector with no keys
        done, out = run_leaf(runner, isa, odd)
        assert done == 1 and np.isnan(out).all(), isa
    narrow = dict(case, tile_q=case["tile_q"][:, :48].copy(), k=case["k"][..., :48].copy(), v=case["v"][..., :48].copy())
    for isa in ("avx2", "avx512"):  # D = 48: the vector paths take multiples of 32 (the extension runs scalar)
        if runs(runner, isa):
            done, out = run_leaf(runner, isa, narrow)
            assert done == 1 and np.isnan(out).all(), isa
    done, out = run_leaf(runner, "scalar", narrow)
    assert done == 0 and np.isfinite(out).all()
