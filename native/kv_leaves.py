"""The int8 / int4 KV cache's paged decode attention (``csrc/kv_attend.h``) as leaves, for the CPU emulator and
ctypes.

The extension runs the same body (``csrc/kv_quant.cpp``'s ``paged_decode_attention_quant``); ``build()`` compiles
``csrc/kv_leaves.cpp``, one leaf per ISA path (``kv_attend_quant_scalar`` / ``_avx2`` / ``_avx512``, each taking one
``kv_attend_args*`` and running every (sequence, KV head) task of the call), freestanding for
``native.emulate.Emulator`` (no libc, no relocations: checked) and, with ``native=True``, as an ordinary library
for ``native.emulate.Native``. ``-mfma -msse4.1`` make the baseline path's ``std::fma`` and ``std::nearbyint`` one
instruction each rather than libm calls (the same correctly rounded results as the extension's calls);
``-ffp-contract=off`` is the extension's flag (no multiply and add may fuse on one path only).

``Args`` mirrors ``kv_attend_args`` (and ``HalfArgs`` the scale conversion leaves' ``kv_half_args``); ``Case`` holds one call's arrays in the pool's layout (kvcache/pool.py),
``quantize`` is ``pool.quantize`` in numpy, and ``attend`` makes one leaf call through a runner (an Emulator or a
Native) and returns the output.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvserve.native import emulate

SOURCE = Path(__file__).resolve().parent / "csrc" / "kv_leaves.cpp"
FLAGS = ["-mfma", "-msse4.1", "-ffp-contract=off", "-fno-jump-tables"]
ISAS = ("scalar", "avx2", "avx512")
# The instructions each leaf runs, as /proc/cpuinfo names them (the AVX-512 leaf uses AVX-512 F only; the
# extension's cpu.h asks more of a CPU before it chooses that path, for its other kernels).
NEEDS = {"scalar": {"fma", "sse4_1"}, "avx2": {"avx2", "fma", "f16c"}, "avx512": {"avx512f", "avx2", "fma", "f16c"}}


class Args(ctypes.Structure):
    """``kv_attend_args`` (csrc/kv_leaves.cpp), field for field; pointers are addresses (guest or host)."""

    _fields_ = [("q", ctypes.c_uint64), ("out", ctypes.c_uint64), ("rows", ctypes.c_uint64),
                ("tables", ctypes.c_uint64), ("lens", ctypes.c_uint64), ("k_codes", ctypes.c_uint64),
                ("k_scales", ctypes.c_uint64), ("v_codes", ctypes.c_uint64), ("v_scales", ctypes.c_uint64),
                ("scores", ctypes.c_uint64), ("q_row", ctypes.c_int64), ("q_head", ctypes.c_int64),
                ("B", ctypes.c_int64), ("H", ctypes.c_int64), ("D", ctypes.c_int64), ("H_kv", ctypes.c_int64),
                ("width", ctypes.c_int64), ("block_size", ctypes.c_int64), ("window", ctypes.c_int64),
                ("G", ctypes.c_int64), ("scale", ctypes.c_float), ("bits", ctypes.c_int32)]


class HalfArgs(ctypes.Structure):
    """``kv_half_args`` (csrc/kv_leaves.cpp): n float16 bits at ``h`` to n floats at ``out``."""

    _fields_ = [("h", ctypes.c_uint64), ("out", ctypes.c_uint64), ("n", ctypes.c_int64)]


def build(native: bool = False) -> Path:
    """The leaves' shared object: freestanding for ``native.emulate.Emulator`` or, with ``native``, for
    ``native.emulate.Native`` (ctypes on this CPU). Cached; raises ``emulate.BuildError`` if a compiler fails and
    ``emulate.NotALeafError`` if the freestanding object has relocations or undefined symbols."""
    if native:
        return emulate.build_native([SOURCE], "kvserve_kv_leaves", flags=FLAGS)
    return emulate.build_freestanding([SOURCE], "kvserve_kv_leaves", flags=FLAGS)


def avx512_takes(bits: int, group: int) -> bool:
    """Whether the AVX-512 leaf runs ``group`` elements per scale (kv_attend.h's avx512_takes: 16 codes of one
    scale per vector); kv_quant.cpp runs the AVX2 path otherwise and the leaf returns 1."""
    return group % (16 if bits == 8 else 32) == 0


def quantize(x: np.ndarray, bits: int, group: int) -> tuple[np.ndarray, np.ndarray]:
    """kvcache.pool.quantize in numpy, the same bits: codes and float16 scales of head vectors.

    Args:
        x: float32 ``[..., D]``.
        bits: 8 or 4.
        group: elements per scale (it must divide D; for int4 even).

    Returns:
        codes ``[..., D]`` int8 (bits 8) or ``[..., D / 2]`` uint8 (bits 4: byte j of a group holds code j + 8
        low and code j + group / 2 + 8 high), scales float16 ``[..., D / group]``.
    """
    qmax = 2 ** (bits - 1) - 1
    grouped = np.asarray(x, np.float32).reshape(*np.shape(x)[:-1], -1, group)  # [..., S, G]
    with np.errstate(over="ignore"):  # a group past 65504 * qmax: an infinite scale, as torch's
        scales = (np.abs(grouped).max(-1, keepdims=True) / np.float32(qmax)).astype(np.float16)
    s = scales.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.clip(np.where(s > 0, np.round(grouped / s), np.float32(0)), -qmax, qmax)
    scales = scales[..., 0]
    if bits == 8:
        return codes.astype(np.int8).reshape(*codes.shape[:-2], -1), scales
    nibbles = (codes + 8).astype(np.uint8)
    half = group // 2
    return (nibbles[..., :half] | (nibbles[..., half:] << 4)).reshape(*codes.shape[:-2], -1), scales


@dataclass
class Case:
    """One paged_decode_attention_quant call's inputs, in the pool's layout (kvcache/pool.py).

    q float32 ``[T, H, D]`` (any strides, D contiguous); rows, lens int64 ``[B]``; tables int64 ``[B, width]``;
    k_codes / v_codes ``[num_blocks, block_size, H_kv, D * bits / 8]`` (int8, or uint8 holding two int4 codes);
    k_scales / v_scales float16 ``[num_blocks, block_size, H_kv, D / group]``; scale the softmax scale (applied
    as float32); window in tokens (<= 0: the whole context).
    """

    q: np.ndarray
    rows: np.ndarray
    tables: np.ndarray
    lens: np.ndarray
    k_codes: np.ndarray
    k_scales: np.ndarray
    v_codes: np.ndarray
    v_scales: np.ndarray
    bits: int
    group: int
    scale: float
    window: int = 0

    @property
    def spans(self) -> np.ndarray:
        """Keys each sequence attends to: int64 ``[B]``."""
        first = np.maximum(0, self.lens - self.window) if self.window > 0 else np.zeros_like(self.lens)
        return self.lens - first


def attend(runner, isa: str, case: Case) -> tuple[int, np.ndarray]:
    """One call of ``kv_attend_quant_{isa}`` through ``runner`` (an Emulator with ``build()`` loaded, or a
    Native over ``build(native=True)``), after ``runner.reset_heap()``. ``isa`` "tile_avx2" or "tile_avx512": the
    prompt-tile leaves (the call's rows one prompt's, attended as one tile per KV head; NEEDS as avx2 / avx512).

    Returns:
        (the leaf's return value: 0 ran, 1 refused the shape), out float32 ``[T, H, D]`` (rows no sequence writes,
        and all of it on a refusal, stay NaN).
    """
    runner.reset_heap()
    q = case.q
    T, H, D = q.shape
    q_row, q_head = q.strides[0] // 4, q.strides[1] // 4
    if q.strides[2] != 4 or q_row < 0 or q_head < 0:
        raise ValueError(f"q's strides {q.strides}: D must be contiguous and the others nonnegative")
    # q keeps its strides in the runner's memory (a view of qkv rows stays one): a buffer spanning them, NaN between
    buffer = np.full((T - 1) * q_row + (H - 1) * q_head + D, np.nan, np.float32)
    np.lib.stride_tricks.as_strided(buffer, q.shape, q.strides)[...] = q
    num_blocks, block_size, H_kv, _ = case.k_codes.shape
    scores = int(H // H_kv * max(1, case.spans.sum()))  # a tile leaf's rows all at once (a row's: the largest)
    out = runner.put(np.full((T, H, D), np.nan, np.float32))
    args = Args(q=runner.put(buffer), out=out, rows=runner.put(case.rows.astype(np.int64)),
                tables=runner.put(case.tables.astype(np.int64)), lens=runner.put(case.lens.astype(np.int64)),
                k_codes=runner.put(case.k_codes), k_scales=runner.put(case.k_scales.view(np.uint16)),
                v_codes=runner.put(case.v_codes), v_scales=runner.put(case.v_scales.view(np.uint16)),
                scores=runner.alloc(4 * scores), q_row=q_row, q_head=q_head, B=len(case.lens),
                H=H, D=D, H_kv=H_kv, width=case.tables.shape[1], block_size=block_size, window=case.window,
                G=case.group, scale=case.scale, bits=case.bits)
    done = runner.call(f"kv_attend_quant_{isa}", runner.put_struct(args))
    return int(done) & 0xFFFFFFFF, runner.get(out, T * H * D, np.float32).reshape(T, H, D)
