"""Replicas behind vllm-router, on real processes (``python -m kvserve.loadtest cluster``, short): cache-aware routing
keeps conversations' prefixes cached, a killed replica costs only the requests already on it, a SIGTERMed
replica finishes its streams while new requests go elsewhere. And the drain's HTTP side in-process.

The cluster test starts 3 ``kvserve serve`` processes (SmolLM2 float32, 64 MiB KV pools, one OpenMP thread
each) and the vllm-router binary, all on 127.0.0.1; it skips when vllm-router is not installed.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from kvserve.server.app import create_app
from kvserve.server.config import ServeConfig
from kvserve.server.drain import Drain
from kvserve.server.state import ServerState
from tests.serverutil import free_port

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


# ---- the drain's HTTP side, in-process ---------------------------------------------------------------

def _started(server: uvicorn.Server, port: int) -> tuple[threading.Thread, str]:
    """Run ``server`` in a daemon thread; returns the thread and the base URL once it has started (30 s at most)."""
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    return thread, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def drained_app(smollm2):
    """A live in-process server whose Drain the test sets draining by hand; yields (url, drain)."""
    drain = Drain(5.0)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(ServerState(smollm2, ServeConfig(kv_cache_memory="64MiB")),
                                                      drain), host="127.0.0.1", port=port, log_level="warning"))
    thread, url = _started(server, port)
    try:
        yield url, drain
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_draining_replica_is_unready_but_alive_and_refuses_new_requests_with_retry_after(drained_app):
    url, drain = drained_app
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    assert httpx.get(url + "/live").json() == {"status": "ok"}
    assert httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=60).status_code == 200
    assert drain.inflight == 0  # counted while in flight, released after
    drain.draining = True
    try:
        health = httpx.get(url + "/health")
        assert (health.status_code, health.json()) == (503, {"status": "draining", "inflight": 0})
        assert httpx.get(url + "/live").json() == {"status": "draining"}  # liveness holds: no restart mid-drain
        refused = httpx.post(url + "/v1/chat/completions", json={**CHAT, "stream": True})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "draining"
        assert httpx.post(url + "/tokenize", json={"prompt": "hi"}).status_code == 200  # not generation
        metrics = httpx.get(url + "/metrics")
        assert metrics.status_code == 200  # still scraped while draining
        assert drain.refused == 1
        rejected = {s.labels["reason"]: s.value for f in text_string_to_metric_families(metrics.text)
                    if f.name == "kvserve:requests_rejected" for s in f.samples}
        assert rejected == {"queue_full": 0.0, "draining": 1.0}  # the 503 counted, beside the 429s
        assert "_created" not in metrics.text  # no start-time series, as vLLM's /metrics
    finally:
        drain.draining = False


def _stream_through_a_drain_deadline(smollm2, path: str, body: dict, drain_s: float = 3.0,
                                     signals: tuple[int, ...] = (signal.SIGTERM,)) -> list[str]:
    """Start a long stream on a DrainingServer with a ``drain_s`` drain, send it ``signals`` once the first event
    arrives; returns the stream's data lines (the server exits after the deadline's cut). A drain of a second or
    more also checks, after the first signal, that the stream counts as in flight and that a new request is refused
    (a shorter one may end, and close the port, before a loaded machine gets to ask)."""
    from kvserve.server.drain import DrainingServer
    from kvserve.server.httpserver import uvicorn_config

    drain = Drain(drain_s)
    port = free_port()
    config = ServeConfig(kv_cache_memory="64MiB")
    server = DrainingServer(uvicorn_config(create_app(ServerState(smollm2, config), drain), "127.0.0.1", port,
                                           config.header_timeout_s, log_level="warning"), drain)
    thread, url = _started(server, port)
    data: list[str] = []
    try:
        with httpx.stream("POST", url + path, json=body | {"stream": True}, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    if not data:
                        server.handle_exit(signals[0], None)  # as the signal handler would
                        if drain_s >= 1 and signals[0] == signal.SIGTERM:
                            time.sleep(0.1)
                            assert drain.inflight == 1  # the stream counts as in flight
                            refused = httpx.post(url + path, json=body)  # new requests are refused while draining
                            assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
                        for sig in signals[1:]:
                            server.handle_exit(sig, None)
                    data.append(line[6:])
    finally:
        thread.join(timeout=15)
        from sse_starlette.sse import AppStatus

        AppStatus.should_exit = False  # sse-starlette's process-wide exit flag: this process serves on in tests
    assert not thread.is_alive()  # the server exited once the cut stream had ended
    return data


LONG = {"max_tokens": 1000, "ignore_eos": True}  # far more than 3 s of tokens


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "Count from 1 to 10000:"} | LONG),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Count from 1 to 10000"}]} | LONG),
])
def test_drain_deadline_ends_a_stream_with_a_final_chunk_and_done(smollm2, path, body):
    data = _stream_through_a_drain_deadline(smollm2, path, body)
    assert data[-1] == "[DONE]"
    final = json.loads(data[-2])["choices"][0]
    assert final["finish_reason"] == "abort"
    assert all(json.loads(d)["choices"][0]["finish_reason"] is None for d in data[:-2])


@pytest.mark.parametrize("drain_s,signals", [
    (0.0, (signal.SIGTERM,)),  # --drain-seconds 0: no wait
    (30.0, (signal.SIGTERM, signal.SIGTERM)),  # a second SIGTERM ends the drain's wait
    (30.0, (signal.SIGINT,)),  # Ctrl-C
])
def test_a_stop_at_once_still_ends_open_streams_with_abort_and_done(smollm2, caplog, drain_s, signals):
    body = {"prompt": "Count from 1 to 10000:"} | LONG
    with caplog.at_level("INFO", logger="kvserve.drain"):
        data = _stream_through_a_drain_deadline(smollm2, "/v1/completions", body, drain_s, signals)
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["choices"][0]["finish_reason"] == "abort"
    name = signal.Signals(signals[-1]).name
    assert f"{name}: stopping now: 1 in-flight request(s) cut" in caplog.text


def test_a_client_that_goes_away_counts_as_an_aborted_request(smollm2):
    from tests.serverutil import running_server

    def finished(url: str) -> dict[tuple[str, str | None], float]:
        families = text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text)
        return {(s.name, s.labels.get("finished_reason")): s.value for f in families for s in f.samples
                if s.name in ("kvserve:request_success_total", "kvserve:e2e_request_latency_seconds_count")}

    with running_server(smollm2, ServeConfig(kv_cache_memory="64MiB")) as url:
        body = {"prompt": "Count from 1 to 10000:", "stream": True} | LONG
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            next(line for line in response.iter_lines() if line.startswith("data: "))  # then hang up
        deadline = time.monotonic() + 30
        while finished(url)[("kvserve:request_success_total", "abort")] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)  # the server notices the hang-up at its next send
        counts = finished(url)
    assert counts == {("kvserve:request_success_total", "stop"): 0.0, ("kvserve:request_success_total", "length"): 0.0,
                      ("kvserve:request_success_total", "abort"): 1.0,
                      ("kvserve:e2e_request_latency_seconds_count", None): 1.0}


def _serve_process(log_path, *flags: str) -> tuple[subprocess.Popen, str]:
    """A real ``kvserve serve`` process on a free port, its output in ``log_path``; returns it and its URL."""
    port = free_port()
    with open(log_path, "w") as out:
        # SIGINT at its default, as a terminal's process has it: a test run started in the background by a
        # non-interactive shell (a CI script's `&`) ignores SIGINT, and a child inherits that
        proc = subprocess.Popen([sys.executable, "-m", "kvserve.server.cli", "serve", "--port", str(port),
                                 "--kv-cache-memory", "64MiB", *flags], stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return proc, f"http://127.0.0.1:{port}"


def _wait_for(proc: subprocess.Popen, ready, what: str, log_path) -> None:
    deadline = time.monotonic() + 120
    while not ready():
        assert proc.poll() is None and time.monotonic() < deadline, f"no {what}: {log_path.read_text()}"
        time.sleep(0.05)


def test_ctrl_c_ends_open_streams_then_the_process_by_sigint_without_a_traceback(tmp_path):
    log_path = tmp_path / "serve.log"
    proc, url = _serve_process(log_path)
    try:
        def healthy() -> bool:
            try:
                return httpx.get(url + "/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        _wait_for(proc, healthy, "health", log_path)
        data = []
        body = {"prompt": "Count from 1 to 10000:", "stream": True} | LONG
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    if not data:
                        proc.send_signal(signal.SIGINT)
                    data.append(line[6:])
        assert proc.wait(timeout=30) == -signal.SIGINT  # ended by the signal, as the docs say
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    text = log_path.read_text()
    assert data[-1] == "[DONE]" and json.loads(data[-2])["choices"][0]["finish_reason"] == "abort"
    assert "SIGINT: stopping now: 1 in-flight request(s) cut" in text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text


def test_ctrl_c_while_the_model_loads_is_quiet(tmp_path):
    log_path = tmp_path / "serve.log"
    proc, _ = _serve_process(log_path)
    try:
        _wait_for(proc, lambda: "environment:" in log_path.read_text(), "start log", log_path)  # options checked
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == -signal.SIGINT
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    text = log_path.read_text()
    assert "SIGINT: stopped" in text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text


def test_drain_deadline_ends_a_responses_stream_with_its_terminal_event(smollm2):
    # the Responses API has no ignore_eos: greedy (its default temperature is 1, whose samples may end the reply at
    # any token) and a 0.2 s drain, a few tokens' time, cut the count long before the model could end it itself
    body = {"input": "Count from 1 to 10000", "max_output_tokens": 1000, "temperature": 0}
    data = _stream_through_a_drain_deadline(smollm2, "/v1/responses", body, 0.2)
    events = [json.loads(d) for d in data]
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "server_shutdown"}
    assert events[-2]["type"] == "response.output_item.done" and events[-2]["item"]["status"] == "incomplete"


def test_drain_seconds_flag_is_validated():
    with pytest.raises(ValueError, match="drain_s"):
        ServeConfig(drain_s=-1)
    with pytest.raises(ValueError, match="drain seconds"):
        Drain(float("nan"))


# ---- vllm-router retries kvserve's refusals elsewhere ----------------------------------------------------

def _refusing_worker(response_for):
    """A stand-in worker on a free port: /health 200, chat answered by ``response_for(hits)``; yields (url, hits)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    hits = []

    async def chat(request):
        hits.append(await request.json())
        return response_for(len(hits))

    app = Starlette(routes=[Route("/health", lambda r: JSONResponse({"status": "ok"})),
                            Route("/v1/chat/completions", chat, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{server.config.port}", hits


def test_router_retries_a_full_queues_429_and_a_draining_replicas_503_on_another_replica(tmp_path):
    """The exact refusals kvserve sends (server/app.py's queue_full 429, server/drain.py's 503, both with
    Retry-After) make vllm-router try another worker: the client sees only 200s."""
    from fastapi.responses import JSONResponse

    from kvserve.loadtest.procs.clusterproc import Cluster, Proc, router_binary
    from kvserve.server.errors import ApiError

    try:
        router_binary()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    full = ApiError(429, "the queue is full", code="queue_full", headers={"Retry-After": "2"})
    workers = [_refusing_worker(lambda n: full.response()), _refusing_worker(lambda n: Drain().refusal().response()),
               _refusing_worker(lambda n: JSONResponse({"choices": [{"message": {"content": "ok"}}]}))]
    fake = [Proc(f"w{i}", url, None, tmp_path / "none") for i, (_, _, url, _) in enumerate(workers)]
    cluster = Cluster(fake, tmp_path)
    try:
        router = cluster.start_router("round_robin")
        statuses = [httpx.post(router.url + "/v1/chat/completions", json=CHAT, timeout=30).status_code
                    for _ in range(6)]
    finally:
        cluster.stop_router()
        for server, thread, _, _ in workers:
            server.should_exit = True
            thread.join(timeout=10)
    hits = [len(h) for _, _, _, h in workers]
    assert statuses == [200] * 6
    assert hits[0] >= 1 and hits[1] >= 1, hits  # both refusers were tried (round robin) ...
    assert hits[2] == 6, hits  # ... and every request ended on the one that serves


# ---- the cluster, real processes ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from kvserve.loadtest.procs.clusterproc import router_binary, serve_flags, start_cluster

    try:
        router_binary()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    started = start_cluster(3, serve_flags("64MiB", drain_s=30.0), log_dir=tmp_path_factory.mktemp("cluster"),
                            start_timeout_s=300)
    try:
        yield started
    finally:
        started.close()


# Small enough for 2 cores (each request prefills ~100-200 tokens on one thread). Three turns: on 3 replicas round
# robin's later turns find some earlier turn of their conversation on their replica ever more often (the 4th with
# probability 1 - (2/3)^3), so the ratio to cache_aware falls with the turns (BENCHMARKS.md: 1.4-1.75x at 4).
WORKLOAD = dict(conversations=6, turns=3, concurrency=2, max_tokens=4, opening_words=80, think_s=0.2)


def test_cache_aware_routing_doubles_the_prefix_hit_rate_of_round_robin(cluster):
    from kvserve.loadtest.loadgen.conversations import Workload
    from kvserve.loadtest.served.cluster import measure_policy

    workload = Workload(**WORKLOAD)
    round_robin = measure_policy(cluster, "round_robin", workload, deadline_s=90)
    cache_aware = measure_policy(cluster, "cache_aware", workload, deadline_s=90)  # the next test reuses its router
    for figures in (cache_aware, round_robin):
        assert (figures.requests, figures.failed) == (18, 0), figures
        assert sum(figures.per_replica) == 18, figures  # the replicas' own counts: every request reached one
    assert round_robin.per_replica == [6, 6, 6]  # round robin really spreads; so conversations change replica
    assert cache_aware.hit_rate >= 2 * round_robin.hit_rate and cache_aware.hit_rate > 0.3, (cache_aware,
                                                                                             round_robin)


def test_killed_replica_costs_only_its_own_requests_and_drained_replica_finishes_its_streams(cluster):
    from kvserve.loadtest.loadgen.conversations import Workload
    from kvserve.loadtest.served.cluster import measure_drain, measure_failover

    workload = Workload(**{**WORKLOAD, "conversations": 4, "max_tokens": 12})
    kill = measure_failover(cluster, workload, deadline_s=90, after_requests=1)
    assert kill.busy_on_victim >= 1, kill  # it was killed with work on it
    assert kill.failed <= kill.busy_on_victim, kill  # nothing that had not reached it failed
    assert kill.hung == 0 and all(s < 10 for s in kill.failed_after_kill_s), kill  # an error, promptly
    assert kill.survivors_healthy and kill.served_by_survivors > 0, kill

    # 256-token replies (seconds each, even on the fast default): a stream seen busy is still in flight a moment
    # later, when the SIGTERM goes out
    drain = measure_drain(cluster, Workload(**{**WORKLOAD, "conversations": 4, "turns": 2, "max_tokens": 256}),
                          deadline_s=90, grace_s=30)
    assert drain.inflight_at_sigterm >= 1, drain
    assert drain.failed == 0, drain  # its streams completed, and the requests refused meanwhile went elsewhere
    assert drain.exit_after_s < 30 and drain.exit_status in (0, -signal.SIGTERM), drain
    assert f"{drain.inflight_at_sigterm} of {drain.inflight_at_sigterm} in-flight request(s) finished, 0 cut" \
        in drain.log_line, drain
    assert drain.served_by_others_after > 0, drain
