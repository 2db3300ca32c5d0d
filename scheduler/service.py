"""The scheduler as an asyncio actor: one task owns all scheduling state.

HTTP handlers never touch the Scheduler: they ``submit`` a sequence (admitted to the inbox or refused
at once with QueueFull) and ``abort`` it; both are commands the loop applies between steps. The model
step runs in a single worker thread, so the event loop keeps answering HTTP during a step.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvserve.engine.plan import SeqResult, StepPlan
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.sequence import FinishReason, SeqEvent, Sequence

log = logging.getLogger("kvserve.scheduler")

_COLD_START_S_PER_REQUEST = 1.0  # Retry-After estimate before two requests have finished (s/request)


class QueueFull(Exception):
    """The waiting queue is at ``max_queue``; ``retry_after_s`` comes from the measured drain rate."""

    def __init__(self, queue_len: int, retry_after_s: int) -> None:
        super().__init__(f"server is at capacity: {queue_len} requests are waiting; retry after {retry_after_s} s")
        self.queue_len = queue_len
        self.retry_after_s = retry_after_s


class _Command(enum.Enum):
    ADD = "add"
    ABORT = "abort"


@dataclass(slots=True)
class StepStats:
    """Counters the metrics endpoint reads (tokens, steps)."""

    steps: int = 0
    prompt_tokens: int = 0       # prompt tokens computed (prefix-cache hits excluded)
    generation_tokens: int = 0
    engine_s: float = 0.0        # wall time inside the model runner (s)
    loop_s: float = 0.0          # wall time between consecutive steps while work was left (s): scheduling,
                                 # applying results, waking the worker thread


class SchedulerService:
    """Runs the scheduling loop.

    Args:
        scheduler: the planning core (owned by this service's task from now on).
        execute: computes a StepPlan (the model runner's ``execute``, or with speculation the ``execute`` of the
            scheduler's ``spec``, which runs the runner's and then its drafter); runs in a worker thread.
        max_queue: waiting sequences beyond which ``submit`` raises QueueFull.
        on_step: called after each successful step with its plan and wall time (s), e.g. to log step costs.
        executor: the single worker thread that runs steps; pass the thread that loaded the model (see
            ``server.serve.run``: one thread for all torch work keeps a single OpenMP team). Default: a new one.
    """

    def __init__(self, scheduler: Scheduler, execute: Callable[[StepPlan], list[SeqResult]], max_queue: int,
                 on_step: Callable[[StepPlan, float], None] | None = None,
                 executor: ThreadPoolExecutor | None = None) -> None:
        self.scheduler = scheduler
        self.on_step = on_step
        self.execute = execute
        self.max_queue = max_queue
        self.stats = StepStats()
        self.dead: BaseException | None = None
        self._inbox: asyncio.Queue[tuple[_Command, object]] = asyncio.Queue()
        self._pending_adds = 0
        # submitted and not yet told their end: whatever fails, each of them hears of it (``_fail_all``)
        self._admitted: dict[int, Sequence] = {}
        self._executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-step")
        self._task: asyncio.Task | None = None

    # -- commands (called from handlers) -------------------------------------------------------------
    def submit(self, seqs: list[Sequence]) -> None:
        """Queue sequences (the choices of one request) or refuse them all at once.

        The bound counts sequences (a request with n choices counts n) that will wait: those beyond the slots
        free at the next step, so a burst into idle slots is not refused. With max_queue > 0 a request that
        finds nobody waiting is always accepted, so a large n cannot be refused forever; max_queue = 0 refuses
        every request.

        Raises:
            QueueFull: the waiting queue would exceed max_queue.
            RuntimeError: the loop has died.
        """
        if self.dead is not None:
            raise RuntimeError(f"engine loop has died: {self.dead!r}")
        queued = len(self.scheduler.waiting) + self._pending_adds  # not running yet
        free = self.scheduler.free_slots()
        waiting = max(0, queued - free)
        if self.max_queue == 0 or (waiting and queued + len(seqs) - free > self.max_queue):
            raise QueueFull(waiting, self.retry_after_s(waiting))
        self._pending_adds += len(seqs)
        for seq in seqs:
            self._admitted[seq.seq_id] = seq
            self._inbox.put_nowait((_Command.ADD, seq))

    @property
    def queued(self) -> int:
        """Sequences submitted and not running yet: waiting in the scheduler or still in the inbox."""
        return len(self.scheduler.waiting) + self._pending_adds

    def abort(self, seq_id: int) -> None:
        """Ask the loop to drop a sequence (queued or running); it is removed before the next step."""
        self._inbox.put_nowait((_Command.ABORT, seq_id))

    def retry_after_s(self, queued: int) -> int:
        """Seconds until ``queued`` waiting requests should have drained, from the measured finish rate."""
        rate = self.scheduler.finish_rate.rate()
        seconds = (queued + 1) / rate if rate else (queued + 1) * _COLD_START_S_PER_REQUEST
        return max(1, min(600, math.ceil(seconds)))

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvserve-scheduler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        self._executor.shutdown(wait=False, cancel_futures=True)

    @property
    def healthy(self) -> bool:
        return self.dead is None and self._task is not None and not self._task.done()

    # -- the loop ------------------------------------------------------------------------------------
    def _apply(self, command: _Command, payload: object) -> None:
        if command is _Command.ADD:
            self._pending_adds -= 1
            self.scheduler.add(payload)
        else:
            seq = self.scheduler.abort(payload)
            if seq is not None:
                self._deliver(seq, SeqEvent(seq.seq_id, finish=FinishReason.ABORT))

    def _deliver(self, seq: Sequence, event: SeqEvent) -> None:
        """Put ``event`` on the sequence's stream; its last event retires it from ``_admitted``."""
        seq.events.put_nowait(event)
        if event.finish is not None:
            self._admitted.pop(seq.seq_id, None)

    def _drain_inbox(self) -> None:
        while not self._inbox.empty():
            self._apply(*self._inbox.get_nowait())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        last_end: float | None = None  # when the previous step ended, if work was left after it
        try:
            while True:
                # going idle waits for a request, once the engine has freed what ended sequences held there
                if not self.scheduler.has_work and self._inbox.empty() and not self.scheduler.ended_ids:
                    self._apply(*await self._inbox.get())
                self._drain_inbox()
                plan = self.scheduler.schedule()
                if not plan.work:
                    if plan.ended_ids:  # a plan with no work only frees what ended sequences held in the engine
                        await self._free_ended(loop, plan)
                    if self.scheduler.has_work:
                        await asyncio.sleep(0.005)  # nothing fits now (only possible transiently)
                    continue
                if last_end is not None:
                    self.stats.loop_s += time.perf_counter() - last_end
                started = time.perf_counter()
                try:
                    results = await loop.run_in_executor(self._executor, self.execute, plan)
                except Exception as exc:  # a failed step fails only its own sequences
                    log.exception("engine step failed")
                    self._fail(plan, exc)
                    last_end = None
                    continue
                self.stats.steps += 1
                seconds = time.perf_counter() - started
                self.stats.engine_s += seconds
                if self.on_step is not None:
                    self._observe(plan, seconds)
                self._count(plan, results)
                if self.scheduler.spec is not None:  # speculation learns acceptance and step costs
                    self.scheduler.spec.observe(plan, results, self.scheduler.running, seconds)
                for seq, event in self.scheduler.update(plan, results):
                    self._deliver(seq, event)
                last_end = time.perf_counter() if self.scheduler.has_work else None
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self.dead = exc  # from now on submit refuses, and /health and /live answer 503
            log.exception("scheduler loop died")
            self._fail_all(exc)
            raise

    async def _free_ended(self, loop: asyncio.AbstractEventLoop, plan: StepPlan) -> None:
        """Run a plan that only frees what ended sequences held in the engine (a drafter's K/V).

        No sequence waits on it, so a failure is logged and serving goes on: the ended sequences' engine state
        is at worst left allocated, never served to anyone (the next sequence with that id is a new one).
        """
        try:
            await loop.run_in_executor(self._executor, self.execute, plan)
        except Exception:
            log.exception("freeing ended sequences in the engine failed; serving goes on")

    def _fail_all(self, exc: BaseException) -> None:
        """End every admitted sequence with an error event: waiting, running, still in the inbox, or finished in
        a step whose events were never delivered."""
        for seq in list(self._admitted.values()):
            self._deliver(seq, SeqEvent(seq.seq_id, finish=FinishReason.ERROR, error=f"engine loop died: {exc!r}"))

    def _observe(self, plan: StepPlan, seconds: float) -> None:
        """Call ``on_step``; an observer that fails (a step log on a full disk) is dropped, never the loop."""
        try:
            self.on_step(plan, seconds)
        except Exception:
            log.exception("step observer failed; it is switched off, serving goes on")
            self.on_step = None

    def _count(self, plan: StepPlan, results: list[SeqResult]) -> None:
        for w, result in zip(plan.work, results):
            if not w.is_decode:  # a recompute after preemption also recomputes generated tokens: not prompt ones
                self.stats.prompt_tokens += min(w.context_len, len(w.prompt_ids)) - w.start_pos
            self.stats.generation_tokens += len(result.tokens)

    def _fail(self, plan: StepPlan, exc: Exception) -> None:
        for w in plan.work:
            seq = self.scheduler.abort(w.seq_id, FinishReason.ERROR)
            if seq is not None:
                self._deliver(seq, SeqEvent(seq.seq_id, finish=FinishReason.ERROR, error=f"engine step failed: {exc}"))
