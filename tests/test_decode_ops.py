"""native/csrc/decode_ops.cpp (fused RMSNorm, RoPE, KV write, paged decode attention) computes what the torch ops do,
and decode_layers.cpp (every layer of a decode step in one call) what the per-layer loop does."""

from __future__ import annotations

import pytest
import torch

import contextlib
from dataclasses import replace
from types import SimpleNamespace

from gguf import GGMLQuantizationType, quants

from kvserve.engine.plan import SeqWork, StepPlan
from kvserve.engine.rope import Rope
from kvserve.engine.loader import wrap_model
from kvserve.engine.runner import ModelRunner
from kvserve import native
from kvserve.kvcache.pool import KVPool, dequantize, quantize
from kvserve.kvcache.sizing import KVCacheDType
from kvserve.quant.ggml import GGMLEmbedding, GGMLKind, GGMLLinear
from tests.engineutil import BLOCK, GREEDY, run_both, tiny
from tests.ggmlutil import with_gguf_blocks

ops = native.load_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="engine decode ops could not be built here")


def _torch_only(monkeypatch) -> None:
    monkeypatch.setattr(native, "load_ops", lambda build=True: None)


@pytest.mark.parametrize("arch,overrides", [("llama", {"attention_bias": True}), ("qwen2", {}),
                                            ("mistral", {"sliding_window": 4})])
def test_fused_ops_equal_torch_ops_on_a_mixed_step(arch, overrides, monkeypatch):
    # a step with a 9-token prefill, a decode at position 6 (its window of 4 drops 3 keys for Mistral) and a
    # 5-token chunk over a cached prefix: logits and every written K/V, with the ops and with torch's
    (fast, fast_kv), (ref, ref_kv) = run_both(wrap_model(tiny(arch, **overrides), tokenizer=None, name=arch))
    _torch_only(monkeypatch)
    (fast_t, fast_kv_t), (ref_t, ref_kv_t) = run_both(wrap_model(tiny(arch, **overrides), tokenizer=None, name=arch))
    for ours, theirs in ((fast, fast_t), (ref, ref_t), (fast_kv, fast_kv_t), (ref_kv, ref_kv_t)):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_norms_and_rope_equal_torch():
    torch.manual_seed(0)
    x, r, w = torch.randn(5, 64), torch.randn(5, 64), torch.rand(64) + 0.5
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), torch.nn.functional.rms_norm(x, (64,), w, 1e-5))
    stream = x.clone()
    out = ops.add_rms_norm_(stream, r, w, 1e-5)
    torch.testing.assert_close(stream, x + r)  # the residual stream is updated in place
    torch.testing.assert_close(out, torch.nn.functional.rms_norm(x + r, (64,), w, 1e-5))

    qkv = torch.randn(3, 6 * 16 + 2 * 16)  # [T, (H + H_kv) d + H_kv d]: RoPE on the first 6 heads only
    angles = torch.rand(3, 8) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # [T, d]
    expected = Rope(cos, sin, None)(qkv[:, :96].view(3, 6, 16))
    rotated = ops.rope_(qkv[:, :96].view(3, 6, 16), cos, sin)
    assert rotated is None  # in place
    torch.testing.assert_close(qkv[:, :96].view(3, 6, 16), expected)


