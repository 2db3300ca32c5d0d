"""An unquantized bfloat16 model served through the AVX512-BF16 kernel: ``BF16Linear`` and ``use_bf16_kernel``.

Not a quantization: the weights are the model's own bfloat16 values, packed once into the kernel's panels
(``bf16_pack``, native/csrc/ukernel_bf16.h). The kernel rounds each float32 activation to bfloat16 (round to
nearest even), multiplies pairs with ``vdpbf16ps`` and accumulates in float32 in K order, one chain per output:
a row's result never depends on the other rows of its call, so the layer serves every call (any batch, any
prefill chunk). Everything else of the model (embedding, norms, attention, the residual stream) runs in float32:
the bfloat16 values widened exactly, so the fast path's fused float32 ops and paged attention serve it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve import native
from kvserve.quant.linear import Layout, QuantLinear
from kvserve.quant.model import projection_names
from kvserve.quant.options import Scheme

PANEL = 32  # output features per packed panel (KV_NR_BF16)


def native_ops():
    """The C++ kernels when they have the bfloat16 ops (``bf16_linear`` and its packing), else None."""
    module = native.load()
    return module if module is not None and hasattr(module, "bf16_linear") else None


def kernel_runs() -> bool:
    """Whether the AVX512-BF16 micro-kernel runs here: the kernels are built, their chosen ISA path is avx512 and
    the CPU has AVX512-BF16 (native/csrc/cpu.h ``bf16()``; ``KVSERVE_ISA=avx2`` or ``scalar`` turns it off)."""
    module = native_ops()
    return module is not None and module.bf16_native()


class BF16Linear(QuantLinear):
    """A projection with bfloat16 weights and float32 activations, ``[..., in]`` -> ``[..., out]``.

    Args:
        weight: bfloat16 ``[out, in]``, the model's weights (other dtypes are rounded to bfloat16 first).
        bias: optional float ``[out]`` (added in float32 after the kernel).

    ``weight`` holds the packed panels (bfloat16 ``[ceil(out / 32), ceil(in / 2) * 64]``); ``dequantize`` unpacks.
    The reference path (no kernel, or another device) multiplies the activations rounded to bfloat16 by the
    weights in float32 with ``F.linear``: the same products, summed in torch's order.

    Raises:
        RuntimeError: the C++ kernels are not built (this layer exists only where they are).
    """

    scheme = Scheme.NONE

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        nn.Module.__init__(self)  # QuantLinear.__init__ quantizes: nothing to round here
        module = native_ops()
        if module is None:
            raise RuntimeError("BF16Linear needs the C++ kernels (python -m kvserve.native --build)")
        out_features, in_features = weight.shape
        self._init_shape(in_features, out_features, in_features, bias)
        self.register_buffer("weight", module.bf16_pack(weight.detach().to(torch.bfloat16).contiguous().cpu()))

    def _layout_for_shape(self) -> Layout:
        return Layout.PANELS

    @property
    def has_kernel(self) -> bool:
        return native_ops() is not None

    @property
    def kernel_max_rows(self) -> int | None:
        return None  # every call: one chain per output in K order, batch-invariant at any size

    def weights(self) -> torch.Tensor:
        """The model's bfloat16 weights ``[out, in]``, unpacked from the panels."""
        return native_ops().bf16_unpack(self.weight.cpu(), self.out_features, self.in_features).to(self.weight.device)

    def dequantize(self) -> torch.Tensor:
        return self.weights().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cpu and self._kernel_usable():
            return super().forward(x)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x.to(torch.bfloat16).to(x.dtype), self.dequantize().to(x.dtype), bias)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return native_ops().bf16_linear(x, self.weight, self.out_features, self.in_features)

    def _bind(self, module):
        return module.bind_bf16(self.weight, self.out_features, self.in_features)

    def _apply(self, fn, recurse: bool = True):
        # .float() / .to(dtype) on the model must not widen the packed weights (they are the kernel's input)
        packed = self.weight
        super()._apply(fn, recurse)
        if self.weight.dtype is not torch.bfloat16:
            self.weight = packed.to(self.weight.device)
        return self

    def _stack_rows(self, layers: list[QuantLinear]) -> None:
        self.weight = native_ops().bf16_pack(torch.cat([m.weights() for m in layers]))  # [sum(out), in], packed
        start = 0
        for m in layers:  # share the storage where a layer's rows fill whole panels
            rows = self.weight[start // PANEL:start // PANEL + m.weight.shape[0]]
            if start % PANEL == 0 and rows.shape == m.weight.shape and torch.equal(rows, m.weight):
                m.weight = rows
            start += m.out_features

    @property
    def weight_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def get_extra_state(self) -> dict:
        return {"scheme": self.scheme.value, "weights": "bfloat16", "group_size": self.group_size,
                "layout": self.layout.value}

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bfloat16 weights (AVX512-BF16 kernel)"


def use_bf16_kernel(model: nn.Module) -> int:
    """Serve a bfloat16 ``model`` with float32 activations: its projections and LM head become ``BF16Linear``
    layers over their own bfloat16 weights, and everything else is widened to float32 (exactly), in place.

    Returns:
        The number of layers now on the kernel (projections and the LM head).

    Raises:
        ValueError: the model's weights are not bfloat16 (they would be rounded: not this model).
        RuntimeError: the C++ kernels are not built.
    """
    dtype = model.get_input_embeddings().weight.dtype
    if dtype is not torch.bfloat16:
        raise ValueError(f"use_bf16_kernel serves a bfloat16 model's own weights; this one is {dtype}")
    head = model.get_output_embeddings()
    names = projection_names(model) + (["lm_head"] if isinstance(head, nn.Linear) else [])
    weights = {name: model.get_submodule(name).weight.detach() for name in names}  # bfloat16, kept through .float()
    model.float()
    for name in names:
        module = model.get_submodule(name)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, BF16Linear(weights[name], module.bias))
    return len(names)
