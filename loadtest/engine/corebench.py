"""The engine core's own cost per decode step, without a model: planning, applying results and building outputs.

``python -m kvserve.loadtest corestep`` runs ``EngineCore.step`` over a stand-in model that samples one token per
sequence at no cost, for B sequences decoding with C tokens of context each, and times the steps (median of
``--steps``). What it shows: the Python around the model per step, per batch size, and that it does not grow with
the context (the contract carries only what changed, and nothing inside the core copies the context). Prints the
table and writes BENCHMARKS.md's "corestep" section.
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvserve.engine.plan import SamplingParams, SeqResult, StepPlan, TokenLogprob
from kvserve.kvcache.block_manager import BlockManager
from kvserve.loadtest.argtypes import positive_int, positive_ints
from kvserve.loadtest.publish.benchmarks_md import update_section
from kvserve.scheduler.contract import EngineRequest
from kvserve.scheduler.core import EngineCore
from kvserve.scheduler.scheduler import Scheduler, SchedulerConfig

_BLOCK_SIZE = 16


def _no_model(plan: StepPlan) -> list[SeqResult]:
    """Token 7 for every sequence that samples, at no cost."""
    return [SeqResult(w.seq_id, [TokenLogprob(7, -0.5)] if w.sample else []) for w in plan.work]


def step_us(batch: int, context: int, steps: int) -> float:
    """Median microseconds of one decode step of ``batch`` sequences with ``context`` tokens cached each."""
    blocks = batch * (-(-(context + steps + 8) // _BLOCK_SIZE)) + 1
    config = SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(batch, 2048),
                             max_model_len=context + steps + 16)
    core = EngineCore(Scheduler(config, BlockManager(blocks, _BLOCK_SIZE, enable_prefix_caching=True)), _no_model,
                      timed=False)
    greedy = SamplingParams(temperature=0.0)
    for seq in range(batch):  # distinct prompts: no prefix-cache hit shortens a prefill
        core.add(EngineRequest(request_id=seq, prompt_ids=[(seq * 7919 + i) % 30000 + 10 for i in range(context)],
                               params=greedy, max_tokens=steps + 4))
    while any(seq.num_uncomputed > 1 for seq in core.scheduler.running) or core.scheduler.waiting:
        core.step()  # the prompts, in chunks of the budget
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=positive_ints, default=[1, 32], help="comma list of batch sizes")
    parser.add_argument("--context", type=positive_ints, default=[100, 4000], help="comma list of context lengths")
    parser.add_argument("--steps", type=positive_int, default=200, help="timed decode steps per cell")
    parser.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")


def run(args: argparse.Namespace) -> int:
    header = "| sequences | " + " | ".join(f"{c:,} tokens of context" for c in args.context) + " |"
    rows = [header, "|---" * (len(args.context) + 1) + "|"]
    for batch in args.batch:
        cells = [step_us(batch, context, args.steps) for context in args.context]
        rows.append(f"| {batch} | " + " | ".join(f"{us:.0f} us" for us in cells) + " |")
    text = "\n".join(rows) + (
        f"\n\nMedian wall time of `EngineCore.step()` over {args.steps} decode steps with a stand-in model that "
        "samples at no cost: the scheduler's planning, applying the results (stop checks, prefix-cache hashing of "
        "newly full blocks) and the outputs and step record, per step. A row's cells are equal within noise: what "
        "crosses the contract, and what the core reads, does not grow with the context (tests/test_core.py checks "
        "the allocations).")
    print(text)
    if not args.no_write:
        update_section("corestep", "The engine core's cost per step, by context length",
                       "python -m kvserve.loadtest corestep", text)
    return 0
