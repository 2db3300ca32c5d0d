"""``python -m kvserve.loadtest ui``: serving throughput with the live page open, against without it.

Starts ``kvserve serve`` on 127.0.0.1 and runs one steady load (``--streams`` concurrent greedy completions of
``--tokens`` tokens, refilled as they end, for ``--duration`` seconds) while a viewer process opens and closes
the page every ``--switch`` seconds. Comparing each open window with the closed windows on either side of it
cancels what drifts slower than a few seconds (a neighbour's load, the clock of a shared VM): on a shared 2-core
machine two whole runs of the same load a minute apart differ by 10-20%, which no 2% figure survives.

The viewer:

- ``stream``: a reader of the page's event stream (/ui/events) that parses every snapshot: the server's side of
  an open page, as when the browser runs on another machine (the reader's own CPU is small, and counted);
- ``browser``: the page itself in headless chromium (Playwright with the system chromium), drawing every
  snapshot, opened with ``page.goto`` and closed to ``about:blank``; its rendering runs on the server's cores.

``--pin`` puts the server on CPU 0 with one torch thread and the load and the viewer on the other CPUs, in both
states: the page's drawing then takes none of the server's CPU, as when the browser runs on another machine,
and what is left is the server's own cost of an open page (its requests, the event stream, the snapshots).
Unpinned, on this 2-core machine, a browser drawing five snapshots a second in software competes with the
server's two torch threads, and the figure is the cost of running the browser there.

Per window: output tokens/s (from the server's ``--step-log``, between the ends of the window's first and last
steps) and the CPU the server's main thread (its
event loop: HTTP, SSE, and the snapshots) spent, read by the viewer at each switch from /proc.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

from kvserve.loadtest.argtypes import positive_int
from kvserve.loadtest.errors import UsageError
from kvserve.loadtest.loadgen import report, workloads
from kvserve.loadtest.loadgen.generator import LoadConfig, RunResult, run_sync
from kvserve.loadtest.loadgen.runcmd import server_model
from kvserve.loadtest.procs.serverproc import ServerStartError, kvserve_command, launch
from kvserve.loadtest.publish.benchmarks_md import update_section
from kvserve.loadtest.served.overhead import thread_cpu_s, tree_cpu_s

VIEWERS = ("browser", "stream", "none")


@dataclass(slots=True)
class Switch:
    """The viewer's log line at one switch: ``at`` perf_counter() (s), the state from then on, the server's
    main-thread CPU seconds then, and the snapshots (stream) or steps drawn (browser) in the window just ended."""

    at: float
    page_open: bool
    loop_cpu_s: float
    count: int


@dataclass(slots=True)
class Window:
    """One window between two switches: its state, output tokens/s, and the server's main-thread CPU per output
    token (ms)."""

    page_open: bool
    start_s: float
    tokens_per_s: float
    loop_cpu_ms: float
    count: int


def view(url: str, viewer: str, log_path: str, switch_s: str, pid: str) -> None:
    """Close and open the page (or its event stream) on ``url`` in turns of ``switch_s`` seconds, closed first,
    until killed; append a ``Switch`` line (``at open cpu count``) to ``log_path`` at every switch, reading server
    ``pid``'s main-thread CPU. Run as its own process by ``_Viewer``."""
    period, pid = float(switch_s), int(pid)

    def log(page_open: bool, count: int) -> None:
        line = f"{time.perf_counter():.6f} {int(page_open)} {thread_cpu_s(pid)['main']:.4f} {count}\n"
        with open(log_path, "a") as out:
            out.write(line)

    if viewer == "none":  # the control: the same switches with nothing opened (the method's own noise)
        log(False, 0)
        while True:
            time.sleep(period)
            log(True, 0)
            time.sleep(period)
            log(False, 0)
    if viewer == "stream":
        import json

        # one client for the run: a client per window would build an SSL context each time (tens of ms of this
        # machine's CPU, charged to the page), where a browser keeps its connection setup to itself
        client = httpx.Client(timeout=httpx.Timeout(period + 5.0))
        log(False, 0)
        while True:
            time.sleep(period)
            log(True, 0)
            count, end = 0, time.perf_counter() + period
            with client.stream("GET", url + "/ui/events") as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        json.loads(line[len("data: "):])
                        count += 1
                    if time.perf_counter() >= end:
                        break
            log(False, count)  # the open window's count, logged as it closes
    import shutil

    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=shutil.which("chromium"), headless=True,
                                             args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1440, "height": 1000})
        log(False, 0)
        while True:
            time.sleep(period)
            log(True, 0)
            end = time.perf_counter() + period
            page.goto(url + "/")
            page.wait_for_selector("#main", state="visible")
            time.sleep(max(0.0, end - time.perf_counter()))
            count = page.evaluate("Number(document.body.dataset.steps || 0)")
            page.goto("about:blank")
            log(False, count)


