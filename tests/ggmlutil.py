"""GGUF blocks and quantized activations that the GGUF kernel tests share (tests/test_ggml_*.py), and a model's
layers put on GGUF blocks (``with_gguf_blocks``).

Blocks of every format the kernels serve: made by the ``gguf`` package's quantizer where it has one (Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0), else random bytes (every code, every 6-bit scale and minimum) with sane float16 scales.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from kvserve.native.ggml_leaves import LAYOUTS, random_units
from kvserve.quant.ggml import GGMLKind, GGMLLinear

QTYPES = {kind: GGMLQuantizationType[kind.upper()] for kind in LAYOUTS}
QUANTIZABLE = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")  # gguf 0.19 quantizes these; not the K-quants


def _halves(kind: str) -> list[int]:
    """Offsets of the float16 fields in a unit of ``kind`` (d first, then dmin or m)."""
    return [offset for offset, size, _ in LAYOUTS[kind][2] if size == 2]


def random_blocks(kind: str, N: int, K: int, rng: np.random.Generator, extreme: bool = True) -> np.ndarray:
    """``ggml_leaves.random_units``: random bytes with float16 fields of either sign in [2^-10, 2^-5). ``extreme``:
    feature 0's first unit at the codes' extreme, the largest integer dot (all code bits set; Q8_0 codes -128;
    Q6_K codes 0 with scales -128, i.e. (q - 32) sc = 32 * 128), and for Q6_K feature 1's at the other end, codes
    63 with scales -128: the vector paths' sum of the codes as stored, before the offset comes off, at its largest
    (63 * 128 per weight)."""
    raw = random_units(kind, N, K, rng)
    if extreme:
        halves = {b for offset in _halves(kind) for b in (offset, offset + 1)}
        codes = [b for b in range(LAYOUTS[kind][0]) if b not in halves]
        raw[0, codes] = 0x80 if kind == "q8_0" else 0xFF
        if kind == "q6_k":
            raw[0, :192] = 0
            raw[0, 192:208] = 0x80
            if N > 1:
                raw[1, :192] = 0xFF
                raw[1, 192:208] = 0x80
    return raw


def quantized_blocks(kind: str, N: int, K: int, rng: np.random.Generator) -> np.ndarray:
    """Units ``[N, K / weights * bytes]`` of float weights ~ N(0, 0.02) quantized by gguf where it can, else
    ``random_blocks``."""
    if kind not in QUANTIZABLE:
        return random_blocks(kind, N, K, rng, extreme=False)
    return quants.quantize(rng.normal(0.0, 0.02, (N, K)).astype(np.float32), QTYPES[kind])


def dequantize(raw: np.ndarray, kind: str) -> np.ndarray:
    """gguf's dequantization, float64 ``[N, K]``."""
    return quants.dequantize(raw, QTYPES[kind]).astype(np.float64).reshape(raw.shape[0], -1)


def magnitudes(raw: np.ndarray, kind: str) -> np.ndarray:
    """Per weight, float64 ``[N, K]``: the sum of its terms' magnitudes, ``|d q| + |m|`` for formats with a
    minimum (``|D q| + |dmin m|`` for the K-quants), else ``|w|``: the scale of the rounding errors of a product
    whose blocks' terms may cancel."""
    halves = _halves(kind)
    if kind not in ("q4_1", "q5_1", "q4_k", "q5_k"):
        return np.abs(dequantize(raw, kind))
    unit = LAYOUTS[kind][0]
    units = raw.reshape(-1, unit).copy()
    d, second = (units[:, h:h + 2].view(np.float16) for h in halves)
    d[:] = np.abs(d)
    second[:] = np.abs(second) * (-1 if kind.endswith("_k") else 1)  # K-quants subtract dmin m
    return dequantize(units.reshape(raw.shape), kind)


def quantized_activations(M: int, K: int, rng: np.random.Generator, group: int = 32) -> dict[str, np.ndarray]:
    """Activations as the driver hands them to a micro-kernel: codes xq int8 [M, K] in -127..127, scales xd and
    xs = xd * qsum float32 [M, K/32] (``group`` 256: one scale per 256, repeated over its 8 blocks, as the K-quants
    take them), qsum int32 [M, K/32] (and as int16, xsum16), qsum per 16 codes as int16 [M, K/16] (xsum16h: Q6_K's
    offset on the activation side); row 0's first block (with ``group`` 256 its first super-block) at -127 (the
    extreme dots with ``random_blocks``'s extreme units)."""
    nb = K // 32
    q = rng.integers(-127, 128, (M, K), dtype=np.int8)
    q[0, :min(group, K)] = -127
    d = np.repeat(rng.uniform(0.0, 0.1, (M, K // group)).astype(np.float32), group // 32, axis=1)
    qsum = q.reshape(M, nb, 32).astype(np.int32).sum(-1, dtype=np.int32)
    qsum16 = q.reshape(M, 2 * nb, 16).astype(np.int32).sum(-1, dtype=np.int32)
    return {"xq": q, "xd": d, "xs": d * qsum.astype(np.float32), "xsum": qsum,
            "xsum16": qsum.astype(np.int16), "xsum16h": qsum16.astype(np.int16)}


def with_gguf_blocks(model) -> None:
    """Every decoder layer's projections of ``model`` as GGUF blocks, quantized by gguf's own quantizer: Q4_1,
    and Q8_0 for the down projection (the embedded file's mixture); a projection's bias (Qwen2's q/k/v) is kept."""
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, linear in list(parent.named_children()):
                if isinstance(linear, torch.nn.Linear):
                    kind = GGMLKind.Q8_0 if name == "down_proj" else GGMLKind.Q4_1
                    raw = quants.quantize(linear.weight.detach().numpy(), GGMLQuantizationType[kind.name])
                    bias = None if linear.bias is None else linear.bias.detach().clone()
                    setattr(parent, name, GGMLLinear(torch.from_numpy(raw), kind, bias))
