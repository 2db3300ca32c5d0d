"""The GGUF micro-kernels (``csrc/ukernel*.h``) as a library of leaves, for the CPU emulator and ctypes.

The extension compiles the same headers (``csrc/linear_ggml.cpp``); ``build()`` compiles ``csrc/leaves.cpp``, which
includes them all, freestanding (``native.emulate.build_freestanding``: no libc, no relocations, checked), and
``build(native=True)`` as an ordinary library for this CPU. ``-mfma`` makes the scalar kernels' ``fmaf`` the one
instruction rather than a libm call (the same correctly rounded result). ``Args`` mirrors ``kv_ggml_args`` and
``pack_panels`` is the panel layout of ukernel_gguf.h written in numpy for any panel width (the extension packs for
its own ISA only).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from kvserve.native import emulate

SOURCE = Path(__file__).resolve().parent / "csrc" / "leaves.cpp"
FLAGS = ["-mfma", "-fno-jump-tables"]
ISAS = ("scalar", "avx2", "avx512")
# Panel widths and register tile rows (ukernel.h's KV_NR_* / KV_MR_*); the scalar kernel takes any of either.
NR = {"avx2": 8, "avx512": 16}
MR = {"avx2": 4, "avx512": 8}
# Each format's unit (one block of 32 weights, or a super-block of 256) and its fields in packed order, as
# ukernel_gguf.h's kLayouts: (offset in the file's unit, bytes, whether stored through kv_qh_pack).
LAYOUTS = {
    "q4_0": (18, 32, [(0, 2, False), (2, 16, False)]),
    "q4_1": (20, 32, [(0, 2, False), (2, 2, False), (4, 16, False)]),
    "q5_0": (22, 32, [(0, 2, False), (2, 4, True), (6, 16, False)]),
    "q5_1": (24, 32, [(0, 2, False), (2, 2, False), (4, 4, True), (8, 16, False)]),
    "q8_0": (34, 32, [(0, 2, False), (2, 32, False)]),
    "q4_k": (144, 256, [(0, 2, False), (2, 2, False), (4, 12, False), (16, 128, False)]),
    # qh's chunks alternating with qs's first 8, then the rest of qs (q5_k_layout)
    "q5_k": (176, 256, [(0, 2, False), (2, 2, False), (4, 12, False)]
             + [(offset + 4 * c, 4, False) for c in range(8) for offset in (16, 48)] + [(80, 96, False)]),
    # d, scales, then per half h and chunk c: ql chunks 16h + c and 16h + 8 + c, qh chunk 8h + c (q6_k_layout)
    "q6_k": (210, 256, [(208, 2, False), (192, 16, False)]
             + [(offset + 4 * c, 4, False) for h in range(2) for c in range(8)
                for offset in (64 * h, 64 * h + 32, 128 + 32 * h)]),
}
KINDS = tuple(LAYOUTS)
# activation values per scale (ukernel_gguf.h): one per 256 for the K-quants, per block of 32 for the others
ACT_GROUP = {kind: 256 if kind.endswith("_k") else 32 for kind in LAYOUTS}
BLOCK_BYTES = {kind: unit for kind, (unit, _, _) in LAYOUTS.items()}  # bytes per unit, as in a GGUF file
BLOCK_WEIGHTS = {kind: weights for kind, (_, weights, _) in LAYOUTS.items()}
# kv_qh_pack: bit k of Q5_0 / Q5_1's qh word goes to bit QH_ORDER[k] (bit t of byte i: weight 4t + i's fifth bit,
# bit 4 + t: weight 16 + 4t + i's)
QH_ORDER = np.array([8 * (k & 3) + ((k & 15) >> 2) + (4 if k >= 16 else 0) for k in range(32)])


class Args(ctypes.Structure):
    """``kv_ggml_args`` (csrc/ukernel.h), field for field; pointers are addresses (guest or host). ``panels`` panels
    ``ldw`` bytes apart are one call's (all ``nr`` wide but the last, whose first ``cols`` features are stored)."""

    _fields_ = [("w", ctypes.c_uint64), ("xq", ctypes.c_uint64), ("xd", ctypes.c_uint64), ("xs", ctypes.c_uint64),
                ("xsum", ctypes.c_uint64), ("y", ctypes.c_uint64), ("ldq", ctypes.c_int64),
                ("ldb", ctypes.c_int64), ("ldy", ctypes.c_int64), ("nb", ctypes.c_int32),
                ("rows", ctypes.c_int32), ("cols", ctypes.c_int32), ("nr", ctypes.c_int32),
                ("ldw", ctypes.c_int64), ("panels", ctypes.c_int32),
                ("ahead", ctypes.c_int32), ("unpack", ctypes.c_int32), ("xsum16", ctypes.c_uint64),
                ("xsum16h", ctypes.c_uint64)]


