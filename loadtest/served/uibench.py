"""``python -m kvserve.loadtest ui``: serving throughput with the live page open, against without it.

Starts ``kvserve serve`` on 127.0.0.1 and runs the same load (``--streams`` concurrent greedy completions of
``--tokens`` tokens) in alternating rounds, page closed then page open, so that a drift of the machine's speed
hits both alike. "Page open" is a viewer process started before the round and stopped after it:

- ``browser``: the page itself in headless chromium (Playwright with the system chromium), drawing every
  snapshot; its CPU is spent on this machine too, so the figure includes a browser's rendering;
- ``stream``: a reader of the page's event stream (/ui/events) that parses every snapshot: the server's side
  of an open page alone, as when the browser runs on another machine.

Per round: output tokens/s (client-measured) and the CPU the server's main thread (its event loop, which also
builds the snapshots) spends per output token. The table gives each round and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
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
from kvserve.loadtest.loadgen.generator import LoadConfig, run_sync
from kvserve.loadtest.loadgen.runcmd import server_model
from kvserve.loadtest.procs.serverproc import ServerStartError, kvserve_command, launch
from kvserve.loadtest.publish.benchmarks_md import update_section
from kvserve.loadtest.served.overhead import thread_cpu_s

VIEWERS = ("browser", "stream")


@dataclass(slots=True)
class Round:
    """One load run. ``loop_cpu_ms`` is the server's main-thread CPU per output token (ms)."""

    page_open: bool
    tokens_per_s: float
    loop_cpu_ms: float
    snapshots: int  # snapshots the viewer received during the round (0 with the page closed)


def view(url: str, viewer: str, out_path: str) -> None:
    """Keep the page (or its event stream) open on ``url`` until killed; count snapshots into ``out_path``.

    Run as its own process by ``_Viewer``."""
    if viewer == "stream":
        count = 0
        with httpx.stream("GET", url + "/ui/events", timeout=None) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    json.loads(line[len("data: "):])
                    count += 1
                    _write_count(out_path, count)
        return
    import shutil

    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=shutil.which("chromium"), headless=True,
                                             args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1440, "height": 1000})
        page.goto(url + "/")
        page.wait_for_selector("#main", state="visible")
        while True:
            time.sleep(1)  # steps drawn so far: proof the page keeps up
            _write_count(out_path, page.evaluate("Number(document.body.dataset.steps || 0)"))


def _write_count(path: str, count: int) -> None:
    """Replace the count file whole: a reader never sees it truncated (read as 0, a negative difference)."""
    with open(path + ".tmp", "w") as out:
        out.write(str(count))
    os.replace(path + ".tmp", path)


class _Viewer:
    """The viewer process of one round (a context manager)."""

    def __init__(self, url: str, viewer: str, out_path: str) -> None:
        self.argv = [sys.executable, "-c", "import sys; from kvserve.loadtest.served.uibench import view; view(*sys.argv[1:])",
                     url, viewer, out_path]
        self.out_path = out_path

    def __enter__(self) -> _Viewer:
        open(self.out_path, "w").close()
        self.proc = subprocess.Popen(self.argv)
        deadline = time.monotonic() + 60
        while not open(self.out_path).read().strip():  # the page is up and drawing
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the viewer did not start (exit status {self.proc.poll()})")
            time.sleep(0.2)
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)

    def count(self) -> int:
        return int(open(self.out_path).read().strip() or 0)


def measure(url: str, pid: int, streams: int, tokens: int, viewer: _Viewer | None) -> Round:
    """One round of ``2 * streams`` completions, ``streams`` at a time.

    Raises:
        RuntimeError: a request failed.
    """
    count = 2 * streams
    config = LoadConfig(url=url, concurrency=streams, count=count, duration_s=1800, timeout_s=1800,
                        model=server_model(url), progress=False)
    before = viewer.count() if viewer else 0
    cpu0 = thread_cpu_s(pid)["main"]
    summary = report.summarize(run_sync(workloads.fixed(count, tokens), config, "ui"))
    cpu1 = thread_cpu_s(pid)["main"]
    if summary.ok != summary.sent:
        raise RuntimeError(f"{summary.sent - summary.ok} of {summary.sent} requests failed")
    return Round(viewer is not None, summary.tokens_per_s, 1000 * (cpu1 - cpu0) / summary.output_tokens,
                 (viewer.count() - before) if viewer else 0)


