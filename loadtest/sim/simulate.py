"""``python -m kvserve.loadtest simulate``: replay seed64 through static and continuous batching in a discrete-step model.

The model (Yu et al., Orca, OSDI 2022, iteration-level scheduling; the chapter's static-vs-continuous example):
all requests arrive at t = 0 in file order; a step costs ``cost(prefills, decodes)`` seconds; in one step
every admitted request that has not started is prefilled and samples its first token, and every running
one decodes one token. A request of length n therefore runs 1 prefill step + (n - 1) decode steps. The steps are
planned by kvserve's own scheduler, through the engine core and its offline runner (``scheduler.offline``), on a
stand-in model that charges each step's cost to a clock: the policies replayed are the ones served.

- static: when nothing runs, admit the next ``slots`` requests; admit nobody else until all of them end.
  A member's slot idles once it is done, and its response ends with the group's (kvserve holds each
  member's final event until the group ends, as ``generate`` returns a batch at once): its e2e is the
  group's end.
- continuous: before every step, fill every free slot from the queue.

The step cost comes from the real engine (``engine.runner.ModelRunner``), measured for every
(prefills, decodes) mix with ``prefills + decodes <= slots`` (timed round-robin, median of ``--reps``) and
used as measured; ``--flat`` uses 1 s per step instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvserve.engine.plan import SamplingParams, SeqResult, StepPlan, TokenLogprob
from kvserve.kvcache.block_manager import BlockManager
from kvserve.loadtest.argtypes import positive_int
from kvserve.loadtest.loadgen import report, workloads
from kvserve.scheduler.contract import EngineRequest, StepOutput
from kvserve.scheduler.core import EngineCore
from kvserve.scheduler.offline import run_offline
from kvserve.scheduler.policies import Policy
from kvserve.scheduler.scheduler import Scheduler, SchedulerConfig

StepCost = Callable[[int, int], float]  # (prefills, decodes) -> seconds


@dataclass(slots=True, frozen=True)
class SimResult:
    """Predicted figures of one policy (times in s, throughput in tokens/s)."""

    policy: str
    steps: int
    wall_s: float
    tokens_per_s: float
    e2e_mean_s: float
    e2e_p99_s: float
    ttft_mean_s: float
    e2e_s: tuple[float, ...]


def simulate(lengths: list[int], slots: int, static: bool, cost: StepCost, order: list[int] | None = None) -> SimResult:
    """Run the step model over requests of the given output lengths (tokens), all arriving at t = 0.

    Args:
        lengths: output tokens of each request.
        slots: sequences per step.
        static: static batching (else continuous).
        cost: seconds per step for (prefills, decodes).
        order: queue order of the requests (default: as listed). Requests sent "at once" over HTTP reach a
            server in no fixed order, and which request is admitted last decides the tail, so ``compare``
            replays the order each server actually admitted.

    Raises:
        ValueError: a length below 1, fewer than one slot, or an order that is not a permutation.
    """
    if slots < 1 or any(n < 1 for n in lengths):
        raise ValueError("need slots >= 1 and every length >= 1")
    queue = list(range(len(lengths))) if order is None else list(order)
    if sorted(queue) != list(range(len(lengths))):
        raise ValueError("order must list every request once")
    # the real scheduler, on a stand-in model: one-token prompts, so a request's first step computes its prompt and
    # samples its first token (a prefill), and each later step one more (a decode); the clock advances by the cost
    # of each step's mix
    config = SchedulerConfig(max_num_seqs=slots, max_num_batched_tokens=2 * slots, max_model_len=max(lengths) + 2,
                             policy=Policy.STATIC if static else Policy.CONTINUOUS)
    blocks = BlockManager(slots * (max(lengths) + 2) + 1, 1, enable_prefix_caching=False)
    clock = [0.0]
    ttft = [0.0] * len(lengths)
    e2e = [0.0] * len(lengths)

    def execute(plan: StepPlan) -> list[SeqResult]:
        prefills = [w.seq_id for w in plan.work if not w.is_decode]
        clock[0] += cost(len(prefills), len(plan.work) - len(prefills))
        for request_id in prefills:  # its first token is computed now (a static server may hold it back)
            ttft[request_id] = clock[0]
        return [SeqResult(w.seq_id, [TokenLogprob(1, 0.0)]) for w in plan.work]

    def timed(_step: int, out: StepOutput) -> None:
        for output in out.outputs:
            if output.finished:  # static batching releases a group's final outputs together, at its end
                e2e[output.request_id] = clock[0]

    greedy = SamplingParams(temperature=0.0)
    requests = [EngineRequest(request_id=r, prompt_ids=[1], params=greedy, max_tokens=lengths[r]) for r in queue]
    run = run_offline(EngineCore(Scheduler(config, blocks), execute, timed=False), {0: requests}, on_step=timed)
    p99 = float(np.percentile(e2e, 99))  # same definition as the load report's p99
    return SimResult("static" if static else "continuous", len(run.records), clock[0], sum(lengths) / clock[0],
                     statistics.fmean(e2e), p99, statistics.fmean(ttft), tuple(e2e))


def ratios(static: SimResult, continuous: SimResult) -> dict[str, float]:
    """Continuous over static: throughput gain and how many times lower the mean latencies are."""
    return {"throughput": continuous.tokens_per_s / static.tokens_per_s,
            "mean_e2e": static.e2e_mean_s / continuous.e2e_mean_s,
            "p99_e2e": static.e2e_p99_s / continuous.e2e_p99_s,
            "mean_ttft": static.ttft_mean_s / continuous.ttft_mean_s}


def flat_cost(_prefills: int, _decodes: int) -> float:
    """One second per step, whatever the batch: the ideal the chapter computes by hand."""
    return 1.0


def measure_step_costs(slots: int, prompt_len: int, context_len: int, reps: int = 5, model: str | None = None,
                       device: str = "auto", dtype: str = "auto",
                       quantization: str = "auto") -> dict[tuple[int, int], float]:
    """Median engine step time (s) for every (prefills, decodes) with 1 <= prefills + decodes <= slots.

    Prefills are ``prompt_len`` tokens each; decodes attend to a real cache of ``context_len`` tokens. The
    model is loaded as ``kvserve serve --model MODEL --device DEVICE --dtype DTYPE --quantization Q`` would
    load it.
    """
    from kvserve.engine.loader import Device, DType
    from kvserve.loadtest.engine.enginebench import EngineBench, dummy_ids, load_served

    loaded, _ = load_served(quantization, DType(dtype), model, Device(device))
    bench = EngineBench(loaded, num_seqs=2 * slots, max_len=max(prompt_len, context_len) + 1)
    for s in range(slots):
        bench.fill(slots + s, context_len)
    mixes = [(p, d) for p in range(slots + 1) for d in range(slots + 1 - p) if p + d]
    plans = [[bench.prefill(s, dummy_ids(prompt_len, 1000 + s)) for s in range(p)]
             + [bench.decode(slots + s, context_len) for s in range(d)] for p, d in mixes]
    # round-robin over every mix, so a slow spell on a shared machine lands on all of them alike
    return dict(zip(mixes, bench.time_plans(plans, reps=reps)))


def fit_cost(costs: dict[tuple[int, int], float]) -> tuple[float, float, float]:
    """Least-squares fit ``cost = base + per_prefill * prefills + per_decode * decodes`` (s) to a measured grid.

    One step is one forward pass: a fixed part (weights streamed once, Python and kernel launches) plus a
    part per sequence; the fit smooths the noise of single grid points on a shared machine.
    """
    keys = sorted(costs)
    design = np.array([[1.0, p, d] for p, d in keys])  # [points, 3]
    target = np.array([costs[k] for k in keys])  # [points]
    base, per_prefill, per_decode = np.linalg.lstsq(design, target, rcond=None)[0]
    return float(base), float(per_prefill), float(per_decode)


def grid_cost(costs: dict[tuple[int, int], float]) -> StepCost:
    """The measured grid itself as the step cost: every (prefills, decodes) mix the simulator can produce was
    timed, and step time is not linear in the batch (1 decode ~55 ms, 8 decodes ~115 ms on this CPU), so a
    line would misprice the one-request tail steps that both policies end with."""
    return lambda prefills, decodes: costs[(prefills, decodes)]


def linear_cost(base: float, per_prefill: float, per_decode: float) -> StepCost:
    """The fitted model as a step-cost function."""
    return lambda prefills, decodes: base + per_prefill * prefills + per_decode * decodes


def seed64_prompt_len(model: str | None = None) -> int:
    """Mean prompt length of seed64 in tokens of ``model``'s tokenizer (default: the embedded SmolLM2)."""
    from transformers import AutoTokenizer

    from kvserve.engine.loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(model))
    lengths = [len(tokenizer(spec.prompt)["input_ids"]) for spec in workloads.seed64()]
    return round(statistics.fmean(lengths))


