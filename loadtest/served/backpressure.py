"""Overload and disconnect drills against a kvserve server on 127.0.0.1 (bounded in time, stops by itself).

``python -m kvserve.loadtest backpressure`` starts ``kvserve serve`` with small limits, then:
- overload: keeps ``4 x (slots + queue)`` closed-loop clients busy for ``--seconds``; counts requests sent,
  admitted, 429s (each checked for Retry-After and an OpenAI error body), 5xx and other failures, TTFT
  percentiles of admitted requests, /health answers during the run, and the server's RSS before/after;
- disconnect: opens 20 streams, closes each after its first chunk, then reads ``kv_cache_usage_perc``
  until it is 0 and times a new request's first token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from kvserve.loadtest.procs.serverproc import kvserve_command, launch
from kvserve.loadtest.publish.benchmarks_md import update_section


@dataclass(slots=True)
class OverloadReport:
    """Counts over one overload run; TTFTs in seconds."""

    sent: int = 0
    admitted: int = 0
    completed: int = 0
    rejected_429: int = 0
    rejected_without_retry_after: int = 0
    server_errors: int = 0
    other_failures: int = 0       # an HTTP status other than 200/429/5xx, or an error event in a stream
    transport_errors: int = 0     # the connection broke (client side or server side): not an HTTP answer
    failure_kinds: dict[str, int] = field(default_factory=dict)
    health_checks: int = 0
    health_failures: int = 0
    ttfts: list[float] = field(default_factory=list)

    def note(self, kind: str) -> None:
        self.failure_kinds[kind] = self.failure_kinds.get(kind, 0) + 1

    def percentile(self, q: float) -> float:
        if not self.ttfts:
            return float("nan")
        ordered = sorted(self.ttfts)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def summary(self) -> dict:
        return {"sent": self.sent, "admitted": self.admitted, "completed": self.completed,
                "rejected_429": self.rejected_429, "429_without_retry_after": self.rejected_without_retry_after,
                "5xx": self.server_errors, "other_failures": self.other_failures,
                "transport_errors": self.transport_errors, "failure_kinds": self.failure_kinds,
                "health_checks": self.health_checks, "health_failures": self.health_failures,
                "ttft_p50_s": round(self.percentile(0.5), 3), "ttft_p99_s": round(self.percentile(0.99), 3)}


async def _one_request(client: httpx.AsyncClient, body: dict, report: OverloadReport) -> None:
    report.sent += 1
    start = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as response:
            if response.status_code == 429:
                report.rejected_429 += 1
                payload = json.loads(await response.aread())
                if not response.headers.get("retry-after", "").isdigit() or "error" not in payload:
                    report.rejected_without_retry_after += 1
                return
            if response.status_code >= 500:
                report.server_errors += 1
                return
            if response.status_code != 200:
                report.other_failures += 1
                report.note(f"HTTP {response.status_code}")
                return
            report.admitted += 1
            first = True
            finished = False
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    report.other_failures += 1
                    report.note("error event: " + str(chunk["error"].get("message"))[:80])
                    return
                if first:
                    report.ttfts.append(time.perf_counter() - start)
                    first = False
                finished = finished or chunk["choices"][0]["finish_reason"] is not None
            report.completed += int(finished)
    except httpx.HTTPError as exc:
        report.transport_errors += 1
        report.note(f"{type(exc).__name__}: {exc}"[:120])


async def overload(url: str, clients: int, seconds: float, body: dict) -> OverloadReport:
    """Run ``clients`` closed-loop clients for ``seconds`` and poll /health every 0.5 s meanwhile."""
    report = OverloadReport()
    deadline = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(seconds + 120), limits=limits) as client:
        async def user() -> None:
            while time.perf_counter() < deadline:
                before = report.rejected_429
                await _one_request(client, body, report)
                if report.rejected_429 > before:
                    await asyncio.sleep(0.2)  # a polite client backs off a little (not the full Retry-After)

        async def health() -> None:
            while time.perf_counter() < deadline:
                report.health_checks += 1
                try:
                    ok = (await client.get("/health", timeout=5)).status_code == 200
                except httpx.HTTPError:
                    ok = False
                report.health_failures += int(not ok)
                await asyncio.sleep(0.5)

        await asyncio.gather(health(), *(user() for _ in range(clients)))
    return report


async def disconnect_drill(url: str, clients: int, body: dict, usage_of) -> dict:
    """Open ``clients`` streams, drop each after its first chunk; time until the KV pool is empty again.

    Args:
        usage_of: async callable returning the server's KV usage in [0, 1].
    """
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async def drop_after_first_chunk() -> None:
            async with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        return  # closing the stream mid-flight: the server must abort

        await asyncio.gather(*(drop_after_first_chunk() for _ in range(clients)))
        closed = time.perf_counter()
        while await usage_of() > 0 and time.perf_counter() - closed < 10:
            await asyncio.sleep(0.02)
        freed_s = time.perf_counter() - closed
        start = time.perf_counter()
        ttft = None
        async with client.stream("POST", "/v1/completions",
                                 json={"prompt": "Hello", "max_tokens": 2, "stream": True}) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and ttft is None:
                    ttft = time.perf_counter() - start
        return {"clients": clients, "blocks_free_after_s": round(freed_s, 3), "new_request_ttft_s": round(ttft, 3)}


async def _metric(client: httpx.AsyncClient, name: str) -> float:
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith((name + " ", name + "{")):  # kvserve labels every series with model_name
            return float(line.split()[-1])
    raise KeyError(name)


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's flags: the server's limits and the drills' sizes."""
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-queue", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--disconnects", type=int, default=20, help="streams the disconnect drill opens and drops")
    parser.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")