def render(rounds: list[Round], viewer: str, streams: int, tokens: int, scheme: str) -> str:
    """The markdown table, the ratio of medians and what it means."""
    lines = ["| round | page | output tok/s | server event-loop CPU ms/token | viewer count |", "|---|---|---|---|---|"]
    for i, r in enumerate(rounds):
        lines.append(f"| {i // 2 + 1} | {'open' if r.page_open else 'closed'} | {r.tokens_per_s:.1f} | "
                     f"{r.loop_cpu_ms:.3f} | {r.snapshots if r.page_open else '–'} |")
    closed = statistics.median(r.tokens_per_s for r in rounds if not r.page_open)
    opened = statistics.median(r.tokens_per_s for r in rounds if r.page_open)
    # each open round against the closed round just before it: a drift of the machine's speed over the run
    # cancels within a pair, which the ratio of the two medians does not
    paired = statistics.median(o.tokens_per_s / c.tokens_per_s for c, o in zip(rounds[::2], rounds[1::2]))
    what = ("the page in headless chromium on this machine (its rendering shares the CPU with the server)"
            if viewer == "browser" else "a reader of /ui/events parsing every snapshot (the server's side of an "
            "open page)")
    count = "steps drawn by the page" if viewer == "browser" else "snapshots received"
    return "\n".join(lines) + (
        f"\n\nMedian output tokens/s: page closed {closed:.1f}, page open {opened:.1f} (ratio {opened / closed:.3f}); "
        f"median of each round's open / closed ratio: **{paired:.3f}**.\n\n`kvserve serve --quantization {scheme} --max-num-seqs {streams}`, "
        f"{streams} concurrent greedy completions of {tokens} tokens ({2 * streams} per round), rounds alternating "
        f"closed and open. Page open: {what}. Viewer count: {count} during the round. Event-loop CPU: the "
        "server's main thread (HTTP, SSE, and the snapshots the page's stream is built from) per output token."
        + (f" Environment: OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} (the server's torch threads)."
           if "OMP_NUM_THREADS" in os.environ else ""))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--viewer", choices=VIEWERS, default="browser",
                        help="what keeps the page open: headless chromium, or a reader of its event stream")
    parser.add_argument("--quantization", default="auto", choices=["auto", "none", "gguf", "int8", "int4", "nf4"],
                        help="as kvserve serve --quantization (default auto: the server as the README starts it)")
    parser.add_argument("--streams", type=positive_int, default=32, help="concurrent streams")
    parser.add_argument("--tokens", type=positive_int, default=128, help="output tokens per request")
    parser.add_argument("--rounds", type=positive_int, default=5, help="rounds of (closed, open)")
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
    command = kvserve_command(["--quantization", args.quantization, "--max-num-seqs", str(args.streams)])
    out_path = str(report.OUT_DIR / "ui-viewer.txt")
    rounds: list[Round] = []
    try:
        with launch(command, name="ui") as server:
            measure(server.url, server.pid, 4, 16, None)  # warm-up: first requests pay one-time costs
            for _ in range(args.rounds):
                rounds.append(measure(server.url, server.pid, args.streams, args.tokens, None))
                with _Viewer(server.url, args.viewer, out_path) as viewer:
                    rounds.append(measure(server.url, server.pid, args.streams, args.tokens, viewer))
    except (ServerStartError, RuntimeError, OSError) as exc:
        print(f"ui: {exc}", file=sys.stderr)
        return 1
    text = render(rounds, args.viewer, args.streams, args.tokens, args.quantization)
    print(text)
    if not args.no_write:
        update_section(f"ui-{args.viewer}", f"The live page's overhead: throughput with the page open ({args.viewer})",
                       f"python -m kvserve.loadtest ui --viewer {args.viewer} --quantization {args.quantization} "
                       f"--streams {args.streams} "
                       f"--tokens {args.tokens} --rounds {args.rounds}", text)
    return 0
