"""The bfloat16 KV cache's attention for one tile (``csrc/attend_bf16.h``) as leaves, for the CPU emulator and
ctypes.

The extension runs the same tile body (``csrc/decode_ops.cpp``'s ``attend_decode_bf16``, one task per tile and
KV head); ``build()`` compiles ``csrc/attend_bf16_leaves.cpp``, one leaf per ISA path (``kv_attend_bf16_scalar`` /
``_avx2`` / ``_avx512``, each taking one ``kv_attend_bf16_args*`` and running one tile with the caller's scratch),
freestanding for ``native.emulate.Emulator`` (no libc, no relocations: checked) and, with ``native=True``, as an
ordinary library for ``native.emulate.Native``. The flags are kv_leaves.py's (``-ffp-contract=off`` as the
extension: no multiply and add may fuse on one path only).

``Args`` mirrors ``kv_attend_bf16_args``; ``attend_tile`` makes one leaf call through a runner (an Emulator or a
Native) and returns the tile's output.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from kvserve.native import emulate, kv_leaves

SOURCE = Path(__file__).resolve().parent / "csrc" / "attend_bf16_leaves.cpp"
ISAS = ("scalar", "avx2", "avx512")
# The instructions each leaf runs, as /proc/cpuinfo names them.
NEEDS = {"scalar": {"fma", "sse4_1"}, "avx2": {"avx2", "fma"},
         "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx2", "fma"}}


class Args(ctypes.Structure):
    """``kv_attend_bf16_args`` (csrc/attend_bf16_leaves.cpp), field for field; pointers are addresses."""

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
        return emulate.build_native([SOURCE], "kvserve_attend_bf16_leaves", flags=kv_leaves.FLAGS)
    return emulate.build_freestanding([SOURCE], "kvserve_attend_bf16_leaves", flags=kv_leaves.FLAGS)


def attend_tile(runner, isa: str, q: np.ndarray, first: np.ndarray, length: np.ndarray, table: np.ndarray,
                k_bits: np.ndarray, v_bits: np.ndarray, g: int, scale: float,
                scores_only: bool = False) -> tuple[int, np.ndarray]:
    """One call of ``kv_attend_bf16_{isa}`` through ``runner`` (after ``runner.reset_heap()``).

    Args:
        q: float32 ``[n, D]``, the tile's query vectors.
        first, length: int64 ``[n]``: vector j attends to keys first[j] .. length[j]-1.
        table: int64 ``[width]`` block ids.
        k_bits, v_bits: uint16 ``[blocks, block_size, H_kv, D]``, bfloat16 bits.
        g: the KV head.
        scale: the softmax scale (applied as float32).
        scores_only: stop after the scores and return them instead of the output.

    Returns:
        (the leaf's return value: 0 ran, 1 refused the shape), out float32 ``[n, D]`` (NaN where nothing wrote),
        or with ``scores_only`` the scores float32 ``[sum of length - first]``: vector 0's keys first[0] ..
        length[0]-1, then vector 1's, ...
    """
    runner.reset_heap()
    n, D = q.shape
    _, block_size, H_kv, _ = k_bits.shape
    out = runner.put(np.full((n, D), np.nan, np.float32))
    keys = max(1, int(np.sum(np.asarray(length) - np.asarray(first))))
    scores = runner.put(np.full(keys, np.nan, np.float32))
    args = Args(q=runner.put(np.ascontiguousarray(q, np.float32)), out=out,
                first=runner.put(np.asarray(first, np.int64)), len=runner.put(np.asarray(length, np.int64)),
                scores=scores,
                qb=runner.alloc(2 * n * D), table=runner.put(np.asarray(table, np.int64)),
                kp=runner.put(np.ascontiguousarray(k_bits, np.uint16)),
                vp=runner.put(np.ascontiguousarray(v_bits, np.uint16)), n=n, block_size=block_size, H_kv=H_kv,
                g=g, D=D, scale=scale, scores_only=int(scores_only))
    done = int(runner.call(f"kv_attend_bf16_{isa}", runner.put_struct(args))) & 0xFFFFFFFF
    if scores_only:
        return done, runner.get(scores, keys, np.float32)
    return done, runner.get(out, n * D, np.float32).reshape(n, D)
