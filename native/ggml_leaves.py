"""The GGUF micro-kernels (``csrc/ukernel*.h``) as a library of leaves, for the CPU emulator and ctypes.

The extension compiles the same headers (``csrc/linear_ggml.cpp``); ``build()`` compiles ``csrc/leaves.c``, which
includes them all, freestanding (``native.emulate.build_freestanding``: no libc, no relocations, checked), and
``build(native=True)`` as an ordinary library for this CPU. ``-mfma`` makes the scalar kernels' ``fmaf`` the one
instruction rather than a libm call (the same correctly rounded result). ``Args`` mirrors ``kv_ggml_args`` and
``pack_panels`` is the panel layout of ukernel.h written in numpy for any panel width (the extension packs for
its own ISA only).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from kvserve.native import emulate

SOURCE = Path(__file__).resolve().parent / "csrc" / "leaves.c"
FLAGS = ["-mfma", "-fno-jump-tables"]
KINDS = ("q4_1", "q8_0")
ISAS = ("scalar", "avx2", "avx512")
# Panel widths and register tile rows (ukernel.h's KV_NR_* / KV_MR_*); the scalar kernel takes any of either.
NR = {"avx2": 8, "avx512": 16}
MR = {"avx2": 4, "avx512": 8}
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}  # one block of 32 weights, as in a GGUF file
SCALE_BYTES = {"q4_1": 4, "q8_0": 2}    # its fp16 d (and m) at the start


class Args(ctypes.Structure):
    """``kv_ggml_args`` (csrc/ukernel.h), field for field; pointers are addresses (guest or host)."""

    _fields_ = [("w", ctypes.c_uint64), ("xq", ctypes.c_uint64), ("xd", ctypes.c_uint64), ("xs", ctypes.c_uint64),
                ("xsum", ctypes.c_uint64), ("y", ctypes.c_uint64), ("ldq", ctypes.c_int64),
                ("ldb", ctypes.c_int64), ("ldy", ctypes.c_int64), ("nb", ctypes.c_int32),
                ("rows", ctypes.c_int32), ("cols", ctypes.c_int32), ("nr", ctypes.c_int32)]


def build(native: bool = False) -> Path:
    """The leaves' shared object: freestanding for ``native.emulate.Emulator`` or, with ``native``, for
    ``native.emulate.Native`` (ctypes on this CPU). Cached; raises ``emulate.BuildError`` if a compiler fails and
    ``emulate.NotALeafError`` if the freestanding object has relocations or undefined symbols."""
    if native:
        return emulate.build_native([SOURCE], "kvserve_leaves", flags=FLAGS)
    return emulate.build_freestanding([SOURCE], "kvserve_leaves", flags=FLAGS)


def pack_panels(raw: np.ndarray, kind: str, nr: int) -> np.ndarray:
    """GGUF blocks uint8 ``[N, K/32 * bytes]`` in ukernel.h's panel order: uint8 ``[ceil(N / nr), K/32 * nr * bytes]``.

    Per panel and block: the ``nr`` features' fp16 d (then m, for Q4_1), then the codes in 4-byte groups, group t
    of feature n at lane n of chunk t; features past N are zero.
    """
    N, row = raw.shape
    nb, head = row // BLOCK_BYTES[kind], SCALE_BYTES[kind]
    panels = -(-N // nr)
    padded = np.zeros((panels * nr, row), np.uint8)
    padded[:N] = raw
    blocks = padded.reshape(panels, nr, nb, BLOCK_BYTES[kind]).transpose(0, 2, 1, 3)  # [panels, nb, nr, bytes]
    scales = [blocks[..., s:s + 2].reshape(panels, nb, 2 * nr) for s in range(0, head, 2)]
    codes = blocks[..., head:].reshape(panels, nb, nr, -1, 4).transpose(0, 1, 3, 2, 4).reshape(panels, nb, -1)
    return np.ascontiguousarray(np.concatenate([*scales, codes], axis=-1).reshape(panels, -1))
