"""The bfloat16 KV cache's attention (native/csrc/attend_bf16.h): float32 queries over K and V stored as bfloat16,
scores and outputs as bfloat16 dot products with float32 accumulation (vdpbf16ps' arithmetic), one order of float
operations on every path.

Checked here: the write rounds as torch does; a prompt's rows attended together (prefill tiles) have the bits of
each row alone (a decode row); every ISA path (AVX-512 BF16 where the CPU has it, forced AVX2, forced scalar) gives
the scalar path's bits; the output's order of operations is the one attend_bf16.h states (a numpy reference of
it gives the same bits, and a reference with the pair's two products swapped does not); the result is within
bfloat16 rounding of float32 attention over the same cache. The engine-level exactness (alone = batched =
chunked = prefix hit) runs in tests/test_kv_quant.py with the bfloat16 cache among its caches.
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
from tests.test_decode_ops import prompt_rows

ops = native.load_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="the C++ ops are not built")
ROOT = Path(__file__).resolve().parent.parent

# prompt rows, cached prefix, heads, kv heads, head_dim, window: tiles of rows, chunks of 64 keys, key counts that
# end mid-block and on odd positions, GQA and not, D = 64 / 128 (vector paths, D known), 96 (vector, looped),
# 40 (the scalar path on every CPU), a window whose first key is odd
BF16_SHAPES = [
    (100, 0, 9, 3, 64, 0),
    (37, 5, 8, 8, 64, 0),
    (70, 0, 4, 1, 128, 0),
    (45, 20, 6, 3, 96, 0),
    (21, 3, 6, 2, 40, 0),
    (90, 0, 9, 3, 64, 41),
    (17, 200, 9, 3, 64, 0),
]


def _bf16_pool(blocks: int, block_size: int, kv_heads: int, dim: int,
               extremes: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded K and V blocks in bfloat16; extremes: with a few denormals, negative zeros and large values (|x| ~ 1e4,
    which drive some weights and outputs into float32's underflow range)."""
    k = torch.randn(blocks, block_size, kv_heads, dim) * 2
    v = torch.randn(blocks, block_size, kv_heads, dim)
    for x in (k, v) if extremes else ():
        flat = x.view(-1)
        picks = torch.randperm(flat.numel())[:3 * 17]
        flat[picks[:17]] = 1e-39  # a float32 denormal: a bfloat16 denormal once rounded
        flat[picks[17:34]] = -0.0
        flat[picks[34:]] *= 1e4
    return k.bfloat16(), v.bfloat16()


def bf16_prompt_case(prompt, start, heads, kv_heads, dim, window, extremes=True):
    """One prompt's rows (consecutive, context lengths growing by one, one block table) between two rows of other
    sequences, over a bfloat16 pool (_bf16_pool's extremes or not): (q, rows, tables, lens, k_blocks, v_blocks,
    the call's output)."""
    torch.manual_seed(prompt + start + dim + window)
    block_size, blocks = 16, (start + prompt) // 16 + 2
    k_blocks, v_blocks = _bf16_pool(blocks * 3, block_size, kv_heads, dim, extremes)
    rows, lens, tables = prompt_rows(prompt, start, blocks * 3, blocks)
    q = torch.randn(prompt + 2, heads, dim)
    together = torch.zeros(q.shape)
    ops.paged_decode_attention(q, rows, tables, lens, k_blocks, v_blocks, dim ** -0.5, window, together)
    return q, rows, tables, lens, k_blocks, v_blocks, together


def test_write_kv_rounds_as_torch_does():
    torch.manual_seed(1)
    k_cache, v_cache = torch.zeros(40, 2, 64, dtype=torch.bfloat16), torch.zeros(40, 2, 64, dtype=torch.bfloat16)
    k, v = torch.randn(5, 2, 64), torch.randn(5, 2, 64)
    k[0, 0, :3] = torch.tensor([1e-39, -0.0, 3.0e38])
    slots = torch.tensor([7, 0, 39, 12, 13])
    ops.write_kv(k_cache, v_cache, slots, k, v)
    assert torch.equal(k_cache[slots].view(torch.int16), k.bfloat16().view(torch.int16))
    assert torch.equal(v_cache[slots].view(torch.int16), v.bfloat16().view(torch.int16))


