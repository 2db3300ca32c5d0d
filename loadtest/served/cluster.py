"""``python -m kvserve.loadtest cluster``: K kvserve replicas behind a router on 127.0.0.1, measured as a cluster.

Every replica is a real ``kvserve serve`` process (SmolLM2, float32, a small KV pool) on a free port. The routers:
the real ``vllm-router`` binary (``pip install vllm-router``, in the ``cluster`` and ``test`` extras) for
``round_robin``, ``cache_aware`` (which guesses where a prefix lives from the text it has routed) and ``kv_aware``
(its own index of the replicas' KV events, queried with the prompt tokens a replica's render route gives it), and
loadtest's own KV-aware router (``procs/kvrouter.py``) for ``kv_events``: its index is built only from the replicas'
KV events (``--kv-events-config``, vLLM's format, with vLLM's ``sha256_cbor`` block hashes), and a request goes to
the replica that holds its longest prefix. Two workloads: ``conversations`` (default), multi-turn chat, each turn
resending the growing history (its own opening, the replies so far and a new question), so a conversation's
prefix is cached on the replica that served its previous turn, and only there; ``system-prompts``, many tenants'
long system prompts, each shared by its requests, more than one replica's KV pool holds.

1. Per policy, a fresh router over the same replicas and fresh prompts: the prefix-cache hit rate summed over the
   replicas (``kvserve:prefix_cache_hits`` over ``..._queries``, deltas from their /metrics), the mean and p99 TTFT
   as the client sees it, requests finished per second, requests per replica.
2. Failover (conversations, ``cache_aware``): SIGKILL one replica while streams are in flight on it. Reported:
   requests that failed (only those already on the dead replica may), requests the router retried elsewhere (its
   own metrics), how the cut streams ended (an error, never a hang), what the survivors served, and their /health.
3. Drain: SIGTERM one of the survivors with streams in flight on it (kvserve drains, server/drain.py):
   its in-flight streams must all complete within ``--drain-seconds``, new requests go to the others.

Bounded in requests and time; every process it starts is stopped on the way out (Ctrl-C and SIGTERM too).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import re
import signal
import sys
import time
from dataclasses import dataclass, field

import httpx

from kvserve.loadtest.loadgen.conversations import Result, SystemPrompts, Workload, run_conversations, run_system_prompts
from kvserve.loadtest.loadgen.report import OUT_DIR
from kvserve.loadtest.procs.clusterproc import (EVENT_POLICIES, KV_AWARE, KV_EVENTS, KV_EVENTS_IN_FLIGHT, Cluster,
                                                Proc, kv_events_flags,
                                                replica_counts, router_binary, router_retries, serve_flags,
                                                start_cluster)
from kvserve.loadtest.publish.benchmarks_md import update_section

# cache_aware last of vllm-router's: the kill and drain phases reuse its router. kv_events: loadtest's own KV-aware
# router (procs/kvrouter.py), its index built only from the replicas' KV events; kv_events_in_flight: the same, also
# counting the prompts of the requests it has in flight on each replica; kv_aware: vllm-router's own KV-aware policy
# on the same events
POLICIES = ("round_robin", KV_EVENTS, KV_EVENTS_IN_FLIGHT, KV_AWARE, "cache_aware")
OWN_ROUTER = {KV_EVENTS, KV_EVENTS_IN_FLIGHT}


# ---- the three phases --------------------------------------------------------------------------------

@dataclass
class PolicyFigures:
    policy: str
    requests: int
    failed: int
    hit_rate: float
    mean_ttft_s: float
    p99_ttft_s: float
    requests_per_s: float  # finished requests over the phase's wall time
    per_replica: list[int]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _p99(values: list[float]) -> float:
    """The 99th percentile (nearest rank), NaN for none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, -(-99 * len(ordered) // 100) - 1))]


def warm_up(cluster: Cluster) -> None:
    """One short request straight to each replica, so no policy's first requests pay first-call costs."""
    for replica in cluster.replicas:
        httpx.post(replica.url + "/v1/chat/completions", timeout=120,
                   json={"messages": [{"role": "user", "content": "warm up"}], "max_tokens": 2}).raise_for_status()


def measure_policy(cluster: Cluster, policy: str, workload: Workload | SystemPrompts,
                   deadline_s: float) -> PolicyFigures:
    """A fresh router with ``policy`` over all replicas, fresh conversations (or system prompts); deltas of the
    replicas' counters."""
    cluster.start_router(policy)
    before = [replica_counts(r) for r in cluster.replicas]
    started = time.perf_counter()
    if isinstance(workload, SystemPrompts):
        results = asyncio.run(run_system_prompts(cluster.router.url, workload, policy, deadline_s))
    else:
        results = asyncio.run(run_conversations(cluster.router.url, workload, f"{policy}", deadline_s))
    wall_s = time.perf_counter() - started
    after = [replica_counts(r) for r in cluster.replicas]
    hits = sum(a["hits"] - b["hits"] for a, b in zip(after, before))
    queries = sum(a["queries"] - b["queries"] for a, b in zip(after, before))
    ttfts = [r.ttft_s for r in results if r.ok and r.ttft_s is not None]
    return PolicyFigures(policy, len(results), sum(not r.ok for r in results),
                         hits / queries if queries else 0.0, _mean(ttfts), _p99(ttfts),
                         sum(r.ok for r in results) / wall_s,
                         [int(a["finished"] - b["finished"]) for a, b in zip(after, before)])


async def _when(predicate, timeout_s: float, poll_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await asyncio.to_thread(predicate):
            return True
        await asyncio.sleep(poll_s)
    return False


@dataclass
class FailoverFigures:
    victim: str
    busy_on_victim: int  # requests running or waiting on it just before the kill
    requests: int
    failed: int
    failed_after_kill_s: list[float]  # per failed request: when it ended, s after the kill
    hung: int  # requests that ran into the client timeout
    retries: float  # the router's retry counter over the phase
    served_by_survivors: int  # requests the survivors finished during the phase
    survivors_healthy: bool
    errors: list[str] = field(default_factory=list)


def measure_failover(cluster: Cluster, workload: Workload, deadline_s: float, after_requests: int = 3) -> FailoverFigures:
    """SIGKILL the busiest replica once ``after_requests`` requests finished and it has streams in flight."""
    cluster.start_router("cache_aware")
    retries_before = router_retries(cluster.router_metrics)
    finished_before = {r.name: replica_counts(r)["finished"] for r in cluster.replicas}
    results: list[Result] = []

    async def go() -> tuple[Proc, int, float]:
        t0 = time.perf_counter()
        load = asyncio.create_task(run_conversations(cluster.router.url, workload, "failover", deadline_s, results))
        await _when(lambda: sum(r.end_s > 0 for r in results) >= after_requests or load.done(), deadline_s)
        victim, busy = None, 0
        for _ in range(200):  # a replica with a stream in flight (10 s at most)
            counts = [((await asyncio.to_thread(replica_counts, r))["busy"], r) for r in cluster.replicas]
            busy, victim = max(counts, key=lambda c: c[0])
            if busy > 0 or load.done():
                break
            await asyncio.sleep(0.05)
        victim.signal(signal.SIGKILL)
        killed_at = time.perf_counter() - t0
        await load
        return victim, int(busy), killed_at

    victim, busy, killed_at = asyncio.run(go())
    victim.popen.wait(timeout=30)
    survivors = [r for r in cluster.replicas if r is not victim]
    retries = router_retries(cluster.router_metrics) - retries_before
    served = int(sum(replica_counts(r)["finished"] - finished_before[r.name] for r in survivors))
    healthy = all(httpx.get(r.url + "/health", timeout=5).status_code == 200 for r in survivors)
    failed = [r for r in results if not r.ok]
    return FailoverFigures(victim.name, busy, len(results), len(failed), [r.end_s - killed_at for r in failed],
                           sum(1 for r in failed if r.error and "Timeout" in r.error), retries, served, healthy,
                           sorted({r.error or "" for r in failed}))


@dataclass
class DrainFigures:
    target: str
    inflight_at_sigterm: int  # from the replica's own drain line (-1 if it wrote none)
    requests: int
    failed: int
    exit_after_s: float  # SIGTERM to the process's exit
    exit_status: int | None
    log_line: str  # kvserve's "drain done ..." line: finished, cut, refused
    served_by_others_after: int
    errors: list[str] = field(default_factory=list)


_DRAIN_LINE = re.compile(r"drain done in .*")
_DRAIN_COUNTS = re.compile(r"(\d+) of (\d+) in-flight")


def measure_drain(cluster: Cluster, workload: Workload, deadline_s: float, grace_s: float) -> DrainFigures:
    """SIGTERM a live replica while it has streams in flight; the load keeps coming through the router. Replies
    run to their max_tokens (ignore_eos): a reply the model ends early could finish before the signal."""
    workload = dataclasses.replace(workload, ignore_eos=True)
    cluster.start_router("cache_aware")
    live = [r for r in cluster.replicas if r.alive]
    results: list[Result] = []
    state: dict = {}

    async def go() -> None:
        t0 = time.perf_counter()
        load = asyncio.create_task(run_conversations(cluster.router.url, workload, "drain", deadline_s, results))
        target = None
        for _ in range(400):  # a replica with a stream in flight (20 s at most)
            counts = [((await asyncio.to_thread(replica_counts, r))["busy"], r) for r in live]
            busy, target = max(counts, key=lambda c: c[0])
            if busy > 0 or load.done():  # streams in flight there: ignore_eos replies last to their max_tokens
                break
            await asyncio.sleep(0.05)
        others = [r for r in live if r is not target]
        state["others_before"] = sum(replica_counts(r)["finished"] for r in others)
        target.signal(signal.SIGTERM)
        sent = time.perf_counter()
        exited = await _when(lambda: target.popen.poll() is not None, grace_s + 15)
        state["exit_after_s"] = time.perf_counter() - sent if exited else float("inf")
        await load
        state.update(target=target, others=others, t0=t0)

    asyncio.run(go())
    target, others = state["target"], state["others"]
    served_after = int(sum(replica_counts(r)["finished"] for r in others) - state["others_before"])
    lines = _DRAIN_LINE.findall(target.log.read_text(errors="replace"))
    counts = _DRAIN_COUNTS.search(lines[-1]) if lines else None
    failed = [r for r in results if not r.ok]
    return DrainFigures(target.name, int(counts.group(2)) if counts else -1, len(results), len(failed),
                        state["exit_after_s"],
                        target.popen.poll(), lines[-1] if lines else "(no drain line in the log)", served_after,
                        sorted({r.error or "" for r in failed}))


# ---- the command -------------------------------------------------------------------------------------

def _describe(workload: Workload | SystemPrompts) -> str:
    if isinstance(workload, SystemPrompts):
        return (f"{workload.requests} single-turn chats, {workload.concurrency} at a time, each with one of "
                f"{workload.prompts} tenants' system prompts of {workload.prompt_words} words (picked at random) and "
                f"a {workload.question_words}-word question of its own, {workload.max_tokens} tokens per reply.")
    return (f"{workload.conversations} conversations x {workload.turns} turns, {workload.concurrency} conversations "
            f"at a time, {workload.max_tokens} tokens per reply; each opening is {workload.opening_words} words "
            f"unique to its conversation, each later turn resends the history plus {workload.followup_words} words "
            f"after a random pause of up to {workload.think_s} s.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = Workload()
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=d.conversations)
    parser.add_argument("--turns", type=int, default=d.turns)
    parser.add_argument("--concurrency", type=int, default=d.concurrency, help="conversations at a time")
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens, help="per reply")
    parser.add_argument("--opening-words", type=int, default=d.opening_words)
    parser.add_argument("--kv-cache-memory", default="128MiB", help="each replica's KV pool")
    parser.add_argument("--drain-seconds", type=float, default=30.0, help="the replicas' --drain-seconds")
    parser.add_argument("--phase-seconds", type=float, default=300.0, help="no new turn starts after this")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--kv-aware-temperature", type=float, default=0.0,
                        help="vllm-router's --router-temperature for kv_aware (0, its default: the cheapest replica, "
                             "the first of equals; above 0: a softmax draw over cost / temperature)")
    parser.add_argument("--no-failover", action="store_true", help="skip the kill and the SIGTERM phases")
    parser.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    s = SystemPrompts()
    parser.add_argument("--workload", choices=["conversations", "system-prompts"], default="conversations",
                        help="conversations: multi-turn chats with openings of their own; system-prompts: many "
                             "tenants' long system prompts, each shared by its requests (more than one replica's "
                             "KV pool holds; the failover phases then use conversations)")
    parser.add_argument("--system-prompts", type=int, default=s.prompts, help="tenants (system-prompts workload)")
    parser.add_argument("--prompt-words", type=int, default=s.prompt_words, help="words per system prompt")
    parser.add_argument("--requests", type=int, default=s.requests, help="requests per policy (system-prompts)")


