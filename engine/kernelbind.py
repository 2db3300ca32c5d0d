"""Binding a decoder layer's projections to the C++ kernels, and the profiler labels those calls carry.

engine.fastpath computes the forward; this module decides, once per model, what each projection calls:

    Projection          one nn.Linear / QuantLinear with its kernel: checks each input, falls back to the module
    LayerProjections    a layer's Projections, q/k/v fused (and gate/up when quantized)
    LayerKernels        what the layer loop calls, by name; three views of the same LayerProjections:
                          checked()  the Projections (any step, any dtype: checks, then kernel or module)
                          direct()   the bare kernels (all-decode float32 CPU steps: no checks, no Python frame)
                          torch()    the modules (torch's own ops, for dispatch-level tools)
                        and handles(): the kernels as C++ function pointers, for the layer stack that runs
                        every layer of an all-decode step in one C++ call (native/csrc/decode_layers.cpp)

Fusing stacks the weights once: the fused matrix owns the storage and the original projections become views
of its rows, so memory is not doubled and transformers' modules (the reference path) still read the same
weights. A second decoder over the same model finds the rows already stacked and views them again.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch
from torch import nn

from kvserve import native
from kvserve.quant.linear import QuantLinear, concat_outputs

# Up to this many rows (decode batches, and steps mixing a short prefill with decodes), float32 CPU projections
# use native/csrc/linear_f32.cpp, which reads each weight row once for all rows; it beats torch's GEMM up to
# about 64 rows and loses beyond (BENCHMARKS.md, "Kernel crossovers", `python -m kvserve.loadtest kernelbench`).
# Longer calls run it on blocks of this many rows: torch's GEMM would block its reduction by the call's size, so a
# row's last bits would depend on how many rows share its step, and an int8 / int4 KV cache turns such a bit into
# another code (a visible change, not a last-bit one).
DENSE_MAX_ROWS = 64
# A 16-bit projection on CPU runs torch's GEMM (oneDNN), which blocks its reduction by the call's shape and the
# CPU's kernels: on some AVX-512 EPYCs a row of a call of up to 32 rows has the bits of that row alone, on others a
# 2-row call of the down projection's shape already changes them. So the most rows a call may have is probed once
# per shape (invariant_rows), at most this many, and longer calls are cut into calls of that many rows: a row's bits
# never depend on how many rows share its step (a prefill chunk, a verify pass or a batch).
INVARIANT_ROWS = 32
PROFILE_LABEL = "kvserve::projection"  # what torch.profiler shows for a projection (kernel time is its self time)

Linear = Callable[[torch.Tensor], torch.Tensor]  # [T, in] -> [T, out]


class Projection:
    """A projection as the fast path calls it: ``[T, in]`` -> ``[T, out]``.

    On CPU with float32 rows, calls go straight to a C++ kernel: ``f32_linear`` for float32 weights (in calls of
    at most DENSE_MAX_ROWS rows), the layer's own kernel for a QuantLinear (up to its ``kernel_max_rows``: every call
    for the integer kernels). Anything else calls the module (torch's GEMM, or a bf16 ``nn.Linear``); a 16-bit
    ``nn.Linear`` on CPU in calls of at most ``INVARIANT_ROWS`` rows, so each row is computed as if alone.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.bias = getattr(module, "bias", None)
        self.kernel: Linear | None = None  # the bare kernel (bias not added): contiguous float32 input only
        self.dense = False  # the kernel is f32_linear
        self.max_rows = 0  # most rows a call may send to the kernel
        weight = getattr(module, "weight", None)
        if (type(module) is nn.Linear and weight.dtype is torch.float32 and weight.is_cpu
                and weight.is_contiguous() and native.load() is not None):
            self.kernel, self.dense, self.max_rows = native.load().bind_f32(weight), True, DENSE_MAX_ROWS
        elif isinstance(module, QuantLinear):
            limit = module.kernel_max_rows
            self.kernel, self.max_rows = module.decode_kernel(), (limit if limit is not None else sys.maxsize)
        # a 16-bit CPU nn.Linear: cut into calls of at most invariant_rows(...) rows
        self.row_blocks = 0
        if type(module) is nn.Linear and weight.is_cpu and weight.dtype in (torch.bfloat16, torch.float16):
            self.row_blocks = invariant_rows(module.out_features, module.in_features, weight.dtype)

    def handle(self, bias_apart: bool = False):
        """The kernel as a projection handle (``QuantLinear.projection_handle``), for C++ callers that run it
        without Python on contiguous float32 rows, at most ``max_rows`` of them; None where there is none (no
        kernel, a bias unless ``bias_apart``: the caller adds it, a kernel family without handles)."""
        if (self.kernel is None or (self.bias is not None and not bias_apart)
                or not isinstance(self.module, QuantLinear)):
            return None
        return self.module.projection_handle()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.dtype is torch.float32 and (x.shape[0] <= self.max_rows or self.dense):
            x = x if x.is_contiguous() else x.contiguous()
            y = self.kernel(x) if x.shape[0] <= self.max_rows else torch.cat(
                [self.kernel(part) for part in x.split(self.max_rows)])  # [T, out], blocks of DENSE_MAX_ROWS rows
            return y if self.bias is None else y + self.bias
        if self.row_blocks and x.shape[0] > self.row_blocks:
            return torch.cat([self.module(part) for part in x.split(self.row_blocks)])  # [T, out]
        return self.module(x)


@functools.lru_cache(maxsize=None)
def invariant_rows(out_features: int, in_features: int, dtype: torch.dtype) -> int:
    """The most rows (1 to ``INVARIANT_ROWS``) a CPU ``nn.Linear`` call of this shape and dtype may have so that
    each row's output has the bits of that row computed alone; probed once per shape (cached).

    torch's GEMM picks its blocking, and with it the order of each dot product's additions, from the shape and the
    CPU, not from the values. On ordinary data another order rarely shows through a 16-bit output's rounding, so
    the probe's data make every order show: weights ``s_n t_k`` (random signs), and rows in which half the inputs
    are ``±2^20 t_k`` cancelling in pairs at random places and the rest small (0.5-1.5), so a partial sum keeps or
    loses the small terms depending on where the large ones fall in it. Every call size up to the one returned
    is checked (a call cut into parts of that size has a remainder of any smaller size). Costs about
    INVARIANT_ROWS^2 / 2 rows of the GEMM, once per shape.
    """
    generator = torch.Generator().manual_seed(0)
    signs_in = torch.randint(0, 2, (in_features,), generator=generator) * 2 - 1
    signs_out = torch.randint(0, 2, (out_features,), generator=generator) * 2 - 1
    weight = (signs_out[:, None] * signs_in[None, :]).to(dtype)  # [out, in]
    rows = []
    for _ in range(INVARIANT_ROWS):
        large = torch.randperm(in_features, generator=generator)[: in_features // 2]
        pairs = torch.ones(large.numel())
        pairs[1::2] = -1
        row = torch.rand(in_features, generator=generator) + 0.5
        row[large] = 2.0 ** 20 * pairs * signs_in[large]
        rows.append(row)
    x = torch.stack(rows).to(dtype)  # [INVARIANT_ROWS, in]
    with torch.inference_mode():
        alone = torch.cat([nn.functional.linear(row[None], weight) for row in x])  # [INVARIANT_ROWS, out]
        for count in range(2, INVARIANT_ROWS + 1):
            if not torch.equal(nn.functional.linear(x[:count], weight), alone[:count]):
                return count - 1
    return INVARIANT_ROWS


@dataclass(slots=True, frozen=True)
class LayerKernels:
    """One decoder layer's projections as the layer loop calls them, each ``[T, in]`` -> ``[T, out]``.

    Exactly one of ``gate_up`` and (``gate``, ``up``) is set.
    """

    qkv: Linear  # [T, hidden] -> [T, (H + 2 H_kv) d]
    o_proj: Linear  # [T, H d] -> [T, hidden]
    gate_up: Linear | None  # [T, hidden] -> [T, 2I]: gate and up side by side (one call, quantized layers)
    gate: Linear | None  # [T, hidden] -> [T, I]
    up: Linear | None  # [T, hidden] -> [T, I]
    down: Linear  # [T, I] -> [T, hidden]

    def labelled(self) -> LayerKernels:
        """The same calls, each under the projections' profiler label."""
        return replace(self, **{f.name: labelled(getattr(self, f.name), PROFILE_LABEL) for f in fields(self)
                                if getattr(self, f.name) is not None})


class LayerProjections:
    """One decoder layer's projections (``layer.self_attn`` and ``layer.mlp``), fused where possible."""

    def __init__(self, layer: nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        fused = fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        self.qkv = None if fused is None else Projection(fused)
        # unfused fallback (e.g. q/k/v quantized with different group sizes): three calls
        self.separate_qkv = (None if fused is not None
                             else [Projection(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj)])
        self.o_proj = Projection(attn.o_proj)
        # float32 gate and up stay separate: a fused [2I, hidden] GEMM was not faster on this CPU (its weights
        # no longer fit the cache together), unlike q/k/v, which gain from one call. Quantized ones are fused:
        # their kernels stream the codes either way, and one call quantizes the activations once.
        fused_mlp = fuse([mlp.gate_proj, mlp.up_proj]) if isinstance(mlp.gate_proj, QuantLinear) else None
        self.gate_up = None if fused_mlp is None else Projection(fused_mlp)
        self.gate, self.up = ((None, None) if fused_mlp is not None
                              else (Projection(mlp.gate_proj), Projection(mlp.up_proj)))
        self.down = Projection(mlp.down_proj)

    def all(self) -> list[Projection]:
        """Every Projection of the layer, in call order."""
        return [p for p in (self.qkv, *(self.separate_qkv or []), self.o_proj, self.gate_up, self.gate, self.up,
                            self.down) if p is not None]

    @property
    def max_rows(self) -> int:
        """Most rows every projection of the layer sends to its kernel."""
        return min(p.max_rows for p in self.all())

    def checked(self) -> LayerKernels:
        """The Projections themselves: any input, kernel where it applies, else the module."""
        qkv = self.qkv if self.qkv is not None else self._separate_qkv
        return LayerKernels(qkv, self.o_proj, self.gate_up, self.gate, self.up, self.down)

    def direct(self) -> LayerKernels | None:
        """The bare kernels, for inputs known to be contiguous float32 with at most ``max_rows`` rows; None if a
        projection has no kernel or adds a bias. Unfused q/k/v (layers whose q, k and v differ in kind) is one call
        of the three kernels, their outputs side by side."""
        if any(p.kernel is None or p.bias is not None for p in self.all()):
            return None
        qkv = (self.qkv.kernel if self.qkv is not None
               else functools.partial(_side_by_side, tuple(p.kernel for p in self.separate_qkv)))
        return LayerKernels(qkv, self.o_proj.kernel, *(
            p.kernel if p is not None else None for p in (self.gate_up, self.gate, self.up)), self.down.kernel)

    def handles(self) -> tuple | None:
        """The q/k/v, o, gate/up and down projections as projection handles (``QuantLinear.projection_handle``),
        for the decode ops' layer stack (``DecodeLayers.add_layer``): q/k/v and gate/up each a list of handles
        whose outputs go side by side (one where the layer fused them, else q, k, v and gate, up); None where one
        has none (no kernel, a kernel family without handles, a bias other than q/k/v's: ``qkv_bias`` gives
        that one, which the stack adds)."""
        qkv = [self.qkv] if self.qkv is not None else self.separate_qkv
        if any(p.bias is None for p in qkv) and any(p.bias is not None for p in qkv):
            return None  # a bias on some parts only: the stack adds one over the whole row
        gate_up = [self.gate_up] if self.gate_up is not None else [self.gate, self.up]
        handles = ([p.handle(bias_apart=True) for p in qkv], self.o_proj.handle(), [p.handle() for p in gate_up],
                   self.down.handle())
        flat = [*handles[0], handles[1], *handles[2], handles[3]]
        return None if any(h is None for h in flat) else handles

    def qkv_bias(self) -> torch.Tensor | None:
        """The q/k/v projection's bias ``[(H + 2 H_kv) d]`` (Qwen2's), the parts' side by side, or None."""
        qkv = [self.qkv] if self.qkv is not None else self.separate_qkv
        if any(p.bias is None for p in qkv):
            return None
        return torch.cat([p.bias.detach() for p in qkv]).contiguous()

    def torch(self) -> LayerKernels:
        """The modules: torch's own ops (or a QuantLinear's forward), never a bare kernel."""
        qkv = self.qkv.module if self.qkv is not None else self._separate_qkv_modules
        return LayerKernels(qkv, self.o_proj.module, *(p.module if p is not None else None
                                                       for p in (self.gate_up, self.gate, self.up)),
                            self.down.module)

    def _separate_qkv(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([proj(h) for proj in self.separate_qkv], dim=-1)  # [T, (H + 2 H_kv) d]

    def _separate_qkv_modules(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([proj.module(h) for proj in self.separate_qkv], dim=-1)  # [T, (H + 2 H_kv) d]


def _side_by_side(kernels: tuple[Callable, ...], h: torch.Tensor) -> torch.Tensor:
    """The kernels' outputs on ``h`` ``[T, in]`` side by side: ``[T, sum(out)]``."""
    return torch.cat([kernel(h) for kernel in kernels], dim=-1)


def labelled(fn: Callable, label: str) -> Callable:
    """``fn`` inside a torch.profiler label (C++ calls are not aten ops: unlabelled, a profile would not see them)."""
    def call(*args):
        with torch.profiler.record_function(label):
            return fn(*args)
    return call


def profiling() -> bool:
    """Whether a torch.profiler is recording (the only place that asks)."""
    return getattr(torch.autograd.profiler, "_is_profiler_enabled", False)


def fuse(linears: list[nn.Module]) -> nn.Module | None:
    """One layer computing ``linears`` side by side (rows stacked), sharing storage; None if they differ."""
    first = linears[0]
    if all(type(m) is nn.Linear for m in linears):
        weight = _stacked([m.weight.detach() for m in linears])
        if weight is None:
            weight = torch.cat([m.weight.detach() for m in linears])  # [sum(out), in]
            start = 0
            for m in linears:
                m.weight.data = weight[start:start + m.out_features]  # the original layer now reads the fused rows
                start += m.out_features
        biases = [m.bias for m in linears if m.bias is not None]
        fused = nn.Linear(first.in_features, weight.shape[0], bias=bool(biases), device="meta")
        fused.weight = nn.Parameter(weight, requires_grad=False)
        if biases:
            fused.bias = nn.Parameter(torch.cat([m.bias.detach() if m.bias is not None
                                                 else biases[0].new_zeros(m.out_features) for m in linears]),
                                      requires_grad=False)
        return fused
    if all(isinstance(m, QuantLinear) for m in linears):
        try:
            return concat_outputs(linears)
        except ValueError:
            return None
    return None


def _stacked(weights: list[torch.Tensor]) -> torch.Tensor | None:
    """``[sum(out), in]``: a view over weights that are already consecutive rows of one storage (an earlier
    ``fuse``), or None."""
    first = weights[0]
    offset = first.storage_offset()
    for w in weights:
        if (w.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or not w.is_contiguous()
                or w.storage_offset() != offset or w.shape[1:] != first.shape[1:]):
            return None
        offset += w.numel()
    rows = sum(w.shape[0] for w in weights)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())