@pytest.mark.parametrize("shape", BF16_SHAPES, ids=[str(s) for s in BF16_SHAPES])
def test_a_prompts_rows_together_have_the_bits_of_each_row_alone(shape):
    """Prefill tiles (a prompt's rows in one call) = decode rows (each row in a call of its own), bit for bit."""
    q, rows, tables, lens, k_blocks, v_blocks, together = bf16_prompt_case(*shape)
    alone = torch.zeros(q.shape)
    for b in range(len(rows)):
        ops.paged_decode_attention(q, rows[b:b + 1], tables[b:b + 1], lens[b:b + 1], k_blocks, v_blocks,
                                   q.shape[-1] ** -0.5, shape[-1], alone)
    assert torch.equal(together.view(torch.int32), alone.view(torch.int32))


@pytest.mark.parametrize("shape", BF16_SHAPES[:3] + BF16_SHAPES[5:6], ids=str)
def test_within_bfloat16_rounding_of_float32_attention_over_the_same_cache(shape):
    """Against the float32 cache's attention over the same values: the query and the weights rounded to bfloat16
    (relative 2^-9 each) make the difference. A score of these cases (|q . k| * scale up to ~20) moves by up to
    ~0.02 with q's rounding, so a weight by up to ~2% and an output by up to ~2% of its scale (max(|out|, 1));
    the median stays near the weights' own rounding."""
    q, rows, tables, lens, k_blocks, v_blocks, ours = bf16_prompt_case(*shape, extremes=False)
    theirs = torch.zeros(q.shape)
    ops.paged_decode_attention(q, rows, tables, lens, k_blocks.float(), v_blocks.float(), q.shape[-1] ** -0.5,
                               shape[-1], theirs)
    diff = (ours - theirs).abs()
    scale = theirs.abs().clamp(min=1.0)
    assert (diff / scale).max() < 3e-2 and diff.median() < 1e-3
    assert not torch.equal(ours, theirs)  # it is not the float32 path


def _paths_case() -> list[torch.Tensor]:
    return [bf16_prompt_case(*shape, extremes=False)[-1] for shape in BF16_SHAPES]


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_every_path_gives_the_scalar_paths_bits(isa, tmp_path):
    """The best path here (AVX-512 BF16's vdpbf16ps where the CPU has it) against a forced lesser one, on every
    shape: the same bits. With the scalar run this checks vdpbf16ps itself against the stated order (its pair
    order, one rounding per product added). Values here stay clear of float32's underflow range: there Zen 4's
    vdpbf16ps departs from the SDM's pseudo-code that the reference follows (attend_bf16.h says how)."""
    if isa not in native.native_isas() or os.environ.get("KVSERVE_ISA") == isa:
        pytest.skip(f"{isa} is not a lesser path here")
    code = ("import sys, torch; from tests.test_bf16_cache import _paths_case; "
            "from kvserve import native; print(native.load_ops().bf16_attention_path(64)); "
            "torch.save(_paths_case(), sys.argv[1])")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / f"{isa}.pt")], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "KVSERVE_ISA": isa})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[0] == isa
    for shape, ours, theirs in zip(BF16_SHAPES, _paths_case(), torch.load(tmp_path / f"{isa}.pt"), strict=True):
        assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32)), shape


def _ftz(x: np.ndarray) -> np.ndarray:
    """vdpbf16ps' flush: a float32 with a zero exponent field becomes the zero of its sign."""
    bits = x.view(np.uint32)
    return np.where((bits & 0x7F800000) == 0, bits & 0x80000000, bits).astype(np.uint32).view(np.float32)


