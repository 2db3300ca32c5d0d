"""From a validated request to a stream of per-choice text updates.

``prepare`` tokenizes and checks limits (raising ApiError before anything is queued); ``Generation``
submits one Sequence per choice and turns their SeqEvents into ChoiceUpdates: detokenized, cut at stop
strings, with logprobs, timings and metrics. Streamed and non-streamed responses both consume it.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from jinja2.exceptions import TemplateError

from engine.plan import SamplingParams, TokenLogprob
from scheduler.sequence import FinishReason, SeqEvent, Sequence
from server import tools
from server.detok import IncrementalDetokenizer, StopStringMatcher
from server.errors import ApiError
from server.fim import fim_prompt
from server.schemas import ChatCompletionRequest, CompletionRequest
from server.state import ServerState


@dataclass(slots=True)
class Prepared:
    """A request reduced to what the scheduler needs."""

    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams
    n: int
    stop_strings: list[str]
    stop_token_ids: frozenset[int]
    min_tokens: int
    grammar: object | None = None  # engine.constraints.Grammar of a structured-output request (server.structured)


def _check_text(text: str, param: str) -> None:
    """Raise a 400 for text that is not valid Unicode (lone surrogates cannot be tokenized)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"{param} is not valid UTF-8 text: {exc.reason} at position {exc.start}",
                       param=param) from exc


def chat_prompt_ids(state: ServerState, messages: list, request: ChatCompletionRequest | None = None) -> list[int]:
    """Token ids of chat messages through the model's chat template, ready for the assistant's turn (with the
    request's tools, see server.tools)."""
    for index, message in enumerate(messages):
        _check_text(message.text, f"messages.{index}.content")
    if state.tokenizer.chat_template is None:  # a base model: only plain-text completions make sense
        raise ApiError(400, f"model {state.model_name!r} has no chat template; send the text to /v1/completions",
                       param="messages")
    turns, tool_defs = tools.template_inputs(messages, request, state.tokenizer.chat_template)
    try:
        text = state.tokenizer.apply_chat_template(turns, tools=tool_defs, add_generation_prompt=True, tokenize=False)
    except TemplateError as exc:  # the template's own refusal, e.g. roles that do not alternate
        raise ApiError(400, f"the model's chat template refused these messages: {exc}", param="messages") from exc
    return state.tokenizer(text, add_special_tokens=False)["input_ids"]


def text_prompt_ids(state: ServerState, text: str, add_special_tokens: bool = True) -> list[int]:
    _check_text(text, "prompt")
    return state.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


def prompt_ids_of(state: ServerState, request: ChatCompletionRequest | CompletionRequest) -> list[int]:
    """Tokenize the prompt (chat template for chat). Raises ApiError on bad text or token ids."""
    tokenizer = state.tokenizer
    if isinstance(request, ChatCompletionRequest):
        return chat_prompt_ids(state, request.messages, request)
    if isinstance(request.prompt, str):
        if request.suffix:
            _check_text(request.suffix, "suffix")
            return text_prompt_ids(state, fim_prompt(tokenizer, request.prompt, request.suffix))
        return text_prompt_ids(state, request.prompt)
    if request.suffix:
        raise ApiError(400, "suffix needs a text prompt (the fill-in-the-middle layout is text)", param="suffix")
    vocab = len(tokenizer)
    bad = [t for t in request.prompt if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"prompt token ids out of range [0, {vocab}): {bad[:5]}", param="prompt")
    return list(request.prompt)