def read_switches(text: str) -> list[Switch]:
    """The viewer's log as switches, in order. A line closing an open window carries that window's count; a
    repeated state (none is written, but a log is read as it is) is not a switch."""
    switches: list[Switch] = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 4:
            continue  # a line cut by the viewer's end
        at, state, cpu, count = float(parts[0]), parts[1] == "1", float(parts[2]), int(parts[3])
        if switches and switches[-1].page_open == state:
            continue
        if switches and switches[-1].page_open and not state:
            switches[-1].count = count
        switches.append(Switch(at, state, cpu, 0))
    return switches


class _Viewer:
    """The viewer process of the run (a context manager); ``switches()`` reads its log."""

    def __init__(self, url: str, viewer: str, log_path: str, switch_s: float, pid: int) -> None:
        self.argv = [sys.executable, "-c",
                     "import sys; from kvserve.loadtest.served.uibench import view; view(*sys.argv[1:])",
                     url, viewer, log_path, str(switch_s), str(pid)]
        self.log_path = log_path

    def __enter__(self) -> _Viewer:
        open(self.log_path, "w").close()
        self.proc = subprocess.Popen(self.argv)
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)

    def switches(self) -> list[Switch]:
        with open(self.log_path) as log:
            return read_switches(log.read())


def step_tokens(step_log: str) -> list[tuple[float, int]]:
    """(perf_counter() time at the step's end, output tokens) of every step in the server's ``--step-log`` text: a
    step's output tokens are a token per decode plus one per prefill (the prompt's first token; a chunk of a longer
    prompt yields none, an error of at most a token per request). Drafts are not counted: the log has those
    proposed, not those accepted, and this benchmark's server runs without speculation. A line cut by the server's
    end is skipped."""
    import json

    out = []
    for line in step_log.splitlines():
        try:
            step = json.loads(line)
        except json.JSONDecodeError:
            continue
        out.append((step["end_s"], step["decodes"] + step["prefills"]))
    return out


def windows(switches: list[Switch], steps: list[tuple[float, int]], steady: tuple[float, float]) -> list[Window]:
    """The windows between consecutive switches that lie inside ``steady`` (perf_counter() s: every stream
    busy), with their rates; ``start_s`` counts from ``steady[0]``.

    A window's rate runs from the end of its first step to the end of its last (the tokens of the steps after the
    first, over that time), not from switch to switch: steps of tens to hundreds of ms end a few seconds' window
    at any point of a step, and counting whole steps against the switches' times would move each window's rate by
    up to a step's share (6% for 17 steps), far more than the effect measured."""
    import bisect

    steps = sorted(steps)
    times = [t for t, _ in steps]
    out = []
    for a, b in zip(switches, switches[1:]):
        if a.at < steady[0] or b.at > steady[1]:
            continue
        inside = steps[bisect.bisect_right(times, a.at):bisect.bisect_right(times, b.at)]
        if len(inside) < 3:
            continue
        n = sum(tokens for _, tokens in inside[1:])
        if n <= 0:
            continue
        out.append(Window(a.page_open, a.at - steady[0], n / (inside[-1][0] - inside[0][0]),
                          1000 * (b.loop_cpu_s - a.loop_cpu_s) / sum(tokens for _, tokens in inside), a.count))
    return out


def paired_ratios(ws: list[Window]) -> list[float]:
    """Each open window's tokens/s over the mean of the closed windows just before and after it (both must be
    there, adjacent): a drift that is linear over three windows cancels."""
    ratios = []
    for before, opened, after in zip(ws, ws[1:], ws[2:]):
        if opened.page_open and not before.page_open and not after.page_open and \
                math.isclose(after.start_s - before.start_s, 2 * (opened.start_s - before.start_s), rel_tol=0.25):
            ratios.append(opened.tokens_per_s / ((before.tokens_per_s + after.tokens_per_s) / 2))
    return ratios