def _pair_steps(w: np.ndarray, v: np.ndarray, first: int, length: int, odd_first: bool = True) -> np.ndarray:
    """attend_bf16.h's output in numpy float32: w [keys] (bfloat16 values), v [keys, D]; key pairs (2p, 2p + 1)
    from floor(first / 2), the odd key's product first (odd_first=False: the wrong order), keys outside
    first .. length-1 weight 0 and value 0."""
    acc = np.zeros(v.shape[1], np.float32)
    for p in range(first // 2, (length + 1) // 2):
        pair = []
        for t in (2 * p + 1, 2 * p) if odd_first else (2 * p, 2 * p + 1):
            inside = first <= t < length
            pair.append((np.float32(w[t] if inside else 0), v[t] if inside else np.zeros_like(acc)))
        for weight, value in pair:
            acc = _ftz(acc + _ftz(weight * _ftz(value)))
    return acc


@pytest.mark.parametrize("first_odd", [False, True])
def test_the_output_takes_the_stated_order_and_a_swapped_pair_order_does_not_match(first_odd):
    """One decode row over 45 keys (an odd count: its last pair half empty; a window of 40 starts it on an odd
    key). One-hot values (v_t = e_t) make out[t] the rounded weight of key t exactly; then random values through
    numpy's pair steps give the kernel's bits, and the same steps with each pair's products swapped do not."""
    torch.manual_seed(5)
    dim, length, window = 64, 45, 40 if first_odd else 0
    first = length - window if window else 0
    q = torch.randn(1, 1, dim) * 3
    k_blocks = torch.randn(3, 16, 1, dim).bfloat16()
    table, lens, rows = torch.tensor([[2, 0, 1]]), torch.tensor([length]), torch.tensor([0])
    one_hot = torch.zeros(3, 16, 1, dim, dtype=torch.bfloat16)
    for t in range(length):
        one_hot[table[0, t // 16], t % 16, 0, t] = 1
    weights = torch.zeros(1, 1, dim)
    ops.paged_decode_attention(q, rows, table, lens, k_blocks, one_hot, dim ** -0.5, window, weights)
    w = weights[0, 0, :length].numpy()
    assert (w[first:] > 0).all() and (w[:first] == 0).all()
    assert np.array_equal(w.view(np.uint32) & 0xFFFF, np.zeros(length, np.uint32))  # bfloat16 values
    v_blocks = (torch.randn(3, 16, 1, dim) * 4).bfloat16()
    out = torch.zeros(1, 1, dim)
    ops.paged_decode_attention(q, rows, table, lens, k_blocks, v_blocks, dim ** -0.5, window, out)
    values = torch.stack([v_blocks[table[0, t // 16], t % 16, 0] for t in range(length)]).float().numpy()
    ours = out[0, 0].numpy()
    assert np.array_equal(_pair_steps(w, values, first, length).view(np.uint32), ours.view(np.uint32))
    swapped = _pair_steps(w, values, first, length, odd_first=False)
    assert not np.array_equal(swapped.view(np.uint32), ours.view(np.uint32))


def test_the_op_names_its_path_and_refuses_an_odd_head_size():
    assert ops.bf16_attention_path(40) == "scalar"
    assert ops.bf16_attention_path(64) in native.native_isas()
    q, out = torch.randn(1, 2, 63), torch.zeros(1, 2, 63)
    blocks = torch.zeros(2, 16, 1, 63, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="head size must be even"):
        ops.paged_decode_attention(q, torch.tensor([0]), torch.tensor([[0]]), torch.tensor([3]), blocks, blocks,
                                   1.0, 0, out)


def test_the_quant_reports_bfloat16_attention_rounds_as_the_kernel_does():
    """kvserve quant report --kv-caches bfloat16 measures quality with a torch attention that makes the kernel's
    roundings (query, keys, values, weights to bfloat16); against the kernel over the same prompt it differs only
    by the order of float32 sums (and a weight that this moves across a bfloat16 rounding boundary)."""
    from kvserve.server.quant_report import register_kv_caches
    from transformers import AttentionInterface

    class _Config:  # the geometry register_kv_caches reads
        num_attention_heads, num_key_value_heads, head_dim, num_hidden_layers, hidden_size = 6, 2, 64, 1, 384
    assert register_kv_caches(_Config(), ("bfloat16",)) == {"bfloat16": ("kvserve-kv-bfloat16", 1 * 2 * 2 * 64 * 2)}
    torch.manual_seed(3)
    q, k, v = torch.randn(1, 6, 40, 64), torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64)
    ours, _ = AttentionInterface()["kvserve-kv-bfloat16"](None, q, k, v, None, scaling=0.125)
    # the kernel: the 40 positions as one prompt's rows over a bfloat16 pool of 3 blocks
    blocks = torch.zeros(2, 3, 16, 2, 64, dtype=torch.bfloat16)
    slots = torch.arange(40)
    ops.write_kv(blocks[0].flatten(0, 1), blocks[1].flatten(0, 1), slots, k[0].transpose(0, 1), v[0].transpose(0, 1))
    kernel = torch.zeros(40, 6, 64)
    ops.paged_decode_attention(q[0].transpose(0, 1).contiguous(), slots, torch.arange(3).repeat(40, 1), slots + 1,
                               blocks[0], blocks[1], 0.125, 0, kernel)
    torch.testing.assert_close(ours[0], kernel, rtol=0, atol=5e-3)
    exact = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125,
                                                            enable_gqa=True)
    assert (ours[0] - kernel).abs().max() < (exact[0].transpose(0, 1) - kernel).abs().max()
