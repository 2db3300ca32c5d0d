"""Quantized replacements for ``nn.Linear``: ``QuantLinear``, the base every weight format implements (kvserve's
own roundings in quant/layers.py, the GGUF's own blocks in quant/ggml.py), and ``concat_outputs``.

Every class holds its codes in ``weight`` and its scales in ``scales`` (buffers, so ``.to(device)`` and
``state_dict`` carry them) and records its scheme, group size and code layout (row-major, or the integer
kernels' panels) in the saved state (``_extra_state``).
``forward`` runs the C++ kernel on CPU (every call for int8 and int4, up to ``KERNEL_MAX_ROWS`` tokens
for NF4's); otherwise, and on any other device, it runs the reference: dequantize to the activation dtype,
then ``F.linear``.

The int8 and int4 kernels multiply integers, which streams the weights about twice as fast as widening them
to floats: int4 quantizes the activations to int8 per block of 32 (``ACT_BLOCK``, llama.cpp's Q8_0) for
AVX2's 8-bit dot products, int8 to int16 per block of 64 (``ACT16_BLOCK``; 32 where the row is not a multiple
of 64) for its 16-bit ones (an int16 step is far below the int8 weights' error, so the served int8 layer is as
accurate as weight-only int8). So that one model is served whatever the batch size, the reference path applies
the same activation quantization (``quant.schemes.quantize_activations``); ``act_block = None`` turns it off
(weight-only quantization, as the quality report's per-scheme rows measure), which also turns the kernel off.
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve import native
from kvserve.quant.schemes import ACT16_BLOCK, ACT_BLOCK, Q8_MAX, QuantSpec, Scheme, quantize_activations

# NF4's float-table kernel serves up to this many tokens per call (decode batches); longer prefill chunks
# dequantize once and run a float GEMM, which is faster there. The integer kernels (int8; int4 in panels) serve
# every call instead: they beat dequantize + GEMM at every chunk size measured, 32 to 512 rows (BENCHMARKS.md,
# "Kernel crossovers", `python -m kvserve.loadtest kernelbench`). One code path for every batch also keeps greedy output independent
# of what else is in the step: a prefill in the same step does not move a sequence onto other arithmetic, which
# quantized activations could amplify into another token.
KERNEL_MAX_ROWS = 32



class Layout(enum.Enum):
    """How a layer's integer codes are ordered in memory (recorded in its saved state)."""

    ROWS = "rows"      # row-major [out, in]
    PANELS = "panels"  # the integer kernels' order: quant.panels.pack_int8_panels, pack_nibble_panels

