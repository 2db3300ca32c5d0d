"""Prometheus metrics with vLLM's names under the ``kvserve:`` prefix, so existing dashboards transfer.

Histograms and per-request counters are observed by the server as outputs arrive; gauges and the step counters
are read at scrape time by a custom collector, from the engine core's load and the service's sums of step records.

Every series carries ``model_name`` (vLLM's dashboard filters every panel by it). Metrics are defined once,
under ``kvserve:``, in a source registry; the registry that ``/metrics`` exposes relabels them and, with
``--vllm-metric-names``, repeats each under ``vllm:`` too (plus vLLM's deprecated ``gpu_cache_usage_perc``
alias that its dashboard still plots), so vLLM's Grafana dashboard and HPA rules work unchanged.
Names and buckets follow vLLM v1 (vllm/v1/metrics/loggers.py).
"""

from __future__ import annotations

from collections.abc import Callable
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvserve.scheduler.service import SchedulerService
from kvserve.server.choice import ChoiceTimes
from kvserve.speculation.policy import DraftPolicy

_P = "kvserve:"
VLLM_PREFIX = "vllm:"
# No ``*_created`` series (each counter's and histogram's start time, one more series per family and label set):
# vLLM turns them off too, and no dashboard, rule or scrape of kvserve reads them. Process-wide, as
# prometheus_client's switch is.
disable_created_metrics()
# Buckets (s) as vLLM's: TTFT and queue time span ms to minutes; ITL is ms-scale.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
# vLLM's request_latency_buckets: e2e, queue, inference, prefill and decode time per request
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)
_E2E_BUCKETS = _REQUEST_BUCKETS
# request_success_total's finished_reason: vLLM's FinishReason values but error, which kvserve counts in
# request_failure_total; abort: the client went away, or the drain cut the stream
FINISH_REASONS = ("stop", "length", "abort")
# requests_rejected_total's reason: queue_full (429, --max-queue), draining (503 after SIGTERM, server/drain.py)
REJECT_REASONS = ("queue_full", "draining")
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_value`` (the context length)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class _SchedulerCollector:
    """Reads gauges (the core's load) and the step counters (summed step records) at scrape time, and speculation's
    from ``drafts``."""

    def __init__(self, service: SchedulerService, drafts: DraftPolicy | None) -> None:
        self.service = service
        self.drafts = drafts

    def collect(self):
        load, totals = self.service.core.load, self.service.totals
        yield GaugeMetricFamily(_P + "num_requests_running", "Sequences in the running batch.", value=load.running)
        yield GaugeMetricFamily(_P + "num_requests_waiting", "Sequences waiting to be scheduled.", value=load.waiting)
        yield GaugeMetricFamily(_P + "kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", value=load.kv_usage)
        yield CounterMetricFamily(_P + "num_preemptions", "Sequences preempted for KV blocks.",
                                  value=totals.preemptions)
        yield CounterMetricFamily(_P + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                  value=totals.prefix_queries)
        yield CounterMetricFamily(_P + "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                  value=totals.prefix_hits)
        yield CounterMetricFamily(_P + "prompt_tokens", "Prompt tokens computed (prefill).", value=totals.prompt_tokens)
        yield CounterMetricFamily(_P + "generation_tokens", "Tokens generated.", value=totals.generation_tokens)
        yield CounterMetricFamily(_P + "engine_steps", "Model steps run.", value=totals.steps)
        yield CounterMetricFamily(_P + "engine_step_seconds", "Wall time inside the model runner (s).",
                                  value=totals.engine_s)
        # vLLM's speculative-decoding families under our prefix; zero without --speculative, so that the
        # dashboard's panel and a rule over them evaluate on every server
        draft = self.drafts
        yield CounterMetricFamily(_P + "spec_decode_num_drafts", "Verify passes of sequences with drafts.",
                                  value=draft.num_drafts if draft else 0)
        yield CounterMetricFamily(_P + "spec_decode_num_draft_tokens", "Draft tokens verified.",
                                  value=draft.drafted if draft else 0)
        yield CounterMetricFamily(_P + "spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                  value=draft.accepted if draft else 0)
        per_pos = CounterMetricFamily(_P + "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the draft (0: first).", labels=["position"])
        for position in range(draft.max_draft if draft else 0):
            count = draft.accepted_per_pos[position] if position < len(draft.accepted_per_pos) else 0
            per_pos.add_metric([str(position)], count)
        yield per_pos
        yield CounterMetricFamily(_P + "scheduler_loop_seconds",
                                  "Wall time between consecutive steps while work was left (s).",
                                  value=self.service.totals.loop_s)


class _Exposed:
    """The source registry's families as ``/metrics`` shows them: ``model_name`` on every sample, and each
    family under every prefix asked for (``kvserve:`` and optionally ``vllm:``)."""

    # vLLM still exposes (and its dashboard still plots) the pre-0.9 name of kv_cache_usage_perc
    _VLLM_ALIASES = {"kv_cache_usage_perc": "gpu_cache_usage_perc"}

    def __init__(self, source: CollectorRegistry, model_name: str, vllm_names: bool) -> None:
        self.source = source
        self.model_name = model_name
        self.vllm_names = vllm_names

    def _renamed(self, family: Metric, prefix: str, base: str) -> Metric:
        out = Metric(prefix + base, family.documentation, family.type, family.unit)
        for sample in family.samples:
            name = prefix + base + sample.name.removeprefix(family.name)  # keeps _bucket, _total, _created, ...
            out.add_sample(name, {"model_name": self.model_name, **sample.labels}, sample.value, sample.timestamp,
                           sample.exemplar)
        return out

    def collect(self):
        for family in self.source.collect():
            base = family.name.removeprefix(_P)
            yield self._renamed(family, _P, base)
            if self.vllm_names:
                yield self._renamed(family, VLLM_PREFIX, base)
                if base in self._VLLM_ALIASES:
                    yield self._renamed(family, VLLM_PREFIX, self._VLLM_ALIASES[base])


class Metrics:
    """All of one server's metrics, in their own registry (several servers can live in one process).

    Args:
        service: the scheduler service whose gauges and counters are read at scrape time.
        model_name: the served model name (the ``model_name`` label).
        max_model_len: context length (tokens); the token-count histograms' buckets end there.
        cache_info: ``cache_config_info``'s labels (block size, blocks, dtype, prefix caching).
        vllm_names: expose every family under ``vllm:`` too (``--vllm-metric-names``).
        drafts: speculation's draft-length policy, whose totals the spec_decode families read; None without
            speculation (they read 0).

    ``registry`` is what ``/metrics`` serves; metrics are defined in ``source`` (``r`` below).
    """

    def __init__(self, service: SchedulerService, model_name: str = "", max_model_len: int = 2048,
                 cache_info: dict[str, str] | None = None, vllm_names: bool = False,
                 drafts: DraftPolicy | None = None) -> None:
        self.source = CollectorRegistry()
        self.registry = CollectorRegistry()
        self.registry.register(_Exposed(self.source, model_name, vllm_names))
        self.source.register(_SchedulerCollector(service, drafts))
        r = self.source
        self.ttft = Histogram(_P + "time_to_first_token_seconds", "Time to first token (s), from arrival.",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram(_P + "inter_token_latency_seconds", "Time between consecutive tokens (s).",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram(_P + "e2e_request_latency_seconds", "Arrival to last token (s).",
                             buckets=_E2E_BUCKETS, registry=r)
        self.queue = Histogram(_P + "request_queue_time_seconds", "Arrival to first scheduling (s).",
                               buckets=_REQUEST_BUCKETS, registry=r)
        self.success = Counter(_P + "request_success", "Finished requests by finish reason.",
                               ["finished_reason"], registry=r)
        self.failed = Counter(_P + "request_failure", "Requests that failed in the engine.", registry=r)
        self.rejected = Counter(_P + "requests_rejected", "Requests refused before admission, by reason.",
                                ["reason"], registry=r)
        # series exist from the start, so rate() sees the first increase too
        for reason in REJECT_REASONS:
            self.rejected.labels(reason=reason)
        for reason in FINISH_REASONS:
            self.success.labels(finished_reason=reason)
        self._add_vllm_families(r, max_model_len, cache_info or {})

    # -- vLLM's per-request and per-step families (its dashboards and autoscaling rules read them) --------------
    def _add_vllm_families(self, r: CollectorRegistry, max_model_len: int, cache_info: dict[str, str]) -> None:
        tokens = buckets_1_2_5(max_model_len)
        self.tpot = Histogram(_P + "time_per_output_token_seconds", "Time per output token after the first (s).",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.prompt_tokens = Histogram(_P + "request_prompt_tokens", "Prompt tokens per finished request.",
                                       buckets=tokens, registry=r)
        self.generation_tokens = Histogram(_P + "request_generation_tokens",
                                           "Generated tokens per finished request.", buckets=tokens, registry=r)
        self.max_generation_tokens = Histogram(
            _P + "request_max_num_generation_tokens",
            "Most tokens generated by one choice of a finished request (its n choices).", buckets=tokens, registry=r)
        self.inference = Histogram(_P + "request_inference_time_seconds",
                                   "First scheduling to last token (s): time in the running batch.",
                                   buckets=_REQUEST_BUCKETS, registry=r)
        self.prefill = Histogram(_P + "request_prefill_time_seconds", "First scheduling to first token (s).",
                                 buckets=_REQUEST_BUCKETS, registry=r)
        self.decode = Histogram(_P + "request_decode_time_seconds", "First token to last token (s).",
                                buckets=_REQUEST_BUCKETS, registry=r)
        self.iteration_tokens = Histogram(_P + "iteration_tokens_total", "Tokens computed per engine step.",
                                          buckets=_ITERATION_TOKEN_BUCKETS, registry=r)
        self.params_n = Histogram(_P + "request_params_n", "The n parameter of admitted requests.",
                                  buckets=_N_BUCKETS, registry=r)
        self.params_max_tokens = Histogram(_P + "request_params_max_tokens",
                                           "The max_tokens parameter of admitted requests (tokens).",
                                           buckets=tokens, registry=r)
        if cache_info:
            r.register(_InfoCollector(_P + "cache_config_info", "The KV cache's configuration (value 1).",
                                      cache_info))

    def count_kv_events_dropped(self, dropped: Callable[[], int]) -> None:
        """Expose ``kv_events_dropped``: KV events the publisher dropped on a full queue (``dropped()``, read at each
        scrape); after a drop the next batch resends the whole cache (server/kv_events.py)."""
        self.source.register(_CallbackCounter(_P + "kv_events_dropped",
                                              "KV cache events dropped on the publisher's full queue.", dropped))

    def request_admitted(self, n: int, max_tokens: int) -> None:
        """Observe one admitted request's ``n`` and ``max_tokens``."""
        self.params_n.observe(n)
        self.params_max_tokens.observe(max_tokens)

    def tokens_returned(self, times: ChoiceTimes, previous: float | None, now: float, step_tokens: int = 1) -> None:
        """Observe the ``step_tokens`` tokens one step returned to a client: TTFT for a choice's first, else the gap
        since its previous token (ITL; TPOT as vLLM's per-token histogram, as its dashboard plots). Times:
        ``time.perf_counter()`` s; ``previous`` is None for the first token. TTFT is the choice's first token time,
        the same one the response's ``timings`` report.

        The tokens one verify pass accepts (speculative decoding) arrive together: ITL is observed once per step
        that delivered tokens, as vLLM does (a gap of 0 between them would flatter it), and TPOT shares the step's
        gap among its tokens, so its mean stays per token."""
        if previous is None:
            first_token = times.first_token if times.first_token is not None else now
            self.ttft.observe(first_token - times.arrival)
        elif now != previous:
            self.itl.observe(now - previous)
            for _ in range(step_tokens):
                self.tpot.observe((now - previous) / step_tokens)

    def choice_finished(self, times: ChoiceTimes, prompt_tokens: int, reason: str, generated: int,
                        now: float) -> None:
        """Observe one choice finished other than by an error (``reason``: one of ``FINISH_REASONS``; an aborted
        choice counts too, as vLLM counts it): e2e and queue time, its token counts, its phases' durations (s), and
        the finish reason.

        Phases as vLLM times them: prefill = first scheduling to first token, decode = first token to the
        last, inference = their sum; ``now`` is the finish time on ``time.perf_counter``'s clock.
        """
        self.e2e.observe(now - times.arrival)
        self.success.labels(finished_reason=reason).inc()
        self.prompt_tokens.observe(prompt_tokens)
        self.generation_tokens.observe(generated)
        if times.first_scheduled is None:
            return
        self.queue.observe(times.first_scheduled - times.arrival)
        self.inference.observe(now - times.first_scheduled)
        first_token = times.first_token if times.first_token is not None else now
        self.prefill.observe(first_token - times.first_scheduled)
        self.decode.observe(now - first_token)


class _InfoCollector:
    """An info-style gauge: one series, value 1, the facts in its labels (vLLM's ``cache_config_info``)."""

    def __init__(self, name: str, documentation: str, labels: dict[str, str]) -> None:
        self.name, self.documentation, self.labels = name, documentation, labels

    def collect(self):
        family = GaugeMetricFamily(self.name, self.documentation, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), 1.0)
        yield family


class _CallbackCounter:
    """A counter whose value a callable reads at each scrape."""

    def __init__(self, name: str, documentation: str, value: Callable[[], int]) -> None:
        self.name, self.documentation, self.value = name, documentation, value

    def collect(self):
        yield CounterMetricFamily(self.name, self.documentation, value=self.value())
