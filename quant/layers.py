"""kvserve's own roundings of float weights as layers: int8 per row, and int4 and NF4 in groups (``QuantLinear``
subclasses, one per scheme, each quantize-then-forward; the GGUF's own blocks are quant/ggml.py's).

Every class holds its codes in ``weight`` and its scales in ``scales`` (buffers, so ``.to(device)`` and
``state_dict`` carry them) and records its scheme, group size and code layout in the saved state; quant/linear.py
says how ``forward`` chooses between the C++ kernel and the reference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvserve import native
from kvserve.quant.linear import Layout, QuantLinear
from kvserve.quant.panels import (INT4_PANEL_ROWS, INT8_PANEL_ROWS, pack_int8_panels, pack_nibble_panels, pack_nibbles,
                                  unpack_int8_panels, unpack_nibble_panels, unpack_nibbles)
from kvserve.quant.schemes import (ACT16_BLOCK, ACT_BLOCK, INT4_OFFSET, NF4_LEVELS, Q16_MAX, SERVING_SPECS, QuantSpec,
                                   Scheme, dequantize_int, dequantize_nf4, quantize_int, quantize_nf4)


class Int8Linear(QuantLinear):
    """int8 codes ``weight [out, in]`` with float32 ``scales [out]`` (per output row); int16 activations.

    Where the kernel serves the layer and ``out`` is a multiple of 16, the codes are stored in its panel order
    (``quant.panels.pack_int8_panels``); ``dequantize`` reads either order.
    """

    scheme = Scheme.INT8
    act_qmax = Q16_MAX

    def __init__(self, linear: nn.Linear, spec: QuantSpec = SERVING_SPECS[Scheme.INT8],
                 hessian: torch.Tensor | None = None) -> None:
        super().__init__(linear, spec)
        q, scales = quantize_int(linear.weight.detach(), spec, hessian)  # hessian: GPTQ rounding
        self.register_buffer("weight", pack_int8_panels(q) if self.layout is Layout.PANELS else q)  # [out, in] int8
        self.register_buffer("scales", scales.float().expand(self.out_features).contiguous())  # [out]

    def _layout_for_shape(self) -> Layout:
        return Layout.PANELS if self.has_kernel and self.out_features % INT8_PANEL_ROWS == 0 else Layout.ROWS

    def dequantize(self) -> torch.Tensor:
        codes = unpack_int8_panels(self.weight) if self.layout is Layout.PANELS else self.weight
        return dequantize_int(codes, self.scales, self.group_size)

    @property
    def kernel_act_block(self) -> int | None:
        """int16 activation blocks of 64 values, or 32 where ``in_features`` is not a multiple of 64."""
        if self.in_features % ACT16_BLOCK == 0:
            return ACT16_BLOCK
        return ACT_BLOCK if self.has_kernel else None

    @property
    def has_kernel(self) -> bool:
        return self.in_features % ACT_BLOCK == 0

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return native.load().int8_linear(x, self.weight, self.scales, self.kernel_act_block, self.layout is Layout.PANELS)

    def _bind(self, module) -> Callable[[torch.Tensor], torch.Tensor]:
        return module.bind_int8(self.weight, self.scales, self.kernel_act_block, self.layout is Layout.PANELS)


class Nibble4Linear(QuantLinear):
    """4-bit codes packed two per byte ``weight [out, in // 2]``, float16 ``scales [in // group, out]``.

    A code ``c`` means ``lut[c] * scale``: ``c - 8`` for int4, ``NF4_LEVELS[c]`` for NF4, so one kernel
    serves both.
    """

    def __init__(self, linear: nn.Linear, spec: QuantSpec) -> None:
        super().__init__(linear, spec)
        if self.in_features % 2:
            raise ValueError(f"4-bit packing needs an even in_features, got {self.in_features}")
        self.register_buffer("lut", self._levels(), persistent=False)  # [16] float32

    @staticmethod
    def _levels() -> torch.Tensor:
        raise NotImplementedError

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return native.load().lut4_linear(x, self.weight, self.scales, self.group_size, self.lut)

    def _bind(self, module) -> Callable[[torch.Tensor], torch.Tensor]:
        return module.bind_lut4(self.weight, self.scales, self.group_size, self.lut)


class Int4Linear(Nibble4Linear):
    """Symmetric int4 (codes -7..7 stored as nibbles 1..15) with a 16-bit scale per group.

    Where the integer kernel serves the layer (groups of whole activation blocks, ``out`` a multiple of 8) the
    codes are stored in its panel order (``quant.panels.pack_nibble_panels``), otherwise row-major for the float
    table kernel; ``dequantize`` reads either.
    """

    scheme = Scheme.INT4

    def __init__(self, linear: nn.Linear, spec: QuantSpec = SERVING_SPECS[Scheme.INT4],
                 hessian: torch.Tensor | None = None) -> None:
        super().__init__(linear, spec)
        q, scales = quantize_int(linear.weight.detach(), spec, hessian)  # hessian: GPTQ rounding
        codes = (q + INT4_OFFSET).to(torch.uint8)
        packed = pack_nibble_panels(codes) if self.layout is Layout.PANELS else pack_nibbles(codes)
        self.register_buffer("weight", packed)  # [out, in // 2]
        # Per-tensor and per-row scales are widened to the group layout so one kernel reads them all.
        groups = self.in_features // self.group_size
        self.register_buffer("scales", scales.half().expand(groups, self.out_features).contiguous()
                             if scales.dim() < 2 else scales)  # [in//group, out]

    @staticmethod
    def _levels() -> torch.Tensor:
        return torch.arange(16, dtype=torch.float32) - INT4_OFFSET

    def _layout_for_shape(self) -> Layout:
        panels = self.group_size % ACT_BLOCK == 0 and self.out_features % INT4_PANEL_ROWS == 0
        return Layout.PANELS if panels else Layout.ROWS

    @property
    def kernel_act_block(self) -> int | None:
        """Panels (groups of whole activation blocks) take the integer kernel; others the float table kernel."""
        return ACT_BLOCK if self.layout is Layout.PANELS else None

    @property
    def kernel_max_rows(self) -> int | None:
        """Every call, for both kernels: a row's bits must not depend on how many rows share the call."""
        return None

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel_act_block is None:
            return super()._kernel(x)
        return native.load().int4_linear(x, self.weight, self.scales, self.group_size, INT4_OFFSET)

    def _bind(self, module) -> Callable[[torch.Tensor], torch.Tensor]:
        if self.kernel_act_block is None:
            return super()._bind(module)
        return module.bind_int4(self.weight, self.scales, self.group_size, INT4_OFFSET)

    def dequantize(self) -> torch.Tensor:
        codes = unpack_nibble_panels(self.weight) if self.layout is Layout.PANELS else unpack_nibbles(self.weight)
        q = codes.to(torch.int8) - INT4_OFFSET  # [out, in]
        return dequantize_int(q, self.scales, self.group_size)


class NF4Linear(Nibble4Linear):
    """NF4 (QLoRA): codes index the 16 normal-quantile levels, float16 absmax per block of 64."""

    scheme = Scheme.NF4

    def __init__(self, linear: nn.Linear, spec: QuantSpec = SERVING_SPECS[Scheme.NF4]) -> None:
        super().__init__(linear, spec)
        codes, absmax = quantize_nf4(linear.weight.detach(), self.group_size)
        self.register_buffer("weight", pack_nibbles(codes))  # [out, in//2]
        self.register_buffer("scales", absmax)  # [in//block, out]

    @staticmethod
    def _levels() -> torch.Tensor:
        return torch.tensor(NF4_LEVELS, dtype=torch.float32)

    def dequantize(self) -> torch.Tensor:
        return dequantize_nf4(unpack_nibbles(self.weight), self.scales, self.group_size)


LAYER_CLASSES: dict[Scheme, type[QuantLinear]] = {Scheme.INT8: Int8Linear, Scheme.INT4: Int4Linear,
                                                  Scheme.NF4: NF4Linear}
