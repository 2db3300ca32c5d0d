"""What the live page shows, as plain data: slots, the KV pool's blocks, recent steps, counters and histograms.

Everything here is read on the event loop from what the scheduler, its block manager and the metrics already
keep. The scheduler's state changes only on the event loop too (its service task plans and applies results
there; the engine thread works on a copy, the StepPlan), so a snapshot taken between two awaits is consistent
and costs the step loop nothing: no lock, nothing sent to the engine thread. No token ids or text go into a
snapshot, so a viewer never sees another request's prompt or output.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import orjson
from prometheus_client import Counter, Histogram

from kvserve.engine.plan import StepPlan
from kvserve.scheduler.sequence import SeqStatus, Sequence
from kvserve.scheduler.service import SchedulerService
from kvserve.server.metrics import Metrics

MAX_WAITING_ROWS = 32   # waiting sequences listed one by one; the rest are only counted
RATE_WINDOW_S = 2.0     # tokens/s is measured over a trailing window of at least this long (s) ...
RATE_MIN_STEPS = 8      # ... and at least this many engine steps: a loaded step can outlast RATE_WINDOW_S, and a
                        # window holding no step read 0 between two busy ones
RATE_READINGS = 600     # readings kept at most (one per SLOW_PARTS_S): a window of long steps stops growing there
STEP_BUILDS = 3         # a snapshot carries the steps of the last this many builds (see SnapshotHub)
SLOW_PARTS_S = 1.0      # the histograms and totals are rebuilt at most this often (s): reading a Prometheus
                        # histogram costs about as much as the rest of a snapshot, and a person reads a
                        # distribution or a total once a second at most (the live page's overhead: BENCHMARKS.md)


def slot_state(seq: Sequence) -> str:
    """``waiting``, ``preempted`` (waiting again after its blocks were taken), ``prefill`` (prompt or recompute
    tokens still to compute: chunked prefill, or the step now running computes them) or ``decode``."""
    if seq.status is SeqStatus.WAITING:
        return "preempted" if seq.num_preemptions else "waiting"
    return "prefill" if seq.num_uncomputed > 1 else "decode"


def slot_row(seq: Sequence) -> dict:
    """One slot row: ids and counts only (tokens), never token ids or text."""
    return {"id": seq.seq_id, "state": slot_state(seq), "prompt": len(seq.prompt_ids), "generated": len(seq.output_ids),
            "cached": seq.num_cached_tokens or 0, "drafted": seq.num_draft_tokens, "accepted": seq.num_accepted_tokens,
            "preemptions": seq.num_preemptions, "blocks": list(seq.block_table)}


@dataclass(slots=True, frozen=True)
class StepRecord:
    """One engine step as the page plots it. Tokens are counts in the step; ``ms`` is its wall time inside the
    runner; ``rows`` is the number of sequences in the batch."""

    n: int
    prefill: int
    decode: int
    draft: int
    ms: float
    rows: int

    @classmethod
    def of(cls, n: int, plan: StepPlan, seconds: float) -> StepRecord:
        """The record of step ``n`` (1-based) that ran ``plan`` in ``seconds``."""
        prefill = sum(len(w.token_ids) for w in plan.work if not w.is_decode)
        draft = plan.num_draft_tokens
        return cls(n, prefill, plan.num_tokens - prefill - draft, draft, round(seconds * 1000, 3), len(plan.work))


class StepTrace:
    """The last ``size`` steps (a ring; appending is O(1), so the step loop pays nothing that grows)."""

    # A snapshot carries the steps of its last STEP_BUILDS builds and a page keeps its own longer history
    # (charts.js), so the ring only needs those with room to spare (64: three 0.2 s builds at 80 steps a second
    # are 48).
    def __init__(self, size: int = 64) -> None:
        self.steps: deque[StepRecord] = deque(maxlen=size)
        self.count = 0

    def record(self, plan: StepPlan, seconds: float) -> None:
        """Append one step (the service's ``on_step`` observer calls this on the event loop)."""
        self.count += 1
        self.steps.append(StepRecord.of(self.count, plan, seconds))


def histogram(metric: Histogram) -> dict:
    """A Prometheus histogram as the page draws it: bucket upper bounds (s) and the count in each bucket (not
    cumulative), the last bucket being ``+Inf``."""
    bounds, cumulative = [], []
    for sample in metric.collect()[0].samples:
        if sample.name.endswith("_bucket"):
            bounds.append(sample.labels["le"])
            cumulative.append(sample.value)
    counts = [int(c - p) for c, p in zip(cumulative, [0.0] + cumulative[:-1])]
    return {"le": bounds, "counts": counts}


def counter_value(metric: Counter, **labels: str) -> int:
    """A counter's current total (one labelled child's when ``labels`` are given)."""
    child = metric.labels(**labels) if labels else metric
    return int(next(s.value for s in child.collect()[0].samples if s.name.endswith("_total")))


class SnapshotHub:
    """Builds the page's snapshot at most once per ``min_interval_s``, however many pages are open.

    Args:
        service: the scheduler service (its scheduler, blocks and step counters are read).
        metrics: the server's Metrics (TTFT and ITL histograms, 429s).
        steps: the trace of recent steps.
        info: fixed facts about the server (model, pool size, limits), sent in every snapshot.
        min_interval_s: the fastest the snapshot is rebuilt (s); pages poll the hub at this rate.
    """

    def __init__(self, service: SchedulerService, metrics: Metrics, steps: StepTrace, info: dict,
                 min_interval_s: float = 0.1) -> None:
        self.service = service
        self.metrics = metrics
        self.steps = steps
        self.info = info
        self.min_interval_s = min_interval_s
        self._json: str | None = None
        self._snapshot: dict | None = None
        self._views: dict[str, str] = {}  # owner -> the snapshot as that key's page sees it, since the last build
        self._built = 0.0
        self._slow: dict | None = None  # the histograms and totals, rebuilt every SLOW_PARTS_S
        self._slow_built = 0.0
        # (time s, generation tokens, steps), one per slow_parts call, over the window of tokens_per_s
        self._tokens: deque[tuple[float, int, int]] = deque(maxlen=RATE_READINGS)
        # the step count at each of the last STEP_BUILDS builds: a snapshot carries the steps since the oldest, so a
        # page that missed a build or two (pages poll at the hub's rate, on their own clocks) still gets every step,
        # and no snapshot carries the whole ring (most of a snapshot's JSON, encoded at every build)
        self._marks: deque[int] = deque(maxlen=STEP_BUILDS)

    def latest(self, owner: str | None = None, owners: dict[int, str] | None = None) -> str:
        """The snapshot as JSON text, rebuilt when older than ``min_interval_s``.

        Args:
            owner: the viewer's API key fingerprint (server.auth): its page lists only the slots of its own
                requests; None lists every slot (no keys, or an admin key).
            owners: seq_id -> the fingerprint of the key that sent it (``ServerState.seq_owners``).
        """
        now = time.monotonic()
        if self._json is None or now - self._built >= self.min_interval_s:
            # orjson, not json: with the standard encoder, encoding the lists of small ints was most of a snapshot's
            # cost on the event loop (python -m kvserve.loadtest ui measures the page's cost: BENCHMARKS.md)
            self._snapshot = self.build(now)
            self._json = orjson.dumps(self._snapshot).decode()
            self._views.clear()
            self._built = now
        if owner is None:
            return self._json
        if owner not in self._views:
            mine = [row for row in self._snapshot["slots"] if (owners or {}).get(row["id"]) == owner]
            self._views[owner] = orjson.dumps(self._snapshot | {"slots": mine}).decode()
        return self._views[owner]

    def tokens_per_s(self, now: float, idle: bool = False) -> float:
        """Generated tokens per second over a trailing window that spans at least RATE_WINDOW_S and at least
        RATE_MIN_STEPS engine steps (so a window never falls between two long steps); 0 until two readings exist,
        and 0 while the server is ``idle`` (nothing running or queued: the window starts afresh with the next
        request, and an idle server's snapshot stops changing, so none is sent)."""
        if idle:
            self._tokens.clear()
            return 0.0
        stats = self.service.stats
        self._tokens.append((now, stats.generation_tokens, stats.steps))
        while len(self._tokens) > 2:
            t1, _, steps1 = self._tokens[1]  # the window's start were the oldest reading dropped
            if now - t1 < RATE_WINDOW_S or stats.steps - steps1 < RATE_MIN_STEPS:
                break
            self._tokens.popleft()
        (t0, n0, _), (t1, n1, _) = self._tokens[0], self._tokens[-1]
        return round((n1 - n0) / (t1 - t0), 1) if t1 > t0 else 0.0

    def build(self, now: float) -> dict:
        """The snapshot as a dict (see docs/ui.md for what each part means). Slots, blocks, steps and the queue
        are read now; the histograms and totals at most every ``SLOW_PARTS_S``."""
        sched = self.service.scheduler
        waiting = list(sched.waiting)
        pending = self.service.queued - len(waiting)  # submitted, not yet taken from the inbox
        if self._slow is None or now - self._slow_built >= SLOW_PARTS_S:
            self._slow = self.slow_parts(now)
            self._slow_built = now
        since = self._marks[0] if len(self._marks) == STEP_BUILDS else 0
        self._marks.append(self.steps.count)
        return {
            "info": self.info,
            "slots": [slot_row(s) for s in sched.running] + [slot_row(s) for s in waiting[:MAX_WAITING_ROWS]],
            "queue": len(waiting) + pending,
            "blocks": sched.blocks.state_digits(),
            "steps": [[r.n, r.prefill, r.decode, r.draft, r.ms, r.rows] for r in self.steps.steps if r.n > since],
            **self._slow,
        }

    def slow_parts(self, now: float) -> dict:
        """The snapshot's totals, tokens/s and TTFT / ITL histograms."""
        sched = self.service.scheduler
        return {
            "totals": {"steps": self.service.stats.steps, "prompt_tokens": self.service.stats.prompt_tokens,
                       "generation_tokens": self.service.stats.generation_tokens,
                       "preemptions": sched.num_preemptions, "prefix_queries": sched.prefix_queries,
                       "prefix_hits": sched.prefix_hits,
                       "rejected": counter_value(self.metrics.rejected, reason="queue_full")},
            "tokens_per_s": self.tokens_per_s(now, idle=not sched.running and self.service.queued == 0),
            "ttft": histogram(self.metrics.ttft),
            "itl": histogram(self.metrics.itl),
        }