def _attention_reference(q, tables, lens, k_blocks, v_blocks, scale, window):
    """Per sequence: gather its keys/values through the block table, softmax(q k^T * scale) v in float64."""
    block_size, kv_heads = k_blocks.shape[1], k_blocks.shape[2]
    group = q.shape[1] // kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for b, length in enumerate(lens.tolist()):
        slots = [tables[b, t // block_size].item() * block_size + t % block_size for t in range(length)]
        first = max(0, length - window) if window > 0 else 0
        keys = k_blocks.flatten(0, 1)[slots[first:]].double().repeat_interleave(group, dim=1)  # [S, H, D]
        values = v_blocks.flatten(0, 1)[slots[first:]].double().repeat_interleave(group, dim=1)
        weights = torch.softmax(torch.einsum("hd,shd->hs", q[b].double(), keys) * scale, dim=-1)  # [H, S]
        out[b] = torch.einsum("hs,shd->hd", weights, values)
    return out


@pytest.mark.parametrize("batch,context,heads,kv_heads,dim,window", [
    (1, 1, 4, 2, 16, 0),      # a single key
    (3, 37, 9, 3, 64, 0),     # SmolLM2's heads, a tail of 5 keys after 32 (the vectorized exp and its tail)
    (4, 300, 8, 1, 128, 0),   # long contexts (keys prefetched ahead), one KV head for all
    (2, 90, 4, 4, 40, 16),    # no GQA, a sliding window of 16 keys
    (2, 50, 6, 2, 20, 0),     # head size not a multiple of 8: the scalar loop
])
def test_paged_decode_attention_equals_a_float64_softmax(batch, context, heads, kv_heads, dim, window):
    torch.manual_seed(batch * context + dim)
    block_size = 16
    per_seq = -(-context // block_size)
    num_blocks = batch * per_seq + 3
    k_blocks = torch.randn(num_blocks, block_size, kv_heads, dim)
    v_blocks = torch.randn(num_blocks, block_size, kv_heads, dim)
    tables = torch.randperm(num_blocks)[:batch * per_seq].view(batch, per_seq).contiguous()  # scattered blocks
    lens = torch.tensor([max(1, context - 11 * b) for b in range(batch)])
    q = torch.randn(batch, heads, dim) * 3  # peaked softmaxes: many weights far below the largest
    out = torch.empty_like(q)
    ops.paged_decode_attention(q, torch.arange(batch), tables, lens, k_blocks, v_blocks, dim ** -0.5, window, out)
    expected = _attention_reference(q, tables, lens, k_blocks, v_blocks, dim ** -0.5, window)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=2e-6)


# (prompt, start, heads, kv_heads, dim, window) of one prompt's rows attended in one call
PROMPT_TILE_SHAPES = [
    (100, 0, 9, 3, 64, 0),      # SmolLM2's heads: several tiles of rows and chunks of 64 keys
    (37, 5, 8, 8, 64, 0),       # over a cached prefix of 5 tokens, no GQA
    (70, 0, 4, 1, 128, 0),      # D = 128
    (50, 3, 6, 2, 72, 0),       # D = 72: the loop over D (neither 64 nor 128; AVX2 only)
    (45, 20, 6, 3, 80, 0),      # D = 80: the loop over D on the AVX-512 path too
    (90, 0, 9, 3, 64, 40),      # a sliding window shorter than the prompt
    (17, 200, 9, 3, 64, 0),     # one tile's rows over a long prefix
]


def prompt_rows(prompt: int, start: int, pool: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rows, lens, tables of a call holding one prompt's rows (after a cached prefix of ``start`` tokens:
    consecutive rows, context lengths growing by one, one block table of ``blocks`` of a ``pool``-block pool)
    between two rows of other sequences."""
    table = torch.randperm(pool)[:blocks]
    other = torch.randperm(pool)[:blocks]
    rows = torch.arange(prompt + 2)
    lens = torch.cat([torch.tensor([9]), torch.arange(start + 1, start + prompt + 1), torch.tensor([start + 3])])
    tables = torch.cat([other[None], table.repeat(prompt, 1), other[None]])
    return rows, lens, tables


def prompt_tile_case(prompt, start, heads, kv_heads, dim, window):
    """A call holding one prompt's rows (``prompt_rows``) between two rows of other sequences: (q, rows, tables,
    lens, k_blocks, v_blocks, the call's output)."""
    torch.manual_seed(0)
    block_size, blocks = 16, (start + prompt) // 16 + 2
    pool = blocks * 3
    k_blocks, v_blocks = torch.randn(pool, block_size, kv_heads, dim), torch.randn(pool, block_size, kv_heads, dim)
    rows, lens, tables = prompt_rows(prompt, start, pool, blocks)
    q = torch.randn(prompt + 2, heads, dim)
    together = torch.zeros(q.shape)
    ops.paged_decode_attention(q, rows, tables, lens, k_blocks, v_blocks, dim ** -0.5, window, together)
    return q, rows, tables, lens, k_blocks, v_blocks, together


@pytest.mark.parametrize("prompt,start,heads,kv_heads,dim,window", PROMPT_TILE_SHAPES)
def test_a_prompts_rows_attended_in_one_call_have_the_bits_of_each_row_alone(prompt, start, heads, kv_heads, dim,
                                                                             window):
    """rows_alone prefill: every token of a prompt is a decode row; one call attends consecutive rows of one
    prompt together (tiles sharing each K and V row read; on AVX-512 the K rows transposed and the query vectors
    register-blocked), and each row must have the bits it has alone. The call also holds rows of other
    sequences, before and after the prompt, which are not of its tiles."""
    q, rows, tables, lens, k_blocks, v_blocks, together = prompt_tile_case(prompt, start, heads, kv_heads, dim,
                                                                           window)
    assert torch.equal(together, _each_row_alone(q, rows, tables, lens, k_blocks, v_blocks, window))
    expected = _attention_reference(q, tables, lens, k_blocks, v_blocks, dim ** -0.5, window)
    torch.testing.assert_close(together.double(), expected, rtol=1e-5, atol=1e-5)


def _each_row_alone(q, rows, tables, lens, k_blocks, v_blocks, window):
    """Each row of a call attended by a call of its own (a decode row)."""
    alone = torch.zeros(q.shape)
    for b in range(len(rows)):
        ops.paged_decode_attention(q, rows[b:b + 1], tables[b:b + 1], lens[b:b + 1], k_blocks, v_blocks,
                                   q.shape[-1] ** -0.5, window, alone)
    return alone


def test_a_prompts_rows_in_tiles_of_64_have_the_bits_of_each_row_alone():
    """On the AVX-512 path a prompt whose rows make 4 tasks a thread is cut into tiles of 64 rows (130 rows x 3 KV
    heads on one thread: two tiles of 64 and one of 2), handed to the threads largest first; each row still has
    the bits it has alone. (Elsewhere, and on the AVX2 path, tiles are of 32 rows.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        q, rows, tables, lens, k_blocks, v_blocks, together = prompt_tile_case(130, 0, 9, 3, 64, 0)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, _each_row_alone(q, rows, tables, lens, k_blocks, v_blocks, 0))


@pytest.mark.parametrize("heads,kv_heads,dim,window", [(9, 3, 64, 0), (4, 4, 16, 5)])
def test_decode_attention_is_rope_kv_write_and_attention_in_one_call(heads, kv_heads, dim, window):
    # the fused all-decode op must give the bits of the three separate calls: out, rotated qkv and the pool
    torch.manual_seed(heads)
    batch, block_size, num_blocks = 3, 4, 12
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * dim)
    angles = torch.rand(batch, dim // 2) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # [T, d]
    k_blocks = torch.randn(num_blocks, block_size, kv_heads, dim)
    v_blocks = torch.randn(num_blocks, block_size, kv_heads, dim)
    tables = torch.randperm(num_blocks)[:9].view(batch, 3).contiguous()
    lens = torch.tensor([9, 12, 1])
    slots = torch.stack([tables[b, (n - 1) // block_size] * block_size + (n - 1) % block_size
                         for b, n in enumerate(lens.tolist())])  # each query's own position
    rows = torch.arange(batch)
    expected_qkv, expected_k, expected_v = qkv.clone(), k_blocks.clone(), v_blocks.clone()
    x = expected_qkv.view(batch, heads + 2 * kv_heads, dim)
    ops.rope_(x[:, :heads + kv_heads], cos, sin)
    ops.write_kv(expected_k.view(-1, kv_heads, dim), expected_v.view(-1, kv_heads, dim), slots,
                 x[:, heads:heads + kv_heads], x[:, heads + kv_heads:])
    expected = torch.empty(batch, heads, dim)
    ops.paged_decode_attention(x[:, :heads], rows, tables, lens, expected_k, expected_v, 0.3, window, expected)
    out = ops.decode_attention_(qkv, heads, kv_heads, cos, sin, slots, k_blocks, v_blocks, rows, tables, lens, 0.3,
                                window)
    assert torch.equal(out, expected) and torch.equal(qkv, expected_qkv)
    assert torch.equal(k_blocks, expected_k) and torch.equal(v_blocks, expected_v)
    with pytest.raises(RuntimeError, match="qkv must be contiguous"):
        ops.decode_attention_(qkv[:, 1:], heads, kv_heads, cos, sin, slots, k_blocks, v_blocks, rows, tables, lens,
                              0.3, window)


def quantized_attention_case(bits: int, heads: int = 9, kv_heads: int = 3, dim: int = 64, window: int = 0,
                             context: int = 45, group: int | None = None) -> tuple[torch.Tensor, ...]:
    """A seeded int8 / int4 pool written by the C++ op over scattered blocks, and the quantized paged attention's
    output over it: (out, q, tables, lens, k_codes, k_scales, v_codes, v_scales). group: elements per scale
    (default the pool's: dim for int8, 32 for int4). tests/test_isa.py runs it on each ISA path and compares the
    bits."""
    torch.manual_seed(bits * 100 + dim + window + context)
    batch, block_size, per_seq = 3, 16, -(-context // 16)
    num_blocks = batch * per_seq + 2
    group = group or (dim if bits == 8 else 32)
    codes = torch.zeros(2, num_blocks, block_size, kv_heads, dim * bits // 8,
                        dtype=torch.int8 if bits == 8 else torch.uint8)
    scales = torch.zeros(2, num_blocks, block_size, kv_heads, dim // group, dtype=torch.float16)
    slots = torch.randperm(num_blocks * block_size)
    k, v = torch.randn(slots.numel(), kv_heads, dim) * 2, torch.randn(slots.numel(), kv_heads, dim)
    ops.write_kv_quant(codes[0].flatten(0, 1), scales[0].flatten(0, 1), codes[1].flatten(0, 1),
                       scales[1].flatten(0, 1), slots, k, v, bits)
    tables = torch.randperm(num_blocks)[:batch * per_seq].view(batch, per_seq).contiguous()
    lens = torch.tensor([context, max(1, context - 20), 1])
    q = torch.randn(batch, heads, dim) * 3
    out = torch.empty_like(q)
    ops.paged_decode_attention_quant(q, torch.arange(batch), tables, lens, codes[0], scales[0], codes[1], scales[1],
                                     bits, dim ** -0.5, window, out)
    return out, q, tables, lens, codes[0], scales[0], codes[1], scales[1]


# Shapes that reach every branch of kv_quant.cpp's attention: SmolLM2's (9 query heads on 3 KV heads of 64),
# head blocks of 3 + 1 and 3 + 3 + 2, a head size with an odd 8-lane tail (40: int8 on the AVX2 order's first
# accumulator, the AVX-512 path stepping down), int4 scales per 16 (AVX-512 steps down), 4 scales per head, a
# sliding window, and softmax tails (contexts not a multiple of 8).
QUANT_SHAPES = [  # bits, heads, kv_heads, dim, window, context, group
    (8, 9, 3, 64, 0, 45, None),
    (4, 9, 3, 64, 0, 45, None),
    (8, 4, 1, 128, 0, 300, None),
    (4, 8, 1, 128, 0, 77, None),
    (8, 4, 4, 40, 7, 30, None),
    (4, 6, 2, 64, 0, 50, 16),
    (8, 2, 2, 16, 0, 19, 8),
]


@pytest.mark.parametrize("bits", [8, 4])
def test_write_kv_quant_gives_the_torch_reference_codes(bits):
    # kvcache.pool.quantize is the rule; the C++ write must give its bits, from strided K/V rows
    torch.manual_seed(bits)
    T, H, D = 6, 3, 64
    qkv = torch.randn(T, 9 + 2 * H, D) * torch.logspace(-3, 3, T)[:, None, None]
    k, v = qkv[:, 9:9 + H], qkv[:, 9 + H:]
    k[2, 1] = 0.0
    row, group = D * bits // 8, D if bits == 8 else 32
    dtype = torch.int8 if bits == 8 else torch.uint8
    k_codes, v_codes = torch.zeros(10, H, row, dtype=dtype), torch.zeros(10, H, row, dtype=dtype)
    k_scales, v_scales = torch.zeros(10, H, D // group, dtype=torch.float16), torch.zeros(10, H, D // group,
                                                                                          dtype=torch.float16)
    slots = torch.tensor([7, 0, 3, 9, 4, 1])
    v_codes.fill_(99 if bits == 8 else 255)  # stale codes of a freed block must not survive the write
    ops.write_kv_quant(k_codes, k_scales, v_codes, v_scales, slots, k, v, bits)
    for codes, scales, x in ((k_codes, k_scales, k), (v_codes, v_scales, v)):
        expected_codes, expected_scales = quantize(x, bits, group)
        assert torch.equal(codes[slots], expected_codes) and torch.equal(scales[slots], expected_scales)
    with pytest.raises(RuntimeError, match="slot 10 out of range"):
        ops.write_kv_quant(k_codes, k_scales, v_codes, v_scales, torch.tensor([10] * T), k, v, bits)
    with pytest.raises(RuntimeError, match="bits must be 8 or 4"):
        ops.write_kv_quant(k_codes, k_scales, v_codes, v_scales, slots, k, v, 2)


@pytest.mark.parametrize("bits,heads,kv_heads,dim,window", [
    (8, 9, 3, 64, 0),     # SmolLM2's heads
    (4, 9, 3, 64, 0),
    (8, 4, 4, 16, 7),     # no GQA, a sliding window
    (4, 8, 1, 128, 0),    # 4 scales per head vector
])
def test_quantized_paged_attention_equals_a_float64_softmax_over_the_dequantized_cache(bits, heads, kv_heads, dim,
                                                                                      window):
    out, q, tables, lens, k_codes, k_scales, v_codes, v_scales = quantized_attention_case(bits, heads, kv_heads, dim,
                                                                                          window)
    k_blocks = dequantize(k_codes, k_scales, bits, torch.float64)
    v_blocks = dequantize(v_codes, v_scales, bits, torch.float64)
    expected = _attention_reference(q, tables, lens, k_blocks, v_blocks, dim ** -0.5, window)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("bits,heads,kv_heads,dim,window,context,group", QUANT_SHAPES)
def test_quantized_attention_has_the_float32_kernels_bits_over_the_dequantized_cache(bits, heads, kv_heads, dim,
                                                                                     window, context, group):
    # kv_quant.cpp performs the float32 cache's AVX2 kernel's operations in its order on code * scale (exact), so
    # over the dequantized pool the two ops agree bit for bit, on the AVX-512 path as on the AVX2 one
    if native.isa().startswith("scalar"):
        pytest.skip("the float32 kernel's scalar path has its own order; tests/test_isa.py compares the quantized "
                    "kernel's scalar bits with its vector paths'")
    out, q, tables, lens, k_codes, k_scales, v_codes, v_scales = quantized_attention_case(
        bits, heads, kv_heads, dim, window, context, group)
    expected = torch.empty_like(q)
    ops.paged_decode_attention(q, torch.arange(3), tables, lens, dequantize(k_codes, k_scales, bits, torch.float32),
                               dequantize(v_codes, v_scales, bits, torch.float32), dim ** -0.5, window, expected)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("bits,prompt,start,heads,kv_heads,dim,window", [
    (bits, *shape) for bits in (8, 4) for shape in [*PROMPT_TILE_SHAPES[:4], (40, 9, 4, 2, 320, 0)]
    if bits == 8 or shape[4] % 32 == 0])  # int4: a scale per 32
def test_a_prompts_rows_over_a_quantized_cache_have_the_bits_of_each_row_alone(bits, prompt, start, heads, kv_heads,
                                                                                dim, window):
    """The int8 / int4 cache attends a prompt's consecutive rows in tiles (each chunk of code rows dequantized once
    for the tile: kv_attend.h's QuantPool, read by the float32 cache's tiles; D = 320 is past its buffer and runs
    row by row): each row has the bits it has alone (the per-row kernel), and, on the vector paths, the float32
    kernel's bits over the dequantized cache."""
    q, rows, tables, lens, k_blocks, v_blocks, _ = prompt_tile_case(prompt, start, heads, kv_heads, dim, window)
    group = dim if bits == 8 else 32
    codes = torch.zeros(2, *k_blocks.shape[:3], dim * bits // 8, dtype=torch.int8 if bits == 8 else torch.uint8)
    scales = torch.zeros(2, *k_blocks.shape[:3], dim // group, dtype=torch.float16)
    ops.write_kv_quant(codes[0].flatten(0, 1), scales[0].flatten(0, 1), codes[1].flatten(0, 1),
                       scales[1].flatten(0, 1), torch.arange(k_blocks.shape[0] * k_blocks.shape[1]),
                       k_blocks.flatten(0, 1), v_blocks.flatten(0, 1), bits)
    cache = (codes[0], scales[0], codes[1], scales[1], bits)

    def attend(b0, b1, out):
        ops.paged_decode_attention_quant(q, rows[b0:b1], tables[b0:b1], lens[b0:b1], *cache, dim ** -0.5, window,
                                         out)

    together, alone = torch.zeros(q.shape), torch.zeros(q.shape)
    attend(0, len(rows), together)
    for b in range(len(rows)):
        attend(b, b + 1, alone)
    assert torch.equal(together, alone)
    if not native.isa().startswith("scalar"):
        expected = torch.zeros(q.shape)
        ops.paged_decode_attention(q, rows, tables, lens, dequantize(codes[0], scales[0], bits, torch.float32),
                                   dequantize(codes[1], scales[1], bits, torch.float32), dim ** -0.5, window, expected)
        assert torch.equal(together, expected)


def test_the_quantized_attention_runs_the_avx512_path_on_the_pools_groupings():
    best = native.native_isas()[-1]
    forced = native.forced_isa()
    if best != "avx512" or forced not in (None, "avx512"):
        pytest.skip("AVX-512 is not this CPU's path (or KVSERVE_ISA forces a lesser one); kv_quant.cpp's AVX-512 "
                    "path runs as a leaf under the emulator in tests/test_kv_quant_emulated.py")
    assert ops.kv_quant_path(8, 64) == ops.kv_quant_path(4, 32) == "avx512"  # the pool's: a scale per head, per 32
    assert ops.kv_quant_path(4, 16) == ops.kv_quant_path(8, 40) == "avx2"  # 16 codes of one scale do not fit a Vec


def test_quantized_paged_attention_refuses_mismatched_caches():
    _, q, tables, lens, k_codes, k_scales, v_codes, v_scales = quantized_attention_case(8)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="k codes must be contiguous int8"):
        ops.paged_decode_attention_quant(q, torch.arange(3), tables, lens, k_codes.view(torch.uint8), k_scales,
                                         v_codes, v_scales, 8, 0.1, 0, out)
    with pytest.raises(RuntimeError, match="v scales must be contiguous float16"):
        ops.paged_decode_attention_quant(q, torch.arange(3), tables, lens, k_codes, k_scales, v_codes,
                                         v_scales.float(), 8, 0.1, 0, out)


def test_bad_indices_raise_instead_of_reading_out_of_bounds():
    k_cache, v_cache = torch.zeros(8, 2, 16), torch.zeros(8, 2, 16)
    k = torch.randn(1, 2, 16)
    with pytest.raises(RuntimeError, match="slot 8 out of range"):  # the number and the text after it
        ops.write_kv(k_cache, v_cache, torch.tensor([8]), k, k)
    blocks = torch.zeros(2, 4, 2, 16)  # 2 blocks of 4 slots
    q, out = torch.randn(1, 4, 16), torch.empty(1, 4, 16)
    rows, lens = torch.tensor([0]), torch.tensor([5])
    with pytest.raises(RuntimeError, match="block id"):
        ops.paged_decode_attention(q, rows, torch.tensor([[0, 7]]), lens, blocks, blocks, 0.25, 0, out)
    with pytest.raises(RuntimeError, match="context length 5 does not fit"):
        ops.paged_decode_attention(q, rows, torch.tensor([[0]]), lens, blocks, blocks, 0.25, 0, out)


def test_the_kernels_format_error_messages_without_iostreams():
    # Where libstdc++ is linked statically into an extension (an H200 host: gcc 13, torch 2.11), a number
    # formatted through TORCH_CHECK's ostringstream crashed the process instead of raising; native/csrc/check.h
    # builds messages from std::string. Every check in every source must go through it.
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    sources = sorted((root / "native" / "csrc").glob("*.cpp")) + sorted((root / "native" / "csrc").glob("*.h"))
    assert len(sources) >= 8
    for source in sources:
        if source.name == "check.h":
            continue  # the one wrapper around TORCH_CHECK (its comment says why no stream)
        text = source.read_text()
        assert not re.search(r"ostream|stringstream|iostream|std::c(out|err)", text), source.name
        assert "TORCH_CHECK(" not in text, source.name
    checked = [s.name for s in sources if "KV_CHECK(" in s.read_text()]
    assert {"decode_ops.cpp", "linear_int8.cpp", "linear_int4.cpp", "linear_lut4.cpp", "linear_f32.cpp"} <= set(checked)
    qlinear = native.load()
    with pytest.raises(RuntimeError, match="per block of 32 or 64 that divides K; block = 32, K = 30$"):
        qlinear.int8_linear(torch.randn(1, 30), torch.zeros(4, 30, dtype=torch.int8), torch.ones(4), 32, False)


def _gguf_tiny(arch: str, overrides: dict, embedding: str | None = None, head: str | None = None):
    """The tiny model on GGUF blocks (``with_gguf_blocks``), its embedding and LM head too where a kind is given
    (gguf's quantizer on their float weights)."""
    model = tiny(arch, **overrides)
    generator = torch.Generator().manual_seed(1)
    for layer in model.model.layers:  # transformers initialises biases to 0 and norm weights to 1: make them count
        attn = layer.self_attn
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            if proj.bias is not None:
                proj.bias.data = torch.randn(proj.bias.shape, generator=generator)
        for norm in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)):
            if norm is not None:
                norm.weight.data = 0.5 + torch.rand(norm.weight.shape, generator=generator)
    with_gguf_blocks(model)

    def blocks(weight: torch.Tensor, kind: str) -> torch.Tensor:
        return torch.from_numpy(quants.quantize(weight.detach().numpy(), GGMLQuantizationType[kind.upper()]))
    if embedding is not None:
        model.model.embed_tokens = GGMLEmbedding(blocks(model.model.embed_tokens.weight, embedding),
                                                 GGMLKind(embedding))
    if head is not None:
        model.lm_head = GGMLLinear(blocks(model.lm_head.weight, head), GGMLKind(head))
    return wrap_model(model, tokenizer=None, name=f"{arch}-gguf")


def _pool(loaded, blocks: int, pool_dtype: torch.dtype | None = None) -> KVPool:
    """A KV pool of ``blocks`` blocks for ``loaded``, in ``pool_dtype`` (default the model's; bfloat16 takes the
    bfloat16 cache's shape)."""
    shape = loaded.kv_shape(KVCacheDType.BFLOAT16 if pool_dtype is torch.bfloat16 else KVCacheDType.AUTO)
    return KVPool(shape, blocks, BLOCK, pool_dtype or loaded.dtype)


def _stack_and_loop(loaded, rows: int, prepare=lambda fast: None,
                    pool_dtype: torch.dtype | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Logits and the pool after an all-decode step of ``rows`` sequences (contexts of 10-12 tokens), with the
    layer stack and with the layer loop; ``prepare(decoder)`` runs on each fresh decoder; ``pool_dtype``: the KV
    cache's (default the model's). The loop's q/k/v calls are counted: each path ran (the bare kernels', or the
    checked projections' where a bias keeps the bare ones off)."""
    tables = [list(range(s * 8, s * 8 + 8)) for s in range(3)]

    def slots(s, positions):
        return [tables[s][p // BLOCK] * BLOCK + p % BLOCK for p in positions]
    outputs = []
    for stack in (True, False):
        runner = ModelRunner(loaded, _pool(loaded, 32, pool_dtype))
        assert runner.fast.layer_stack is not None
        prepare(runner.fast)
        calls: list[int] = []
        kernels = "direct" if runner.fast.direct is not None else "checked"
        setattr(runner.fast, kernels, [replace(k, qkv=lambda h, qkv=k.qkv: calls.append(1) or qkv(h))
                                       for k in getattr(runner.fast, kernels)])
        prompts = [list(range(3 + s, 12 + 2 * s)) for s in range(rows)]
        runner.execute(StepPlan([SeqWork(s, p, 0, tables[s], slots(s, range(len(p))), False, GREEDY, p, [])
                                 for s, p in enumerate(prompts)]))
        calls.clear()  # the prompts' rows ran the loop (a prefill step)
        plan = StepPlan([SeqWork(s, [40 + s], len(p), tables[s], slots(s, [len(p)]), True, GREEDY, p, [40 + s])
                         for s, p in enumerate(prompts)])
        with contextlib.nullcontext() if stack else runner.fast.layer_loop_only():
            logits = runner.logits(plan)
        assert len(calls) == (0 if stack else len(loaded.model.model.layers))
        outputs.append((logits, runner.pool.data.clone()))
    return outputs


@pytest.mark.parametrize("arch,overrides,embedding,head", [
    ("llama", {}, None, None), ("mistral", {"sliding_window": 4}, None, None), ("llama", {}, "q8_0", "q8_0"),
    ("llama", {}, "q4_0", "q4_1"), ("llama", {}, "q4_1", None), ("llama", {}, "q5_0", "q8_0"),
    ("llama", {}, "q5_1", None), ("qwen2", {}, "q8_0", "q8_0"), ("qwen3", {"head_dim": 32}, None, "q4_0")])
def test_fused_layer_stack_gives_the_bits_of_the_layer_loop(arch, overrides, embedding, head):
    # An all-decode step of a model on GGUF blocks runs in one C++ call (DecodeLayers.decode): the embedding
    # looked up there (a float32 table, or each GGUF kind of 32-weight units), the RoPE rows, every layer, the
    # final norm and, where the head is on GGUF blocks, the LM head. The logits and every K/V it writes are the
    # per-layer loop's, bit for bit, at 1 and 3 rows (Mistral's 4-token window reaches the attention; Qwen2's q/k/v
    # biases; Qwen3's q/k norms, with heads of 32 whose H d = 128 is twice the hidden width).
    loaded = _gguf_tiny(arch, overrides, embedding, head)
    for rows in (1, 3):
        outputs = _stack_and_loop(loaded, rows)
        assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])
    fast = ModelRunner(loaded, KVPool(loaded.kv_shape(), 32, BLOCK, loaded.dtype)).fast
    assert fast.stack_embeds and fast.stack_head == (head is not None)


@pytest.mark.parametrize("arch,pool_dtype", [("llama", torch.float32), ("llama", torch.bfloat16),
                                             ("qwen2", torch.float32), ("qwen3", torch.float32)])
def test_fused_layer_stack_gives_the_loops_bits_on_a_prefill_chunk_wider_than_its_mlp_runs(arch, pool_dtype):
    # A lone prompt's chunk runs in the stack as decode rows; its MLP goes kMlpRows (64) rows at a time
    # (decode_layers.cpp), so a 150-token chunk takes three runs, the last one partial: the logits and every K/V
    # written (float32 or bfloat16) are the per-layer loop's, bit for bit, which runs all 150 rows at once (with
    # Qwen2's q/k/v biases and Qwen3's q/k norms too).
    loaded = _gguf_tiny(arch, {}, "q8_0", "q8_0")
    prompt = [(7 * i) % 200 + 3 for i in range(150)]
    table = list(range(-(-len(prompt) // BLOCK)))
    outputs = []
    for stack in (True, False):
        runner = ModelRunner(loaded, _pool(loaded, len(table) + 1, pool_dtype))
        assert runner.rows_alone and runner.fast.layer_stack is not None
        calls: list[int] = []
        kernels = "direct" if runner.fast.direct is not None else "checked"
        setattr(runner.fast, kernels, [replace(k, qkv=lambda h, qkv=k.qkv: calls.append(1) or qkv(h))
                                       for k in getattr(runner.fast, kernels)])
        plan = StepPlan([SeqWork(0, prompt, 0, table, [t // BLOCK * BLOCK + t % BLOCK for t in range(len(prompt))],
                                 True, GREEDY, prompt, [])])
        with contextlib.nullcontext() if stack else runner.fast.layer_loop_only():
            logits = runner.logits(plan)
        # the loop's direct calls show the step met the stack's conditions (all decode rows, few enough rows)
        assert len(calls) == (0 if stack else len(loaded.model.model.layers))
        outputs.append((logits, runner.pool.data.clone()))
    bits = torch.int16 if pool_dtype is torch.bfloat16 else torch.int32  # compared as bits: NaN-proof
    assert outputs[0][1].dtype is pool_dtype and torch.equal(outputs[0][0], outputs[1][0])
    assert torch.equal(outputs[0][1].view(bits), outputs[1][1].view(bits))


def test_a_stack_workspace_made_at_start_for_the_step_budget_gives_smaller_steps_the_same_bits():
    # The server makes the stack's workspace once for its token budget (ModelRunner's step_tokens): a 150-row
    # chunk and then a decode row run in the first rows of a 512-row workspace, with the bits of a workspace made
    # for each step as it comes.
    loaded = _gguf_tiny("llama", {}, "q8_0", "q8_0")
    prompt = [(7 * i) % 200 + 3 for i in range(150)]
    table = list(range(-(-(len(prompt) + 1) // BLOCK)))
    outputs = []
    for step_tokens in (512, None):
        runner = ModelRunner(loaded, _pool(loaded, len(table) + 1), step_tokens=step_tokens)
        stack = runner.fast.layer_stack
        assert runner.rows_alone and stack is not None and stack.workspace_rows() == (step_tokens or 0)
        slots = [t // BLOCK * BLOCK + t % BLOCK for t in range(len(prompt) + 1)]
        first = runner.logits(StepPlan([SeqWork(0, prompt, 0, table, slots[:-1], True, GREEDY, prompt, [])]))
        nxt = runner.logits(StepPlan([SeqWork(0, [9], len(prompt), table, slots[-1:], True, GREEDY, prompt, [9])]))
        assert stack.workspace_rows() == (step_tokens or len(prompt))  # made once: not again for smaller steps
        outputs.append((first, nxt, runner.pool.data.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*outputs))
    with pytest.raises(RuntimeError, match="positive number of rows"):
        runner.fast.reserve(0)


def test_fused_layer_stack_runs_layers_whose_projections_mix_block_kinds():
    # llama.cpp's Q4_K_M mixture gives some layers a Q6_K attn_v beside Q4_K q and k: q/k/v cannot be fused into
    # one kernel there, and such a model ran every decode step through the per-layer loop from Python. The stack
    # takes the parts' handles side by side (here v, and up, in Q8_0 beside Q4_1), with the loop's bits.
    loaded = _gguf_tiny("llama", {})
    for layer in loaded.model.model.layers[:1]:
        for parent, name in ((layer.self_attn, "v_proj"), (layer.mlp, "up_proj")):
            weight = getattr(parent, name).dequantize()
            raw = quants.quantize(weight.numpy(), GGMLQuantizationType.Q8_0)
            setattr(parent, name, GGMLLinear(torch.from_numpy(raw), GGMLKind.Q8_0))
    fast = ModelRunner(loaded, KVPool(loaded.kv_shape(), 32, BLOCK, loaded.dtype)).fast
    assert fast.projections[0].qkv is None and fast.projections[0].gate_up is None  # layer 0 is made of parts
    assert fast.projections[1].qkv is not None and fast.layer_stack is not None and fast.stack_head is False
    for rows in (1, 3):
        outputs = _stack_and_loop(loaded, rows)
        assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])


@pytest.mark.parametrize("shape,mix,embedding", [("tiny-llama", "Q4_K_M", GGMLKind.Q6_K),
                                                  ("tiny-mistral", "Q4_K_M", GGMLKind.Q4_K),
                                                  ("tiny-mistral", "Q5_K_M", GGMLKind.Q5_K),
                                                  ("tiny-qwen2", "Q4_K_M", GGMLKind.Q6_K),
                                                  ("tiny-qwen3", "Q4_K_M", GGMLKind.Q6_K)])
def test_a_k_quant_file_runs_its_whole_decode_step_in_the_stack(tiny_gguf, shape, mix, embedding):
    # the mixture as llama.cpp's quantizer writes it: layer 1's attn_v is Q6_K, layer 0's Q4_K (Q5_K); the token
    # embedding in super-blocks of 256 (the tied Q6_K table, or an untied one of the mixture's base type) is
    # looked up in the stack, bit for bit as GGMLEmbedding dequantizes it in the loop. Qwen2's q/k/v biases and
    # Qwen3's q/k norms are the stack's too (added, and normed per head, as the loop does)
    from kvserve.engine.loader import Device, DType, load_model

    loaded = load_model(str(tiny_gguf(shape, mix)), DType.AUTO, Device.CPU, quantized=True, blocks=True)
    assert loaded.model.model.embed_tokens.kind is embedding
    fast = ModelRunner(loaded, KVPool(loaded.kv_shape(), 32, BLOCK, loaded.dtype)).fast
    assert fast.projections[0].qkv is not None and fast.projections[1].qkv is None
    assert fast.layer_stack is not None and fast.stack_head and fast.stack_embeds
    tied = embedding is GGMLKind.Q6_K  # tiny-llama's table is its LM head's: looked up in the head's panels
    assert (loaded.model.model.embed_tokens.head is loaded.model.lm_head) is tied
    outputs = _stack_and_loop(loaded, 2)
    assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])


@pytest.mark.parametrize("arch,overrides", [("llama", {"head_dim": 32}), ("mistral", {"sliding_window": 4})])
def test_fused_layer_stack_runs_a_bfloat16_cache_with_the_bits_of_the_layer_loop(arch, overrides):
    # A bfloat16 KV cache under float32 activations: the stack writes and attends it (attend_bf16.h) as the
    # per-layer loop's ops do, bit for bit, the pool's bfloat16 K/V included (head_dim 32: the vector paths;
    # Mistral's 16 with a window: the scalar path).
    loaded = _gguf_tiny(arch, overrides, "q8_0", "q8_0")
    for rows in (1, 3):
        (stack_logits, stack_pool), (loop_logits, loop_pool) = _stack_and_loop(loaded, rows,
                                                                               pool_dtype=torch.bfloat16)
        assert stack_pool.dtype is torch.bfloat16
        assert torch.equal(stack_logits, loop_logits) and torch.equal(stack_pool.view(torch.int16),
                                                                      loop_pool.view(torch.int16))


def test_fused_layer_stack_takes_rows_and_rope_from_python():
    # Where the stack cannot look the ids up (an nn.Embedding with a max_norm) or a position is past its RoPE table,
    # the step hands it the embedded rows and cos/sin: the same bits.
    loaded = _gguf_tiny("llama", {}, "q8_0", "q8_0")
    seen: list[bool] = []

    def from_python(fast) -> None:
        fast.stack_embeds, fast.stack_rope_positions = False, 0  # every position past the stack's table
        decode = fast.layer_stack.decode
        fast.layer_stack = SimpleNamespace(decode=lambda *args: seen.append(all(a is not None for a in args[-3:]))
                                           or decode(*args))
    outputs = _stack_and_loop(loaded, 3, from_python)
    assert seen and all(seen)  # the prompts' step and the decode step
    assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])


def test_the_served_model_runs_its_whole_decode_step_in_the_stack(smollm2_gguf):
    fast = ModelRunner(smollm2_gguf, KVPool(smollm2_gguf.kv_shape(), 4, 16, smollm2_gguf.dtype)).fast
    assert fast.layer_stack is not None and fast.stack_embeds and fast.stack_head
    # the server makes its stack's workspace at start for its token budget
    from kvserve.server.config import ServeConfig
    from kvserve.server.state import ServerState

    state = ServerState(smollm2_gguf, ServeConfig(num_kv_blocks=16, max_num_batched_tokens=96))
    assert state.runner.fast.layer_stack.workspace_rows() == 96


def test_fused_layer_stack_refuses_what_it_cannot_run(smollm2_gguf):
    runner = ModelRunner(smollm2_gguf, KVPool(smollm2_gguf.kv_shape(), 4, 16, smollm2_gguf.dtype))
    stack, pool = runner.fast.layer_stack, runner.pool
    x, cos, one = torch.randn(1, 576), torch.randn(1, 64), torch.ones(1, dtype=torch.long)
    table, zero = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="slot 64 out of range"):
        stack.forward(x, cos, cos, torch.tensor([64]), zero, table, one, pool.data)
    with pytest.raises(RuntimeError, match="x must be contiguous"):
        stack.forward(torch.randn(1, 64), cos, cos, zero, zero, table, one, pool.data)
    with pytest.raises(RuntimeError, match="kv must be the contiguous pool"):
        stack.forward(x, cos, cos, zero, zero, table, one, pool.data[:, :2])
    with pytest.raises(RuntimeError, match="does not fit its block table"):
        stack.forward(x, cos, cos, zero, zero, table, torch.tensor([17]), pool.data)
    # a whole step from ids: each index checked before it is read
    with pytest.raises(RuntimeError, match="token id 49152 out of range for a vocabulary of 49152"):
        stack.decode(torch.tensor([49152]), zero, zero, zero, table, one, pool.data, zero)
    with pytest.raises(RuntimeError, match="position 8192 is past the RoPE table's 8192 positions"):
        stack.decode(zero, torch.tensor([8192]), zero, zero, table, one, pool.data, zero)
    with pytest.raises(RuntimeError, match="keep row 1 out of range"):
        stack.decode(zero, zero, zero, zero, table, one, pool.data, one)
    with pytest.raises(RuntimeError, match="embedding kind iq4_nl"):
        stack.set_embedding(torch.zeros(4, 576 // 32 * 18, dtype=torch.uint8), "iq4_nl")
    with pytest.raises(RuntimeError, match="q6_k embedding rows must be uint8 .* of whole units of 256 weights"):
        stack.set_embedding(torch.zeros(4, 576 // 256 * 210, dtype=torch.uint8), "q6_k")  # 576: 2.25 units
    qkv, o_proj, gate_up, down = runner.fast.projections[0].handles()  # qkv, gate_up: lists of one handle
    norm = torch.ones(576)
    with pytest.raises(RuntimeError, match=r"qkv computes \[576\] -> \[576\], the layer needs \[576\] -> \[960\]"):
        stack.add_layer(norm, 1e-5, norm, 1e-5, o_proj, o_proj, gate_up, down, 0.125, 0)
    with pytest.raises(TypeError):  # not a capsule at all
        stack.add_layer(norm, 1e-5, norm, 1e-5, None, o_proj, gate_up, down, 0.125, 0)
    with pytest.raises(TypeError, match="qkv must be projection handles"):
        stack.add_layer(norm, 1e-5, norm, 1e-5, [qkv[0], None], o_proj, gate_up, down, 0.125, 0)
    with pytest.raises(RuntimeError, match=r"qkv's parts compute \[576\] -> \[1536\], the layer needs"):
        stack.add_layer(norm, 1e-5, norm, 1e-5, [qkv[0], o_proj], o_proj, gate_up, down, 0.125, 0)


def test_silu_mul_is_torch_bits_on_contiguous_and_strided_halves():
    ops = native.load_ops()
    torch.manual_seed(0)
    both = torch.randn(5, 2 * 96) * 4
    gate, up = both[:, :96], both[:, 96:]
    assert torch.equal(ops.silu_mul(gate, up), torch.nn.functional.silu(gate) * up)
    assert torch.equal(ops.silu_mul(gate.contiguous(), up.contiguous()), torch.nn.functional.silu(gate) * up)
    with pytest.raises(RuntimeError, match="gate and up"):
        ops.silu_mul(gate, up[:, :95])


@pytest.mark.parametrize("vocab", [49152, 61, 5])  # SmolLM2's; a scalar tail; no full vector at all
def test_greedy_pick_is_argmax_and_its_log_softmax(vocab):
    torch.manual_seed(vocab)
    logits = torch.randn(7, vocab) * 6
    logits[1, [vocab - 3, 1]] = 40.0  # a tie: the first index wins, as with torch.argmax
    logits[2, 1], logits[2, 3] = float("nan"), float("nan")  # NaN counts as the maximum, as in torch
    logits[3, :] = float("-inf")
    logits[3, vocab - 1] = 2.0  # one finite logit (the rest suppressed): logprob 0
    logits[4, :] = float("-inf")  # nothing left: token 0, logprob NaN, as torch
    logits[5, 2] = float("inf")  # +inf: picked, logprob NaN, as torch
    tokens, logprobs = ops.greedy_pick(logits)
    assert tokens.tolist() == logits.argmax(-1).tolist()
    expected = logits.log_softmax(-1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs, expected, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert logprobs[3] == 0.0 and tokens[1] == 1 and tokens[2] == 1


@pytest.mark.parametrize("vocab", [49152, 61, 5])
def test_log_softmax_is_torchs_and_gives_greedy_picks_bits(vocab):
    torch.manual_seed(vocab + 1)
    logits = torch.randn(4, vocab) * 6
    logits[1, 2] = float("-inf")  # a suppressed token: -inf, as torch
    logits[2, 0] = float("nan")  # a NaN row: all NaN, as torch
    out = ops.log_softmax(logits)
    torch.testing.assert_close(out, logits.log_softmax(-1), rtol=1e-5, atol=1e-5, equal_nan=True)
    tokens, logprobs = ops.greedy_pick(logits)
    for row in (0, 1, 3):
        assert out[row, tokens[row]].item() == logprobs[row].item()


def test_greedy_pick_of_no_rows_and_bad_input():
    tokens, logprobs = ops.greedy_pick(torch.empty(0, 10))
    assert tokens.shape == logprobs.shape == (0,)
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.greedy_pick(torch.randn(10, 4).t())
