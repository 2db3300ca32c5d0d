"""The processes of ``python -m kvserve.loadtest cluster``: kvserve replicas and vllm-router on 127.0.0.1, and their metrics.

Every process runs in its own session, so it and its children can be signalled as a group; ``Cluster.close``
stops all of them (the command and the tests call it in ``finally``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvserve.loadtest.loadgen.report import OUT_DIR
from kvserve.loadtest.procs.serverproc import ServerStartError, free_port, kvserve_command, log_tail, spawn


# ---- processes ---------------------------------------------------------------------------------------

@dataclass
class Proc:
    """A started process (its own session, so its whole group can be signalled) and where it listens.

    ``popen`` None: a server someone else runs (tests put stand-ins behind the router); never signalled.
    """

    name: str
    url: str
    popen: subprocess.Popen | None
    log: Path
    kv_events: tuple[str, str] | None = None  # a replica's KV events: (PUB, replay) endpoints to connect to

    @property
    def alive(self) -> bool:
        return self.popen is None or self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.popen is not None and self.popen.poll() is None:
            os.killpg(self.popen.pid, sig)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``; returns once the process is gone."""
        if self.popen is not None and self.popen.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.popen.wait()


def _spawn(name: str, argv: list[str], port: int, log_dir: Path, env: dict[str, str] | None = None) -> Proc:
    popen, log = spawn(name, argv, log_dir, env)
    return Proc(name, f"http://127.0.0.1:{port}", popen, log)


def _wait_ready(proc: Proc, path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise ServerStartError(f"{proc.name} exited with {proc.popen.returncode}; log {proc.log}:\n"
                                   f"{log_tail(proc.log)}")
        try:
            if httpx.get(proc.url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise ServerStartError(f"{proc.name}: no 200 from {path} after {timeout_s:.0f} s; log {proc.log}:\n"
                           f"{log_tail(proc.log)}")


def router_binary() -> str:
    """Path of the ``vllm-router`` launcher beside this Python, or on PATH.

    Raises:
        FileNotFoundError: not installed (``pip install -e '.[cluster]'``).
    """
    beside = Path(sys.executable).parent / "vllm-router"
    found = str(beside) if beside.exists() else shutil.which("vllm-router")
    if found is None:
        raise FileNotFoundError("vllm-router is not installed: pip install -e '.[cluster]' (or pip install vllm-router)")
    return found


KV_EVENTS = "kv_events"  # the policy of loadtest's own KV-aware router (procs/kvrouter.py), fed by the replicas' events
KV_EVENTS_IN_FLIGHT = "kv_events_in_flight"  # the same, also counting the prompts of requests in flight (--in-flight)
KV_AWARE = "kv_aware"  # vllm-router's own KV-aware policy, fed by the same events
EVENT_POLICIES = {KV_EVENTS, KV_EVENTS_IN_FLIGHT, KV_AWARE}  # the policies whose replicas publish KV events
BLOCK_SIZE = 16  # the replicas' KV block size (kvserve's default): a KV-aware router hashes prompts in these blocks


def kv_events_flags() -> list[str]:
    """A replica's flags that publish its KV events with vLLM's block hashes, on TCP ports that ``start_cluster``
    fills in (``{events_port}``, ``{replay_port}``): vllm-router takes only ``tcp://HOST:PORT`` sources. vLLM's
    default topic (empty): vllm-router's static sources subscribe to that topic only."""
    return ["--prefix-caching-hash-algo", "sha256_cbor", "--kv-events-config",
            '{"enable_kv_cache_events": true, "endpoint": "tcp://*:{events_port}", '
            '"replay_endpoint": "tcp://*:{replay_port}"}']


def kvrouter_command(port: int, replicas: list[Proc], in_flight: bool = False) -> list[str]:
    """loadtest's KV-aware router (``procs/kvrouter.py``) over ``replicas``, which publish as ``kv_events_flags``."""
    argv = [sys.executable, "-m", "kvserve.loadtest.procs.kvrouter", "--port", str(port),
            "--block-size", str(BLOCK_SIZE), *(["--in-flight"] if in_flight else [])]
    for replica in replicas:
        pub, replay = replica.kv_events
        argv += ["--replica", f"{replica.url}={pub},{replay}"]
    return argv


def kv_aware_flags(replicas: list[Proc], temperature: float = 0.0) -> list[str]:
    """vllm-router's flags for its ``kv_aware`` policy over ``replicas``, which publish as ``kv_events_flags``.

    Each replica is a static event source (vllm-router finds HTTP workers' sources no other way); the model name
    is the replicas' (their ``/v1/models``): it only names the index, which the router fills from the events and
    queries with the prompt tokens it gets from a replica's render route. ``temperature``: its
    ``--router-temperature`` (0, its default: the cheapest replica, the first of equals; above 0: a softmax draw
    over cost / temperature, so equals share new prompts).
    """
    model = httpx.get(replicas[0].url + "/v1/models", timeout=10).json()["data"][0]["id"]
    argv = ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", model,
            "--router-temperature", str(temperature)]
    for replica in replicas:
        pub, replay = replica.kv_events
        argv += ["--kv-event-source", f"{replica.url}={pub}", "--kv-event-replay-source", f"{replica.url}={replay}"]
    return argv


def router_command(port: int, metrics_port: int, workers: list[str], policy: str) -> list[str]:
    """vllm-router on 127.0.0.1 in front of ``workers``, tuned to notice a dead or draining replica quickly.

    Health checks every second, one failure takes a worker out and one success puts it back; a failed
    attempt (connection refused, 503 from a draining replica, 429 from a full one) is retried up to 5 times
    with backoff from 100 ms, long enough (~1.5 s) for the health check to steer the retry elsewhere
    (``cache_aware`` retries on the worker holding the prefix until that worker is out); two failures in a
    row open the worker's circuit breaker for 5 s, which also takes it out.
    """
    return [router_binary(), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
            "--worker-urls", *workers,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--worker-startup-check-interval", "1", "--health-check-interval-secs", "1",
            "--health-failure-threshold", "1", "--health-success-threshold", "1", "--health-check-timeout-secs", "2",
            "--retry-max-retries", "5", "--retry-initial-backoff-ms", "100", "--retry-max-backoff-ms", "1000",
            "--cb-failure-threshold", "2", "--cb-timeout-duration-secs", "5",
            "--log-level", "warning"]


@dataclass
class Cluster:
    """Replicas and (at most one at a time) a router; ``close`` stops all of them."""

    replicas: list[Proc]
    log_dir: Path
    router: Proc | None = None
    router_policy: str = ""
    router_metrics: str = ""
    kv_aware_temperature: float = 0.0  # vllm-router's --router-temperature for its kv_aware policy

    def start_router(self, policy: str, timeout_s: float = 60.0) -> Proc:
        """A router with ``policy`` over the live replicas, once it has found all of them healthy.

        The running one is kept when it has the same policy (a start costs several seconds), else replaced.
        """
        if self.router is not None and self.router.alive and self.router_policy == policy:
            return self.router
        self.stop_router()
        self.router_policy = policy
        port, metrics_port = free_port(), free_port()
        alive = [r for r in self.replicas if r.alive]
        live = [r.url for r in alive]
        if policy in (KV_EVENTS, KV_EVENTS_IN_FLIGHT):
            command = kvrouter_command(port, alive, in_flight=policy == KV_EVENTS_IN_FLIGHT)
        else:
            command = router_command(port, metrics_port, live, policy)
            if policy == KV_AWARE:
                command += kv_aware_flags(alive, self.kv_aware_temperature)
        self.router = _spawn(f"router-{policy}", command, port, self.log_dir)
        self.router_metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        # /readiness counts the workers the router has found healthy; wait for all of them
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.router.popen.poll() is not None:
                raise ServerStartError(f"router exited with {self.router.popen.returncode}; log {self.router.log}:\n"
                                       f"{log_tail(self.router.log)}")
            try:
                if httpx.get(self.router.url + "/readiness", timeout=5).json().get("healthy_workers") == len(live):
                    return self.router
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.3)
        raise ServerStartError(f"router did not see all {len(live)} workers healthy after {timeout_s:.0f} s; log "
                               f"{self.router.log}:\n{log_tail(self.router.log)}")

    def stop_router(self) -> None:
        if self.router is not None:
            self.router.stop()
            self.router = None

    def close(self) -> None:
        self.stop_router()
        for replica in self.replicas:
            replica.stop()


