"""A real Prometheus scrapes live kvserve servers during a short load; its HTTP API must then report the
request count, the 429s and a TTFT quantile that agree with what the clients saw, and the shipped rules,
dashboard queries and adapter query must all evaluate on that data.

Needs the `prometheus` binary (Debian's package, installed in CI by scripts/ci_system_deps.sh); skips
with the reason when it is absent. Bounded in time: every wait has a deadline, every process is stopped.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from kvserve.server.config import ServeConfig
from tests.serverutil import free_port, running_server

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "rules" / "kvserve.rules.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "kvserve.json"
ADAPTER = ROOT / "deploy" / "k8s" / "monitoring" / "prometheus-adapter-config.yaml"
VLLM_DASHBOARD_QUERIES = ROOT / "tests" / "data" / "vllm_grafana_queries.txt"
MODEL_NAME = "SmolLM2-135M-Instruct"

N_STREAMS = 4      # streamed requests to the serving server, all at once
N_REJECTED = 2     # requests to the server whose queue holds nothing (each gets 429)
WAIT_S = 30.0      # deadline for Prometheus to start, scrape and evaluate
TTFT = "kvserve:time_to_first_token_seconds_bucket"


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        pytest.skip("the prometheus binary is not installed (Debian package `prometheus`: "
                    "bash scripts/ci_system_deps.sh)")
    return found


def wait_for(predicate, what: str, deadline_s: float = WAIT_S):
    """Polls ``predicate`` every 0.25 s until it returns a truthy value, which is returned."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {deadline_s:.0f} s waiting for {what}")


