"""``python -m kvserve.loadtest prefill``: what attending every prefill row as a decode row costs.

Where the C++ paged attention runs (float32 activations and pool on CPU), every token attends through it, one
query row at a time in block order (engine/runner.py ``_rows_alone``), so that a row's bits never depend on how
its prompt was cut into chunks. The alternative is SDPA over each prefill span, faster on long prompts but not
chunk-invariant. This command times whole-prompt prefills of the served default (the GGUF's own blocks) both
ways, side by side: rounds alternate the two, each size's median over the rounds is kept, and the ratio is
what to read (the machine may be shared).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

SIZES = (128, 512, 2048)


def _prefill_seconds(loaded, tokens: int, rows_alone: bool) -> float:
    """Wall seconds of one step that prefills a ``tokens``-token prompt from position 0 (no sampling)."""
    from kvserve.engine.plan import SamplingParams, SeqWork, StepPlan
    from kvserve.engine.runner import ModelRunner
    from kvserve.kvcache.pool import KVPool

    block = 16
    pool = KVPool(loaded.kv_shape(), tokens // block + 1, block, loaded.dtype, loaded.device)
    runner = ModelRunner(loaded, pool)
    runner.rows_alone = rows_alone
    ids = [1000 + (7 * i) % 40000 for i in range(tokens)]
    table = list(range(tokens // block + 1))
    work = SeqWork(0, ids, 0, table, list(range(tokens)), False, SamplingParams(temperature=0.0), ids, [])
    started = time.perf_counter()
    runner.execute(StepPlan([work]))
    return time.perf_counter() - started


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per size (the median is kept)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")


@torch.inference_mode()
def run(args: argparse.Namespace) -> int:
    from kvserve import native
    from kvserve.engine import weights
    from kvserve.engine.loader import Device, DType, load_model
    from kvserve.loadtest.publish.benchmarks_md import update_section
    from kvserve.quant.options import Scheme

    loaded = load_model(None, DType.AUTO, Device.CPU, quantized=True, blocks=True)
    weights.apply(loaded, Scheme.GGUF, None)
    times: dict[tuple[int, bool], list[float]] = {}
    for size in SIZES:
        _prefill_seconds(loaded, size, True)  # warm-up
        for _ in range(args.rounds):
            for alone in (False, True):
                times.setdefault((size, alone), []).append(_prefill_seconds(loaded, size, alone))
    rows = ["| prompt tokens | SDPA spans (s) | every row as a decode row (s) | ratio |", "|---:|---:|---:|---:|"]
    for size in SIZES:
        sdpa, alone = (statistics.median(times[(size, a)]) for a in (False, True))
        rows.append(f"| {size} | {sdpa:.3f} | {alone:.3f} | {alone / sdpa:.2f}x |")
    body = (f"The served default (the GGUF's own Q4_1/Q8_0 blocks, kernels {native.isa()}), one whole-prompt "
            f"prefill step, median of {args.rounds} alternating rounds; ratio > 1: the chunk-invariant attention "
            "costs that much more TTFT.\n\n" + "\n".join(rows))
    print(body)
    if not args.no_write:
        update_section("prefill-attention", "Prefill attention: every row as a decode row, against SDPA spans",
                       "python -m kvserve.loadtest prefill", body)
    return 0