def prepare(state: ServerState, request: ChatCompletionRequest | CompletionRequest) -> Prepared:
    """Tokenize and check a request against the context and the pool.

    Raises:
        ApiError: 400 when the prompt is empty, or prompt + max_tokens exceeds the model's context or
            can never fit the KV pool (the message gives the token counts and the limit).
    """
    prompt_ids = prompt_ids_of(state, request)
    prompt_param = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
    if not prompt_ids:
        raise ApiError(400, "the prompt is empty", param=prompt_param)
    for limit, what in ((state.max_model_len, "This model's maximum context length"),
                        (state.pool_tokens, "This server's KV cache")):
        if len(prompt_ids) >= limit:
            raise ApiError(400, f"{what} is {limit} tokens, but the prompt has {len(prompt_ids)} tokens (at least "
                                f"1 more is needed for the completion). Please shorten the prompt.", param=prompt_param)
    limit = min(state.max_model_len, state.pool_tokens)
    field_name = "max_completion_tokens" if getattr(request, "max_completion_tokens", None) else "max_tokens"
    max_tokens = request.token_limit
    if max_tokens is None:
        max_tokens = limit - len(prompt_ids)
    if request.min_tokens > max_tokens:
        raise ApiError(400, f"min_tokens ({request.min_tokens}) must not exceed {field_name} ({max_tokens})",
                       param="min_tokens")
    vocab = len(state.tokenizer)
    bad_stops = [t for t in request.stop_token_ids if not 0 <= t < vocab]
    if bad_stops:
        raise ApiError(400, f"stop_token_ids out of range [0, {vocab}): {bad_stops[:5]}", param="stop_token_ids")
    bad_bias = [t for t in request.logit_bias_ids if not 0 <= t < vocab]
    if bad_bias:
        raise ApiError(400, f"logit_bias: token ids out of range [0, {vocab}): {bad_bias[:5]}", param="logit_bias")
    total = len(prompt_ids) + max_tokens
    if total > state.max_model_len:
        raise ApiError(400, f"This model's maximum context length is {state.max_model_len} tokens. However, you "
                            f"requested {total} tokens ({len(prompt_ids)} in the prompt, {max_tokens} for the "
                            f"completion). Please reduce the prompt or {field_name}.", param=field_name)
    if total > state.pool_tokens:
        raise ApiError(400, f"The KV cache holds at most {state.pool_tokens} tokens. However, you requested {total} "
                            f"tokens ({len(prompt_ids)} in the prompt, {max_tokens} for the completion).",
                       param=field_name)
    echo_logprobs = isinstance(request, CompletionRequest) and request.echo and request.logprobs is not None
    params = SamplingParams(temperature=request.temperature, top_p=request.top_p, top_k=max(request.top_k, 0),
                            min_p=request.min_p, seed=request.seed, presence_penalty=request.presence_penalty,
                            frequency_penalty=request.frequency_penalty,
                            repetition_penalty=request.repetition_penalty, logprobs=request.num_logprobs,
                            prompt_logprobs=echo_logprobs, logit_bias=request.logit_bias_ids or None,
                            processed_logprobs=request.logprobs_mode == "processed_logprobs")
    stop_ids = set(request.stop_token_ids) | (set() if request.ignore_eos else set(state.eos_ids))
    return Prepared(prompt_ids=prompt_ids, max_tokens=max_tokens, params=params, n=request.n,
                    stop_strings=request.stop_strings, stop_token_ids=frozenset(stop_ids),
                    min_tokens=min(request.min_tokens, max_tokens))


@dataclass(slots=True)
class ChoiceUpdate:
    """New output of one choice: text, the tokens behind it, and the finish reason on the last update.

    ``tokens`` are the tokens whose text has been released (see ``_Choice.pending``), and ``offsets[i]`` is the
    character offset in this choice's completion text where ``tokens[i]``'s text starts (a token that completes
    no character yet starts where its character will).
    """

    index: int
    text: str = ""
    tokens: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    offsets: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Choice:
    seq: Sequence
    detok: IncrementalDetokenizer
    matcher: StopStringMatcher
    completion_tokens: int = 0
    finish_reason: str | None = None
    last_token_time: float | None = None
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # Logprobs describe exactly the returned text: a token is released with the first character of its text
    # (text held back as a possible stop string holds its token back too), and tokens wholly inside a matched
    # stop string are dropped with it. Entries: (token, character offset where its text starts).
    pending: collections.deque[tuple[TokenLogprob, int]] = field(default_factory=collections.deque)
    fed_chars: int = 0      # characters of detokenized text given to the stop-string matcher
    emitted_chars: int = 0  # characters of it released as the choice's text