def render(ws: list[Window], viewer: str, streams: int, tokens: int, scheme: str, switch_s: float,
           viewer_cpu_s: float, span_s: float, pinned: bool = False, viewer_s: float = 0.0) -> str:
    """The summary table, the paired ratio with its 95% interval, and what the figures mean."""
    ratios = paired_ratios(ws)
    viewer_s = viewer_s or span_s
    if len(ratios) < 2:
        return f"Only {len(ratios)} open window(s) with closed ones on both sides inside the steady load: run longer."
    mean = statistics.fmean(ratios)
    half = 1.96 * statistics.stdev(ratios) / math.sqrt(len(ratios))
    rows = ["| page | windows | output tok/s (median) | server event-loop CPU ms/token | viewer count per window |",
            "|---|---:|---:|---:|---:|"]
    for state in (False, True):
        part = [w for w in ws if w.page_open == state]
        tokens_all = sum(w.tokens_per_s for w in part)
        cpu = sum(w.loop_cpu_ms * w.tokens_per_s for w in part) / tokens_all  # token-weighted
        count = f"{statistics.median(w.count for w in part):.0f}" if state else "–"
        rows.append(f"| {'open' if state else 'closed'} | {len(part)} | {statistics.median(w.tokens_per_s for w in part):.1f} "
                    f"| {cpu:.3f} | {count} |")
    what = (("the page in headless chromium on CPUs the server does not use (as from another machine)" if pinned
             else "the page in headless chromium on this machine (its rendering shares the CPU with the server)")
            if viewer == "browser" else "nothing (the control: the same switches, the method's own noise)"
            if viewer == "none" else "a reader of /ui/events parsing every snapshot (the server's side of an "
            "open page)")
    count = "steps drawn by the page" if viewer == "browser" else "snapshots received"
    return "\n".join(rows) + (
        f"\n\nOpen window against the closed windows on either side, tokens/s: mean **{mean:.3f}** "
        f"(95% interval {mean - half:.3f}-{mean + half:.3f}, {len(ratios)} open windows; median {statistics.median(ratios):.3f}).\n\n"
        f"`kvserve serve --quantization {scheme} --max-num-seqs {streams}`, {streams} concurrent greedy completions "
        f"of {tokens} tokens, refilled as they end, for {span_s:.0f} s of steady load; the page open and closed in "
        f"turns of {switch_s:g} s. Page open: {what}. Viewer count: {count} per open window. Event-loop CPU: the "
        f"server's main thread (HTTP, SSE, and the snapshots the page's stream is built from) per output token. "
        f"The viewer (with its browser's processes) used {viewer_cpu_s:.1f} CPU s in its {viewer_s:.0f} s, "
        f"{100 * viewer_cpu_s / viewer_s:.1f}% of one CPU (the page was open half of that time)."
        + (" Pinned: the server on one CPU with one torch thread, the load and the viewer on the others."
           if pinned else f" Environment: OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} (the server's torch "
           "threads)." if "OMP_NUM_THREADS" in os.environ else ""))