def start_cluster(replicas: int, serve_flags: list[str], log_dir: Path = OUT_DIR / "cluster",
                  start_timeout_s: float = 600.0) -> Cluster:
    """Start ``replicas`` kvserve processes at once and wait until every one answers /health.

    Each gets one OpenMP thread (they share the machine's cores). On failure every one started is stopped.

    Raises:
        ServerStartError: a replica exited or was not ready within ``start_timeout_s``.
    """
    procs = []
    try:
        for i in range(replicas):
            ports = {"{port}": free_port(), "{events_port}": free_port(), "{replay_port}": free_port()}
            argv = kvserve_command(serve_flags)
            for placeholder, number in ports.items():
                argv = [p.replace(placeholder, str(number)) for p in argv]
            proc = _spawn(f"replica{i}", argv, ports["{port}"], log_dir, env={"OMP_NUM_THREADS": "1"})
            if any("{events_port}" in flag for flag in serve_flags):
                proc.kv_events = tuple(f"tcp://127.0.0.1:{ports[p]}" for p in ("{events_port}", "{replay_port}"))
            procs.append(proc)
        for proc in procs:
            _wait_ready(proc, "/health", start_timeout_s)
    except BaseException:
        for proc in procs:
            proc.stop()
        raise
    return Cluster(procs, log_dir)


# ---- metrics -----------------------------------------------------------------------------------------

def scrape(url: str) -> dict[str, float]:
    """``{series name: value}`` from a Prometheus text page, label sets summed (empty if unreachable)."""
    try:
        text = httpx.get(url, timeout=5).text
    except httpx.HTTPError:
        return {}
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def replica_counts(replica: Proc) -> dict[str, float]:
    """The kvserve counters the report uses: prefix-cache hits and queries, finished requests, running, waiting."""
    m = scrape(replica.url + "/metrics")
    return {"hits": m.get("kvserve:prefix_cache_hits_total", 0.0),
            "queries": m.get("kvserve:prefix_cache_queries_total", 0.0),
            "finished": m.get("kvserve:request_success_total", 0.0) + m.get("kvserve:request_failure_total", 0.0),
            "busy": m.get("kvserve:num_requests_running", 0.0) + m.get("kvserve:num_requests_waiting", 0.0)}


def router_retries(metrics_url: str) -> float:
    """Attempts the router repeated (``vllm_router_retries_total``, all routes), 0 before its first."""
    return scrape(metrics_url).get("vllm_router_retries_total", 0.0)


def serve_flags(kv_cache_memory: str, drain_s: float) -> list[str]:
    """A small replica: SmolLM2 float32 on CPU, a small pool, a short context."""
    return ["--device", "cpu", "--dtype", "float32", "--kv-cache-memory", kv_cache_memory,
            "--max-num-seqs", "8", "--max-model-len", "2048", "--drain-seconds", str(drain_s),
            "--sse-ping-seconds", "0", "--log-level", "info"]
