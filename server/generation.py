"""One request's choices in flight: a Sequence per choice submitted to the scheduler, their events turned into
ChoiceUpdates (server.choice), metrics observed as tokens arrive and choices finish.

Who finishes a choice, and why there are two sides:

- The scheduler finishes a **sequence** on a stop token id (EOS unless ignored), max_tokens or the context
  length, or an engine error: it computes the tokens, so it knows first, and it must free the blocks at once.
  It records that on the Sequence (``status``, ``finish_reason``) and says so on the sequence's last SeqEvent.
- The server finishes a **choice** on a stop-string match: stop strings are text, and only the server
  detokenizes. It then aborts the sequence so the scheduler frees its blocks (the scheduler records ABORT;
  the response says "stop"), and drops the events of tokens computed before the abort arrived.

So each fact has one home. The scheduler's Sequence owns what it computes and when: generated tokens,
arrival, first scheduling and first token times, prefix-cache hits. The server's Choice owns what was
returned: the text state, the tokens returned (``completion_tokens``), the response's finish reason and the
time of the last token returned. The server never reads ``Sequence.finish_reason``: the response's reason
comes from the events and from the stop-string match.

Streamed and non-streamed responses both consume ``Generation.updates``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Coroutine

from kvserve.engine.plan import TokenLogprob
from kvserve.scheduler.sequence import SeqEvent, Sequence
from kvserve.server.choice import Choice, ChoiceUpdate
from kvserve.server.prepare import Prepared
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
        self.events: asyncio.Queue[SeqEvent] = asyncio.Queue()
        self.choices: dict[int, Choice] = {}  # by seq_id
        first: Sequence | None = None
        for index in range(prepared.n):
            params = prepared.params
            if params.seed is not None and index:
                params = dataclasses.replace(params, seed=params.seed + index)  # n choices must differ
            seq = Sequence(seq_id=state.next_id(), prompt_ids=prepared.prompt_ids, params=params,
                           max_tokens=prepared.max_tokens, stop_token_ids=prepared.stop_token_ids,
                           min_tokens=prepared.min_tokens, events=self.events, prefix_source=first,
                           cache_salt=prepared.cache_salt,
                           constraint=prepared.grammar.constraint(prepared.max_tokens)
                           if prepared.grammar is not None else None)
            first = first or seq
            if prepared.owner is not None:
                state.seq_owners[seq.seq_id] = prepared.owner
            self.choices[seq.seq_id] = Choice(index, seq, state.tokenizer, prepared.prompt_ids,
                                              prepared.stop_strings)
        self.created = int(time.time())

    @property
    def num_choices(self) -> int:
        """Choices in the response (the request's ``n``)."""
        return len(self.choices)

    @property
    def sequences(self) -> list[Sequence]:
        """The choices' sequences, in choice order (what ``start`` submits)."""
        return [c.seq for c in self.choices.values()]

    def start(self) -> None:
        """Submit every choice's sequence to the scheduler."""
        self.state.service.submit(self.sequences)
        self.state.metrics.request_admitted(self.prepared.n, self.prepared.max_tokens)

    def abort(self) -> None:
        """Drop every unfinished choice (client gone)."""
        for choice in self.choices.values():
            self.state.seq_owners.pop(choice.seq.seq_id, None)
            if choice.finish_reason is None:
                self.state.service.abort(choice.seq.seq_id)

    @property
    def done(self) -> bool:
        """Every choice has finished (as the response sees it: a stop string ends a choice at once)."""
        return all(c.finish_reason is not None for c in self.choices.values())

    async def updates(self) -> AsyncIterator[ChoiceUpdate]:
        """Yield updates until every choice has finished."""
        while not self.done:
            event = await self.events.get()
            update = self._on_event(event)
            if update is not None:
                yield update

    def _on_event(self, event: SeqEvent) -> ChoiceUpdate | None:
        """One SeqEvent (one token at most) of one choice."""
        choice = self.choices[event.seq_id]
        if choice.finish_reason is not None:
            return None  # tokens computed after a stop string matched
        metrics = self.state.metrics
        if event.token is not None:
            metrics.token_returned(choice.seq, choice.last_token_time, event.time, event.step_tokens)
        update = choice.on_event(event)
        if update is None or update.finish_reason is None:
            return update
        if choice.stop_matched:
            self.state.service.abort(choice.seq.seq_id)  # the server finished it: the scheduler stops computing
        if update.finish_reason == "error":
            metrics.failed.inc()
            return update
        metrics.choice_finished(choice.seq, update.finish_reason, choice.completion_tokens, time.perf_counter())
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
        cached = max((c.seq.num_cached_tokens or 0 for c in self.choices.values()), default=0)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def prompt_ids(self, index: int) -> list[int]:
        """The prompt's tokens of choice ``index`` (every choice shares one prompt; PromptGroups has several)."""
        return self.prepared.prompt_ids

    def timings(self, index: int) -> dict:
        """Queue time, TTFT (ms) and decode tokens/s of one choice, as measured by the server."""
        choice = self._choice(index)
        seq = choice.seq
        queue_ms = ((seq.first_scheduled_time or seq.arrival_time) - seq.arrival_time) * 1000
        ttft_ms = ((seq.first_token_time or seq.arrival_time) - seq.arrival_time) * 1000
        decode_s = (choice.last_token_time or 0) - (seq.first_token_time or 0)
        tps = (choice.completion_tokens - 1) / decode_s if choice.completion_tokens > 1 and decode_s > 0 else 0.0
        timings = {"queue_ms": round(queue_ms, 3), "ttft_ms": round(ttft_ms, 3), "decode_tokens_per_s": round(tps, 3),
                   "prompt_tokens": len(self.prepared.prompt_ids), "completion_tokens": choice.completion_tokens,
                   "cached_tokens": seq.num_cached_tokens or 0}
        if self.state.speculating:  # speculative decoding: what it drafted and kept
            timings |= {"draft_tokens": seq.num_draft_tokens, "accepted_tokens": seq.num_accepted_tokens}
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
