"""Scheduling policies under a flood, served: one tenant's flood against another's trickle, and high-priority requests
behind a low-priority flood, each policy side by side.

``python -m kvserve.loadtest fairness`` starts ``kvserve serve`` on 127.0.0.1 once per policy and, against each:

- tenants (``fcfs`` vs ``fair``): tenant *flood* sends ``--flood`` streamed requests at once (``X-Tenant-ID:
  flood``); once they are queued, tenant *lone* sends ``--lone`` requests, one every ``--interval`` seconds whether
  or not the last has been answered (an open-loop trickle, so every one of them arrives while the flood still
  waits: size the flood to outlast the trickle). The TTFT of each tenant's requests, p50 and p99, as the clients see
  it;
- priority (``fcfs`` vs ``priority``): the same flood, at priority 10 under ``priority`` (no field under ``fcfs``,
  which refuses one), and the same trickle at priority 0: their TTFT.

Every request asks for exactly ``--max-tokens`` tokens (``ignore_eos``), so both tenants' requests cost the same and
only the order differs. Prints the tables and writes BENCHMARKS.md's "fairness" section.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import time
from dataclasses import dataclass, field

import httpx

from kvserve.loadtest.argtypes import positive_float, positive_int
from kvserve.loadtest.procs.serverproc import kvserve_command, launch
from kvserve.loadtest.publish.benchmarks_md import update_section

_SERVER_FLAGS = ["--max-num-seqs", "8", "--max-queue", "1024", "--log-level", "warning"]
_PROMPT = "Write a long story about a lighthouse keeper and the sea, with many details. Story {}:"


@dataclass(slots=True)
class Ttfts:
    """Client-side TTFTs (s) of one group of requests, and how many failed."""

    values: list[float] = field(default_factory=list)
    failed: int = 0

    def percentile(self, q: float) -> float:
        """The ``q`` quantile (nearest rank), NaN when nothing was measured."""
        if not self.values:
            return float("nan")
        ordered = sorted(self.values)
        return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]

    def cell(self) -> str:
        """``p50 / p99`` in seconds, and the failures if any."""
        text = f"{self.percentile(0.5):.2f} / {self.percentile(0.99):.2f}"
        return text + (f" ({self.failed} failed)" if self.failed else "")


async def ttft_s(client: httpx.AsyncClient, body: dict, headers: dict[str, str]) -> float | None:
    """Send one streamed completion; the seconds to its first content chunk (None: it failed)."""
    sent = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            return None
        first = None
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {"):
                if any(choice.get("text") for choice in json.loads(line[6:]).get("choices") or []):
                    first = time.perf_counter() - sent
        return first


async def _measured(client: httpx.AsyncClient, body: dict, headers: dict[str, str], into: Ttfts) -> None:
    try:
        ttft = await ttft_s(client, body, headers)
    except httpx.HTTPError:
        ttft = None
    if ttft is None:
        into.failed += 1
    else:
        into.values.append(ttft)


def _body(index: int, max_tokens: int, priority: int | None = None) -> dict:
    body = {"prompt": _PROMPT.format(index), "max_tokens": max_tokens, "min_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}
    return body if priority is None else body | {"priority": priority}


async def flood_and_trickle(url: str, flood: int, lone: int, max_tokens: int, priorities: tuple[int, int] | None,
                            interval_s: float = 0.5) -> tuple[Ttfts, Ttfts]:
    """Tenant "flood" sends ``flood`` requests at once, then tenant "lone" sends ``lone``, one every ``interval_s``
    seconds without waiting for the answers (with ``priorities`` = (flood's, lone's) as their ``priority`` fields, or
    none). Returns both groups' TTFTs."""
    flood_priority, lone_priority = priorities or (None, None)
    flooded, trickled = Ttfts(), Ttfts()
    limits = httpx.Limits(max_connections=flood + 4, max_keepalive_connections=flood + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(1800, connect=30), limits=limits) as client:
        await _measured(client, _body(-1, 4), {}, Ttfts())  # warm-up: threads, allocator
        tasks = [asyncio.create_task(_measured(client, _body(i, max_tokens, flood_priority),
                                               {"X-Tenant-ID": "flood"}, flooded)) for i in range(flood)]
        await asyncio.sleep(0.5)  # the flood is queued
        for i in range(lone):
            if i:
                await asyncio.sleep(interval_s)
            tasks.append(asyncio.create_task(_measured(client, _body(10_000 + i, max_tokens, lone_priority),
                                                       {"X-Tenant-ID": "lone"}, trickled)))
        await asyncio.gather(*tasks)
    return flooded, trickled


