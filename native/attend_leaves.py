"""The KV cache's attention for one tile as leaves, for the CPU emulator and ctypes: the bfloat16 cache's tile
(``csrc/attend_bf16.h``) and the float32 cache's (``csrc/attend_tile.h``).

The extension runs the same tile bodies (``csrc/decode_ops.cpp``'s ``attend_decode_bf16`` and ``attend_decode``,
one task per tile and KV head); ``build()`` compiles ``csrc/attend_leaves.cpp``, one leaf per cache and ISA path
(``kv_attend_bf16_scalar`` / ``_avx2`` / ``_avx512``, ``kv_attend_f32_avx2`` / ``_avx512``: ``LEAVES``), each
taking one ``kv_attend_args*`` and running one tile with the caller's scratch, freestanding for
``native.emulate.Emulator`` (no libc, no relocations: checked) and, with ``native=True``, as an ordinary library
for ``native.emulate.Native``. The flags are kv_leaves.py's (``-ffp-contract=off`` as the extension: no multiply
and add may fuse on one path only).

``Args`` mirrors ``kv_attend_args``; ``attend_tile`` makes one leaf call through a runner (an Emulator or a
Native) and returns the tile's output.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from kvserve.native import emulate, kv_leaves

SOURCE = Path(__file__).resolve().parent / "csrc" / "attend_leaves.cpp"
# Each leaf (kv_attend_LEAF) and the instructions it runs, as /proc/cpuinfo names them: the bfloat16 cache's on
# every ISA path, the float32 cache's on its two vector paths.
LEAVES = {"bf16_scalar": {"fma", "sse4_1"}, "bf16_avx2": {"avx2", "fma"},
          "bf16_avx512": {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx2", "fma"},
          "f32_avx2": {"avx2", "fma"}, "f32_avx512": {"avx512f", "avx2", "fma"}}
# The pools' element type each cache's leaves take: bfloat16 bits, or float32.
POOL_DTYPE = {"bf16": np.uint16, "f32": np.float32}


class Args(ctypes.Structure):
    """``kv_attend_args`` (csrc/attend_leaves.cpp), field for field; pointers are addresses."""

    _fields_ = [("q", ctypes.c_uint64), ("out", ctypes.c_uint64), ("first", ctypes.c_uint64),
                ("len", ctypes.c_uint64), ("scores", ctypes.c_uint64), ("qb", ctypes.c_uint64),
                ("table", ctypes.c_uint64), ("kp", ctypes.c_uint64), ("vp", ctypes.c_uint64),
                ("n", ctypes.c_int64), ("block_size", ctypes.c_int64), ("H_kv", ctypes.c_int64),
                ("g", ctypes.c_int64), ("D", ctypes.c_int64), ("scale", ctypes.c_float),
                ("scores_only", ctypes.c_int32)]


def build(native: bool = False) -> Path:
    """The leaves' shared object: freestanding for ``native.emulate.Emulator`` or, with ``native``, for
    ``native.emulate.Native``. Cached; raises ``emulate.BuildError`` if a compiler fails and
    ``emulate.NotALeafError`` if the freestanding object has relocations or undefined symbols."""
    if native:
        return emulate.build_native([SOURCE], "kvserve_attend_leaves", flags=kv_leaves.FLAGS)
    return emulate.build_freestanding([SOURCE], "kvserve_attend_leaves", flags=kv_leaves.FLAGS)


def attend_tile(runner, leaf: str, q: np.ndarray, first: np.ndarray, length: np.ndarray, table: np.ndarray,
                k: np.ndarray, v: np.ndarray, g: int, scale: float,
                scores_only: bool = False) -> tuple[int, np.ndarray]:
    """One call of ``kv_attend_{leaf}`` through ``runner`` (after ``runner.reset_heap()``).

    Args:
        leaf: a key of ``LEAVES``, e.g. "bf16_avx2" or "f32_avx512".
        q: float32 ``[n, D]``, the tile's query vectors.
        first, length: int64 ``[n]``: vector j attends to keys first[j] .. length[j]-1.
        table: int64 ``[width]`` block ids.
        k, v: ``[blocks, block_size, H_kv, D]``, the cache's pools: uint16 bfloat16 bits for the bf16 leaves,
            float32 for the f32 ones (``POOL_DTYPE``).
        g: the KV head.
        scale: the softmax scale (applied as float32).
        scores_only: (bf16 leaves) stop after the scores and return them instead of the output.

    Returns:
        (the leaf's return value: 0 ran, 1 refused the shape), out float32 ``[n, D]`` (NaN where nothing wrote),
        or with ``scores_only`` the scores float32 ``[sum of length - first]``: vector 0's keys first[0] ..
        length[0]-1, then vector 1's, ...

    Raises:
        ValueError: ``leaf`` is not one of ``LEAVES``, or ``scores_only`` for an f32 leaf.
    """
    if leaf not in LEAVES or (scores_only and not leaf.startswith("bf16")):
        raise ValueError(f"no leaf kv_attend_{leaf}{' with scores_only' if scores_only else ''}")
    pool = POOL_DTYPE[leaf.split("_")[0]]
    runner.reset_heap()
    n, D = q.shape
    _, block_size, H_kv, _ = k.shape
    out = runner.put(np.full((n, D), np.nan, np.float32))
    keys = max(1, int(np.sum(np.asarray(length) - np.asarray(first))))
    scores = runner.put(np.full(keys, np.nan, np.float32))
    args = Args(q=runner.put(np.ascontiguousarray(q, np.float32)), out=out,
                first=runner.put(np.asarray(first, np.int64)), len=runner.put(np.asarray(length, np.int64)),
                scores=scores,
                qb=runner.alloc(2 * n * D), table=runner.put(np.asarray(table, np.int64)),
                kp=runner.put(np.ascontiguousarray(k, pool)), vp=runner.put(np.ascontiguousarray(v, pool)),
                n=n, block_size=block_size, H_kv=H_kv, g=g, D=D, scale=scale, scores_only=int(scores_only))
    done = int(runner.call(f"kv_attend_{leaf}", runner.put_struct(args))) & 0xFFFFFFFF
    if scores_only:
        return done, runner.get(scores, keys, np.float32)
    return done, runner.get(out, n * D, np.float32).reshape(n, D)
