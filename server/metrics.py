"""Prometheus metrics with vLLM's names under the ``kvserve:`` prefix, so existing dashboards transfer.

Histograms and per-request counters are observed by the server as events arrive; gauges and the
scheduler's own counters are read from the scheduler at scrape time by a custom collector.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from scheduler.service import SchedulerService

_P = "kvserve:"
# Buckets (s) after vLLM's: TTFT and queue time span ms to minutes; ITL is ms-scale.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0)


class _SchedulerCollector:
    """Reads gauges and the scheduler's counters at scrape time."""

    def __init__(self, service: SchedulerService) -> None:
        self.service = service

    def collect(self):
        sched = self.service.scheduler
        yield GaugeMetricFamily(_P + "num_requests_running", "Sequences in the running batch.",
                                value=len(sched.running))
        yield GaugeMetricFamily(_P + "num_requests_waiting", "Sequences waiting to be scheduled.",
                                value=len(sched.waiting))
        yield GaugeMetricFamily(_P + "kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).",
                                value=sched.blocks.usage)
        yield CounterMetricFamily(_P + "num_preemptions", "Sequences preempted for KV blocks.",
                                  value=sched.num_preemptions)
        yield CounterMetricFamily(_P + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                  value=sched.prefix_queries)
        yield CounterMetricFamily(_P + "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                  value=sched.prefix_hits)
        yield CounterMetricFamily(_P + "prompt_tokens", "Prompt tokens computed (prefill).",
                                  value=self.service.stats.prompt_tokens)
        yield CounterMetricFamily(_P + "generation_tokens", "Tokens generated.",
                                  value=self.service.stats.generation_tokens)
        yield CounterMetricFamily(_P + "engine_steps", "Model steps run.", value=self.service.stats.steps)
        yield CounterMetricFamily(_P + "engine_step_seconds", "Wall time inside the model runner (s).",
                                  value=self.service.stats.engine_s)
        yield CounterMetricFamily(_P + "scheduler_loop_seconds",
                                  "Wall time between consecutive steps while work was left (s).",
                                  value=self.service.stats.loop_s)


class Metrics:
    """All of one server's metrics, in their own registry (several servers can live in one process)."""

    def __init__(self, service: SchedulerService) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_SchedulerCollector(service))
        r = self.registry
        self.ttft = Histogram(_P + "time_to_first_token_seconds", "Time to first token (s), from arrival.",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram(_P + "inter_token_latency_seconds", "Time between consecutive tokens (s).",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram(_P + "e2e_request_latency_seconds", "Arrival to last token (s).",
                             buckets=_E2E_BUCKETS, registry=r)
        self.queue = Histogram(_P + "request_queue_time_seconds", "Arrival to first scheduling (s).",
                               buckets=_TTFT_BUCKETS, registry=r)
        self.success = Counter(_P + "request_success", "Finished requests by finish reason.",
                               ["finished_reason"], registry=r)
        self.failed = Counter(_P + "request_failure", "Requests that failed in the engine.", registry=r)
        self.rejected = Counter(_P + "requests_rejected", "Requests refused before admission, by reason.",
                                ["reason"], registry=r)
        # series exist from the start, so rate() sees the first increase too
        self.rejected.labels(reason="queue_full")
        for reason in ("stop", "length"):
            self.success.labels(finished_reason=reason)