def build(native: bool = False) -> Path:
    """The leaves' shared object: freestanding for ``native.emulate.Emulator`` or, with ``native``, for
    ``native.emulate.Native`` (ctypes on this CPU). Cached; raises ``emulate.BuildError`` if a compiler fails and
    ``emulate.NotALeafError`` if the freestanding object has relocations or undefined symbols."""
    if native:
        return emulate.build_native([SOURCE], "kvserve_leaves", flags=FLAGS)
    return emulate.build_freestanding([SOURCE], "kvserve_leaves", flags=FLAGS)


def qh_pack(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1 qh words (uint32, any shape) in the kernels' bit order (``kv_qh_pack``)."""
    bits = (qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1
    return (bits << QH_ORDER.astype(np.uint32)).sum(-1, dtype=np.uint32)


def pack_panels(raw: np.ndarray, kind: str, nr: int) -> np.ndarray:
    """GGUF units uint8 ``[N, units * bytes]`` in ukernel_gguf.h's panel order: uint8 ``[ceil(N / nr), units * nr *
    bytes]``.

    Per panel and unit: each field in ``LAYOUTS`` order, an fp16 field as the ``nr`` features' halves, any other in
    4-byte groups, group t of feature n at lane n of chunk t (Q5's qh word through ``qh_pack``); features past N
    are zero.
    """
    unit, _, fields = LAYOUTS[kind]
    N, row = raw.shape
    nb = row // unit
    panels = -(-N // nr)
    padded = np.zeros((panels * nr, row), np.uint8)
    padded[:N] = raw
    units = padded.reshape(panels, nr, nb, unit).transpose(0, 2, 1, 3)  # [panels, nb, nr, bytes]
    parts = []
    for offset, size, permuted in fields:
        field = np.ascontiguousarray(units[..., offset:offset + size])  # [panels, nb, nr, size]
        if permuted:
            field = qh_pack(field.view(np.uint32)).view(np.uint8).reshape(field.shape)
        if size == 2:
            parts.append(field.reshape(panels, nb, 2 * nr))
        else:
            parts.append(field.reshape(panels, nb, nr, -1, 4).transpose(0, 1, 3, 2, 4).reshape(panels, nb, -1))
    return np.ascontiguousarray(np.concatenate(parts, axis=-1).reshape(panels, -1))


def random_units(kind: str, N: int, K: int, rng: np.random.Generator) -> np.ndarray:
    """Valid GGUF units of ``kind``, uint8 ``[N, K / weights * bytes]``: random bytes (every code, every sub-block
    scale and minimum) with finite float16 fields (d, and dmin or m) of either sign in [2^-10, 2^-5), so products
    stay finite and blocks differ in scale (what the gguf package cannot quantize, e.g. the K-quants)."""
    unit, weights, fields = LAYOUTS[kind]
    units = N * K // weights
    raw = rng.integers(0, 256, (units, unit), dtype=np.uint8)
    for offset in (offset for offset, size, _ in fields if size == 2):
        value = rng.uniform(2.0**-10, 2.0**-5, units) * rng.choice([-1.0, 1.0], units)
        raw[:, offset:offset + 2] = value.astype(np.float16).view(np.uint8).reshape(units, 2)
    return raw.reshape(N, -1)
