"""Quantize a whole model in place: every ``nn.Linear`` projection becomes a QuantLinear.

The input embedding stays in the model's dtype (a table lookup reads one row per token). The LM head, the
most sensitive output, is kept as it is by default; ``head=True`` gives it its own int8 per-row copy (the
tied embedding keeps the float weights), as llama.cpp keeps ``output.weight`` at 6-8 bits in its 4-bit files.
``kvserve serve`` does that for the 4-bit schemes (``serving_quantizes_head``): there the float32 head is
113 MB against 53 MB of projections, over half a decode step. With int8 projections it keeps the float head:
the int8 scheme is held to 1% perplexity, and on SmolLM2 an int8 head added about 0.1 point to it (BENCHMARKS.md,
"Kernel crossovers"; measured with ``kvserve quant report``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from kvserve import native
from kvserve.quant import gptq
from kvserve.quant.layers import LAYER_CLASSES, Int8Linear
from kvserve.quant.linear import QuantLinear
from kvserve.quant.schemes import SERVING_SPECS, QuantSpec, Scheme

log = logging.getLogger("kvserve.quant")
# Schemes whose served codes are rounded by GPTQ: the integer grids. For int8 per row, rounding to nearest
# changes more of full precision's greedy choices than the 3 in 100 the quality goal allows; for int4 it moves
# the model much further (BENCHMARKS.md, `python -m kvserve.loadtest quant`). NF4's table levels keep rounding to nearest.
SERVING_GPTQ = frozenset({Scheme.INT8, Scheme.INT4})


@dataclass(slots=True, frozen=True)
class QuantSummary:
    """What ``quantize_model`` did.

    Attributes:
        scheme: the scheme applied (NONE: nothing was changed).
        spec_label: the recipe, e.g. ``int4/group128`` ("none" for NONE).
        group_sizes: group sizes actually used (per-row int8 lists the row lengths), ascending.
        num_layers: linear layers replaced.
        bits_per_weight: stored bits per quantized weight, scales included (16 or 32 for NONE).
        bytes_before: bytes of the replaced layers' float weights.
        bytes_after: bytes of their codes and scales.
    """

    scheme: Scheme
    spec_label: str
    group_sizes: tuple[int, ...]
    num_layers: int
    bits_per_weight: float
    bytes_before: int
    bytes_after: int
    head: str = "model dtype"

    def describe(self) -> str:
        """One line for logs."""
        if self.scheme is Scheme.NONE:
            return "quantization: none"
        return (f"quantization: {self.spec_label} on {self.num_layers} linear layers, group sizes "
                f"{list(self.group_sizes)}, {self.bits_per_weight:.3f} bits/weight, "
                f"{self.bytes_before / 2**20:.1f} MiB -> {self.bytes_after / 2**20:.1f} MiB; LM head {self.head}")


def projection_names(model: nn.Module) -> list[str]:
    """Qualified names of the ``nn.Linear`` projections to quantize (all but the output embedding)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and module is not head]


def serving_quantizes_head(scheme: Scheme | str) -> bool:
    """Whether ``kvserve serve --quantization scheme`` gives the LM head an int8 copy (the 4-bit schemes)."""
    return Scheme(scheme) in (Scheme.INT4, Scheme.NF4)


