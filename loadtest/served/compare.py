"""``python -m kvserve.loadtest compare``: kvserve's static vs continuous batching on seed64, measured and simulated.

Starts ``kvserve serve --scheduler static --max-num-seqs 8`` on a free 127.0.0.1 port, sends all 64 seed64
requests at once (each pinned to its length), stops it, then does the same with ``--scheduler continuous``.
Prints wall time, output tokens/s, mean and p99 end-to-end latency and mean TTFT of each, the ratios, and the
ratios that ``simulate`` predicts from step costs measured on the engine (before the first run and after the
last, averaged); the two must agree within 15%.
Writes the ``compare`` section of BENCHMARKS.md and ``loadtest/out/compare.json`` / ``compare-latency.png``.

    flock /tmp/kvserve-cpu.lock python -m kvserve.loadtest compare
"""

from __future__ import annotations

import argparse
import shlex
import statistics

import httpx
from prometheus_client.parser import text_string_to_metric_families
from pathlib import Path

from kvserve.loadtest.argtypes import QUANTIZATIONS, positive_int
from kvserve.loadtest.loadgen import report, workloads
from kvserve.loadtest.loadgen.generator import LoadConfig, Mode, RunResult, run_sync
from kvserve.loadtest.loadgen.runcmd import server_model
from kvserve.loadtest.procs.serverproc import kvserve_command, launch
from kvserve.loadtest.publish.benchmarks_md import BENCHMARKS, update_section
from kvserve.loadtest.sim import simulate

POLICIES = ("static", "continuous")
TOLERANCE = 0.15  # measured ratio within 15% of the simulated one
CHECKED = ("throughput", "mean_e2e")


def measured_ratios(static: report.Summary, continuous: report.Summary) -> dict[str, float]:
    """Continuous over static, the same keys as ``simulate.ratios`` (less batch return, which needs groups)."""
    return {"throughput": continuous.tokens_per_s / static.tokens_per_s,
            "mean_e2e": static.e2e_mean_s / continuous.e2e_mean_s,
            "p99_e2e": static.e2e_p99_s / continuous.e2e_p99_s,
            "mean_ttft": static.ttft_mean_s / continuous.ttft_mean_s}


def agreement(measured: dict[str, float], simulated: dict[str, float]) -> dict[str, float]:
    """Relative error of each checked measured ratio against the simulated one (0.1 = 10%)."""
    return {key: abs(measured[key] / simulated[key] - 1) for key in CHECKED}


SERVER_COUNTERS = ("engine_steps", "engine_step_seconds", "scheduler_loop_seconds")


def server_counters(url: str) -> dict[str, float]:
    """The server's own step counters from /metrics: steps, seconds inside the runner, seconds between steps.

    Empty for a server without them (``--server-cmd`` may name any OpenAI-compatible server).
    """
    response = httpx.get(url + "/metrics", timeout=10)
    values: dict[str, float] = {}
    if response.status_code != 200:
        return values
    try:
        for family in text_string_to_metric_families(response.text):
            name = family.name.removeprefix("kvserve:")
            if name in SERVER_COUNTERS and family.samples:
                values[name] = family.samples[0].value
    except ValueError:  # not Prometheus text
        return {}
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--slots", type=positive_int, default=8, help="--max-num-seqs of both servers")
    parser.add_argument("--server-cmd", default=None,
                        help="server command with {port} (default: kvserve serve); --scheduler and "
                             "--max-num-seqs are appended")
    parser.add_argument("--server-args", default="", help="extra flags for both servers, e.g. '--kv-cache-memory 1GiB'")
    parser.add_argument("--model", default=None, help="--model of both servers and of the simulator's engine")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="--device of both servers and of the simulator's engine")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="--dtype of both servers and of the simulator's engine")
    parser.add_argument("--quantization", default="auto", choices=QUANTIZATIONS,
                        help="--quantization of both servers and of the simulator's engine (default auto: the server's)")
    parser.add_argument("--section", default=None,
                        help="BENCHMARKS.md section to write (default: compare, compare-cuda on a GPU, "
                             "compare-int4 etc. with --quantization)")
    parser.add_argument("--flat-sim", action="store_true", help="simulate with a flat step cost (no engine)")
    parser.add_argument("--reps", type=positive_int, default=3, help="timed repetitions per step mix for the simulator")
    parser.add_argument("--timeout", type=float, default=900.0, help="limit per run (s)")
    parser.add_argument("--out", type=Path, default=report.OUT_DIR,
                        help="directory for compare.json, the latency plot and both servers' logs")
    parser.add_argument("--benchmarks", type=Path, default=BENCHMARKS, help="BENCHMARKS.md to update")
    parser.add_argument("--img", type=Path, default=None, help="also save the latency plot here (e.g. docs/img)")
    parser.add_argument("--no-write", action="store_true", help="do not touch BENCHMARKS.md")
    parser.add_argument("--no-progress", action="store_true")