class QuantLinear(nn.Module):
    """Base class: bookkeeping shared by the schemes.

    Args:
        linear: the float layer to quantize (its weight ``[out, in]`` is read, not kept).
        spec: the recipe; its scheme must match the subclass.

    Attributes:
        group_size: weights per scale along ``in`` actually used (``in`` for per-row).
        use_kernel: whether CPU calls may use the C++ kernel (tests turn it off to get the reference).
        act_block: activations are quantized per this many values before the product (``kernel_act_block``,
            what the kernel does), or None for float activations (then only the reference path runs, unless
            the kernel itself takes float activations, as NF4's does).
        act_qmax: the largest activation code: 127 (int8 activations) or 32767 (int16).
    """

    scheme: Scheme
    act_qmax = Q8_MAX

    def __init__(self, linear: nn.Linear, spec: QuantSpec) -> None:
        super().__init__()
        if spec.scheme is not self.scheme:
            raise ValueError(f"{type(self).__name__} takes {self.scheme.value} specs, got {spec.label}")
        self.spec = spec
        self._init_shape(linear.in_features, linear.out_features, spec.group_for(linear.in_features), linear.bias)

    def _init_shape(self, in_features: int, out_features: int, group_size: int, bias: torch.Tensor | None) -> None:
        """The attributes every layer has (the codes and scales are the subclass's)."""
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size
        self.layout = self._layout_for_shape()  # fixed here: concat_outputs keeps it for the stacked codes
        self.use_kernel = True
        self.act_block = self.kernel_act_block
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def dequantize(self) -> torch.Tensor:
        """``W_hat`` as float32 ``[out, in]``."""
        raise NotImplementedError

    def _layout_for_shape(self) -> Layout:
        """How a new layer of this shape orders its codes (``layout``)."""
        return Layout.ROWS

    @property
    def kernel_act_block(self) -> int | None:
        """The activation block the C++ kernel quantizes with (None: it takes float activations)."""
        return None

    @property
    def has_kernel(self) -> bool:
        """Whether a C++ kernel exists for this layer's shape (checked before ``act_block`` is compared)."""
        return True

    @property
    def kernel_max_rows(self) -> int | None:
        """Most tokens per call the kernel serves (None: every call, as the integer kernels do)."""
        return None if self.kernel_act_block is not None else KERNEL_MAX_ROWS

    def _kernel_usable(self) -> bool:
        return (self.use_kernel and self.weight.is_cpu and self.has_kernel and self.act_block == self.kernel_act_block
                and native.load() is not None)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        """``[M, in]`` float32 -> ``[M, out]`` float32 with the C++ kernel."""
        raise NotImplementedError

    def decode_kernel(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The C++ kernel bound to this layer's codes and scales (bias not added), or None where it cannot run.

        For callers that already hold a contiguous float32 CPU ``[M, in]`` with ``M <= kernel_max_rows``:
        it skips ``forward``'s checks and reshapes, which cost more than a one-row product of a small layer
        (BENCHMARKS.md, "Kernel crossovers"), and a SmolLM2 step makes 210 such calls.
        """
        if not self._kernel_usable():
            return None
        return self._bind(native.load())

    def _bind(self, module) -> Callable[[torch.Tensor], torch.Tensor]:
        raise NotImplementedError

    def projection_handle(self):
        """The C++ kernel bound to this layer's weights as a projection handle (a capsule holding a
        ``ProjectionHandle``, native/csrc/projection_handle.h) that the decode ops' layer stack calls without
        Python (``engine.fastpath``); None where the kernel cannot run or its family has no handle (then the
        per-layer loop runs). Same conditions and bits as ``decode_kernel``; the bias is not added."""
        if not self._kernel_usable():
            return None
        return self._handle(native.load())

    def _handle(self, module):
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in]`` -> ``[..., out]`` in the dtype of ``x``."""
        rows = x.numel() // self.in_features
        limit = self.kernel_max_rows
        if x.is_cpu and (limit is None or rows <= limit) and self._kernel_usable():
            flat = x.reshape(rows, self.in_features)  # [M, in]
            if flat.dtype is not torch.float32 or not flat.is_contiguous():
                flat = flat.float().contiguous()
            y = self._kernel(flat).view(*x.shape[:-1], self.out_features)  # float32 [..., out]
            if self.bias is not None:
                y = y + self.bias
            return y if x.dtype is torch.float32 else y.to(x.dtype)
        if self.act_block is not None:
            x = quantize_activations(x, self.act_block, self.act_qmax)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self._reference_weight(x.dtype), bias)

    def _reference_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """``W_hat`` ``[out, in]`` in ``dtype`` for the reference path (dequantized per call unless overridden)."""
        return self.dequantize().to(dtype)

    @property
    def weight_bytes(self) -> int:
        """Bytes of codes and scales (what one decode step reads)."""
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scales))

    def get_extra_state(self) -> dict:
        return {"scheme": self.scheme.value, "granularity": self.spec.granularity.value,
                "group_size": self.group_size, "layout": self.layout.value}

    def set_extra_state(self, state: dict) -> None:
        layout = state.get("layout", Layout.ROWS.value)
        if (state["scheme"] != self.scheme.value or state["group_size"] != self.group_size
                or layout != self.layout.value):
            raise ValueError(f"state is {state['scheme']}/group {state['group_size']}/{layout}, layer is "
                             f"{self.scheme.value}/group {self.group_size}/{self.layout.value}")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        # torch copies the tensors first and calls set_extra_state last: check before any code is overwritten,
        # and refuse codes without the state that says how to read them (strict=False would let them in)
        extra = state_dict.get(prefix + "_extra_state")
        if extra is None and prefix + "weight" in state_dict:
            raise ValueError(f"{prefix}weight comes without its _extra_state (scheme, group size, layout), "
                             "so its codes cannot be read")
        if extra is not None:
            self.set_extra_state(extra)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _stack_rows(self, layers: list[QuantLinear]) -> None:
        """Set this (fused) layer's codes and scales to ``layers``' rows stacked; theirs become views of them."""
        self._move_weights(layers)  # [sum(out), in] or [sum(out), in // 2]
        self.scales = torch.cat([m.scales for m in layers], dim=-1)  # [sum(out)] or [groups, sum(out)]

    def _move_weights(self, layers: list[QuantLinear]) -> None:
        """``weight`` = ``layers``' weights stacked along dim 0, each layer's ``weight`` then a view of its rows.

        The layers' buffers move one at a time, each freed as soon as its rows are in the stack, so loading
        holds at most one layer's bytes twice, not every layer's at once (GGUF layers were unpacked, stacked and
        packed again: the start's peak resident memory, BENCHMARKS.md section ready-avx2). ``torch.empty`` gives
        pages that become resident only as they are written, advised for huge pages first where the kernels are
        built (as their packing does: native/csrc/huge_pages.h).
        """
        first = layers[0].weight
        stacked = first.new_empty((sum(m.weight.shape[0] for m in layers), *first.shape[1:]))
        kernels = native.load(build=False)
        if kernels is not None and stacked.device.type == "cpu":
            kernels.advise_huge_pages(stacked)
        self.weight = stacked  # drop the reference a copy of the first layer's buffers holds
        del first
        start = 0
        for m in layers:
            rows = m.weight.shape[0]
            stacked[start:start + rows].copy_(m.weight)
            m.weight = stacked[start:start + rows]  # the layer's own buffer goes (no other reference holds it)
            start += rows

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.spec.label} (group {self.group_size})"


def concat_outputs(layers: list[QuantLinear]) -> QuantLinear:
    """One layer whose output is the given layers' outputs side by side: ``[..., sum(out_i)]``.

    Exact, not a requantization: every scheme stores its scales per output row (per-tensor scales are
    widened to rows or groups at construction), so rows can be stacked as they are. The fused layer owns
    the codes; each original layer's ``weight`` becomes a view of its rows, so memory is not doubled.

    Args:
        layers: layers of one class with the same ``in_features``, group size and layout (e.g. q, k, v
            projections).

    Raises:
        ValueError: mixed classes, input sizes, group sizes or layouts.
    """
    first = layers[0]
    # the saved state names the scheme, group size, layout (and a GGUF layer's block format): all must agree
    if any(type(m) is not type(first) or m.in_features != first.in_features
           or m.get_extra_state() != first.get_extra_state() for m in layers):
        raise ValueError("concat_outputs needs layers of one scheme, input size, group size and layout")
    fused = copy.copy(first)
    fused._parameters, fused._buffers, fused._modules = dict(first._parameters), dict(first._buffers), {}
    fused.out_features = sum(m.out_features for m in layers)
    fused._stack_rows(layers)
    biases = [m.bias for m in layers if m.bias is not None]
    fused.bias = None if not biases else nn.Parameter(torch.cat(
        [m.bias if m.bias is not None else biases[0].new_zeros(m.out_features) for m in layers]), requires_grad=False)
    return fused