def quantize_model(model: nn.Module, scheme: Scheme | str, spec: QuantSpec | None = None, *, head: bool = False,
                   activations: bool = True,
                   calibration: tuple[torch.Tensor, torch.Tensor] | None = None) -> QuantSummary:
    """Replace every linear projection of ``model`` with its quantized layer, in place.

    Works on any device and dtype: codes are computed from the float32 value of each weight on the weight's
    device, and the new layer lives on that device.

    Args:
        model: a transformers causal LM (or any module; an ``nn.Linear`` that is the output embedding is kept).
        scheme: ``Scheme`` or its value ("none", "int8", "int4", "nf4").
        spec: override the serving default recipe of ``scheme`` (the report uses per-tensor/per-row).
        head: also give the LM head an int8 per-row copy (an ``Int8Linear``; the embedding keeps its weights).
            Not counted in the summary's bits and bytes, which describe the projections.
        activations: quantize activations as the int8/int4 kernels do (``QuantLinear.act_block``); False
            gives weight-only layers that always run the reference (the report's per-scheme rows).
        calibration: ``(ids, mask)`` ``[batch, T]`` (``quant.gptq.calibration_batch``): round the int8 or int4
            codes by GPTQ on the same absmax grid, each layer with the input Hessian of one forward pass of the
            float model over these tokens (the label gets ``+gptq``). The LM head copy stays round-to-nearest.

    Returns:
        The summary (bits per weight measured from the stored bytes).

    Raises:
        ValueError: an unknown scheme, a spec for another scheme, a layer the scheme cannot pack, or a
            calibration for NF4.
    """
    scheme = Scheme(scheme)
    param = next(model.parameters())
    if scheme is Scheme.NONE:
        return QuantSummary(Scheme.NONE, "none", (), 0, float(param.element_size() * 8), 0, 0)
    if scheme not in SERVING_SPECS:
        raise ValueError(f"--quantization {scheme.value} is not a rounding recipe (int8, int4, nf4): "
                         "engine.weights resolves it")
    spec = spec or SERVING_SPECS[scheme]
    if spec.scheme is not scheme:
        raise ValueError(f"spec {spec.label} is not a {scheme.value} spec")
    if param.is_cpu:
        native.load()  # build (or load) the CPU kernels now, at startup, not inside the first request
    names = projection_names(model)
    layer_class = LAYER_CLASSES[scheme]
    built: dict[str, QuantLinear] = {}
    if calibration is not None:
        if scheme is Scheme.NF4:
            raise ValueError("GPTQ rounding is for the integer grids (int8, int4), not NF4's levels")
        started = time.perf_counter()

        def build(name: str, hessian: torch.Tensor) -> None:  # during the pass: the float layer stays in place
            built[name] = layer_class(model.get_submodule(name), spec, hessian=hessian)

        with gptq.plain_attention(model):
            gptq.stream_hessians(model, names, *calibration, build)
        log.info("GPTQ: %d layers rounded with Hessians of %d tokens in %.1f s", len(built),
                 int(calibration[1].sum()), time.perf_counter() - started)
    bytes_before = bytes_after = num_weights = 0
    groups: set[int] = set()
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear: nn.Linear = getattr(parent, child)
        quantized = built.pop(name) if name in built else layer_class(linear, spec)
        quantized = quantized.to(linear.weight.device)
        if not activations:
            quantized.act_block = None
        setattr(parent, child, quantized)
        bytes_before += linear.weight.numel() * linear.weight.element_size()
        bytes_after += quantized.weight_bytes
        num_weights += linear.weight.numel()
        groups.add(quantized.group_size)
    if not num_weights:
        raise ValueError("the model has no linear projections to quantize")
    num_layers = sum(isinstance(m, QuantLinear) for m in model.modules())
    head_label = "model dtype"
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head and isinstance(output, nn.Linear):
        quantized_head = Int8Linear(output).to(output.weight.device)  # codes from a copy: the embedding keeps its own
        if not activations:
            quantized_head.act_block = None
        model.set_output_embeddings(quantized_head)
        head_label = f"int8/row ({quantized_head.weight_bytes / 2**20:.1f} MiB)"
    label = spec.label + ("" if calibration is None else "+gptq")
    return QuantSummary(scheme=scheme, spec_label=label, group_sizes=tuple(sorted(groups)),
                        num_layers=num_layers, bits_per_weight=8 * bytes_after / num_weights,
                        bytes_before=bytes_before, bytes_after=bytes_after, head=head_label)


def quantize_for_serving(model: nn.Module, scheme: Scheme | str, tokenizer=None) -> QuantSummary:
    """Quantize ``model`` in place as ``kvserve serve --quantization scheme`` does.

    The serving recipe (``SERVING_SPECS``) and an int8 LM head copy for the 4-bit schemes; for the schemes in
    ``SERVING_GPTQ``, GPTQ rounding calibrated on the model's own replies (``quant.gptq.calibration_batch``:
    over a minute for SmolLM2 on a 2-core CPU, at every start).

    Args:
        model: a transformers causal LM (the loaded model: its paged attention is restored after calibrating).
        scheme: ``Scheme`` or its value.
        tokenizer: writes the calibration replies; None rounds every code to nearest, which the speed
            benchmarks use: GPTQ's codes differ only in value, so a step costs the same.

    Raises:
        ValueError: as ``quantize_model``.
    """
    scheme = Scheme(scheme)
    calibration = None
    if scheme in SERVING_GPTQ and tokenizer is not None:
        started = time.perf_counter()
        with gptq.plain_attention(model):
            calibration = gptq.calibration_batch(model, tokenizer)
        log.info("GPTQ calibration: the model's replies to %d prompts, %d tokens, in %.1f s",
                 calibration[0].shape[0], int(calibration[1].sum()), time.perf_counter() - started)
    return quantize_model(model, scheme, head=serving_quantizes_head(scheme), calibration=calibration)


def weight_bytes_per_token(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: every linear layer (quantized or not) plus the LM head."""
    total = 0
    for module in model.modules():
        if isinstance(module, QuantLinear):
            total += module.weight_bytes
        elif isinstance(module, nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
    return total


def stored_bytes(model: nn.Module) -> int:
    """Bytes of every distinct parameter and buffer (a tied embedding counts once)."""
    seen: dict[int, int] = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        seen[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
    return sum(seen.values())
