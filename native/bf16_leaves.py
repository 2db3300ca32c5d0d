"""The bfloat16-weight micro-kernels (``csrc/ukernel_bf16.h``) as leaves, for the CPU emulator and ctypes.

They are compiled into the same library of leaves as the GGUF ones (``native.ggml_leaves.build``: csrc/leaves.cpp
includes every micro-kernel header). ``Args`` and ``ConvertArgs`` mirror ``kv_bf16_args`` and
``kv_bf16_convert_args``; ``pack_panels`` and ``pair_rows`` are the layouts of ukernel_bf16.h written in numpy, and
``to_bf16`` is vcvtneps2bf16's rounding (the Intel SDM's convert_fp32_to_bfloat16), so tests can build inputs and
check the conversion leaf against it.
"""

from __future__ import annotations

import ctypes

import numpy as np

from kvserve.native.ggml_leaves import build

__all__ = ["ISAS", "MR", "NR", "Args", "ConvertArgs", "build", "pack_panels", "pair_rows", "to_bf16"]

ISAS = ("scalar", "avx512")
NR = 32  # features per panel (KV_NR_BF16)
MR = 8   # rows per register tile of the AVX512-BF16 kernel (KV_MR_BF16)


class Args(ctypes.Structure):
    """``kv_bf16_args`` (csrc/ukernel_bf16.h), field for field; pointers are addresses (guest or host)."""

    _fields_ = [("w", ctypes.c_uint64), ("x", ctypes.c_uint64), ("y", ctypes.c_uint64), ("ldx", ctypes.c_int64),
                ("ldy", ctypes.c_int64), ("kp", ctypes.c_int32), ("rows", ctypes.c_int32), ("cols", ctypes.c_int32)]


class ConvertArgs(ctypes.Structure):
    """``kv_bf16_convert_args``: n float32 at ``x`` to n bfloat16 at ``out``."""

    _fields_ = [("x", ctypes.c_uint64), ("out", ctypes.c_uint64), ("n", ctypes.c_int64)]


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16, same shape) as vcvtneps2bf16 rounds: zero and denormal -> signed zero,
    infinity kept, NaN quieted (bit 6 set), else round to nearest even (``bits + 0x7FFF + bit 16``, integer add)."""
    u = np.asarray(x, np.float32).view(np.uint32)
    exponent = u & 0x7F800000
    rounded = ((u.astype(np.uint64) + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    special = ((u >> 16) | np.where(u & 0x007FFFFF, 0x40, 0)).astype(np.uint16)
    zero = ((u >> 16) & 0x8000).astype(np.uint16)
    return np.where(exponent == 0, zero, np.where(exponent == 0x7F800000, special, rounded))


def pack_panels(w: np.ndarray) -> np.ndarray:
    """bfloat16 bits uint16 ``[N, K]`` in ukernel_bf16.h's order: uint16 ``[ceil(N / 32), ceil(K / 2) * 64]``
    (pair t of feature n at elements 64 t + 2 n, + 1; padding zero)."""
    N, K = w.shape
    panels, kp = -(-N // NR), -(-K // 2)
    padded = np.zeros((panels * NR, 2 * kp), np.uint16)
    padded[:N, :K] = w
    return np.ascontiguousarray(padded.reshape(panels, NR, kp, 2).transpose(0, 2, 1, 3).reshape(panels, -1))


def pair_rows(xb: np.ndarray) -> np.ndarray:
    """bfloat16 bits uint16 ``[M, K]`` as the kernels read activations: uint32 ``[M, ceil(K / 2)]`` (low half
    k = 2t, high half k = 2t + 1; an odd K's last half zero)."""
    M, K = xb.shape
    padded = np.zeros((M, 2 * -(-K // 2)), np.uint16)
    padded[:, :K] = xb
    return padded.view(np.uint32)