def _serve(policy: str, extra: list[str]):
    return launch(kvserve_command([*_SERVER_FLAGS, "--scheduling-policy", policy, *extra]), name=f"fairness-{policy}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command line of ``python -m kvserve.loadtest fairness``."""
    parser.add_argument("--flood", type=positive_int, default=64, help="requests the flooding tenant sends at once")
    parser.add_argument("--lone", type=positive_int, default=8,
                        help="requests the other tenant (or the high-priority client) sends, one every --interval")
    parser.add_argument("--interval", type=positive_float, default=1.0,
                        help="seconds between the other tenant's requests (sent without waiting for answers)")
    parser.add_argument("--max-tokens", type=positive_int, default=32, help="tokens every request generates")
    parser.add_argument("--extra", type=shlex.split, default=[],
                        help="extra flags for kvserve serve, one quoted string: --extra '--dtype float32'")
    parser.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")


def run(args: argparse.Namespace) -> int:
    """Both experiments, each policy on its own server; prints the tables, writes BENCHMARKS.md's "fairness"."""
    tenants, priority = {}, {}
    for policy in ("fcfs", "fair"):
        with _serve(policy, args.extra) as server:
            tenants[policy] = asyncio.run(flood_and_trickle(server.url, args.flood, args.lone, args.max_tokens, None,
                                                            args.interval))
    for policy in ("fcfs", "priority"):
        with _serve(policy, args.extra) as server:
            priorities = (10, 0) if policy == "priority" else None
            priority[policy] = asyncio.run(flood_and_trickle(server.url, args.flood, args.lone, args.max_tokens,
                                                             priorities, args.interval))
    text = render(tenants, priority, args)
    print(text)
    if not args.no_write:
        command = (f"python -m kvserve.loadtest fairness --flood {args.flood} --lone {args.lone} "
                   f"--interval {args.interval:g} --max-tokens {args.max_tokens}" + (f" --extra {shlex.quote(shlex.join(args.extra))}"
                                                        if args.extra else ""))
        update_section("fairness", "Scheduling policies under a flood: fair share per tenant, priorities", command,
                       text)
    return 0


def render(tenants: dict[str, tuple[Ttfts, Ttfts]], priority: dict[str, tuple[Ttfts, Ttfts]],
           args: argparse.Namespace) -> str:
    """The two tables and what they measured."""
    rows = ["| `--scheduling-policy` | flooding tenant's TTFT p50 / p99 (s) | other tenant's TTFT p50 / p99 (s) |",
            "|---|---|---|"]
    rows += [f"| {policy} | {flood.cell()} | {lone.cell()} |" for policy, (flood, lone) in tenants.items()]
    rows += ["", "| `--scheduling-policy` | flood's TTFT p50 / p99 (s), priority 10 | high-priority requests' "
             "TTFT p50 / p99 (s), priority 0 |", "|---|---|---|"]
    rows += [f"| {policy} | {flood.cell()} | {lone.cell()} |" for policy, (flood, lone) in priority.items()]
    return "\n".join(rows) + (
        f"\n\nOne server per policy (`{' '.join(_SERVER_FLAGS + args.extra)}`). A tenant sends {args.flood} "
        f"streamed completions at once; then another sends {args.lone}, one every {args.interval:g} s without waiting "
        f"for answers; every request generates exactly {args.max_tokens} tokens. TTFT is the client's, from sending "
        f"to the first content chunk. The other tenant's median TTFT under fair share against FCFS: "
        f"{_versus(tenants, 'fair')}; the priority-0 requests' under priority against FCFS: "
        f"{_versus(priority, 'priority')}. Under fair share a newcomer's tenant takes a slot (one of the flood's is "
        "preempted and recomputed) and half the step's token budget at once, instead of waiting behind the flood; "
        "under priority, the priority-0 requests overtake the queued flood the same way.")


def _versus(table: dict[str, tuple[Ttfts, Ttfts]], policy: str) -> str:
    """How the second group's median TTFT under ``policy`` compares with FCFS's, in words."""
    fcfs, other = table["fcfs"][1].values, table[policy][1].values
    if not fcfs or not other:
        return "not measured"
    ratio = statistics.median(fcfs) / statistics.median(other)
    return f"{ratio:.1f}x shorter" if ratio >= 1 else f"{1 / ratio:.1f}x longer"
