"""What the live page shows, as plain data: slots, the KV pool's blocks, recent steps, counters and histograms.

The page keeps its own view of the server (``LiveView``), fed by what crosses the engine core's contract: the
requests submitted, each step's outputs and record (the service's ``on_step``), and each block's state as the block
manager tells its observer. It is read and fed on the event loop (the block observer is told on the engine thread
too: a byte per change, read as one copy), so a snapshot costs the step loop nothing: no lock, nothing sent to the
engine thread, no scheduler object read. No token ids or text go into a snapshot, so a viewer never sees another
request's prompt or output.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import orjson
from prometheus_client import Counter, Histogram

from kvserve.kvcache.block_manager import BlockState
from kvserve.scheduler.contract import EngineRequest, StepOutput, StepRecord
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


@dataclass(slots=True)
class Slot:
    """One request as its slot row shows it, from its outputs: counts only (tokens), never token ids or text."""

    request_id: int
    prompt: int
    generated: int = 0
    computed: int = 0        # tokens in the cache, as of its last output
    cached: int = 0
    drafted: int = 0
    accepted: int = 0
    preemptions: int = 0
    running: bool = False    # scheduled since it arrived or was last preempted
    blocks: list[int] = field(default_factory=list)

    @property
    def state(self) -> str:
        """``waiting``, ``preempted`` (waiting again after its blocks were taken), ``prefill`` (prompt or recompute
        tokens still to compute: chunked prefill) or ``decode`` (only the last sampled token to compute)."""
        if not self.running:
            return "preempted" if self.preemptions else "waiting"
        return "prefill" if self.prompt + self.generated - self.computed > 1 else "decode"

    def row(self) -> dict:
        return {"id": self.request_id, "state": self.state, "prompt": self.prompt, "generated": self.generated,
                "cached": self.cached, "drafted": self.drafted, "accepted": self.accepted,
                "preemptions": self.preemptions, "blocks": self.blocks}


class SlotBoard:
    """Every submitted request not yet finished, as a ``Slot``, in submission order."""

    def __init__(self) -> None:
        self.slots: dict[int, Slot] = {}

    def submitted(self, requests: list[EngineRequest]) -> None:
        for request in requests:
            self.slots[request.request_id] = Slot(request.request_id, len(request.prompt_ids))

    def stepped(self, step: StepOutput) -> None:
        """Apply a step's (or an abort's) outputs."""
        for output in step.outputs:
            slot = self.slots.get(output.request_id)
            if slot is None:
                continue
            if output.finished:
                del self.slots[output.request_id]
                continue
            if output.preempted:
                slot.running, slot.computed, slot.preemptions, slot.blocks = False, 0, slot.preemptions + 1, []
                continue
            slot.running = True
            slot.generated += len(output.tokens)
            slot.computed = output.num_computed_tokens
            slot.cached = output.num_cached_tokens
            slot.drafted += output.num_draft_tokens
            slot.accepted += output.num_accepted_tokens
            slot.blocks.extend(output.new_block_ids)

    def rows(self, max_waiting: int) -> list[dict]:
        """Running rows, then at most ``max_waiting`` waiting ones."""
        running = [slot.row() for slot in self.slots.values() if slot.running]
        waiting = []
        for slot in self.slots.values():
            if len(waiting) == max_waiting:
                break
            if not slot.running:
                waiting.append(slot.row())
        return running + waiting


class BlockStates:
    """Every block's ``BlockState`` as one ASCII digit, in block-id order: the block manager's observer
    (``kvcache.block_manager.BlockObserver``), so a snapshot copies one bytearray and never loops over the pool."""

    def __init__(self, num_blocks: int) -> None:
        self.states = bytearray(b"0" * num_blocks)

    def block_changed(self, block_id: int, state: BlockState) -> None:
        self.states[block_id] = 48 + state  # ord("0") + the state's digit

    def digits(self) -> str:
        """``"0012..."``."""
        return self.states.decode("ascii")


@dataclass(slots=True, frozen=True)
class StepBar:
    """One engine step as the page plots it. Tokens are counts in the step; ``ms`` is its wall time inside the
    runner; ``rows`` is the number of sequences in the batch."""

    n: int
    prefill: int
    decode: int
    draft: int
    ms: float
    rows: int

    @classmethod
    def of(cls, record: StepRecord) -> StepBar:
        return cls(record.index, record.prefill_tokens, record.decode_tokens, record.draft_tokens,
                   round(record.seconds * 1000, 3), record.rows)


class StepTrace:
    """The last ``size`` steps (a ring; appending is O(1), so the step loop pays nothing that grows)."""

    # A snapshot carries the steps of its last STEP_BUILDS builds and a page keeps its own longer history
    # (charts.js), so the ring only needs those with room to spare (64: three 0.2 s builds at 80 steps a second
    # are 48).
    def __init__(self, size: int = 64) -> None:
        self.steps: deque[StepBar] = deque(maxlen=size)
        self.count = 0

    def record(self, record: StepRecord) -> None:
        """Append one step."""
        self.count += 1
        self.steps.append(StepBar.of(record))


class LiveView:
    """The live page's view of the server: slots, blocks and recent steps, fed as described in the module docstring.

    Args:
        num_blocks: blocks in the KV pool (``blocks`` is the block manager's observer).
    """

    def __init__(self, num_blocks: int) -> None:
        self.slots = SlotBoard()
        self.blocks = BlockStates(num_blocks)
        self.steps = StepTrace()

    def stepped(self, step: StepOutput) -> None:
        """The service's ``on_step``: a step's outputs and record (or an abort's output)."""
        self.slots.stepped(step)
        if step.record is not None:
            self.steps.record(step.record)


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
        service: the scheduler service (its queue and step totals are read).
        metrics: the server's Metrics (TTFT and ITL histograms, 429s).
        live: the page's view of slots, blocks and steps.
        info: fixed facts about the server (model, pool size, limits), sent in every snapshot.
        min_interval_s: the fastest the snapshot is rebuilt (s); pages poll the hub at this rate.
    """

    def __init__(self, service: SchedulerService, metrics: Metrics, live: LiveView, info: dict,
                 min_interval_s: float = 0.1) -> None:
        self.service = service
        self.metrics = metrics
        self.live = live
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
            owners: request id -> the fingerprint of the key that sent it (``ServerState.request_owners``).
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
        totals = self.service.totals
        self._tokens.append((now, totals.generation_tokens, totals.steps))
        while len(self._tokens) > 2:
            t1, _, steps1 = self._tokens[1]  # the window's start were the oldest reading dropped
            if now - t1 < RATE_WINDOW_S or totals.steps - steps1 < RATE_MIN_STEPS:
                break
            self._tokens.popleft()
        (t0, n0, _), (t1, n1, _) = self._tokens[0], self._tokens[-1]
        return round((n1 - n0) / (t1 - t0), 1) if t1 > t0 else 0.0

    def build(self, now: float) -> dict:
        """The snapshot as a dict (see docs/ui.md for what each part means). Slots, blocks, steps and the queue
        are read now; the histograms and totals at most every ``SLOW_PARTS_S``."""
        if self._slow is None or now - self._slow_built >= SLOW_PARTS_S:
            self._slow = self.slow_parts(now)
            self._slow_built = now
        steps = self.live.steps
        since = self._marks[0] if len(self._marks) == STEP_BUILDS else 0
        self._marks.append(steps.count)
        return {
            "info": self.info,
            "slots": self.live.slots.rows(MAX_WAITING_ROWS),
            "queue": self.service.queued,
            "blocks": self.live.blocks.digits(),
            "steps": [[r.n, r.prefill, r.decode, r.draft, r.ms, r.rows] for r in steps.steps if r.n > since],
            **self._slow,
        }

    def slow_parts(self, now: float) -> dict:
        """The snapshot's totals, tokens/s and TTFT / ITL histograms."""
        totals = self.service.totals
        return {
            "totals": {"steps": totals.steps, "prompt_tokens": totals.prompt_tokens,
                       "generation_tokens": totals.generation_tokens, "preemptions": totals.preemptions,
                       "prefix_queries": totals.prefix_queries, "prefix_hits": totals.prefix_hits,
                       "rejected": counter_value(self.metrics.rejected, reason="queue_full")},
            "tokens_per_s": self.tokens_per_s(now, idle=not self.service.core.load.running and self.service.queued == 0),
            "ttft": histogram(self.metrics.ttft),
            "itl": histogram(self.metrics.itl),
        }
