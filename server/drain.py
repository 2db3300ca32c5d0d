"""Graceful drain on SIGTERM: stop admitting, let in-flight requests finish within a grace period, then exit.

A replica behind a router (vllm-router, a Kubernetes Service) is told to stop with SIGTERM: a rollout, a
scale-in, a node drain. Stopping at once cuts every open stream. Instead, on the first SIGTERM:

1. ``/health`` answers 503 ``{"status": "draining"}``, so health-checking routers and readiness probes take
   the replica out of rotation;
2. new generation requests (``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/responses``) get 503 with
   ``Retry-After``: vllm-router retries 503 on another worker (as it does 429), so the client never sees them;
3. requests already admitted (streams included) run to completion, for at most ``grace_s`` seconds;
4. streams still open then are cut cleanly (``Drain.cut``): each ends as the API says a cut reply ends (a final
   chunk with finish_reason ``abort``, then ``[DONE]``; a Responses stream with ``response.incomplete``);
5. then uvicorn shuts down as usual, and the process exits 0.

``--drain-seconds 0``, a second SIGTERM and SIGINT skip the wait, not the cut: the open streams end at once as in
step 4, then uvicorn shuts down. A second SIGTERM or a SIGINT then ends the process by that signal, as plain
uvicorn does; ``--drain-seconds 0`` exits 0, as a drain does. A signal during that cut is uvicorn's own.

Kubernetes gives a pod ``terminationGracePeriodSeconds`` between SIGTERM and SIGKILL; ``grace_s`` must be
shorter than that (deploy/k8s/deployment.yaml: 30 s within 60 s).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable
from types import FrameType
from typing import TypeVar

import uvicorn

from kvserve.server.errors import ApiError

log = logging.getLogger("kvserve.drain")
T = TypeVar("T")

_POLL_S = 0.05  # how often the drain looks at the in-flight count
_CUT_WAIT_S = 2.0  # after the cut: the longest wait for the cut streams to send their last events (s)
# What a refused client (or router) is told to wait before retrying here: the replica is going away, so it
# should go elsewhere now; 1 s is the smallest whole value Retry-After can say.
RETRY_AFTER_S = 1


class Drain:
    """One server's drain state, shared by the app (health, admission) and the uvicorn server (SIGTERM).

    Args:
        grace_s: longest wait (s) for in-flight requests after SIGTERM; 0 stops at once, as plain uvicorn.
    """

    def __init__(self, grace_s: float = 30.0) -> None:
        if not grace_s >= 0:
            raise ValueError(f"drain seconds must be >= 0, got {grace_s}")
        self.grace_s = grace_s
        self.draining = False
        self.inflight = 0  # generation requests admitted and not yet answered in full (streams until their end)
        self.refused = 0  # new generation requests answered 503 while draining
        self.deadline = asyncio.Event()  # set by ``cut``: open streams end now (created unbound: 3.10+)

    def cut(self) -> None:
        """The grace period is over: every open stream ends at once, with its final events (call on the loop)."""
        self.deadline.set()

    async def until_cut(self, updates: AsyncIterator[T]) -> AsyncIterator[T | None]:
        """Yield ``updates`` as they come; once ``cut`` is called, yield None (once) and stop.

        A stream reads its updates through this, so the deadline reaches a stream that waits for a token.
        """
        iterator = aiter(updates)
        cut = asyncio.ensure_future(self.deadline.wait())
        pending: asyncio.Future | None = None
        try:
            while True:
                pending = asyncio.ensure_future(anext(iterator))
                await asyncio.wait({pending, cut}, return_when=asyncio.FIRST_COMPLETED)
                if not pending.done():
                    yield None
                    return
                try:
                    update = pending.result()
                except StopAsyncIteration:
                    return
                yield update
        finally:
            cut.cancel()
            if pending is not None and not pending.done():  # let the update being awaited unwind first
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                await aclose()
    def refusal(self) -> ApiError:
        """The 503 a draining replica answers to a new generation request."""
        return ApiError(503, "this replica is draining (shutting down); retry on another replica",
                        code="draining", headers={"Retry-After": str(RETRY_AFTER_S)})


GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


def _is_generation(scope) -> bool:
    # only generation: vllm-router's cache_aware policy tokenizes every request on every worker first
    # (/v1/chat/completions/render, then /tokenize), and those stay cheap and answered while draining
    return scope["type"] == "http" and scope["method"] == "POST" and scope["path"].rstrip("/") in GENERATION_PATHS


class DrainGate:
    """ASGI middleware: counts in-flight generation requests, and refuses new ones with 503 while draining.

    A request counts from its arrival until the app has sent its last body byte, so an SSE stream counts
    until its ``[DONE]`` (or its client goes away). ``on_refused`` is called for each 503 (the metrics count it).
    """

    def __init__(self, app, drain: Drain, on_refused: Callable[[], object] | None = None) -> None:
        self.app = app
        self.drain = drain
        self.on_refused = on_refused

    async def __call__(self, scope, receive, send) -> None:
        if not _is_generation(scope):
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            self.drain.refused += 1
            if self.on_refused is not None:
                self.on_refused()
            await self.drain.refusal().response()(scope, receive, send)
            return
        self.drain.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.inflight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain before the usual shutdown on the first SIGTERM.

    uvicorn installs ``handle_exit`` as its SIGINT/SIGTERM handler; the first SIGTERM here only starts the
    drain (on the event loop), which calls uvicorn's own ``handle_exit`` once nothing is in flight or
    ``grace_s`` has passed. sse-starlette ends open streams from that call on, without their final events, so
    every way out (the drain, ``grace_s`` 0, a second SIGTERM, SIGINT) cuts the open streams first.
    """

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining: asyncio.Task | None = None  # the first SIGTERM's drain, while it waits
        self._stopping = False  # a stop at once is cutting the open streams

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None or self._stopping or self.should_exit:
            # before start-up nothing is open; during the cut or after it, a further signal is uvicorn's own
            # (a second SIGINT forces the exit)
            super().handle_exit(sig, frame)
            return
        first_term = sig == signal.SIGTERM and not self.drain.draining
        self.drain.draining = True  # from now on new generation requests get 503
        name = signal.Signals(sig).name
        if first_term and self.drain.grace_s > 0:
            log.info("%s: draining %d in-flight request(s), at most %.0f s", name, self.drain.inflight,
                     self.drain.grace_s)
            # a signal handler must not touch the loop's state directly; this is the thread-safe way in
            self._loop.call_soon_threadsafe(self._start_drain, sig)
            return
        self._stopping = True
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._stop_now(sig, managed=first_term)))

    def _start_drain(self, sig: int) -> None:
        if not self._stopping:  # a signal that stops at once may have come between the handler and this call
            self._draining = self._loop.create_task(self._finish(sig))

    async def _finish(self, sig: int) -> None:
        start = time.monotonic()
        at_start = self.drain.inflight
        while self.drain.inflight > 0 and time.monotonic() - start < self.drain.grace_s:
            await asyncio.sleep(_POLL_S)
        cut = await self._cut_open_streams()
        # one line with the outcome (python -m kvserve.loadtest cluster reads it from the replica's log)
        log.log(logging.WARNING if cut else logging.INFO,
                "drain done in %.2f s: %d of %d in-flight request(s) finished, %d cut, %d new refused",
                time.monotonic() - start, at_start - cut, at_start, cut, self.drain.refused)
        self._draining = None
        super().handle_exit(sig, None)
        self._stopped_as_asked(sig)

    async def _stop_now(self, sig: int, managed: bool) -> None:
        """``grace_s`` 0, a second SIGTERM or SIGINT: no wait, but the open streams end with their final events
        before uvicorn shuts down. ``managed``: the first SIGTERM, which exits 0 as a drain does."""
        if self._draining is not None:  # the second signal ends the first one's wait
            self._draining.cancel()
            await asyncio.gather(self._draining, return_exceptions=True)
        cut = await self._cut_open_streams()
        log.log(logging.WARNING if cut else logging.INFO, "%s: stopping now: %d in-flight request(s) cut, "
                "%d new refused", signal.Signals(sig).name, cut, self.drain.refused)
        super().handle_exit(sig, None)
        if managed:
            self._stopped_as_asked(sig)

    async def _cut_open_streams(self) -> int:
        """End every open stream with its final events (``Drain.cut``) and give them ``_CUT_WAIT_S`` at most to
        send them; returns how many requests were still in flight, i.e. cut."""
        cut = self.drain.inflight
        if cut:
            self.drain.cut()
            until = time.monotonic() + _CUT_WAIT_S
            while self.drain.inflight > 0 and time.monotonic() < until:
                await asyncio.sleep(_POLL_S)
        return cut

    def _stopped_as_asked(self, sig: int) -> None:
        """The first SIGTERM stops the server the managed way (drained, or at once with ``grace_s`` 0): the
        process then exits 0, as process managers expect of a clean stop. uvicorn would re-raise the signal it
        caught once it has shut down (exit 143); a second SIGTERM or a SIGINT still does, as a forced stop."""
        if sig in self._captured_signals:
            self._captured_signals.reverse()
            self._captured_signals.remove(sig)  # the last one: a signal received meanwhile stays
            self._captured_signals.reverse()