class Generation:
    """One request's choices in flight.

    Args:
        state: the server.
        prepared: the prepared request.

    Raises:
        QueueFull: from ``start`` when the waiting queue is full.
    """

    def __init__(self, state: ServerState, prepared: Prepared) -> None:
        self.state = state
        self.prepared = prepared
        self.events: asyncio.Queue[SeqEvent] = asyncio.Queue()
        self.choices: dict[int, tuple[int, _Choice]] = {}
        first: Sequence | None = None
        for index in range(prepared.n):
            params = prepared.params
            if params.seed is not None and index:
                params = dataclasses.replace(params, seed=params.seed + index)  # n choices must differ
            seq = Sequence(seq_id=state.next_id(), prompt_ids=prepared.prompt_ids, params=params,
                           max_tokens=prepared.max_tokens, stop_token_ids=prepared.stop_token_ids,
                           min_tokens=prepared.min_tokens, events=self.events, prefix_source=first,
                           constraint=prepared.grammar.constraint() if prepared.grammar is not None else None)
            first = first or seq
            choice = _Choice(seq=seq, detok=IncrementalDetokenizer(state.tokenizer, prepared.prompt_ids),
                             matcher=StopStringMatcher(prepared.stop_strings))
            self.choices[seq.seq_id] = (index, choice)
        self.created = int(time.time())

    @property
    def num_choices(self) -> int:
        return len(self.choices)

    def start(self) -> None:
        self.state.service.submit([c.seq for _, c in self.choices.values()])
        self.state.metrics.request_admitted(self.prepared.n, self.prepared.max_tokens)

    def abort(self) -> None:
        """Drop every unfinished choice (client gone)."""
        for _, choice in self.choices.values():
            if choice.finish_reason is None:
                self.state.service.abort(choice.seq.seq_id)

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for _, c in self.choices.values())

    async def updates(self) -> AsyncIterator[ChoiceUpdate]:
        """Yield updates until every choice has finished."""
        while not self.done:
            event = await self.events.get()
            update = self._on_event(event)
            if update is not None:
                yield update

    def _on_event(self, event: SeqEvent) -> ChoiceUpdate | None:
        index, choice = self.choices[event.seq_id]
        if choice.finish_reason is not None:
            return None  # tokens computed after a stop string matched
        missing = len(self.prepared.prompt_ids) - 1 - len(choice.prompt_logprobs)  # a recompute repeats them
        choice.prompt_logprobs.extend(event.prompt_logprobs[:max(missing, 0)])
        update = ChoiceUpdate(index=index)
        if event.token is not None:
            self._observe_token(choice, event)
            choice.completion_tokens += 1
            choice.pending.append((event.token, choice.fed_chars))
            text = choice.detok.add(event.token.token_id)
            choice.fed_chars += len(text)
            update.text, hit = choice.matcher.feed(text)
            choice.emitted_chars += len(update.text)
            self._release(choice, update, everything=False)
            if hit:
                choice.pending.clear()  # the tokens of the withheld stop string
                self.state.service.abort(choice.seq.seq_id)
                return self._finish(choice, update, "stop")
        if event.finish is FinishReason.ERROR:
            self._release(choice, update, everything=True)
            update.error = event.error or "engine error"
            return self._finish(choice, update, "error")
        if event.finish is FinishReason.ABORT:
            choice.finish_reason = "abort"
            return None
        if event.finish is not None:
            tail = choice.detok.flush()
            choice.fed_chars += len(tail)
            tail, hit = choice.matcher.feed(tail)
            tail += "" if hit else choice.matcher.flush()
            update.text += tail
            choice.emitted_chars += len(tail)
            self._release(choice, update, everything=not hit)
            return self._finish(choice, update, "stop" if hit else event.finish.value)
        return update

    @staticmethod
    def _release(choice: _Choice, update: ChoiceUpdate, everything: bool) -> None:
        """Move pending tokens whose text has begun to be released (all of them when ``everything``) to
        ``update``; with a stop string matched, the rest are the stop string's and are dropped by the caller."""
        pending = choice.pending
        while pending and (everything or pending[0][1] < choice.emitted_chars):
            token, offset = pending.popleft()
            update.tokens.append(token)
            update.offsets.append(offset)

    def _observe_token(self, choice: _Choice, event: SeqEvent) -> None:
        metrics, now = self.state.metrics, event.time
        if choice.last_token_time is None:
            metrics.ttft.observe(now - choice.seq.arrival_time)
        elif now != choice.last_token_time:
            # The tokens one verify pass accepts arrive together (speculative decoding). Inter-token latency is
            # observed once per step that delivered tokens, as vLLM does (a gap of 0 between them would flatter
            # it); time per output token shares the step's gap among its tokens, so its mean stays per token.
            gap = now - choice.last_token_time
            metrics.itl.observe(gap)
            for _ in range(event.step_tokens):
                metrics.tpot.observe(gap / event.step_tokens)
        choice.last_token_time = now

    def _finish(self, choice: _Choice, update: ChoiceUpdate, reason: str) -> ChoiceUpdate:
        choice.finish_reason = reason
        update.finish_reason = reason
        metrics, seq = self.state.metrics, choice.seq
        if reason != "error":
            metrics.e2e.observe(time.perf_counter() - seq.arrival_time)
            metrics.sequence_finished(seq, choice.completion_tokens, time.perf_counter())
            if self.done:
                metrics.max_generation_tokens.observe(max(c.completion_tokens for _, c in self.choices.values()))
            if seq.first_scheduled_time is not None:
                metrics.queue.observe(seq.first_scheduled_time - seq.arrival_time)
        if reason == "error":
            metrics.failed.inc()
        else:
            metrics.success.labels(finished_reason=reason).inc()
        return update

    # -- figures for responses -----------------------------------------------------------------------
    def prompt_logprobs(self, index: int) -> list[TokenLogprob]:
        return next(c.prompt_logprobs for i, c in self.choices.values() if i == index)

    def usage(self) -> dict:
        completion = sum(c.completion_tokens for _, c in self.choices.values())
        prompt = len(self.prepared.prompt_ids)
        cached = max((c.seq.num_cached_tokens or 0 for _, c in self.choices.values()), default=0)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def timings(self, index: int) -> dict:
        """Queue time, TTFT (ms) and decode tokens/s of one choice, as measured by the server."""
        choice = next(c for i, c in self.choices.values() if i == index)
        seq = choice.seq
        queue_ms = ((seq.first_scheduled_time or seq.arrival_time) - seq.arrival_time) * 1000
        ttft_ms = ((seq.first_token_time or seq.arrival_time) - seq.arrival_time) * 1000
        decode_s = (choice.last_token_time or 0) - (seq.first_token_time or 0)
        tps = (choice.completion_tokens - 1) / decode_s if choice.completion_tokens > 1 and decode_s > 0 else 0.0
        timings = {"queue_ms": round(queue_ms, 3), "ttft_ms": round(ttft_ms, 3), "decode_tokens_per_s": round(tps, 3),
                   "prompt_tokens": len(self.prepared.prompt_ids), "completion_tokens": choice.completion_tokens,
                   "cached_tokens": seq.num_cached_tokens or 0}
        if self.state.service.scheduler.draft is not None:  # speculative decoding: what it drafted and kept
            timings |= {"draft_tokens": seq.num_draft_tokens, "accepted_tokens": seq.num_accepted_tokens}
        return timings
