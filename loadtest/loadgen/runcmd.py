"""``python -m kvserve.loadtest run``: drive a workload at any OpenAI-compatible server and report.

    python -m kvserve.loadtest run --url http://127.0.0.1:8000 --workload seed64 --concurrency 64
    python -m kvserve.loadtest run --url http://127.0.0.1:8000 --workload fixed --max-tokens 128 --concurrency 1,8,32
    python -m kvserve.loadtest run --url http://127.0.0.1:8000 --workload chat --mode open --rate 2 --duration 60

Several ``--concurrency`` levels (closed loop) or ``--rate`` values (open loop) run one after another.
Writes ``<out>/<label>.json`` (summaries and per-request records), ``<label>-latency.png`` (CDFs per run)
and, for a sweep, ``<label>-throughput.png``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import httpx

from kvserve.loadtest.argtypes import positive_float, positive_floats, positive_int, positive_ints
from kvserve.loadtest.loadgen import report, workloads
from kvserve.loadtest.loadgen.generator import LoadConfig, Mode, RunResult, run_sync


def server_model(url: str, api_key: str | None = None) -> str:
    """The first model id the server lists at /v1/models, or "default" if it lists none."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        data = httpx.get(f"{url}/v1/models", headers=headers, timeout=10).json().get("data") or []
    except (httpx.HTTPError, ValueError):
        return "default"
    return data[0]["id"] if data else "default"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    parser.add_argument("--workload", type=workloads.WorkloadName, choices=list(workloads.WorkloadName),
                        default=workloads.WorkloadName.SEED64,
                        metavar="{" + ",".join(w.value for w in workloads.WorkloadName) + "}")
    parser.add_argument("--count", type=positive_int, default=None, help="requests per run (default: the workload once)")
    parser.add_argument("--max-tokens", type=positive_int, default=128, help="output length of the fixed workload")
    parser.add_argument("--mode", type=Mode, choices=list(Mode), default=Mode.CLOSED,
                        metavar="{" + ",".join(m.value for m in Mode) + "}")
    parser.add_argument("--concurrency", type=positive_ints, default=[8], help="closed-loop users; a comma list runs a sweep")
    parser.add_argument("--rate", type=positive_floats, default=[4.0], help="open-loop arrivals/s; a comma list runs a sweep")
    parser.add_argument("--duration", type=positive_float, default=600.0, help="stop sending after this many seconds")
    parser.add_argument("--timeout", type=positive_float, default=300.0, help="per-request limit (s)")
    parser.add_argument("--model", default=None, help="model name (default: the server's first)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--label", default="run", help="name of the output files")
    parser.add_argument("--out", type=Path, default=report.OUT_DIR, help="output directory")
    parser.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    model = args.model or server_model(args.url, args.api_key)
    specs = workloads.build(args.workload, args.count if args.workload is not workloads.WorkloadName.SEED64
                            else None, args.max_tokens)
    levels = args.concurrency if args.mode is Mode.CLOSED else args.rate
    runs: list[RunResult] = []
    for level in levels:
        config = LoadConfig(url=args.url, mode=args.mode, model=model, count=args.count, duration_s=args.duration,
                            timeout_s=args.timeout, api_key=args.api_key, progress=not args.no_progress,
                            **({"concurrency": level} if args.mode is Mode.CLOSED else {"rate": level}))
        name = f"{args.workload.value} c={level}" if args.mode is Mode.CLOSED else f"{args.workload.value} r={level}/s"
        runs.append(run_sync(specs, config, name))
    summaries = [report.summarize(r) for r in runs]
    report.print_table(summaries)
    for line in report.error_lines(runs):
        print("failed:", line)
    paths = [report.write_json(runs, args.out / f"{args.label}.json"),
             report.plot_latency_cdfs(runs, args.out / f"{args.label}-latency.png", f"{args.label}: latency")]
    if len(runs) > 1 and args.mode is Mode.CLOSED:
        paths.append(report.plot_throughput({args.label: [(lvl, s.tokens_per_s) for lvl, s in zip(levels, summaries)]},
                                            args.out / f"{args.label}-throughput.png"))
    print("wrote", *paths)
    return 0 if all(s.ok for s in summaries) else 1