def _measure_costs(args: argparse.Namespace, prompt_len: int) -> dict[tuple[int, int], float] | None:
    """Engine step costs (s) for every mix of prefills and decodes (None with ``--flat-sim``)."""
    if args.flat_sim:
        return None
    return simulate.measure_step_costs(args.slots, prompt_len, prompt_len + 32, args.reps, args.model, args.device,
                                       args.dtype, args.quantization)


def step_cost(before: dict[tuple[int, int], float] | None, after: dict[tuple[int, int], float] | None,
              prompt_len: int, reps: int) -> tuple[simulate.StepCost, str, dict[str, float]]:
    """The simulator's step cost, a sentence on it, and the costs used (ms) by "prefills,decodes".

    ``before`` and ``after`` are the step costs (s) measured before the first served run and after the last;
    the simulator uses their mean, so a machine whose speed drifts during the runs is priced at its mean speed
    over them rather than at its speed in the minute before. Either None: a flat step cost.
    """
    if before is None or after is None:
        return simulate.flat_cost, "flat step cost", {}
    costs = {mix: (before[mix] + after[mix]) / 2 for mix in before}
    drift = statistics.median(after[mix] / before[mix] for mix in before)
    how = (f"engine step costs measured for every mix of prefills ({prompt_len}-token prompts) and decodes "
           f"(median of {reps}, round-robin) before the served runs and again after them, and their mean used "
           f"as measured (after / before: {drift:.2f}, median over the mixes); for scale, a least-squares line "
           f"through them is {simulate.describe_fit(simulate.fit_cost(costs))}")
    return simulate.grid_cost(costs), how, {f"{p},{d}": 1000 * t for (p, d), t in costs.items()}


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The ``--model``/``--device``/``--dtype`` flags the servers get (only those given), and ``--quantization``."""
    flags = ["--model", args.model] if args.model else []
    flags += ["--device", args.device] if args.device != "auto" else []
    flags += ["--dtype", args.dtype] if args.dtype != "auto" else []
    return flags + ["--quantization", args.quantization]


def section_and_title(device: str, quantization: str) -> tuple[str, str]:
    """BENCHMARKS.md section and title for a run: one section per device and weight scheme."""
    suffixes = ([] if device == "cpu" else [device]) + ([] if quantization == "auto" else [quantization])
    title = "Static vs continuous batching (seed64, 8 slots" + ("" if quantization == "auto" else
                                                                f", {quantization} weights") + ")"
    return "-".join(["compare", *suffixes]), title + ("" if device == "cpu" else f" on {device}")


def admission_order(run: RunResult) -> list[int]:
    """Request indices in the order the server admitted them (its queue is FIFO, so: arrival order).

    From kvserve's own queue time when the server reports it, else from the first token.
    """
    def admitted_at(record) -> tuple[float, int]:
        if record.server_queue_ms is not None:
            wait = record.server_queue_ms / 1000
        else:
            wait = record.ttft_s if record.ttft_s is not None else record.e2e_s
        return record.start_s + wait, record.index
    return [record.index for record in sorted(run.records, key=admitted_at)]


def run(args: argparse.Namespace) -> int:
    from kvserve.loadtest.engine.enginebench import check_engine_flags, check_out_dir

    check_engine_flags(args.model, args.device)
    check_out_dir(args.out)
    specs = workloads.seed64()
    lengths = [s.max_tokens for s in specs]
    prompt_len = 0 if args.flat_sim else simulate.seed64_prompt_len(args.model)
    before = _measure_costs(args, prompt_len)
    base = shlex.split(args.server_cmd) if args.server_cmd else kvserve_command([])
    runs: list[RunResult] = []
    counters: dict[str, dict[str, float]] = {}
    for policy in POLICIES:
        command = base + ["--scheduler", policy, "--max-num-seqs", str(args.slots), *engine_flags(args),
                          *shlex.split(args.server_args)]
        with launch(command, name=f"compare-{policy}", log_dir=args.out) as server:
            config = LoadConfig(url=server.url, mode=Mode.CLOSED, concurrency=len(specs), count=len(specs),
                                duration_s=args.timeout, timeout_s=args.timeout, model=server_model(server.url),
                                progress=not args.no_progress)
            runs.append(run_sync(specs, config, policy))
            counters[policy] = server_counters(server.url)
    cost, how, costs_ms = step_cost(before, _measure_costs(args, prompt_len), prompt_len, args.reps)
    orders = tuple(admission_order(r) for r in runs)
    sims = dict(zip(POLICIES, simulate.run_both(lengths, args.slots, cost, orders)))
    simulate.print_results(sims["static"], sims["continuous"])
    simulated = simulate.ratios(sims["static"], sims["continuous"])
    static, continuous = (report.summarize(r) for r in runs)
    report.print_table([static, continuous])
    measured = measured_ratios(static, continuous)
    errors = agreement(measured, simulated)
    ok = all(e <= TOLERANCE for e in errors.values()) and static.ok == continuous.ok == len(specs)
    for key in measured:
        print(f"{key:>10}: measured {measured[key]:.2f}x  simulated {simulated[key]:.2f}x")
    steps = step_table(sims, counters)
    print(steps)
    print(f"agreement within {TOLERANCE:.0%} on {', '.join(CHECKED)}: {'yes' if ok else 'NO'} "
          f"({', '.join(f'{k} {100 * v:.1f}%' for k, v in errors.items())})")
    paths = [report.write_json(runs, args.out / "compare.json", {"simulated": simulated, "measured": measured,
                                                                    "step_costs_ms": costs_ms,
                                                                    "server_counters": counters,
                                                                    "admission_orders": dict(zip(POLICIES, orders))}),
             report.plot_latency_cdfs(runs, args.out / "compare-latency.png", "seed64, 8 slots: static vs continuous")]
    if args.img:
        paths.append(report.plot_latency_cdfs(runs, args.img / "compare-latency.png",
                                              "seed64, 8 slots: static vs continuous"))
    print("wrote", *paths)
    if not args.no_write:
        from kvserve.engine.loader import Device, resolve_device

        device = resolve_device(Device(args.device)).type
        section, title = section_and_title(device, args.quantization)
        section = args.section or section
        update_section(section, title, " ".join(["python -m kvserve.loadtest compare", *engine_flags(args)])
                       + (f" --server-args '{args.server_args}'" if args.server_args else ""),
                       _markdown(static, continuous, measured, simulated, errors, ok, how, args.img, steps),
                       args.benchmarks, per_kernel_path=device == "cpu")
    return 0 if ok else 2


def step_table(sims: dict[str, simulate.SimResult], counters: dict[str, dict[str, float]]) -> str:
    """Markdown: steps and mean step time, simulated vs what each server counted (where they part ways)."""
    rows = ["| policy | steps simulated | steps served | ms/step simulated | ms/step in the runner (served) "
            "| ms between steps (served) |", "|---|---|---|---|---|---|"]
    for policy, sim in sims.items():
        c = counters.get(policy, {})
        served = c.get("engine_steps", 0) or float("nan")
        rows.append(f"| {policy} | {sim.steps} | {served:.0f} | {1000 * sim.wall_s / sim.steps:.1f} "
                    f"| {1000 * c.get('engine_step_seconds', float('nan')) / served:.1f} "
                    f"| {1000 * c.get('scheduler_loop_seconds', float('nan')) / served:.2f} |")
    return "\n".join(rows)


def _markdown(static: report.Summary, continuous: report.Summary, measured: dict, simulated: dict,
              errors: dict, ok: bool, how: str, img: Path | None, steps: str) -> str:
    rows = ["| policy | wall s | output tok/s | mean e2e s | p99 e2e s | mean TTFT s |", "|---|---|---|---|---|---|"]
    for s in (static, continuous):
        rows.append(f"| {s.label} | {s.wall_s:.1f} | {s.tokens_per_s:.1f} | {s.e2e_mean_s:.2f} | {s.e2e_p99_s:.2f} "
                    f"| {s.ttft_mean_s:.2f} |")
    rows += ["", "| continuous vs static | measured | simulated |", "|---|---|---|"]
    rows += [f"| {key} | {measured[key]:.2f}x | {simulated[key]:.2f}x |" for key in measured]
    rows += ["", steps]
    text = "\n".join(rows) + (
        f"\n\nAll 64 requests sent at once, each pinned to its length ({static.output_tokens} output tokens). "
        f"Simulator: {how}; each policy is replayed in the order its server admitted the requests (64 requests "
        f"sent at once reach a server in no fixed order). Measured vs simulated within {TOLERANCE:.0%} on "
        f"{', '.join(CHECKED)}: "
        f"**{'yes' if ok else 'no'}** ({', '.join(f'{k} off by {100 * v:.1f}%' for k, v in errors.items())}).")
    if img is not None:
        text += f"\n\n![latency CDFs]({img.as_posix()}/compare-latency.png)"
    return text
