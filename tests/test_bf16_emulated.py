"""The bfloat16-weight micro-kernels (native/csrc/ukernel_bf16.h) run as leaves: the AVX512-BF16 kernel and the
activation conversion against the scalar reference and a numpy model of the Intel SDM's VDPBF16PS /
VCVTNEPS2BF16, bit for bit, under the CPU emulator (a Sapphire Rapids core: BF16 on any x86-64 machine) and, where
this CPU has AVX512-BF16, natively too.

The shapes cover every tile remainder: 1..MR+1 rows, a panel's first vector only, both vectors partly, whole
panels, odd K (the zero half pair), K of one pair and SmolLM2's 576 and 1536.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvserve.native import bf16_leaves as leaves
from kvserve.native import emulate
from tests.test_ggml_emulated import runner  # noqa: F401  (one library of leaves holds both families)

NATIVE_BF16 = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"}
SHAPES = [(21, 7), (49, 64), (40, 1), (64, 576), (32, 1536), (17, 2)]  # (N, K): 21 < 16 + 16; 49 = 32 + 17


def runs_vector(runner) -> bool:
    return not isinstance(runner, emulate.Native) or NATIVE_BF16 <= emulate.host_cpu_flags()


def flush(x: np.ndarray) -> np.ndarray:
    """Zero (of its sign) for every float32 with a zero exponent field: DAZ / FTZ."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return np.where(u & 0x7F800000, u, u & 0x80000000).astype(np.uint32).view(np.float32)