class Prom:
    """A Prometheus server process on 127.0.0.1 and its query API."""

    def __init__(self, workdir: Path, targets: dict[str, str]) -> None:
        """Starts Prometheus scraping each ``pod name -> host:port`` every second, with the shipped rules."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.instance = targets  # the rules aggregate by (job, instance): pod name -> instance label
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{
                "job_name": "kvserve",
                # namespace and pod as the Kubernetes scrape job attaches them, for the adapter's query
                "static_configs": [{"targets": [address], "labels": {"namespace": "test", "pod": pod}}
                                   for pod, address in targets.items()],
            }],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = workdir / "prometheus.log"
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                [prometheus_binary(), f"--config.file={workdir / 'prometheus.yml'}",
                 f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
                 "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT)

    def ready(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"prometheus exited with {self.process.returncode}: {self.log.read_text()}")
        try:
            return httpx.get(self.url + "/-/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def query(self, promql: str) -> list[dict]:
        """Instant query; returns the result vector. Raises AssertionError on a query error."""
        body = httpx.get(self.url + "/api/v1/query", params={"query": promql}, timeout=5).json()
        assert body["status"] == "success", f"{promql}: {body}"
        return body["data"]["result"]

    def scalar(self, promql: str) -> float | None:
        """The value of a one-element result, or None when the result is empty."""
        result = self.query(promql)
        assert len(result) <= 1, result
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


async def stream_chat(client: httpx.AsyncClient, url: str, content: str) -> dict:
    """One streamed chat completion; returns the ``timings`` of its final chunk."""
    body = {"messages": [{"role": "user", "content": content}], "stream": True, "max_tokens": 8,
            "temperature": 0}
    timings = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[len("data: "):])
                timings = chunk.get("timings", timings)
    assert timings is not None, "no chunk carried timings"
    return timings


async def streams(url: str) -> list[dict]:
    """N_STREAMS streamed requests at once; returns their timings."""
    prompts = [f"Name {n} colours of the rainbow." for n in range(1, N_STREAMS + 1)]
    async with httpx.AsyncClient(timeout=60) as client:
        return list(await asyncio.gather(*(stream_chat(client, url, p) for p in prompts)))


def refuse(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=30,
                      json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})


@pytest.fixture(scope="module")
def scraped(smollm2, tmp_path_factory):
    """Two fresh servers (own metrics) under a live Prometheus, after the load has been scraped.

    Yields:
        (Prom, the ``timings`` the server put in each stream's final chunk, the refused responses)
    """
    prometheus_binary()
    # both also under vLLM's names, for vLLM's own dashboard (test_vllms_dashboard_queries_return_data)
    # the serving one speculates, so that the dashboard's acceptance panel has series (the output is unchanged)
    serving_config = ServeConfig(num_kv_blocks=256, max_num_seqs=N_STREAMS, vllm_metric_names=True,
                                 speculative="ngram", num_speculative_tokens=2)
    refusing_config = ServeConfig(num_kv_blocks=16, max_num_seqs=1, max_queue=0,  # every request: 429
                                  vllm_metric_names=True)
    with running_server(smollm2, serving_config) as serving, running_server(smollm2, refusing_config) as refusing:
        prom = Prom(tmp_path_factory.mktemp("prometheus"),
                    {"kvserve-0": serving.removeprefix("http://"), "kvserve-1": refusing.removeprefix("http://")})
        try:
            wait_for(prom.ready, "prometheus /-/ready")
            wait_for(lambda: prom.scalar('sum(up{job="kvserve"})') == 2, "both targets scraped")
            timings = asyncio.run(streams(serving))
            # A labelled counter's series starts with its first increment, and rate() sees no increase in a
            # series' first sample: refuse once, let Prometheus see it, then refuse the rest.
            refused = [refuse(refusing)]
            wait_for(lambda: prom.scalar("sum(kvserve:requests_rejected_total)") == 1, "the first 429")
            refused += [refuse(refusing) for _ in range(N_REJECTED - 1)]
            # the load is over: wait for a scrape that saw all of it, and for the rules to evaluate on it
            wait_for(lambda: prom.scalar("sum(kvserve:requests_rejected_total)") == N_REJECTED, "the 429s")
            wait_for(lambda: prom.scalar("sum(kvserve:request_success_total)") == N_STREAMS, "the finished requests")
            seen = time.time()
            ratio = f'instance:kvserve_requests_rejected:ratio_rate5m{{instance="{prom.instance["kvserve-1"]}"}}'
            wait_for(lambda: (prom.scalar(f"timestamp({ratio})") or 0) > seen,
                     "the recording rules to evaluate on the last scrape")
            yield prom, timings, refused
        finally:
            prom.stop()


def test_request_and_token_counts(scraped):
    prom, timings, _ = scraped
    by_reason = {r["metric"]["finished_reason"]: float(r["value"][1])
                 for r in prom.query("sum by (finished_reason) (kvserve:request_success_total)")}
    assert sum(by_reason.values()) == N_STREAMS and set(by_reason) <= {"stop", "length", "abort"}
    assert by_reason.get("abort") == 0  # declared from the start, and no client went away
    assert prom.scalar('sum(kvserve:time_to_first_token_seconds_count{pod="kvserve-0"})') == N_STREAMS
    generated = prom.scalar('sum(kvserve:generation_tokens_total{pod="kvserve-0"})')
    assert generated == sum(t["completion_tokens"] for t in timings)


def test_ttft_quantile_agrees_with_the_servers_timings(scraped):
    """histogram_quantile lands between the buckets of the fastest and slowest first tokens the streams reported."""
    prom, timings, _ = scraped
    median = prom.scalar(f'histogram_quantile(0.5, sum by (le) ({TTFT}{{pod="kvserve-0"}}))')
    bounds = sorted(float(r["metric"]["le"]) for r in prom.query(f'{TTFT}{{pod="kvserve-0"}}'))
    ttfts_s = [t["ttft_ms"] / 1000 for t in timings]
    # 2% slack: the histogram and the timings take their clocks a few statements apart
    lowest, highest = min(ttfts_s) * 0.98, max(ttfts_s) * 1.02
    floor = max([0.0] + [b for b in bounds if b < lowest])
    ceiling = min(b for b in bounds if b >= highest)
    assert floor <= median <= ceiling, (median, ttfts_s, bounds)
    # the dashboard's form (a rate over a window) sees the same observations
    p99 = prom.scalar(f'histogram_quantile(0.99, sum by (le) (rate({TTFT}{{pod="kvserve-0"}}[1m])))')
    assert floor <= p99 <= ceiling, (p99, ttfts_s, bounds)


def test_429s_counted_and_ratio_recorded(scraped):
    prom, _, refused = scraped
    assert [r.status_code for r in refused] == [429] * N_REJECTED
    assert all(int(r.headers["retry-after"]) >= 1 for r in refused)
    assert prom.scalar('sum(kvserve:requests_rejected_total{reason="queue_full", pod="kvserve-1"})') == N_REJECTED
    # the recording rule behind KvserveRejectingRequests: every request to kvserve-1 was refused
    refusing = prom.instance["kvserve-1"]
    assert prom.scalar(f'instance:kvserve_requests_rejected:ratio_rate5m{{instance="{refusing}"}}') == 1.0


def test_shipped_alerts_load_and_the_429_alert_goes_pending(scraped):
    prom, _, _ = scraped
    groups = httpx.get(prom.url + "/api/v1/rules", timeout=5).json()["data"]["groups"]
    rules = {rule["name"]: rule for group in groups for rule in group["rules"]}
    assert {"KvserveDown", "KvserveQueueSaturating", "KvserveRejectingRequests", "KvserveKVCacheNearlyFull",
            "KvserveTTFTHigh"} <= set(rules)
    assert all(rule["health"] == "ok" for rule in rules.values()), rules

    def rejecting_alerts():
        alerts = httpx.get(prom.url + "/api/v1/alerts", timeout=5).json()["data"]["alerts"]
        return [a for a in alerts if a["labels"]["alertname"] == "KvserveRejectingRequests"]

    (alert,) = wait_for(rejecting_alerts, "KvserveRejectingRequests to go pending")
    # pending, not firing: its 'for: 5m' has not passed
    assert (alert["state"], alert["labels"]["instance"]) == ("pending", prom.instance["kvserve-1"])


def test_every_dashboard_query_evaluates(scraped):
    """Each panel's PromQL, with Grafana's variables filled in, runs and (but for 429s) returns series.

    The router's panels read vllm-router's own series, which only a cluster has (tests/test_cluster.py); here
    they must still parse and evaluate."""
    prom, _, _ = scraped
    panels = json.loads(DASHBOARD.read_text())["panels"]
    router_panels = 0
    for panel in panels:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$instance", ".*").replace("$__rate_interval", "1m")
            if "vllm_router_" in expr:
                assert prom.query(expr) == [], expr  # evaluates (a bad expression raises), no router here
                router_panels += 1
                continue
            result = prom.query(expr)
            assert result, f"{panel['title']}: {expr} returned nothing"
            assert all(not math.isinf(float(r["value"][1])) for r in result), (expr, result)
    assert router_panels >= 1


def test_adapter_query_gives_the_hpa_one_value_per_pod(scraped):
    """The Prometheus adapter's metricsQuery, rendered as the adapter does for a pod list request."""
    prom, _, _ = scraped
    (rule,) = yaml.safe_load(yaml.safe_load(ADAPTER.read_text())["data"]["config.yaml"])["rules"]
    series = re.match(r"[\w:]+", rule["seriesQuery"]).group(0)
    query = (rule["metricsQuery"].replace("<<.Series>>", series)
             .replace("<<.LabelMatchers>>", 'namespace="test",pod=~"kvserve-0|kvserve-1"')
             .replace("<<.GroupBy>>", "pod"))
    values = {r["metric"]["pod"]: float(r["value"][1]) for r in prom.query(query)}
    assert set(values) == {"kvserve-0", "kvserve-1"}
    assert all(0 <= v <= N_STREAMS for v in values.values())
    assert values["kvserve-1"] == 0.0  # it refused everything: nothing ever waited there


def vllm_dashboard_queries() -> list[str]:
    lines = VLLM_DASHBOARD_QUERIES.read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_vllms_dashboard_queries_return_data(scraped):
    """vLLM's own Grafana dashboard, unchanged: its model_name variable lists our model, and every panel's
    query returns series for it (the server runs with --vllm-metric-names)."""
    prom, _, _ = scraped
    # the dashboard's variable: label_values({__name__=~"vllm:.*"}, model_name)
    names = httpx.get(prom.url + "/api/v1/label/model_name/values", params={"match[]": '{__name__=~"vllm:.*"}'},
                      timeout=5).json()["data"]
    assert names == [MODEL_NAME]
    queries = vllm_dashboard_queries()
    assert len(queries) == 27
    empty = []
    for expr in queries:
        result = prom.query(expr.replace("$model_name", MODEL_NAME).replace("$__rate_interval", "1m"))
        print(f"{len(result)} series, first value {result[0]['value'][1] if result else None}: {expr}")
        if not result:
            empty.append(expr)
    assert not empty, f"{len(empty)} of vLLM's dashboard queries returned nothing: {empty}"


def test_an_hpa_rule_written_for_vllm_sees_every_pod(scraped):
    """A Prometheus-adapter rule as written for vLLM (queue length per pod) works unchanged."""
    prom, _, _ = scraped
    query = 'sum(vllm:num_requests_waiting{namespace="test",pod=~"kvserve-0|kvserve-1"}) by (pod)'
    assert {r["metric"]["pod"] for r in prom.query(query)} == {"kvserve-0", "kvserve-1"}
    # every series carries model_name, under both prefixes
    for prefix in ("kvserve", "vllm"):
        unlabelled = prom.query(f'count({{__name__=~"{prefix}:.*", model_name=""}})')
        assert not unlabelled, unlabelled
