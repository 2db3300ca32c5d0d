"""``python -m kvserve.loadtest overhead``: where a served token's time and CPU go, beyond the model step.

Starts ``kvserve serve`` on 127.0.0.1, streams fixed-length greedy completions at each ``--streams``
concurrency through the load generator, and reads three things around each run:

- the server's own step counters (/metrics): ms per step inside the model runner, ms between steps (scheduling,
  applying results, waking the engine thread), and the rest of the wall time per step, which is the time no step
  ran while streams were active (the first request's arrival, the last token's trip to the client);
- CPU time per output token of the server's threads, from ``/proc/<pid>/task``: the main thread (uvicorn's
  event loop: HTTP, SSE, detokenizing, JSON) apart from all others (the engine thread, its OpenMP team, the
  tokenizer's pool);
- CPU time per output token of this process (the load generator: HTTP client, SSE parsing, timing).

On a machine with as many cores as the engine has threads, every CPU millisecond outside the engine is taken
from it: the runner's ms per step then exceeds the same step's cost in-process (``python -m kvserve.loadtest profile``
measures that step without a server). Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from kvserve.loadtest.argtypes import positive_int, positive_ints
from kvserve.loadtest.errors import UsageError
from kvserve.loadtest.loadgen import report, workloads
from kvserve.loadtest.loadgen.generator import LoadConfig, run_sync
from kvserve.loadtest.loadgen.runcmd import server_model
from kvserve.loadtest.procs.serverproc import OUT_DIR, ServerStartError, kvserve_command, launch
from kvserve.loadtest.publish.benchmarks_md import update_section
from kvserve.loadtest.served.compare import server_counters

_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of process ``pid``: ``{"main": its main thread, "other": all other threads}``.

    "other" is the whole process (``/proc/<pid>/stat``, which keeps the time of threads that have exited) minus
    the main thread, so a thread ending between two readings cannot make a difference negative.

    Raises:
        OSError: no such process, or no ``/proc`` (not Linux).
    """
    main, total = (_cpu_s(Path(f"/proc/{pid}/{where}stat")) for where in (f"task/{pid}/", ""))
    return {"main": main, "other": total - main}


