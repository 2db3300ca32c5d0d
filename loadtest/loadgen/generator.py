"""The load generator: drives a workload at a server in closed loop (N users) or open loop (Poisson arrivals).

Closed loop: N users, each sends its next request when its previous one ends, so at most N are in flight
(with N >= len(workload), every request is sent at t = 0: "all at once"). Open loop: requests arrive at
exponential gaps of mean 1/rate whatever the server does (Poisson arrivals), so a slow server builds a queue.
Both stop after ``count`` requests or when ``duration_s`` has passed, whichever comes first; requests still
in flight at ``duration_s + timeout_s`` are cancelled.
"""

from __future__ import annotations

import asyncio
import enum
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvserve.loadtest.loadgen.client import RequestRecord, stream_request
from kvserve.loadtest.loadgen.workloads import RequestSpec


class Mode(enum.Enum):
    """How requests are paced."""

    CLOSED = "closed"  # N concurrent users
    OPEN = "open"      # Poisson arrivals at a rate (requests/s)


@dataclass(slots=True)
class LoadConfig:
    """One load run.

    Attributes:
        url: server base URL, e.g. ``http://127.0.0.1:8000``.
        mode: closed or open loop.
        concurrency: users in closed loop.
        rate: arrivals per second in open loop.
        count: requests to send; the workload is cycled if shorter. None: one pass over the workload.
        duration_s: stop sending after this many seconds.
        timeout_s: per-request limit (s), also the grace after ``duration_s``.
        model: model name sent in the body.
        seed: seeds the Poisson arrivals.
        api_key: bearer token, if the server wants one.
        progress: show a progress bar.

    Raises:
        ValueError: from ``__post_init__`` on a non-positive concurrency, rate, count or duration.
    """

    url: str
    mode: Mode = Mode.CLOSED
    concurrency: int = 8
    rate: float = 4.0
    count: int | None = None
    duration_s: float = 600.0
    timeout_s: float = 300.0
    model: str = "default"
    seed: int = 0
    api_key: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.rate <= 0:
            raise ValueError("rate must be > 0")
        if self.count is not None and self.count < 1:
            raise ValueError("count must be >= 1")
        if self.duration_s <= 0 or self.timeout_s <= 0:
            raise ValueError("duration_s and timeout_s must be > 0")


@dataclass(slots=True)
class RunResult:
    """Records of one run plus its wall time (s): first send to last response. ``started`` is
    ``time.perf_counter()`` when the run began (records' ``start_s`` count from it): CLOCK_MONOTONIC on Linux, the
    same clock in every process, so another process's timestamps can be placed on the run's time line."""

    label: str
    config: dict
    wall_s: float
    records: list[RequestRecord] = field(default_factory=list)
    started: float = 0.0


def _schedule(specs: list[RequestSpec], count: int | None) -> list[RequestSpec]:
    """The requests to send, in order: the workload cycled or trimmed to ``count``."""
    n = count or len(specs)
    return [specs[i % len(specs)] for i in range(n)]


async def run_load(specs: list[RequestSpec], config: LoadConfig, label: str = "run") -> RunResult:
    """Run ``specs`` against ``config.url``; returns every request's record, in send order.

    Raises:
        ValueError: an empty workload.
    """
    if not specs:
        raise ValueError("empty workload")
    todo = _schedule(specs, config.count)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=max(config.concurrency, 64) * 2, max_keepalive_connections=None)
    records: list[RequestRecord] = []
    progress = Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        disable=not config.progress, transient=True)
    async with httpx.AsyncClient(base_url=config.url, headers=headers, limits=limits, timeout=None) as client:
        with progress:
            bar = progress.add_task(label, total=len(todo))
            start = time.perf_counter()
            deadline = start + config.duration_s

            async def one(i: int) -> None:
                record = await stream_request(client, todo[i], config.model, i, start, config.timeout_s)
                records.append(record)
                progress.advance(bar)

            if config.mode is Mode.CLOSED:
                await _closed_loop(one, len(todo), config.concurrency, deadline, config)
            else:
                await _open_loop(one, len(todo), config.rate, deadline, config)
            wall = max((r.start_s + r.e2e_s for r in records), default=0.0)
    records.sort(key=lambda r: r.index)
    return RunResult(label=label, config=_config_json(config), wall_s=wall, records=records, started=start)


SendOne = Callable[[int], Awaitable[None]]  # sends request i and records it


async def _closed_loop(one: SendOne, total: int, users: int, deadline: float, config: LoadConfig) -> None:
    """``users`` workers take the next request index until none is left or the deadline passes."""
    next_index = iter(range(total))

    async def user() -> None:
        for i in next_index:
            if time.perf_counter() >= deadline:
                return
            await one(i)

    await _bounded(asyncio.gather(*(user() for _ in range(min(users, total)))), deadline, config)


async def _open_loop(one: SendOne, total: int, rate: float, deadline: float, config: LoadConfig) -> None:
    """Launch request i at the i-th arrival of a Poisson process of ``rate`` per second."""
    rng = random.Random(config.seed)
    tasks = []
    arrival = time.perf_counter()
    for i in range(total):
        if i:
            arrival += rng.expovariate(rate)
        if arrival >= deadline:
            break
        await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
        tasks.append(asyncio.create_task(one(i)))
    await _bounded(asyncio.gather(*tasks), deadline, config)


async def _bounded(work: Awaitable, deadline: float, config: LoadConfig) -> None:
    """Await ``work`` but no later than ``deadline + timeout_s``; cancel what is left then."""
    remaining = deadline + config.timeout_s - time.perf_counter()
    try:
        await asyncio.wait_for(work, timeout=max(remaining, 0.001))
    except TimeoutError:
        pass


def _config_json(config: LoadConfig) -> dict:
    return {"url": config.url, "mode": config.mode.value, "concurrency": config.concurrency, "rate": config.rate,
            "count": config.count, "duration_s": config.duration_s, "model": config.model}


def run_sync(specs: list[RequestSpec], config: LoadConfig, label: str = "run") -> RunResult:
    """``run_load`` from synchronous code."""
    return asyncio.run(run_load(specs, config, label))
