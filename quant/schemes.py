"""Weight quantizers in pure PyTorch: symmetric absmax int8/int4 and NF4. The reference for every kernel.

A weight ``W [out, in]`` is cut along ``in`` into groups; each group gets one scale ``s = max|w| / qmax``
and each weight becomes ``q = round(w / s)``, so ``w_hat = q * s``. Granularity sets the group:

    TENSOR  one scale for the whole matrix      scales []
    ROW     one scale per output row            scales [out]
    GROUP   one scale per ``g`` weights of a row scales [in // g, out]   (gpt-fast's layout)

NF4 (Dettmers et al. 2023, QLoRA) replaces the 16 evenly spaced int4 levels with the 16 quantiles of a
normal distribution, scaled by the absmax of each block of 64 weights.

How the codes are laid out in memory (nibble packing, the integer kernels' panels) is quant/panels.py.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from kvserve.quant.options import Scheme  # noqa: F401  (re-exported: the scheme enum without torch)

from kvserve.quant.gptq import gptq_codes


class Granularity(enum.Enum):
    """Which weights share one scale."""

    TENSOR = "tensor"
    ROW = "row"
    GROUP = "group"


# The 16 NF4 levels: normal quantiles normalised to [-1, 1], with an exact zero (QLoRA, appendix E;
# the values bitsandbytes ships).
NF4_LEVELS = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0)
INT4_OFFSET = 8  # a signed int4 code q in [-7, 7] is stored as the nibble q + 8
_SCALE_FLOOR = 2.0 ** -14  # smallest normal float16: a group of zeros still gets a usable 16-bit scale


@dataclass(slots=True, frozen=True)
class QuantSpec:
    """One quantization recipe.

    Attributes:
        scheme: INT8, INT4 or NF4.
        granularity: which weights share a scale.
        group_size: weights per scale along ``in`` for GROUP (a wish: see ``group_for``).

    Raises:
        ValueError: GROUP without a positive group size, or NONE.
    """

    scheme: Scheme
    granularity: Granularity
    group_size: int | None = None

    def __post_init__(self) -> None:
        if self.scheme is Scheme.NONE:
            raise ValueError("Scheme.NONE has no quantization spec")
        if self.granularity is Granularity.GROUP and (self.group_size is None or self.group_size < 2):
            raise ValueError("GROUP granularity needs group_size >= 2")
        if self.scheme is Scheme.NF4 and self.granularity is not Granularity.GROUP:
            raise ValueError("NF4 is defined per block (GROUP granularity)")
        if self.scheme is Scheme.INT8 and self.granularity is Granularity.GROUP:
            raise ValueError("int8 is per tensor or per row (TENSOR or ROW granularity)")

    @property
    def bits(self) -> int:
        """Bits per stored code."""
        return 8 if self.scheme is Scheme.INT8 else 4

    @property
    def label(self) -> str:
        """Short name for tables, e.g. ``int4/group128``."""
        if self.granularity is Granularity.GROUP:
            return f"{self.scheme.value}/group{self.group_size}"
        return f"{self.scheme.value}/{self.granularity.value}"

    def group_for(self, in_features: int) -> int:
        """The group actually used for a row of ``in_features`` weights.

        GROUP takes the largest divisor of ``in_features`` not above ``group_size`` (SmolLM2's 576 gets 96
        instead of 128), so no padding bytes are stored; TENSOR and ROW span the row.
        """
        if self.granularity is not Granularity.GROUP:
            return in_features
        wanted = min(self.group_size, in_features)
        return max(d for d in range(1, wanted + 1) if in_features % d == 0)

    def bits_per_weight(self, in_features: int) -> float:
        """Stored bits per weight including 16-bit group scales (ROW and TENSOR scales are negligible)."""
        if self.granularity is not Granularity.GROUP:
            return float(self.bits)
        return self.bits + 16 / self.group_for(in_features)


# Serving defaults for ``--quantization``.
SERVING_SPECS = {
    Scheme.INT8: QuantSpec(Scheme.INT8, Granularity.ROW),
    Scheme.INT4: QuantSpec(Scheme.INT4, Granularity.GROUP, 128),
    Scheme.NF4: QuantSpec(Scheme.NF4, Granularity.GROUP, 64),
}


def _absmax(w: torch.Tensor, granularity: Granularity, group: int) -> torch.Tensor:
    """max |w| per scale: ``[]``, ``[out]`` or ``[in // group, out]`` (float32)."""
    w = w.float().abs()  # [out, in]
    if granularity is Granularity.TENSOR:
        return w.amax()
    if granularity is Granularity.ROW:
        return w.amax(dim=1)
    out_features, in_features = w.shape
    return w.view(out_features, in_features // group, group).amax(dim=2).t().contiguous()  # [in//g, out]


def _expand(scales: torch.Tensor, shape: torch.Size, group: int) -> torch.Tensor:
    """Broadcast scales of any granularity to ``[out, in]``."""
    if scales.dim() == 0:
        return scales.expand(shape)
    if scales.dim() == 1:
        return scales[:, None].expand(shape)
    return scales.t().repeat_interleave(group, dim=1)  # [out, in]


def quantize_int(w: torch.Tensor, spec: QuantSpec,
                 hessian: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax quantization to ``spec.bits`` signed levels ``[-qmax, qmax]``.

    Args:
        w: ``[out, in]`` float weight.
        spec: INT8 or INT4 spec.
        hessian: ``[in, in]`` input Hessian of the layer: round by GPTQ (``quant.gptq.gptq_codes``) on the
            same absmax grid instead of to the nearest level.

    Returns:
        ``(q, scales)``: ``q`` int8 ``[out, in]`` in ``[-qmax, qmax]``; scales float32 for int8 (TENSOR/ROW),
        float16 for int4 (``[in // g, out]`` for GROUP), as ``Int4Linear`` stores them: rounded to 16 bits
        before ``q`` is computed, so ``q * s`` is exactly what the layer computes with.
    """
    qmax = 2 ** (spec.bits - 1) - 1  # 127 or 7
    group = spec.group_for(w.shape[1])
    scales = (_absmax(w, spec.granularity, group) / qmax).clamp_min(_SCALE_FLOOR)
    if spec.granularity is Granularity.GROUP or spec.bits == 4:
        scales = scales.half()
    steps = _expand(scales.float(), w.shape, group)  # [out, in]
    if hessian is None:
        q = torch.round(w.float() / steps).clamp_(-qmax, qmax)  # [out, in]
    else:
        q = gptq_codes(w, steps, qmax, hessian)
    return q.to(torch.int8), scales


def dequantize_int(q: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """``q * s`` as float32 ``[out, in]`` (inverse of ``quantize_int``)."""
    return q.float() * _expand(scales.float(), q.shape, group)


def quantize_nf4(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """NF4: normalise each block of ``block`` weights by its absmax, take the nearest NF4 level.

    Args:
        w: ``[out, in]`` float weight; ``block`` must divide ``in``.

    Returns:
        ``(codes, absmax)``: codes uint8 ``[out, in]`` in 0..15 (indices into NF4_LEVELS), absmax float16
        ``[in // block, out]``.
    """
    absmax = _absmax(w, Granularity.GROUP, block).clamp_min(_SCALE_FLOOR).half()  # [in//block, out]
    normalised = w.float() / _expand(absmax.float(), w.shape, block)  # [out, in] in [-1, 1]
    levels = torch.tensor(NF4_LEVELS)
    midpoints = (levels[1:] + levels[:-1]) / 2  # [15]: nearest level by bucketing on midpoints
    codes = torch.bucketize(normalised, midpoints.to(w.device))
    return codes.to(torch.uint8), absmax


def dequantize_nf4(codes: torch.Tensor, absmax: torch.Tensor, block: int) -> torch.Tensor:
    """``NF4_LEVELS[code] * absmax`` as float32 ``[out, in]``."""
    levels = torch.tensor(NF4_LEVELS, device=codes.device)
    return levels[codes.long()] * _expand(absmax.float(), codes.shape, block)




def fake_quantize(w: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``W_hat = dequantize(quantize(W))`` as float32 ``[out, in]``: what a quantized layer computes with."""
    group = spec.group_for(w.shape[1])
    if spec.scheme is Scheme.NF4:
        return dequantize_nf4(*quantize_nf4(w, group), group)
    return dequantize_int(*quantize_int(w, spec), group)


def relative_error(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """``||W - W_hat||_F / ||W||_F`` (Frobenius norms, float64 sums)."""
    w = w.double()
    return float(torch.linalg.norm(w - w_hat.double()) / torch.linalg.norm(w))


# Activations enter the int4 kernel quantized to int8 per block of this many values (Q8_0 in llama.cpp) ...
ACT_BLOCK = 32
# ... and the int8 kernel quantized to int16 per block of ACT16_BLOCK (ACT_BLOCK where a row is not a multiple
# of it): a step of 1/32767 of the block's max, far below the int8 weights' own error, so int8 is served as
# accurately as weight-only int8.
ACT16_BLOCK = 64
Q8_MAX = 127
Q16_MAX = 32767


def quantize_activations(x: torch.Tensor, block: int = ACT_BLOCK, qmax: int = Q8_MAX) -> torch.Tensor:
    """Fake-quantize activations as the integer kernels see them, same shape and dtype as ``x``.

    Each run of ``block`` values along the last dim gets ``d = max|x| / qmax`` and becomes ``q * d`` with
    ``q = round(x / d)`` clamped to ``[-qmax, qmax]`` (round half to even; an all-zero block stays zero; the clamp
    acts only where ``d`` is subnormal, max|x| below ~1e-34, and ``x / d`` rounds past qmax). ``qmax`` 127 is ``Q8(x)`` (the int4 kernel, llama.cpp's
    Q8_0 scheme), 32767 is ``Q16(x)`` (the int8 kernel). This is the reference the C++ kernels are tested
    against: they compute ``W_hat @ Q(x)`` with integer dot products.

    Raises:
        ValueError: the last dim is not a multiple of ``block``.
    """
    features = x.shape[-1]
    if features % block:
        raise ValueError(f"{features} features are not a multiple of the activation block {block}")
    xb = x.float().reshape(-1, features // block, block)  # [rows, blocks, block]
    d = xb.abs().amax(-1, keepdim=True) / qmax
    q = torch.where(d == 0, 0.0, torch.round(xb / d).clamp(-qmax, qmax))
    return (q * d).reshape(x.shape).to(x.dtype)