def run(args: argparse.Namespace) -> int:
    from kvserve.loadtest.errors import UsageError

    if args.replicas < 2 or (not args.no_failover and args.replicas < 3):
        raise UsageError("--replicas must be >= 2, and >= 3 with the failover phases (one is killed, one drained)")
    if set(args.policies) - OWN_ROUTER or not args.no_failover:
        router_binary()
    workload = Workload(args.conversations, args.turns, args.concurrency, args.max_tokens, args.opening_words)
    measured = workload if args.workload == "conversations" else SystemPrompts(
        args.system_prompts, args.prompt_words, args.requests, args.concurrency, args.max_tokens)
    flags = serve_flags(args.kv_cache_memory, args.drain_seconds)
    report: list[str] = []

    def emit(line: str = "") -> None:
        print(line, flush=True)
        report.append(line)

    started = time.perf_counter()
    print(f"starting {args.replicas} replicas (SmolLM2 float32, {args.kv_cache_memory} KV each) ...", flush=True)
    log_dir = OUT_DIR / "cluster"
    events = bool(EVENT_POLICIES & set(args.policies))
    if events:
        flags += kv_events_flags()
    cluster = start_cluster(args.replicas, flags, log_dir)
    cluster.kv_aware_temperature = args.kv_aware_temperature
    try:
        print(f"ready in {time.perf_counter() - started:.0f} s", flush=True)
        emit(f"{args.replicas} replicas (`kvserve serve` {' '.join(serve_flags(args.kv_cache_memory, args.drain_seconds))}"
             f"{' + KV events (sha256_cbor digests)' if events else ''}"
             f", one OpenMP thread each) behind the router, all on this machine's cores. Workload: "
             f"{_describe(measured)} "
             f"Fresh prompts per phase; hit rate = prompt tokens found in the prefix caches / looked up, "
             f"summed over the replicas; TTFT as the client sees it through the router; throughput = requests "
             f"finished per second of the phase. round_robin and cache_aware are vllm-router's; kv_events is "
             f"loadtest's KV-aware router (procs/kvrouter.py): an index of each replica's KV events, the longest "
             f"cached prefix wins; kv_events_in_flight also counts the prompts of its requests in flight; kv_aware is "
             f"vllm-router's own KV-aware policy on the same events.")
        emit()
        warm_up(cluster)
        emit("| policy | requests | failed | prefix-cache hit rate | mean TTFT (ms) | p99 TTFT (ms) | requests/s | "
             "requests per replica |")
        emit("|---|---:|---:|---:|---:|---:|---:|---|")
        for policy in args.policies:
            f = measure_policy(cluster, policy, measured, args.phase_seconds)
            emit(f"| {f.policy} | {f.requests} | {f.failed} | {f.hit_rate:.1%} | {f.mean_ttft_s * 1000:.0f} | "
                 f"{f.p99_ttft_s * 1000:.0f} | {f.requests_per_s:.2f} | {' / '.join(map(str, f.per_replica))} |")
        if not args.no_failover:
            k = measure_failover(cluster, workload, args.phase_seconds)
            emit()
            emit(f"Kill (cache_aware): `kill -9` {k.victim} with {k.busy_on_victim} request(s) on it: {k.requests} "
                 f"requests, {k.failed} failed (ended {', '.join(f'{s:+.2f}' for s in k.failed_after_kill_s) or '-'} s "
                 f"from the kill; {k.hung} hung); router retries {k.retries:.0f}; the survivors served "
                 f"{k.served_by_survivors} requests in the phase; survivors' /health "
                 f"{'200' if k.survivors_healthy else 'NOT OK'}.")
            for error in k.errors:
                emit(f"- failed with: `{error}`")
            # longer replies here, so the replica is SIGTERMed in the middle of its streams
            d = measure_drain(cluster, dataclasses.replace(workload, max_tokens=max(workload.max_tokens, 32)),
                              args.phase_seconds, args.drain_seconds)
            emit()
            emit(f"Drain (cache_aware, 32-token replies): SIGTERM {d.target} with {d.inflight_at_sigterm} stream(s) "
                 f"in flight: {d.requests} requests, {d.failed} failed; it exited {d.exit_after_s:.2f} s after the "
                 f"SIGTERM (status {d.exit_status}); the others served {d.served_by_others_after} requests after it. "
                 f"{d.target}'s log: `{d.log_line}`.")
            for error in d.errors:
                emit(f"- failed with: `{error}`")
    finally:
        cluster.close()
    print(f"\ntotal {time.perf_counter() - started:.0f} s; logs in {cluster.log_dir}")
    if not args.no_write:
        # one section per set of flags, so a run with other flags (e.g. --turns 3) does not replace the default's
        flags = [a for a in sys.argv[2:] if a != "--no-write"]
        name = "-".join(["cluster", *(re.sub(r"[^a-z0-9]+", "", a.lower()) for a in flags)])
        title = ("Replicas behind a router: round robin, KV events, cache-aware" +
                 ("" if args.no_failover else ", kill, drain"))
        update_section(name, title + (f" ({' '.join(flags)})" if flags else ""),
                       " ".join(["python -m kvserve.loadtest cluster", *flags]), "\n".join(report))
        print(f"BENCHMARKS.md updated (section {name})")
    return 0
