"""The int8 / int4 KV cache's paged decode attention (native/csrc/kv_attend.h, the body kv_quant.cpp ships) run
as leaves: the AVX2 and AVX-512 paths against the scalar one, bit for bit, under the CPU emulator (a Sapphire
Rapids core: AVX-512 on any x86-64 machine) and, where this CPU has the instructions, natively; and the leaves
against the extension's paged_decode_attention_quant on the same inputs, so the leaf is the shipped kernel.

The shapes reach every branch of the body: head sizes 64, 128, 96, 48 and 40 (an odd 8-lane tail: AVX-512 refuses
it, as kv_quant.cpp steps down to AVX2), GQA groups 1, 2, 3, 4 (head blocks 3 + 1) and 6 (3 + 3), 1 to 8 scales
per head vector, contexts over several (scattered) blocks of 16, 8, 5 and 4 slots, lengths not multiples of 8 (the
softmax tail's exp1), sliding windows, a strided q (rows of qkv), and scales at float16's extremes (0, the
smallest subnormal, the largest subnormal and normal, negative) next to codes at theirs.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvserve.native import emulate
from kvserve.native import kv_leaves as leaves
from tests.leafutil import leaf_runner

# bits, heads, kv_heads, dim, group, lens, block_size, window
SHAPES = [
    (8, 9, 3, 64, 64, (45, 25, 1), 16, 0),   # SmolLM2's heads, its int8 pool (a scale per head vector)
    (4, 9, 3, 64, 32, (45, 25, 1), 16, 0),   # its int4 pool (a scale per 32)
    (8, 4, 2, 128, 32, (37, 70), 16, 0),     # 4 scales per head vector
    (4, 8, 2, 96, 32, (29, 3), 5, 0),        # group 4: head blocks of 3 + 1; 5-slot blocks
    (8, 2, 2, 48, 48, (50, 13), 8, 7),       # group 1, a sliding window; 3 AVX-512 vectors per head vector
    (4, 6, 1, 64, 16, (33,), 16, 0),         # int4 per 16: AVX-512 refuses; group 6 (3 + 3)
    (8, 4, 4, 40, 40, (30, 9), 16, 20),      # D % 16 == 8: AVX-512 refuses; a window longer than one context
    (8, 3, 1, 64, 8, (19,), 4, 0),           # 8 scales per head vector: AVX-512 refuses
]
# float16 bits: 0, the smallest subnormal, the largest subnormal, the smallest normal, the largest normal, -1
EXTREME_SCALES = np.array([0x0000, 0x0001, 0x03FF, 0x0400, 0x7BFF, 0xBC00], np.uint16)


def shape_id(shape) -> str:
    bits, heads, kv_heads, dim, group, lens, block_size, window = shape
    return f"int{bits}-{heads}x{kv_heads}x{dim}-g{group}-len{'_'.join(map(str, lens))}-bs{block_size}-w{window}"


@pytest.fixture(scope="module", params=["emulated", "native"])
def runner(request):
    """The leaves in the emulator, or on this CPU (ctypes)."""
    yield from leaf_runner(request.param, leaves.build)


def runs(runner, isa: str) -> bool:
    return not isinstance(runner, emulate.Native) or leaves.NEEDS[isa] <= emulate.host_cpu_flags()


def random_case(shape, seed: int, strided_q: bool = False) -> leaves.Case:
    """A seeded call on ``shape`` (SHAPES' fields): every code byte, scales of either sign around 0.01 and, on a
    few scattered slots, EXTREME_SCALES and the codes' extremes (int8 -128 and 127, int4 nibbles 0 and 15)."""
    bits, heads, kv_heads, dim, group, lens, block_size, window = shape
    rng = np.random.default_rng(seed)
    per_seq = -(-max(lens) // block_size)
    num_blocks = len(lens) * per_seq + 2
    slots = num_blocks * block_size
    row, S = dim * bits // 8, dim // group
    codes = rng.integers(0, 256, (2, slots, kv_heads, row), dtype=np.uint8)
    scales = (rng.uniform(-0.02, 0.02, (2, slots, kv_heads, S)) + 0.01).astype(np.float16).view(np.uint16)
    for side in range(2):
        picked = rng.choice(slots, len(EXTREME_SCALES), replace=False)
        scales[side, picked, :, 0] = EXTREME_SCALES[:, None]
        codes[side, picked[1::2]] = 0x80 if bits == 8 else 0x00   # int8 -128, int4 -8 -8
        codes[side, picked[::2]] = 0x7F if bits == 8 else 0xFF    # int8 127, int4 7 7
    codes = codes.reshape(2, num_blocks, block_size, kv_heads, row)
    scales = scales.view(np.float16).reshape(2, num_blocks, block_size, kv_heads, S)
    B = len(lens)
    if strided_q:  # q as the query heads of qkv rows [B, heads + 2 kv_heads, dim]
        q = (rng.standard_normal((B, heads + 2 * kv_heads, dim)) * 3).astype(np.float32)[:, :heads]
    else:
        q = (rng.standard_normal((B, heads, dim)) * 3).astype(np.float32)
    return leaves.Case(q=q, rows=rng.permutation(B).astype(np.int64),
                       tables=rng.permutation(num_blocks)[:B * per_seq].reshape(B, per_seq).astype(np.int64),
                       lens=np.array(lens, np.int64), k_codes=codes[0] if bits == 4 else codes[0].view(np.int8),
                       k_scales=scales[0], v_codes=codes[1] if bits == 4 else codes[1].view(np.int8),
                       v_scales=scales[1], bits=bits, group=group, scale=float(np.float32(dim ** -0.5)),
                       window=window)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_vector_paths_give_the_scalar_bits(runner, isa):
    if not runs(runner, isa):
        pytest.skip(f"this CPU has no {isa} (the emulated run covers it)")
    for index, shape in enumerate(SHAPES):
        case = random_case(shape, index, strided_q=index % 3 == 1)
        done, scalar = leaves.attend(runner, "scalar", case)
        assert done == 0 and np.isfinite(scalar).all() and np.abs(scalar).max() > 0, shape_id(shape)
        done, vector = leaves.attend(runner, isa, case)
        if isa == "avx512" and not leaves.avx512_takes(case.bits, case.group):
            assert done == 1 and np.isnan(vector).all(), shape_id(shape)  # refused, nothing written
            continue
        assert done == 0 and same_bits(vector, scalar), shape_id(shape)


def test_a_softmax_over_extreme_scores_stays_the_scalar_bits(runner):
    # one key row with the largest scale and codes dominates every score: the others' exp clamps at -87.3
    shape = (8, 4, 2, 64, 64, (23, 17), 8, 0)
    case = random_case(shape, 99)
    case.k_scales[case.tables[0, 1], 3] = np.float16(65504)
    case.k_codes[case.tables[0, 1], 3] = 127
    done, scalar = leaves.attend(runner, "scalar", case)
    assert done == 0 and np.isfinite(scalar).all()
    for isa in ("avx2", "avx512"):
        if runs(runner, isa):
            done, vector = leaves.attend(runner, isa, case)
            assert done == 0 and same_bits(vector, scalar), isa


def test_each_leaf_refuses_a_shape_the_body_does_not_take(runner):
    case = random_case(SHAPES[0], 0)
    for isa in leaves.ISAS:
        if not runs(runner, isa):
            continue
        for bits, group in ((2, 64), (8, 12), (8, 48)):  # bits, a group not a multiple of 8, one not dividing 64
            done, out = leaves.attend(runner, isa, leaves.Case(**{**vars(case), "bits": bits, "group": group}))
            assert done == 1 and np.isnan(out).all(), (isa, bits, group)


# bits, heads, kv_heads, dim, group, prompt rows, cached prefix, block size, window
PROMPT_SHAPES = [
    (8, 9, 3, 64, 64, 7, 60, 16, 0),     # SmolLM2's int8 pool: 21 query vectors a tile, two chunks of 64 keys
    (4, 8, 2, 128, 32, 4, 30, 16, 0),    # int4, D = 128: 16 vectors (the AVX-512 tile transposes K)
    (8, 4, 2, 96, 32, 5, 70, 8, 37),     # D = 96 (looped), a sliding window
    (4, 2, 2, 64, 16, 3, 20, 16, 0),     # int4 per 16 (the per-row AVX-512 path refuses it; the tile does not)
    (8, 4, 4, 40, 40, 6, 9, 16, 0),      # D = 40: AVX-512's branch hands it to the AVX2 tile
]


def prompt_case(shape, seed: int) -> leaves.Case:
    """One prompt's rows over a seeded quantized pool: context lengths start + 1 .. start + prompt over one
    scattered block table (the rows the extension attends as a tile)."""
    bits, heads, kv_heads, dim, group, prompt, start, block_size, window = shape
    rng = np.random.default_rng(seed)
    width = -(-(start + prompt) // block_size)
    pool = 2 * width + 1
    k_codes, k_scales = leaves.quantize(rng.standard_normal((pool, block_size, kv_heads, dim)), bits, group)
    v_codes, v_scales = leaves.quantize(rng.standard_normal((pool, block_size, kv_heads, dim)), bits, group)
    table = rng.permutation(pool)[:width]
    return leaves.Case(q=rng.standard_normal((prompt, heads, dim)).astype(np.float32), rows=np.arange(prompt),
                       tables=np.tile(table, (prompt, 1)), lens=np.arange(start + 1, start + prompt + 1),
                       k_codes=k_codes, k_scales=k_scales, v_codes=v_codes, v_scales=v_scales, bits=bits,
                       group=group, scale=float(np.float32(dim ** -0.5)), window=window)


@pytest.mark.parametrize("tile", ["tile_avx2", "tile_avx512"])
def test_a_prompts_rows_in_a_tile_have_the_bits_of_each_row_alone(runner, tile):
    """The extension's prompt tiles over a quantized pool (each chunk of code rows dequantized once, the float32
    cache's tile over them; AVX-512's under the emulator on any CPU) against the per-row AVX2 kernel, bit for bit."""
    if not runs(runner, tile.removeprefix("tile_")):
        pytest.skip(f"this CPU has no {tile.removeprefix('tile_')} (the emulated run covers it)")
    for index, shape in enumerate(PROMPT_SHAPES):
        case = prompt_case(shape, index)
        done, alone = leaves.attend(runner, "avx2", case)
        assert done == 0 and np.isfinite(alone).all(), shape
        done, tiled = leaves.attend(runner, tile, case)
        assert done == 0 and same_bits(tiled, alone), shape


def test_every_float16_scale_converts_to_the_same_float_on_both_conversions(runner):
    # the baseline's integer conversion against vcvtph2ps (the AVX2 and AVX-512 paths'), all 65536 values, NaNs
    # included (quieted, payload kept); finite ones are also numpy's
    halves = np.arange(1 << 16, dtype=np.uint16)
    got = {}
    for isa in ("scalar", "avx2"):
        if not runs(runner, isa):
            continue
        runner.reset_heap()
        out = runner.alloc(4 * halves.size)
        runner.call(f"kv_half_to_float_{isa}", runner.put_struct(leaves.HalfArgs(h=runner.put(halves), out=out,
                                                                                 n=halves.size)))
        got[isa] = runner.get(out, halves.size, np.float32)
    finite = np.isfinite(halves.view(np.float16))
    assert same_bits(got["scalar"][finite], halves.view(np.float16)[finite].astype(np.float32))
    if "avx2" in got:
        assert same_bits(got["scalar"], got["avx2"])


def test_numpy_quantize_is_the_pools():
    torch = pytest.importorskip("torch")
    from kvserve.kvcache.pool import quantize

    rng = np.random.default_rng(5)
    x = (rng.standard_normal((7, 3, 64)) * np.logspace(-4, 4, 7)[:, None, None]).astype(np.float32)
    x[2, 1] = 0.0
    x[3, 0, :32] = 0.0
    for bits, group in ((8, 64), (8, 16), (4, 32), (4, 16)):
        codes, scales = leaves.quantize(x, bits, group)
        expected_codes, expected_scales = quantize(torch.from_numpy(x), bits, group)
        assert np.array_equal(codes, expected_codes.numpy()), (bits, group)
        assert np.array_equal(scales.view(np.uint16), expected_scales.numpy().view(np.uint16)), (bits, group)


def test_the_leaves_are_the_extensions_kernel(runner):
    """Every leaf this runner runs gives paged_decode_attention_quant's bits (the extension runs the path
    native/csrc/cpu.h chose here; all give the same bits), on random codes and on a pool written from vectors
    with ``quantize``."""
    torch = pytest.importorskip("torch")
    from kvserve import native

    ops = native.load_ops()
    if ops is None:
        pytest.skip("the native extension is not built here")
    cases = [random_case(shape, 10 + index, strided_q=index % 2 == 0) for index, shape in enumerate(SHAPES)]
    rng = np.random.default_rng(3)
    written = random_case(SHAPES[1], 3)
    for side in ("k", "v"):
        x = (rng.standard_normal((*written.k_codes.shape[:3], 64)) * 2).astype(np.float32)
        codes, scales = leaves.quantize(x, written.bits, written.group)
        setattr(written, f"{side}_codes", codes)
        setattr(written, f"{side}_scales", scales)
    for case in [*cases, written]:
        out = torch.full(case.q.shape, float("nan"))
        ops.paged_decode_attention_quant(torch.from_numpy(case.q), torch.from_numpy(case.rows),
                                         torch.from_numpy(case.tables), torch.from_numpy(case.lens),
                                         torch.from_numpy(case.k_codes), torch.from_numpy(case.k_scales),
                                         torch.from_numpy(case.v_codes), torch.from_numpy(case.v_scales),
                                         case.bits, case.scale, case.window, out)
        for isa in leaves.ISAS:
            if not runs(runner, isa) or (isa == "avx512" and not leaves.avx512_takes(case.bits, case.group)):
                continue
            done, ours = leaves.attend(runner, isa, case)
            assert done == 0 and same_bits(ours, out.numpy()), (isa, case.bits, case.q.shape, case.group)


def dequantize(codes: np.ndarray, scales: np.ndarray, bits: int, group: int) -> np.ndarray:
    """float64 head vectors [..., D] from the pool's codes and float16 scales (kvcache.pool.dequantize)."""
    if bits == 8:
        values = codes.astype(np.float64)
    else:
        packed = codes.reshape(*codes.shape[:-1], -1, group // 2)
        values = (np.concatenate([packed & 15, packed >> 4], axis=-1).astype(np.float64) - 8).reshape(
            *codes.shape[:-1], -1)
    return (values.reshape(*values.shape[:-1], -1, group) * scales.astype(np.float64)[..., None]).reshape(
        values.shape)


def test_the_scalar_leaf_is_attention_over_the_dequantized_cache(runner):
    """The reference itself: a float64 softmax attention over code * scale, within float32 rounding."""
    for index in (0, 1, 4, 6):
        case = random_case(SHAPES[index], 20 + index)
        case.k_scales[np.abs(case.k_scales) > 1] = np.float16(0.01)  # no dominating key: every weight counts
        done, out = leaves.attend(runner, "scalar", case)
        assert done == 0
        k, v = (dequantize(c, s, case.bits, case.group).reshape(-1, *c.shape[2:3], out.shape[2])
                for c, s in ((case.k_codes, case.k_scales), (case.v_codes, case.v_scales)))
        block_size, H_kv = case.k_codes.shape[1], case.k_codes.shape[2]
        group = out.shape[1] // H_kv
        for b, (row, n, span) in enumerate(zip(case.rows, case.lens, case.spans)):
            t = np.arange(n - span, n)
            slot = case.tables[b, t // block_size] * block_size + t % block_size
            for h in range(out.shape[1]):
                s = k[slot, h // group] @ case.q[row, h].astype(np.float64) * case.scale
                w = np.exp(s - s.max())
                expected = (w / w.sum()) @ v[slot, h // group]
                bound = 1e-5 * (np.abs(v[slot, h // group]).max() + 1e-30)
                assert np.abs(out[row, h] - expected).max() <= bound, (index, b, h)