def _cpu_s(stat: Path) -> float:
    text = stat.read_text()
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) ": utime and stime are fields 14 and 15
    return (int(fields[11]) + int(fields[12])) * _TICK_S


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` and every process below it: the live ones read from /proc,
    the ended ones as the kernel adds them to their parent when it reaps them (``cutime``/``cstime``). A browser
    is such a tree (a driver, the browser, its renderer and GPU processes).

    Raises:
        OSError: no process ``pid``, or no ``/proc`` (not Linux).
    """
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2:].split()
    total = sum(int(f) for f in fields[11:15]) * _TICK_S  # utime, stime, cutime, cstime
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue  # the thread ended
        for child in children:
            try:
                total += tree_cpu_s(int(child))
            except OSError:
                pass  # ended between the two reads: its time went to cutime, read already or not at all
    return total


def own_cpu_s() -> float:
    """CPU seconds (user + system) of this process, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def client_setup_cpu_s(url: str) -> float:
    """CPU seconds this process spends on a load run's fixed part: an event loop and an HTTP client set up and
    closed (``run_load`` does both once per run; httpx builds an SSL context even for http URLs)."""
    async def setup() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=None):
            pass

    start = own_cpu_s()
    asyncio.run(setup())
    return own_cpu_s() - start


@dataclass(slots=True)
class Overhead:
    """One run at ``streams`` concurrent streams. Times in ms; CPU in ms per output token."""

    streams: int
    tokens_per_s: float
    itl_ms: float                # client-measured mean inter-token latency
    runner_ms_per_step: float    # inside ModelRunner.execute
    between_ms_per_step: float   # between consecutive steps while work was left
    other_ms_per_step: float     # wall time per step in neither (no step running)
    tokens_per_step: float
    cpu_event_loop: float        # server main thread
    cpu_engine: float            # every other server thread
    cpu_client: float            # this process


def measure(url: str, pid: int, streams: int, tokens: int) -> Overhead:
    """Run ``max(streams, 4)`` completions of ``tokens`` tokens each, ``streams`` at a time, and split the run.

    Raises:
        RuntimeError: a request failed.
    """
    count = max(streams, 4)  # at 1 stream, enough tokens for the 10 ms ticks of the server's CPU times
    config = LoadConfig(url=url, concurrency=streams, count=count, duration_s=900, timeout_s=900,
                        model=server_model(url), progress=False)
    specs = workloads.fixed(count, tokens)
    client_fixed = client_setup_cpu_s(url)  # taken out of the load generator's CPU below
    # the /metrics scrapes stay outside the CPU windows (each costs the client and the event loop CPU too)
    counters0 = server_counters(url)
    threads0, client0 = thread_cpu_s(pid), own_cpu_s()
    summary = report.summarize(run_sync(specs, config, f"streams={streams}"))
    client1, threads1 = own_cpu_s(), thread_cpu_s(pid)
    counters1 = server_counters(url)
    if summary.ok != summary.sent:
        raise RuntimeError(f"streams={streams}: {summary.sent - summary.ok} of {summary.sent} requests failed")
    steps = counters1["engine_steps"] - counters0["engine_steps"]
    runner_s = counters1["engine_step_seconds"] - counters0["engine_step_seconds"]
    between_s = counters1["scheduler_loop_seconds"] - counters0["scheduler_loop_seconds"]
    per_token = 1000 / summary.output_tokens
    return Overhead(
        streams=streams, tokens_per_s=summary.tokens_per_s, itl_ms=1000 * summary.itl_mean_s,
        runner_ms_per_step=1000 * runner_s / steps, between_ms_per_step=1000 * between_s / steps,
        other_ms_per_step=1000 * (summary.wall_s - runner_s - between_s) / steps,
        tokens_per_step=summary.output_tokens / steps,
        cpu_event_loop=per_token * (threads1["main"] - threads0["main"]),
        cpu_engine=per_token * (threads1["other"] - threads0["other"]),
        cpu_client=per_token * max(0.0, client1 - client0 - client_fixed))


def split_text(rows: list[Overhead], model: str | None) -> str:
    """Where a single stream's token goes against the weights' read bound: the served ms per token (1 stream),
    the server's runner ms per step, the projections and LM head alone in this process (``ggmlbench.served_split``)
    and the read bound; "" without a 1-stream row."""
    import torch

    from kvserve.loadtest.engine import ggmlbench

    single = next((r for r in rows if r.streams == 1), None)
    if single is None:
        return ""
    alone, bound, read, nbytes = ggmlbench.served_split(model)
    served = 1000 / single.tokens_per_s
    threads = torch.get_num_threads()
    engine = single.cpu_engine / threads
    return ("| single stream, ms per token | served | runner | served engine CPU per thread | projections + LM head "
            "alone | read bound |\n|---|---:|---:|---:|---:|---:|\n"
            f"| ms | {served:.2f} | {single.runner_ms_per_step:.2f} | {engine:.2f} | {alone:.2f} | {bound:.2f} |\n"
            f"| % of the read bound | {100 * bound / served:.0f}% | {100 * bound / single.runner_ms_per_step:.0f}% | "
            f"{100 * bound / engine:.0f}% | {100 * bound / alone:.0f}% | 100% |\n\n"
            f"Served: 1000 / output tok/s at 1 stream (wall time); runner: the server's ms per step; served engine "
            f"CPU: the server's threads but the event loop, per token, over the {threads} threads (on a shared "
            "machine the figure to compare: others' turns are not in it); alone: every "
            f"projection and the LM head through its bare kernel on one row in this process, timed by CPU seconds "
            f"per thread; read bound: their {nbytes / 1e6:.0f} MB over the read bandwidth of the server's threads "
            f"measured in the same run ({read:.1f} GB/s, ``kernelbench --ggml-model``'s probe).")


def render(rows: list[Overhead], scheme: str, tokens: int) -> str:
    """The markdown table and what it means."""
    head = ("| streams | output tok/s | ITL ms (client) | runner ms/step | between steps ms | no step running ms/step "
            "| tokens/step | CPU ms/token: event loop | engine + OpenMP | load generator |")
    lines = [head, "|---" * 10 + "|"]
    for r in rows:
        lines.append(f"| {r.streams} | {r.tokens_per_s:.1f} | {r.itl_ms:.2f} | {r.runner_ms_per_step:.2f} | "
                     f"{r.between_ms_per_step:.2f} | {r.other_ms_per_step:.2f} | {r.tokens_per_step:.1f} | "
                     f"{r.cpu_event_loop:.2f} | {r.cpu_engine:.2f} | {r.cpu_client:.2f} |")
    return "\n".join(lines) + (
        f"\n\n`kvserve serve {scheme}`, greedy completions of {tokens} tokens through the load "
        "generator (same process as this command). Runner and between-steps times are the server's own counters "
        "(/metrics); \"no step running\" is the rest of the run's wall time per step. CPU per output token: the "
        "server's main thread (uvicorn's event loop: HTTP, SSE, detokenizing, JSON), its other threads (the engine "
        "thread and its OpenMP team), and the load generator (less its fixed cost: an HTTP client's setup, measured "
        "just before). The server's CPU times come in clock ticks (10 ms), so use runs of a few thousand tokens. On "
        "this machine every CPU ms outside the engine "
        "competes with its threads, so it shows up in the runner's ms per step (`python -m kvserve.loadtest profile` "
        "times the same step without a server).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quantization", default=None, choices=["none", "int8", "int4", "nf4"],
                        help="as kvserve serve --quantization (default int4 for the embedded model: the fastest "
                             "single stream here; a --model file's own weights otherwise)")
    parser.add_argument("--model", default=None,
                        help="as kvserve serve --model (e.g. a GGUF file); with a 1-stream row, the split of its "
                             "token against the projections alone and the read bound is printed too")
    parser.add_argument("--streams", type=positive_ints, default=[1, 32], help="comma list of concurrencies")
    parser.add_argument("--tokens", type=positive_int, default=128, help="output tokens per request")
    parser.add_argument("--no-write", action="store_true")


def run(args: argparse.Namespace) -> int:
    if not Path("/proc/self/task").is_dir():
        raise UsageError("overhead reads per-thread CPU time from /proc: Linux only")
    quantization = args.quantization or ("int4" if args.model is None else None)
    flags = (["--quantization", quantization] if quantization else []) + (["--model", args.model] if args.model else [])
    scheme = " ".join(flags)
    command = kvserve_command([*flags, "--max-num-seqs", str(max(args.streams))])
    try:
        with launch(command, name="overhead") as server:
            measure(server.url, server.pid, 2, 16)  # warm-up: first requests pay one-time costs
            rows = [measure(server.url, server.pid, streams, args.tokens) for streams in args.streams]
    except (ServerStartError, RuntimeError, OSError) as exc:
        print(f"overhead: {exc}", file=sys.stderr)
        return 1
    text = render(rows, scheme, args.tokens)
    if args.model is not None:
        split = split_text(rows, args.model)
        text += "\n\n" + split if split else ""
    print(text)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "overhead.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    if not args.no_write:
        key = quantization or Path(args.model).stem
        flags = scheme + ("" if args.streams == [1, 32] else f" --streams {','.join(map(str, args.streams))}") \
            + ("" if args.tokens == 128 else f" --tokens {args.tokens}")  # the command that reruns this table
        update_section(f"overhead-{key}", f"Serving overhead: a served token beyond the model step ({key} weights)",
                       f"python -m kvserve.loadtest overhead {flags}", text)
    return 0
