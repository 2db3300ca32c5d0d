"""One request's choices in flight: an EngineRequest per choice submitted to the engine core, their outputs turned
into ChoiceUpdates (server.choice), metrics observed as tokens arrive and choices finish.

Who finishes a choice, and why there are two sides:

- The core finishes a **request** on a stop token id (EOS unless ignored), max_tokens or the context length, or an
  engine error: it computes the tokens, so it knows first, and it must free the blocks at once. It says so on the
  request's last RequestOutput.
- The server finishes a **choice** on a stop-string match: stop strings are text, and only the server
  detokenizes. It then aborts the request so the core frees its blocks, and drops the outputs of tokens computed
  before the abort arrived.

So each fact has one home. The core owns what it computes: generated tokens, prefix-cache hits, drafts. The
server's Choice owns what was returned and when: the text state, the tokens returned (``completion_tokens``), the
response's finish reason, and the request's timings (arrival, first scheduling, first and last token), taken from
the step records the outputs arrive with.

Streamed and non-streamed responses both consume ``Generation.updates``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Coroutine

from kvserve.engine.plan import TokenLogprob
from kvserve.engine.sampling import mix_seed
from kvserve.scheduler.contract import EngineRequest
from kvserve.scheduler.service import Delivery
from kvserve.server.choice import Choice, ChoiceUpdate
from kvserve.server.prepare import Prepared
from kvserve.server.reasoning import END
from kvserve.server.state import ServerState


class Generation:
    """One request's choices in flight.

    Args:
        state: the server.
        prepared: the prepared request (server.prepare).

    Raises:
        QueueFull: from ``start`` when the waiting queue is full.
    """

    def __init__(self, state: ServerState, prepared: Prepared) -> None:
        self.state = state
        self.prepared = prepared
        self.events: asyncio.Queue[Delivery] = asyncio.Queue()
        self.requests: list[EngineRequest] = []
        self.choices: dict[int, Choice] = {}  # by request id
        arrival = time.perf_counter()
        for index in range(prepared.n):
            params = prepared.params
            if params.seed is not None and index:  # n choices must differ, and differ from other seeds' choices
                params = dataclasses.replace(params, seed=mix_seed(params.seed, index))
            request = EngineRequest(request_id=state.next_id(), prompt_ids=prepared.prompt_ids, params=params,
                                    max_tokens=prepared.max_tokens, min_tokens=prepared.min_tokens,
                                    stop_token_ids=prepared.stop_token_ids, cache_salt=prepared.cache_salt,
                                    priority=prepared.priority, tenant=prepared.tenant,
                                    prefix_source=self.requests[0].request_id if self.requests else None)
            self.requests.append(request)
            # a prompt that opened a thinking block: the grammar starts after it (engine.constraints)
            after = END.encode() if prepared.thinking else None
            constraint = (prepared.grammar.constraint(prepared.max_tokens, after) if prepared.grammar is not None
                          else None)
            self.choices[request.request_id] = Choice(index, state.tokenizer, prepared.prompt_ids,
                                                      prepared.stop_strings, constraint, arrival,
                                                      prepared.min_tokens, prepared.prompt_only)
        self.created = int(time.time())

    @property
    def num_choices(self) -> int:
        """Choices in the response (the request's ``n``)."""
        return len(self.choices)

    @property
    def submissions(self) -> list[tuple[EngineRequest, asyncio.Queue[Delivery]]]:
        """The choices' requests, in choice order, each with the stream its outputs go to (what ``start`` submits)."""
        return [(request, self.events) for request in self.requests]

    def register(self) -> None:
        """Hand the choices' grammar matchers to the runner's constraint plug-in (before they are submitted), and
        name their API key as their owner for the live page."""
        for request_id, choice in self.choices.items():
            if choice.constraint is not None:
                self.state.constraints.add(request_id, choice.constraint)
            if self.prepared.owner is not None:
                self.state.request_owners[request_id] = self.prepared.owner

    def release(self) -> None:
        """Take the choices' grammar matchers back from the constraint plug-in, and their owners from the live page."""
        for request_id in self.choices:
            self.state.request_owners.pop(request_id, None)
        if self.prepared.grammar is not None:
            for request_id in self.choices:
                self.state.constraints.pop(request_id)

    def start(self) -> None:
        """Submit every choice's request to the engine core."""
        self.register()
        try:
            self.state.submit(self.submissions)
        except BaseException:
            self.release()
            raise
        self.state.metrics.request_admitted(self.prepared.n, self.prepared.max_tokens_asked)

    def abort(self) -> None:
        """Drop every unfinished choice (client gone, or the drain's cut); each counts in the metrics as finished
        by ``abort``, as vLLM counts an aborted request."""
        now = time.perf_counter()
        for request_id, choice in self.choices.items():
            if choice.finish_reason is None:
                self.state.service.abort(request_id)
                choice.finish_reason = "abort"  # once: a second call finds it finished
                self.state.metrics.choice_finished(choice.times, len(self.prepared.prompt_ids), "abort",
                                                   choice.completion_tokens, now)
        self.release()

    @property
    def done(self) -> bool:
        """Every choice has finished (as the response sees it: a stop string ends a choice at once)."""
        return all(c.finish_reason is not None for c in self.choices.values())

    async def updates(self) -> AsyncIterator[ChoiceUpdate]:
        """Yield updates until every choice has finished."""
        while not self.done:
            update = self._on_output(*await self.events.get())
            if update is not None:
                yield update

    def _on_output(self, output, record) -> ChoiceUpdate | None:
        """One RequestOutput of one choice, and the step that produced it (None: an abort's or a failure's)."""
        choice = self.choices[output.request_id]
        if choice.finish_reason is not None:
            return None  # tokens computed after a stop string matched
        now = record.ended if record is not None else time.perf_counter()
        if record is not None and choice.times.first_scheduled is None:
            choice.times.first_scheduled = record.started
        metrics = self.state.metrics
        if output.tokens and not choice.prompt_only:
            metrics.tokens_returned(choice.times, choice.last_token_time, now, len(output.tokens))
        update = choice.on_output(output, now)
        if update is None or update.finish_reason is None:
            return update
        if choice.constraint is not None:  # its verdict is read: the matcher goes back
            self.state.constraints.pop(output.request_id)
        if choice.stop_matched:
            self.state.service.abort(output.request_id)  # the server finished it: the core stops computing
        if update.finish_reason == "error":
            metrics.failed.inc()
            return update
        metrics.choice_finished(choice.times, len(self.prepared.prompt_ids), update.finish_reason,
                                choice.completion_tokens, time.perf_counter())
        if self.done:
            metrics.max_generation_tokens.observe(max(c.completion_tokens for c in self.choices.values()))
        return update

    # -- figures for responses -----------------------------------------------------------------------
    def _choice(self, index: int) -> Choice:
        return next(c for c in self.choices.values() if c.index == index)

    def prompt_logprobs(self, index: int) -> list[TokenLogprob]:
        """The prompt's logprobs as choice ``index`` received them (echo)."""
        return self._choice(index).prompt_logprobs

    def usage(self) -> dict:
        """OpenAI's usage object: prompt, completion (tokens returned, all choices) and cached tokens."""
        completion = sum(c.completion_tokens for c in self.choices.values())
        prompt = len(self.prepared.prompt_ids)
        cached = max((c.cached_tokens for c in self.choices.values()), default=0)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def prompt_ids(self, index: int) -> list[int]:
        """The prompt's tokens of choice ``index`` (every choice shares one prompt; PromptGroups has several)."""
        return self.prepared.prompt_ids

    def timings(self, index: int) -> dict:
        """Queue time, TTFT (ms) and decode tokens/s of one choice, as measured by the server."""
        choice = self._choice(index)
        times = choice.times
        queue_ms = ((times.first_scheduled or times.arrival) - times.arrival) * 1000
        ttft_ms = ((times.first_token or times.arrival) - times.arrival) * 1000
        decode_s = (choice.last_token_time or 0) - (times.first_token or 0)
        tps = (choice.completion_tokens - 1) / decode_s if choice.completion_tokens > 1 and decode_s > 0 else 0.0
        timings = {"queue_ms": round(queue_ms, 3), "ttft_ms": round(ttft_ms, 3), "decode_tokens_per_s": round(tps, 3),
                   "prompt_tokens": len(self.prepared.prompt_ids), "completion_tokens": choice.completion_tokens,
                   "cached_tokens": choice.cached_tokens}
        if self.state.speculating:  # speculative decoding: what it drafted and kept
            timings |= {"draft_tokens": choice.draft_tokens, "accepted_tokens": choice.accepted_tokens}
        return timings


DISCONNECT_POLL_S = 0.5  # how often a non-streamed request checks that its client is still there: a hung-up
                         # client's tokens stop within half a second (a streamed one is stopped by its send failing)


async def until_done_or_gone(consume: Coroutine, request, generation) -> bool:
    """Run ``consume`` (a non-streamed request's reading of ``generation``) to its end, unless the client hangs
    up first; the generation is aborted either way, so its slot is freed.

    Args:
        consume: the coroutine that reads every update.
        request: the starlette Request (``is_disconnected`` is polled every ``DISCONNECT_POLL_S``).
        generation: what ``consume`` reads.

    Returns:
        True when ``consume`` finished; False when the client went away (the caller answers 499).

    Raises:
        whatever ``consume`` raised (an ApiError for an engine error).
    """
    task = asyncio.create_task(consume)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                return False
        task.result()
        return True
    finally:
        generation.abort()
