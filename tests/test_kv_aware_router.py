"""vllm-router's own ``kv_aware`` policy in front of two kvserve replicas, unchanged: it subscribes to their KV events
(vLLM's format, on TCP, vLLM's default topic), asks a replica's render route for each request's prompt tokens, and
sends every request to the replica that holds its prefix.

The prefixes are placed behind the router's back (each system prompt sent straight to one replica), in an order no
load-only policy can follow: round robin and least-load each put at most half of the requests on the replica holding
their prefix. Skipped where vllm-router is not installed (the ``cluster`` and ``test`` extras install it).
"""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.loadtest.procs.clusterproc import KV_AWARE, Cluster, Proc, router_binary
from kvserve.server.config import ServeConfig
from kvserve.server.kv_events import KVEventsConfig
from tests.serverutil import free_port, running_server


def _replica_config() -> tuple[ServeConfig, tuple[str, str]]:
    """A replica publishing its KV events on two free TCP ports; returns its config and (PUB, replay) to connect to."""
    pub, replay = free_port(), free_port()
    events = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{pub}", replay_endpoint=f"tcp://*:{replay}")
    config = ServeConfig(num_kv_blocks=128, kv_events=events, prefix_caching_hash_algo="sha256_cbor")
    return config, (f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")


def _chat(url: str, tenant: int) -> dict:
    system = f"Tenant {tenant} rules. " + " ".join(f"Rule {tenant}.{i}: answer in kind {i}." for i in range(24))
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hello?"}],
            "max_tokens": 1, "temperature": 0}
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]


def test_vllm_routers_kv_aware_sends_each_request_to_the_replica_holding_its_prefix(smollm2, tmp_path):
    try:
        router_binary()
    except FileNotFoundError:
        pytest.skip("vllm-router is not installed")
    (first_config, first_events), (second_config, second_events) = _replica_config(), _replica_config()
    with running_server(smollm2, first_config) as first, running_server(smollm2, second_config) as second:
        replicas = [Proc("replica0", first, None, tmp_path / "replica0.log", first_events),
                    Proc("replica1", second, None, tmp_path / "replica1.log", second_events)]
        cluster = Cluster(replicas, tmp_path)
        try:
            router = cluster.start_router(KV_AWARE)
            time.sleep(1.0)  # the router's SUB sockets join the replicas' PUB sockets (ZMQ's slow joiner)
            holder = {0: second, 1: second, 2: first, 3: first}  # tenants 0, 1 on the second replica; 2, 3 on the first
            for tenant, url in holder.items():
                assert _chat(url, tenant)["prompt_tokens_details"]["cached_tokens"] == 0
            time.sleep(1.0)  # their BlockStored events reach the router's index
            for tenant in holder:
                usage = _chat(router.url, tenant)
                # landed where its prefix is: every full block of the prompt but the last token's was cached
                assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 16, tenant
            families = text_string_to_metric_families(httpx.get(cluster.router_metrics, timeout=10).text)
            inputs = {s.labels["result"]: s.value for f in families for s in f.samples
                      if s.name == "vllm_router_kv_routing_inputs_total"}
            assert inputs.get("render", 0) >= len(holder) and "tokenize" not in inputs  # the render route's tokens
        finally:
            cluster.close()