def sdm_reference(w: np.ndarray, xb: np.ndarray) -> np.ndarray:
    """VDPBF16PS chains in numpy: y float32 [M, N] from bfloat16 bits w [N, K] and x [M, K]; per pair the odd
    product first, each product and sum flushed (ukernel_bf16.h's order)."""
    kp = -(-w.shape[1] // 2)

    def widened(bits):  # [rows, K] bf16 bits -> float32 [rows, kp, 2], denormals flushed
        return flush((leaves.pair_rows(bits).view(np.uint16).astype(np.uint32) << 16).view(np.float32)).reshape(
            bits.shape[0], kp, 2)

    wf, xf = widened(w), widened(xb)
    acc = np.zeros((xb.shape[0], w.shape[0]), np.float32)
    with np.errstate(all="ignore"):
        for t in range(kp):
            for half in (1, 0):
                acc = flush(acc + flush(np.outer(xf[:, t, half], wf[:, t, half]).astype(np.float32)))
    return acc


def run(runner, symbol: str, w: np.ndarray, xb: np.ndarray, mr: int) -> np.ndarray:
    """y float32 [M, N] from one micro-kernel call per (panel, tile of mr rows), as linear_bf16.cpp walks them."""
    N, K = w.shape
    M, kp = xb.shape[0], -(-K // 2)
    packed = leaves.pack_panels(w)
    runner.reset_heap()
    wp, xp, y = runner.put(packed), runner.put(leaves.pair_rows(xb)), runner.alloc(M * N * 4)
    for p in range(packed.shape[0]):
        for m in range(0, M, mr):
            args = leaves.Args(w=wp + p * packed.shape[1] * 2, x=xp + m * kp * 4, y=y + 4 * (m * N + p * leaves.NR),
                               ldx=kp, ldy=N, kp=kp, rows=min(mr, M - m), cols=min(leaves.NR, N - p * leaves.NR))
            runner.call(symbol, runner.put_struct(args))
    return runner.get(y, M * N, np.float32).reshape(M, N)


def bf16_normal(rng, shape, scale=1.0) -> np.ndarray:
    return leaves.to_bf16((rng.standard_normal(shape) * scale).astype(np.float32))


DENORMAL_SUM_ROW = 2


def specials(rng, N: int, K: int, M: int) -> tuple[np.ndarray, np.ndarray]:
    """Weights and activations (bf16 bits) with denormal inputs (DAZ), products below float32's normal range
    (FTZ), an infinite product, signed zeros, and row DENORMAL_SUM_ROW whose only nonzero pairs are
    (1.5 - 1) * 2^-126 (a denormal sum: flushed) then 2 * 2^-126, so that it is 2^-125 exactly, not 1.25 * 2^-125."""
    w, xb = bf16_normal(rng, (N, K)), bf16_normal(rng, (M, K))
    w[:, ::7] = rng.integers(1, 0x80, w[:, ::7].shape, dtype=np.uint16)  # denormal weights: read as zero
    w[::3, 3::11] = leaves.to_bf16(np.float32(1e-20))
    xb[:, 3::11] = leaves.to_bf16(np.float32(1e-19))  # 1e-39: a denormal product, flushed
    w[0, 12], xb[:, 12] = leaves.to_bf16(np.float32(1e30)), leaves.to_bf16(np.float32(1e15))  # +inf in feature 0
    w[1, 13], xb[:, 13] = 0x8000, 0x8000  # -0 x -0
    w[:, 4:6], w[:, 8:10] = leaves.to_bf16(np.float32(1.0)), leaves.to_bf16(np.float32(2.0**-126))
    row = xb[DENORMAL_SUM_ROW]
    row[:] = 0
    row[4], row[5] = leaves.to_bf16(np.float32(-2.0**-126)), leaves.to_bf16(np.float32(1.5 * 2.0**-126))
    row[8:10] = leaves.to_bf16(np.float32(1.0))
    return w, xb


def test_the_scalar_reference_is_the_sdm_vdpbf16ps_chain(runner):
    rng = np.random.default_rng(3)
    for case in ("normal", "specials"):
        N, K, M = 40, 66, 3
        w, xb = specials(rng, N, K, M) if case == "specials" else (bf16_normal(rng, (N, K)), bf16_normal(rng, (M, K)))
        got = run(runner, "kv_bf16_scalar", w, xb, M)
        assert np.array_equal(got.view(np.uint32), sdm_reference(w, xb).view(np.uint32)), case
    others = np.arange(got.shape[0]) != DENORMAL_SUM_ROW
    assert np.isposinf(got[others, 0]).all() and np.isfinite(got[:, 1:]).all()
    assert (got[DENORMAL_SUM_ROW] == np.float32(2.0**-125)).all()


def test_the_avx512_bf16_kernel_gives_the_scalar_bits_on_every_remainder(runner):
    if not runs_vector(runner):
        pytest.skip("this CPU has no AVX512-BF16 (the emulated run covers it)")
    rng = np.random.default_rng(0)
    for N, K in SHAPES:
        w = bf16_normal(rng, (N, K), 0.05)
        for M in range(1, leaves.MR + 2):
            xb = bf16_normal(rng, (M, K))
            scalar = run(runner, "kv_bf16_scalar", w, xb, M)  # all rows in one call
            vector = run(runner, "kv_bf16_avx512", w, xb, leaves.MR)
            assert np.array_equal(vector.view(np.uint32), scalar.view(np.uint32)), (N, K, M)
    w, xb = specials(rng, 49, 70, leaves.MR + 1)
    vector = run(runner, "kv_bf16_avx512", w, xb, leaves.MR)
    assert np.array_equal(vector.view(np.uint32), sdm_reference(w, xb).view(np.uint32))


def conversion_inputs(rng) -> np.ndarray:
    """float32 values vcvtneps2bf16 treats specially: ties to even both ways, the carry into infinity,
    denormals, signed zeros, infinities, NaNs with payloads, then random values of every exponent."""
    bits = np.array([0x3F808000, 0x3F818000, 0x3F817FFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x00000001, 0x807FFFFF, 0x00000000,
                     0x80000000, 0x7F800000, 0xFF800000, 0x7F800001, 0xFFC12345, 0x7FBFFFFF, 0x00800000, 0x3F80FFFF],
                    np.uint32)
    rest = rng.integers(0, 2**32, 200, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([bits, rest]).view(np.float32)


def test_the_activation_conversion_is_vcvtneps2bf16s_rounding(runner):
    values = conversion_inputs(np.random.default_rng(5))
    symbols = ["kv_bf16_convert_scalar"] + (["kv_bf16_convert_avx512"] if runs_vector(runner) else [])
    for n in (*range(1, 34), 47, 64, values.size):  # every tail of a 16-value step
        runner.reset_heap()
        x, expected = values[:n], leaves.to_bf16(values[:n])
        for symbol in symbols:
            out = runner.alloc(2 * n + 64)
            runner.call(symbol, runner.put_struct(leaves.ConvertArgs(x=runner.put(x), out=out, n=n)))
            got = runner.get(out, n + 32, np.uint16)
            assert np.array_equal(got[:n], expected), (symbol, n)
            assert not got[n:].any(), (symbol, n)  # the masked tail writes nothing past n
    assert leaves.to_bf16(np.float32(1.00390625))[()] == 0x3F80  # a tie rounds to even (down here)
    assert leaves.to_bf16(np.float32(np.finfo(np.float32).max))[()] == 0x7F80  # and may carry into infinity
