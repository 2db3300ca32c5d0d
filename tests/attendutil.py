"""What the attention-tile leaf tests share (tests/test_attend_bf16_emulated.py, tests/test_attend_emulated.py):
a prompt's tile over a seeded pool, the runner check, the extension's bits for the same rows."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from kvserve.native import attend_leaves as leaves
from kvserve.native import emulate
from tests.leafutil import leaf_runner


@pytest.fixture(scope="module", params=["emulated", "native"])
def runner(request):
    """The attention leaves in the emulator, or on this CPU (ctypes); a test module imports it as its fixture."""
    yield from leaf_runner(request.param, leaves.build)


def runs(runner, leaf: str) -> bool:
    """Whether ``runner`` can run ``kv_attend_{leaf}``: the emulator runs every leaf, this CPU those it has."""
    return not isinstance(runner, emulate.Native) or leaves.LEAVES[leaf] <= emulate.host_cpu_flags()


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return np.array_equal(a.view(np.uint32), b.view(np.uint32))


def tile_case(shape, seed: int, values: Callable[[np.random.Generator, str, tuple], np.ndarray]) -> dict:
    """One prompt's rows over a seeded pool: the arrays of a leaf call for the last KV head (its query vectors row
    by row, each row's group heads in order, as the extension's tiles take them) and of the extension's call.

    Args:
        shape: (prompt rows, cached prefix, heads, kv heads, head size, window, block size): context lengths
            start + 1 .. start + prompt over one scattered block table, a sliding window where window > 0.
        seed: the generator's.
        values: values(rng, name, shape) -> the array of "q" (float32), "k" or "v" (the pool's element type).
    """
    prompt, start, heads, kv_heads, dim, window, block_size = shape
    rng = np.random.default_rng(seed)
    width = -(-(start + prompt) // block_size)
    pool = 2 * width + 1
    k = values(rng, "k", (pool, block_size, kv_heads, dim))
    v = values(rng, "v", (pool, block_size, kv_heads, dim))
    table = rng.permutation(pool)[:width].astype(np.int64)
    q = values(rng, "q", (prompt, heads, dim)).astype(np.float32)
    lens = np.arange(start + 1, start + prompt + 1, dtype=np.int64)
    firsts = np.maximum(0, lens - window) if window > 0 else np.zeros_like(lens)
    group, g = heads // kv_heads, kv_heads - 1
    return dict(q=q, lens=lens, table=table, k=k, v=v, window=window, scale=float(np.float32(dim ** -0.5)),
                g=g, tile_q=q[:, g * group:(g + 1) * group].reshape(-1, dim),
                first=np.repeat(firsts, group), length=np.repeat(lens, group))


def run_leaf(runner, leaf: str, case: dict, scores_only: bool = False) -> tuple[int, np.ndarray]:
    return leaves.attend_tile(runner, leaf, case["tile_q"], case["first"], case["length"], case["table"], case["k"],
                              case["v"], case["g"], case["scale"], scores_only)


def extension_tile(ops, case: dict, k, v) -> np.ndarray:
    """The extension's paged_decode_attention over the case's prompt rows (k, v: its pools as torch tensors, of
    the cache's dtype), cut to the leaf's tile: float32 [n, D]."""
    import torch

    prompt, heads, dim = case["q"].shape
    out = torch.full((prompt, heads, dim), float("nan"))
    ops.paged_decode_attention(torch.from_numpy(case["q"]), torch.arange(prompt),
                               torch.from_numpy(np.tile(case["table"], (prompt, 1))), torch.from_numpy(case["lens"]),
                               k, v, case["scale"], case["window"], out)
    group = heads // case["k"].shape[2]
    return out[:, case["g"] * group:(case["g"] + 1) * group].reshape(-1, dim).numpy()
