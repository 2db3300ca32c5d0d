"""Prefix-cache benchmark: TTFT of a request that shares a 1,024-token prefix with an earlier one, cold vs warm.

``python -m kvserve.loadtest prefix`` starts ``kvserve serve`` on 127.0.0.1, then for each of a few distinct
1,024-token prefixes sends (cold) prefix + question A, then (warm) prefix + question B, and reads the TTFT
of each stream at the client. Prints the medians and their ratio and writes the BENCHMARKS.md section.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import time

import httpx

from kvserve.loadtest.procs.serverproc import kvserve_command, launch
from kvserve.loadtest.publish.benchmarks_md import update_section


def ttft_s(url: str, prompt: list[int]) -> tuple[float, int]:
    """Client-side time to first token (s) of a streamed completion, and the server's cached_tokens."""
    start = time.perf_counter()
    first = None
    cached = 0
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            first = first or time.perf_counter() - start
            chunk = json.loads(line[6:])
            cached = chunk.get("timings", {}).get("cached_tokens", cached)
    return first, cached


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command line of ``python -m kvserve.loadtest prefix``."""
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--extra", type=shlex.split, default=[],
                        help="extra flags for kvserve serve, one quoted string: --extra '--dtype float32' "
                             "(a single flag: --extra=--no-prefix-caching)")
    parser.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")


def run(args: argparse.Namespace) -> int:
    """Cold and warm TTFT over ``args.trials`` prefixes; prints the table, writes BENCHMARKS.md's "prefix"."""
    with launch(kvserve_command(["--max-num-batched-tokens", "2048", "--log-level", "warning", *args.extra]),
                name="prefixbench") as server:
        url = server.url
        ttft_s(url, [1000 + i for i in range(64)])  # warm-up: allocator, threads
        cold, warm = [], []
        for trial in range(args.trials):
            prefix = [300 + (trial * 7919 + j * 104729) % 40000 for j in range(args.prefix_tokens)]
            cold_s, cold_cached = ttft_s(url, prefix + [11, 12, 13, 14])
            warm_s, warm_cached = ttft_s(url, prefix + [21, 22, 23, 24])
            assert cold_cached == 0 and warm_cached >= args.prefix_tokens - 16, (cold_cached, warm_cached)
            cold.append(cold_s)
            warm.append(warm_s)
    cold_ms, warm_ms = statistics.median(cold) * 1000, statistics.median(warm) * 1000
    table = (f"| prefix | cold TTFT (ms) | warm TTFT (ms) | speed-up |\n|---|---|---|---|\n"
             f"| {args.prefix_tokens} tokens | {cold_ms:.1f} | {warm_ms:.1f} | {cold_ms / warm_ms:.1f}x |\n\n"
             f"Medians of {args.trials} trials, each with a fresh prefix; the warm request differs only in its last "
             f"4 tokens, so all full blocks of the prefix are served from the prefix cache. Server flags: "
             f"`--max-num-batched-tokens 2048 {' '.join(args.extra)}`.")
    print(table)
    if not args.no_write:
        command = "python -m kvserve.loadtest prefix" + (f" --extra {shlex.quote(shlex.join(args.extra))}"
                                                      if args.extra else "")
        update_section("prefix", "Prefix cache: TTFT cold vs warm", command, table)
    return 0