def run(args: argparse.Namespace) -> int:
    """Both drills against one server; prints them and writes BENCHMARKS.md's "backpressure" section."""
    flags = ["--max-num-seqs", str(args.max_num_seqs), "--max-queue", str(args.max_queue), "--log-level", "warning"]
    with launch(kvserve_command(flags), name="backpressure") as server:
        clients = 4 * (args.max_num_seqs + args.max_queue)
        body = {"prompt": "Write a long essay about the history of the sea. " * 8, "max_tokens": args.max_tokens,
                "ignore_eos": True}
        rss_before = _rss_mib(server.pid)
        report = asyncio.run(overload(server.url, clients, args.seconds, body))
        rss_after = _rss_mib(server.pid)
        print(json.dumps({"overload": report.summary() | {"clients": clients, "seconds": args.seconds,
                                                          "rss_mib_before": round(rss_before),
                                                          "rss_mib_after": round(rss_after)}}, indent=1))

        async def usage() -> float:
            async with httpx.AsyncClient(base_url=server.url) as client:
                return await _metric(client, "kvserve:kv_cache_usage_perc")

        drill = asyncio.run(disconnect_drill(server.url, args.disconnects, {"prompt": "Count from 1 to 10000:", "max_tokens": 4000},
                                             usage))
        print(json.dumps({"disconnect": drill}, indent=1))
    o = report.summary()
    table = (f"| clients | seconds | sent | admitted | completed | 429 | 429 without Retry-After | 5xx | other failures "
             f"| /health failures | TTFT p50 s | TTFT p99 s | RSS MiB before -> after |\n|{'---|' * 13}\n"
             f"| {clients} | {args.seconds:.0f} | {o['sent']} | {o['admitted']} | {o['completed']} | {o['rejected_429']} "
             f"| {o['429_without_retry_after']} | {o['5xx']} | {o['other_failures']} | {o['health_failures']} of "
             f"{o['health_checks']} | {o['ttft_p50_s']} | {o['ttft_p99_s']} | {rss_before:.0f} -> {rss_after:.0f} |\n\n"
             f"Disconnects: {drill['clients']} streams closed after their first chunk; every KV block free again "
             f"{drill['blocks_free_after_s']} s later; a new request's first token {drill['new_request_ttft_s']} s "
             f"after that.\n\nServer: `--max-num-seqs {args.max_num_seqs} --max-queue {args.max_queue}`, "
             f"{args.max_tokens} output tokens per request, clients back off 0.2 s after a 429.")
    print(table)
    if not args.no_write:
        update_section("backpressure", "Overload (4x) and disconnects", "python -m kvserve.loadtest backpressure", table)
    return 0