def staggered(count: int, tokens: int, seed: int = 0) -> list[workloads.RequestSpec]:
    """``count`` exact-length completions of 1/2 to 3/2 ``tokens`` tokens (uniform, seeded): streams that start
    together then end at different steps, so the load settles into a steady mix of prefill and decode rather than
    waves of 32 prefills every ``tokens`` steps, which would make a few seconds' throughput depend on the phase."""
    import random
    from dataclasses import replace

    rng = random.Random(seed)
    return [replace(spec, max_tokens=rng.randint(max(1, tokens // 2), max(1, 3 * tokens // 2)))
            for spec in workloads.fixed(count, tokens)]


def steady_span(run: RunResult, streams: int, duration_s: float) -> tuple[float, float]:
    """When every stream is busy: from the first token of the last of the first ``streams`` requests to the end
    of sending (perf_counter() s); after it the streams that end are not refilled."""
    first = sorted(run.records, key=lambda r: r.start_s)[:streams]
    start = max(run.started + r.start_s + (r.ttft_s or 0.0) for r in first)
    return start, run.started + duration_s


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--viewer", choices=VIEWERS, default="stream",
                        help="what keeps the page open: a reader of its event stream (the server's side), or "
                             "headless chromium on the same machine")
    parser.add_argument("--quantization", default="auto", choices=["auto", "none", "gguf", "int8", "int4", "nf4"],
                        help="as kvserve serve --quantization (default auto: the server as the README starts it)")
    parser.add_argument("--streams", type=positive_int, default=32, help="concurrent streams")
    parser.add_argument("--tokens", type=positive_int, default=128, help="output tokens per request")
    parser.add_argument("--duration", type=positive_int, default=240, help="seconds of load")
    parser.add_argument("--switch", type=float, default=3.0, help="seconds the page stays open, then closed")
    parser.add_argument("--pin", action="store_true",
                        help="the server on CPU 0 with one torch thread; the load and the viewer on the other CPUs")
    parser.add_argument("--no-write", action="store_true")


def run(args: argparse.Namespace) -> int:
    if args.viewer == "browser":
        import shutil

        try:
            import playwright  # noqa: F401
        except ImportError:
            raise UsageError("--viewer browser needs playwright (pip install .[test]); or use --viewer stream")
        if shutil.which("chromium") is None:
            raise UsageError("--viewer browser needs chromium (scripts/ci_system_deps.sh); or use --viewer stream")
    if args.switch <= 0 or args.duration < 6 * args.switch:
        raise UsageError("--switch must be positive and --duration at least 6 switches long")
    step_log = report.OUT_DIR / "ui-steps.jsonl"
    report.OUT_DIR.mkdir(parents=True, exist_ok=True)
    step_log.write_text("")
    command = kvserve_command(["--quantization", args.quantization, "--max-num-seqs", str(args.streams),
                               "--step-log", str(step_log)])
    env = None
    if args.pin:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise UsageError("--pin needs two CPUs or more")
        command = ["taskset", "-c", str(cpus[0]), *command]
        env = {"OMP_NUM_THREADS": "1"}
        os.sched_setaffinity(0, cpus[1:])  # the load generator, and the viewer it starts
    log_path = str(report.OUT_DIR / "ui-viewer.txt")
    try:
        with launch(command, name="ui", env=env) as server:
            warm = LoadConfig(url=server.url, concurrency=4, count=4, model=server_model(server.url), progress=False)
            run_sync(workloads.fixed(4, 16), warm, "warm-up")  # first requests pay one-time costs
            config = LoadConfig(url=server.url, concurrency=args.streams, count=100_000, duration_s=args.duration,
                                timeout_s=600, model=warm.model, progress=False)
            with _Viewer(server.url, args.viewer, log_path, args.switch, server.pid) as viewer:
                load = run_sync(staggered(256, args.tokens), config, "ui")
                viewer_cpu = tree_cpu_s(viewer.proc.pid)  # with the browser's processes
                viewer_s = time.perf_counter() - viewer.started
                switches = viewer.switches()
    except (ServerStartError, RuntimeError, OSError) as exc:
        print(f"ui: {exc}", file=sys.stderr)
        return 1
    failed = [r for r in load.records if not r.ok]
    if failed:
        print(f"ui: {len(failed)} of {len(load.records)} requests failed, e.g. {failed[0].error}", file=sys.stderr)
        return 1
    steady = steady_span(load, args.streams, args.duration)
    ws = windows(switches, step_tokens(step_log.read_text()), steady)
    text = render(ws, args.viewer, args.streams, args.tokens, args.quantization, args.switch, viewer_cpu,
                  steady[1] - steady[0], args.pin, viewer_s)
    print(text)
    if not args.no_write:
        pin = " --pin" if args.pin else ""
        update_section(f"ui-{args.viewer}{'-pinned' if args.pin else ''}",
                       f"The live page's overhead: throughput with the page open ({args.viewer}"
                       f"{', pinned' if args.pin else ''})",
                       f"python -m kvserve.loadtest ui --viewer {args.viewer} --quantization {args.quantization} "
                       f"--streams {args.streams} --tokens {args.tokens} --duration {args.duration} "
                       f"--switch {args.switch:g}{pin}", text)
    return 0
