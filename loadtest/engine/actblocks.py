"""What the activations' block size costs a GGUF model's next-token distributions.

The GGUF kernels quantize a projection's input to int8 per block of 32 values, but per super-block of 256 for
the K-quants (Q4_K, Q5_K, Q6_K, as llama.cpp's Q8_K does; ukernel_gguf.h): coarser beside an outlier, and what
lets those formats fold their sub-block scales in integer (docs/kernels.md). This measures the cost on a file's
own weights: every K-quant projection of the model run on the reference path (dequantized weights, ``F.linear``)
with its inputs in float, quantized per 32, or per 256, and then through the kernel; each against the float run
over the held-out text of ``kvserve.quant.quality``: mean KL (nats), top-1 agreement and perplexity. The other
projections run their kernels throughout.

    python -m kvserve.loadtest requant --mix Q4_K_M /tmp/smollm2-q4_k_m.gguf
    python -m kvserve.loadtest actblocks --model /tmp/smollm2-q4_k_m.gguf --write
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.loadtest.argtypes import absolute_path
from kvserve.loadtest.errors import UsageError
from kvserve.loadtest.publish.benchmarks_md import update_section
from kvserve.quant.ggml import GGMLKind

TOKENS = 1024
K_QUANTS = (GGMLKind.Q4_K, GGMLKind.Q5_K, GGMLKind.Q6_K)  # the kinds whose kernels take one scale per 256
# (label, act block on the reference path or None for float, through the kernel)
VARIANTS = (("float inputs (the reference)", None, False), ("per 32", 32, False), ("per 256", 256, False),
            ("the kernel", None, True))


@dataclass(frozen=True)
class Row:
    """One variant of one file: its layers' count, perplexity, mean KL from the float run and top-1 agreement."""

    file: str
    variant: str
    layers: int
    perplexity: float
    kl: float
    top1: float


def measure(model: torch.nn.Module, tokenizer, name: str, tokens: int = TOKENS) -> list[Row]:
    """The rows of ``VARIANTS`` for ``model`` (transformers' forward, its GGUF layers ``GGMLLinear``) over the first
    ``tokens`` held-out tokens. Leaves every layer as it found it.

    Raises:
        UsageError: the model has no K-quant projection.
    """
    from kvserve.quant import quality
    from kvserve.quant.ggml import GGMLLinear

    layers = [m for m in model.modules() if isinstance(m, GGMLLinear) and m.kind in K_QUANTS]
    if not layers:
        raise UsageError(f"{name} has no Q4_K, Q5_K or Q6_K projection: nothing to compare")
    saved = [(m.act_block, m.use_kernel) for m in layers]
    ids = quality.heldout_ids(tokenizer, tokens)
    rows, reference, reference_top = [], None, None
    try:
        for label, block, kernel in VARIANTS:
            for m in layers:
                m.act_block, m.use_kernel = (m.kernel_act_block, True) if kernel else (block, False)
            ppl, top, logprobs = quality.heldout_scores(model, ids)
            if reference is None:
                reference, reference_top = logprobs, top
            rows.append(Row(name, label, len(layers), ppl, quality.mean_kl(reference, logprobs),
                            float((top == reference_top).float().mean())))
    finally:
        for m, (block, kernel) in zip(layers, saved):
            m.act_block, m.use_kernel = block, kernel
    return rows


def render(rows: list[Row], tokens: int) -> str:
    """The BENCHMARKS.md table of ``rows``."""
    lines = ["| file | K-quant projections' inputs | projections | perplexity | KL from float inputs (nats) | "
             "top-1 agreement |", "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.file} | {r.variant} | {r.layers} | {r.perplexity:.3f} | {r.kl:.5f} | {r.top1:.4f} |")
    return "\n".join(lines) + (
        f"\n\nThe held-out text's first {tokens} tokens in one causal window; only the file's Q4_K, Q5_K and Q6_K "
        "projections change between rows (the reference path: the file's blocks dequantized, `F.linear`, their "
        "inputs in float or quantized to int8 per 32 or per 256 values; then the kernel, which takes one scale per "
        "256 for these formats); every other projection runs its kernel throughout. The kernel differs from the "
        "per 256 row only in its sums' rounding order (a few float32 ulps per output), which the later layers' "
        "activation rounding amplifies: the two rows' distance is this measure's noise. Perplexity moves by that "
        "noise at this length; the KL is the measure.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=absolute_path, required=True, action="append",
                        help="a GGUF file with Q4_K, Q5_K or Q6_K projections (repeat for several)")
    parser.add_argument("--tokens", type=int, default=TOKENS, help="held-out tokens")
    parser.add_argument("--write", action="store_true",
                        help="also write the table into BENCHMARKS.md (section act-blocks)")


def run(args: argparse.Namespace) -> int:
    """Measure each file, print the table and (``--write``) publish it.

    Raises:
        UsageError: a file is not a .gguf file or has no K-quant projection.
    """
    from kvserve.engine.gguf_model import load_gguf
    from kvserve.engine.lean_model import LeanCausalLM, transformers_model

    rows: list[Row] = []
    for path in args.model:
        if path.suffix != ".gguf" or not path.is_file():
            raise UsageError(f"--model {str(path)!r} is not a .gguf file")
        loaded = load_gguf(path, blocks=True)
        # transformers' forward over the file's modules, so each projection runs its own GGMLLinear.forward
        model = transformers_model(loaded.model) if isinstance(loaded.model, LeanCausalLM) else loaded.model
        model.set_attn_implementation("sdpa")
        rows += measure(model, loaded.tokenizer, Path(path).name, args.tokens)
    text = render(rows, args.tokens)
    print(text)
    if args.write:
        command = "python -m kvserve.loadtest actblocks " + " ".join(f"--model {Path(m).name}" for m in args.model) \
            + (f" --tokens {args.tokens}" if args.tokens != TOKENS else "") + " --write"
        update_section("act-blocks", "What one activation scale per 256 costs K-quant files (real weights)",
                       command, text)
    return 0