def describe_fit(fit: tuple[float, float, float]) -> str:
    base, per_prefill, per_decode = fit
    return (f"step = {1000 * base:.1f} ms + {1000 * per_prefill:.1f} ms per prefill "
            f"+ {1000 * per_decode:.1f} ms per decode")


def run_both(lengths: list[int], slots: int, cost: StepCost,
             orders: tuple[list[int] | None, list[int] | None] = (None, None)) -> tuple[SimResult, SimResult]:
    """Static and continuous runs of the step model (each with its own queue order, default as listed)."""
    return simulate(lengths, slots, True, cost, orders[0]), simulate(lengths, slots, False, cost, orders[1])


def print_results(static: SimResult, continuous: SimResult) -> None:
    for r in (static, continuous):
        print(f"{r.policy:>10}: {r.steps} steps, wall {r.wall_s:.2f} s, {r.tokens_per_s:.1f} tok/s, "
              f"e2e mean {r.e2e_mean_s:.2f} s p99 {r.e2e_p99_s:.2f} s, ttft mean {r.ttft_mean_s:.2f} s")
    print("ratios (continuous vs static):", ", ".join(f"{k} {v:.2f}x" for k, v in ratios(static, continuous).items()))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--slots", type=positive_int, default=8, help="--max-num-seqs of both servers")
    parser.add_argument("--flat", action="store_true", help="1 s per step instead of measured costs")
    parser.add_argument("--reps", type=positive_int, default=5, help="timed repetitions per step mix")
    parser.add_argument("--out", type=Path, default=report.OUT_DIR / "simulate.json")


def run(args: argparse.Namespace) -> int:
    lengths = workloads.seed64_lengths()
    if args.flat:
        costs = None
        static, continuous = run_both(lengths, args.slots, flat_cost)
    else:
        prompt_len = seed64_prompt_len()
        costs = measure_step_costs(args.slots, prompt_len, prompt_len + 32, args.reps)
        print(f"measured step costs (prompt {prompt_len} tokens, decode context {prompt_len + 32}):")
        for (p, d), seconds in sorted(costs.items()):
            if p in (0, 1, args.slots) or d == 0:
                print(f"  prefills {p} decodes {d}: {1000 * seconds:.1f} ms")
        print(f"for reference, a least-squares line: {describe_fit(fit_cost(costs))}")
        static, continuous = run_both(lengths, args.slots, grid_cost(costs))
    print_results(static, continuous)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "slots": args.slots, "ratios": ratios(static, continuous),
        "costs_ms": {f"{p},{d}": 1000 * s for (p, d), s in (costs or {}).items()},
        "static": _plain(static), "continuous": _plain(continuous)}, indent=1))
    print("wrote", args.out)
    return 0


def _plain(result: SimResult) -> dict:
    return {name: getattr(result, name) for name in SimResult.__slots__ if name != "e2e_s"}
