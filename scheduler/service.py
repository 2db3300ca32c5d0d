"""The engine core as an asyncio actor: one task drives it, HTTP handlers only send commands.

Handlers ``submit`` requests (admitted to the inbox, or refused at once with QueueFull) with the stream each one's
outputs go to, and ``abort`` them; the loop applies both between steps and runs ``EngineCore.step`` on a single
worker thread, so the event loop keeps answering HTTP during a whole step (planning and applying included). The
core never sees a stream: outputs come back keyed by request id and this service puts each on its stream.

While requests run and no command waits, the worker thread runs steps back to back and hands each step's outputs
to the event loop as it ends (``_steps``): a step does not wait for the event loop to start it. On a machine whose
cores all run the kernels' threads, that turn of the event loop (its wake-up, then the worker's) took about as
long as a few percent of a single stream's step. Commands still wait for the step that runs: a non-empty inbox
ends the run of steps, and the loop applies the commands before it starts the next.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kvserve.scheduler.contract import (EngineRequest, FinishReason, RequestOutput, StepOutput, StepRecord,
                                        StepTotals)
from kvserve.scheduler.core import EngineCore

log = logging.getLogger("kvserve.scheduler")

_COLD_START_S_PER_REQUEST = 1.0  # Retry-After estimate before two requests have finished (s/request)
_NOTHING_FITS_S = 0.005          # pause before planning again when nothing fitted (only possible transiently)

# What a stream receives: an output, and the step that produced it (None for an abort's or a failure's output).
Delivery = tuple[RequestOutput, StepRecord | None]


class QueueFull(Exception):
    """The waiting queue is at ``max_queue``; ``retry_after_s`` comes from the measured drain rate."""

    def __init__(self, queue_len: int, retry_after_s: int) -> None:
        super().__init__(f"server is at capacity: {queue_len} requests are waiting; retry after {retry_after_s} s")
        self.queue_len = queue_len
        self.retry_after_s = retry_after_s


class _Command(enum.Enum):
    ADD = "add"
    ABORT = "abort"
    RESET = "reset"  # empty the prefix cache (its payload: the future that hears whether it was)
    CALL = "call"  # call the payload between two steps (``between_steps``)


class SchedulerService:
    """Runs the step loop.

    Args:
        core: the engine core (driven by this service's task from now on).
        max_queue: waiting sequences beyond which ``submit`` raises QueueFull.
        on_step: called on the event loop with every ``StepOutput`` once its outputs are delivered (an abort's output
            comes as a StepOutput without a record): the live page, the step log, metrics. One that raises is
            switched off, never the loop.
        executor: the single worker thread that runs steps; pass the thread that loaded the model (see
            ``server.serve.run``: one thread for all torch work keeps a single OpenMP team). Default: a new one.

    Attributes:
        totals: the step records summed since start.
        dead: what ended the loop, once it has died.
    """

    def __init__(self, core: EngineCore, max_queue: int, on_step: Callable[[StepOutput], None] | None = None,
                 executor: ThreadPoolExecutor | None = None) -> None:
        self.core = core
        self.on_step = on_step
        self.max_queue = max_queue
        self.totals = StepTotals()
        self.dead: BaseException | None = None
        self._inbox: asyncio.Queue[tuple[_Command, object]] = asyncio.Queue()
        self._pending_adds = 0
        # submitted and not yet told their end: whatever fails, each of them hears of it (``_fail_all``)
        self._streams: dict[int, asyncio.Queue[Delivery]] = {}
        self._executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-step")
        self._task: asyncio.Task | None = None
        self._stopping = False  # stop() was called: the worker ends its run of steps
        self._last: StepRecord | None = None  # the previous step, if work was left after it

    # -- commands (called from handlers) -------------------------------------------------------------
    def submit(self, requests: list[tuple[EngineRequest, asyncio.Queue[Delivery]]]) -> None:
        """Queue requests (the choices of one HTTP request), each with the stream its outputs go to, or refuse them
        all at once.

        The bound counts sequences (a request with n choices counts n) that will wait: those beyond the slots
        free at the next step, so a burst into idle slots is not refused. With max_queue > 0 a request that
        finds nobody waiting is always accepted, so a large n cannot be refused forever; max_queue = 0 refuses
        every request.

        Raises:
            QueueFull: the waiting queue would exceed max_queue.
            RuntimeError: the loop has died.
        """
        self.check_room(len(requests))
        self._pending_adds += len(requests)
        for request, stream in requests:
            self._streams[request.request_id] = stream
            self._inbox.put_nowait((_Command.ADD, request))

    def check_room(self, sequences: int) -> None:
        """Raise what ``submit`` would for ``sequences`` new sequences now: the server checks before it tokenizes
        a request, so a flood is refused in microseconds each, not after every request's prompt and template.

        Raises:
            QueueFull: the waiting queue would exceed max_queue.
            RuntimeError: the loop has died.
        """
        if self.dead is not None:
            raise RuntimeError(f"engine loop has died: {self.dead!r}")
        queued = self.queued
        free = self.core.load.free_slots
        waiting = max(0, queued - free)
        if self.max_queue == 0 or (waiting and queued + sequences - free > self.max_queue):
            raise QueueFull(waiting, self.retry_after_s(waiting))

    @property
    def queued(self) -> int:
        """Sequences submitted and not running yet: waiting in the core or still in the inbox."""
        return self.core.load.waiting + self._pending_adds

    def abort(self, request_id: int) -> None:
        """Ask the loop to drop a request (queued or running); it is removed before the next step."""
        self._inbox.put_nowait((_Command.ABORT, request_id))

    async def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache between two steps (vLLM's ``/reset_prefix_cache``); False, with nothing changed,
        while requests hold blocks. The reset's KV events go out through ``on_step`` like a step's.

        Raises:
            RuntimeError: the loop has died.
        """
        if self.dead is not None:
            raise RuntimeError(f"engine loop has died: {self.dead!r}")
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._inbox.put_nowait((_Command.RESET, done))
        return await done

    def between_steps(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` on the event loop between two steps, when the core's state is the one the last step led to (an
        ``on_step`` observer runs while the next step may already be running)."""
        self._inbox.put_nowait((_Command.CALL, fn))

    def retry_after_s(self, queued: int) -> int:
        """Seconds until ``queued`` waiting requests should have drained, from the measured finish rate."""
        rate = self.core.load.finish_rate
        seconds = (queued + 1) / rate if rate else (queued + 1) * _COLD_START_S_PER_REQUEST
        return max(1, min(600, math.ceil(seconds)))

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvserve-scheduler")

    async def stop(self) -> None:
        self._stopping = True
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
            self.core.add(payload)
        elif command is _Command.RESET:
            step = self.core.reset_prefix_cache()
            if step is not None:
                self._deliver_step(step)
            if not payload.done():
                payload.set_result(step is not None)
        elif command is _Command.CALL:
            payload()
        else:
            output = self.core.abort(payload)
            if output is not None:
                self._deliver_step(StepOutput([output]))

    def _deliver(self, output: RequestOutput, record: StepRecord | None) -> None:
        """Put ``output`` on its request's stream; its last output retires the stream."""
        stream = self._streams.pop(output.request_id) if output.finished else self._streams.get(output.request_id)
        if stream is not None:
            stream.put_nowait((output, record))

    def _deliver_step(self, step: StepOutput) -> None:
        for output in step.outputs:
            self._deliver(output, step.record)
        if self.on_step is not None:
            self._observe(step)

    def _drain_inbox(self) -> None:
        while not self._inbox.empty():
            self._apply(*self._inbox.get_nowait())

    def _take(self, step: StepOutput, running: bool) -> None:
        """On the event loop: count a step the worker ran (``running``: requests were left after it) and deliver
        its outputs. A failure here kills the service as one in ``_run`` does (``_run`` raises it next)."""
        if self.dead is not None:
            return
        try:
            record = step.record
            if record is not None:
                self.totals.add(record)
                if self._last is not None:
                    self.totals.loop_s += max(0.0, record.ended - self._last.ended - record.seconds)
            self._last = record if record is not None and running else None
            self._deliver_step(step)
        except BaseException as exc:
            self.dead = exc

    def _steps(self, loop: asyncio.AbstractEventLoop) -> bool:
        """On the worker thread: steps until none is left to run, a command waits in the inbox or the service
        stops; each step's outputs go to the event loop (``_take``, in step order) as it ends.

        Returns:
            False when the last step ran nothing while requests wait (nothing fitted: the loop pauses).
        """
        while True:
            step = self.core.step()
            running = self.core.has_requests
            loop.call_soon_threadsafe(self._take, step, running)
            if step.record is None:  # nothing ran: a plan that only freed ended requests, or nothing fitted
                return bool(step.outputs) or not running
            if not running or self._stopping or self.dead is not None or not self._inbox.empty():
                return True

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                # going idle waits for a request, once the engine has freed what ended requests held there
                if not self.core.has_work and self._inbox.empty():
                    self._apply(*await self._inbox.get())
                self._drain_inbox()
                if not self.core.has_work:
                    continue
                fitted = await loop.run_in_executor(self._executor, self._steps, loop)
                if self.dead is not None:
                    raise self.dead
                if not fitted:
                    await asyncio.sleep(_NOTHING_FITS_S)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self.dead = exc  # from now on submit refuses, and /health and /live answer 503
            log.exception("scheduler loop died")
            self._fail_all(exc)
            raise

    def _fail_all(self, exc: BaseException) -> None:
        """End every submitted request with an error output: waiting, running, still in the inbox, or finished in
        a step whose outputs were never delivered."""
        for request_id in list(self._streams):
            self._deliver(RequestOutput(request_id, finish_reason=FinishReason.ERROR,
                                        error=f"engine loop died: {exc!r}"), None)

    def _observe(self, step: StepOutput) -> None:
        """Call ``on_step``; an observer that fails (a step log on a full disk) is dropped, never the loop."""
        try:
            self.on_step(step)
        except Exception:
            log.exception("step observer failed; it is switched off, serving goes on")
            self.on_step = None
