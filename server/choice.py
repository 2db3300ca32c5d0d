"""One choice's output as the client sees it: its RequestOutputs turned into text updates.

A state machine fed one RequestOutput at a time, one token after another: each token's text comes from the
incremental detokenizer, text that may begin a stop string is held back until it can be told apart, and each token is
released with the first character of its text, so logprobs describe exactly the returned text. The choice
ends on the output that finishes its request, or here, on a stop-string match (``stop_matched``: the caller
must then abort the request, see server.generation).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from kvserve.engine.constraints import Constraint, unsatisfied
from kvserve.engine.plan import TokenLogprob
from kvserve.scheduler.contract import FinishReason, RequestOutput
from kvserve.server.detok import IncrementalDetokenizer, StopStringMatcher
from kvserve.server.errors import ApiError


@dataclass(slots=True)
class ChoiceUpdate:
    """New output of one choice: text, the tokens behind it, and the finish reason on the last update.

    ``tokens`` are the tokens whose text has been released (see ``Choice``), and ``offsets[i]`` is the character
    offset in this choice's completion text where ``tokens[i]``'s text starts (a token that completes no
    character yet starts where its character will).
    """

    index: int
    text: str = ""
    tokens: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    error: ApiError | None = None  # set with finish_reason "error": what the response or the stream's last event says
    offsets: list[int] = field(default_factory=list)


@dataclass(slots=True)
class ChoiceTimes:
    """When a choice arrived, was first scheduled and got its first token (``time.perf_counter()`` s; None: not yet).
    The step records its outputs come with give the last two."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None


class Choice:
    """The returned side of one request sent to the engine core.

    Args:
        index: the choice's index in the response.
        tokenizer: the model's tokenizer.
        prompt_ids: the prompt (the detokenizer's context, and the count of prompt logprobs expected).
        stop_strings: strings that end the choice; the text returned stops before them.
        constraint: its grammar matcher (the runner's constraint plug-in holds it while it runs; read here for the
            verdict once the request has ended), or None.
        arrival: when the request arrived (``time.perf_counter()`` s).
        min_tokens: a stop string ends the choice only where it ends in the text of a token after the first
            ``min_tokens`` (it may begin before), as vLLM's ``min_tokens`` holds back stop strings as well as stop
            tokens.
        prompt_only: return no token (completions' echo with max_tokens 0: the request computes one, for the
            prompt's logprobs); the choice ends with "length" when its request does.

    Attributes:
        completion_tokens: tokens returned (the core can compute more after a stop string: it computes on until
            the abort reaches it).
        finish_reason: the response's finish reason ("stop", "length", "error", "abort"); None while running.
        stop_matched: the choice ended on a stop string, not on its request's last output.
        last_token_time: when its last returned token was produced (``time.perf_counter()`` s).
        prompt_logprobs: the prompt's logprobs (echo), once each even if a preemption recomputes them.
        times: arrival, first scheduling, first token.
        cached_tokens, draft_tokens, accepted_tokens: prompt tokens the prefix cache served, draft tokens
            verified for it and accepted, as its outputs said.
    """

    def __init__(self, index: int, tokenizer, prompt_ids: list[int], stop_strings: list[str],
                 constraint: Constraint | None = None, arrival: float = 0.0, min_tokens: int = 0,
                 prompt_only: bool = False) -> None:
        self.index = index
        self.constraint = constraint
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.matcher = StopStringMatcher(stop_strings)
        self.num_prompt_tokens = len(prompt_ids)
        self.min_tokens = min_tokens
        self.prompt_only = prompt_only
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.stop_matched = False
        self.last_token_time: float | None = None
        self.prompt_logprobs: list[TokenLogprob] = []
        self.times = ChoiceTimes(arrival)
        self.cached_tokens = self.draft_tokens = self.accepted_tokens = 0
        # Logprobs describe exactly the returned text: a token is released with the first character of its text
        # (text held back as a possible stop string holds its token back too), and tokens wholly inside a matched
        # stop string are dropped with it. Entries: (token, character offset where its text starts).
        self.pending: collections.deque[tuple[TokenLogprob, int]] = collections.deque()
        self.unsettled = 0      # the last pending tokens, added since the detokenizer last released text
        self.fed_chars = 0      # characters of detokenized text given to the stop-string matcher
        self.emitted_chars = 0  # characters of it released as the choice's text

    def on_output(self, output: RequestOutput, now: float) -> ChoiceUpdate | None:
        """Apply one output of this choice's request, produced at ``now`` (a finished choice must not be given more).

        Returns:
            The text and tokens it releases (with ``finish_reason`` set when the choice ends); None when the
            client aborted (nothing more is sent).
        """
        self.cached_tokens = max(self.cached_tokens, output.num_cached_tokens)
        self.draft_tokens += output.num_draft_tokens
        self.accepted_tokens += output.num_accepted_tokens
        missing = self.num_prompt_tokens - 1 - len(self.prompt_logprobs)  # a recompute repeats them
        self.prompt_logprobs.extend(output.prompt_logprobs[:max(missing, 0)])
        update = ChoiceUpdate(index=self.index)
        for token in () if self.prompt_only else output.tokens:
            if self.times.first_token is None:
                self.times.first_token = now
            self.completion_tokens += 1
            self.last_token_time = now
            self.pending.append((token, self.fed_chars))
            self.unsettled += 1
            text = self.detok.add(token.token_id)
            if text:
                self._settle()
            self.fed_chars += len(text)
            released, hit = self.matcher.feed(text, stops_count=self.completion_tokens > self.min_tokens)
            update.text += released
            self.emitted_chars += len(released)
            self._release(update, everything=False)
            if hit:
                self.pending.clear()  # the tokens of the withheld stop string
                self.stop_matched = True
                return self._finish(update, "stop")
        finish = output.finish_reason
        if finish is FinishReason.ERROR:
            self._release(update, everything=True)
            update.error = ApiError(500, output.error or "engine error", code="engine_error")
            return self._finish(update, "error")
        if finish is FinishReason.ABORT:
            self.finish_reason = "abort"
            return None
        if finish is not None and self.prompt_only:
            return self._finish(update, "length")  # the token it computed is not the client's
        if finish is not None:
            tail = self.detok.flush()
            if tail:
                self._settle()
            self.fed_chars += len(tail)
            tail, hit = self.matcher.feed(tail)
            tail += "" if hit else self.matcher.flush()
            update.text += tail
            self.emitted_chars += len(tail)
            self._release(update, everything=not hit)
            if finish is FinishReason.STOP and not hit and self.constraint is not None:
                why = unsatisfied(self.constraint)
                if why is not None:  # a stop token where the grammar was not complete: never labelled "stop"
                    update.error = ApiError(400, why, code="constraint_unsatisfied")
                    return self._finish(update, "error")
            return self._finish(update, "stop" if hit else finish.value)
        return update

    def _settle(self) -> None:
        """Give the tokens whose text the detokenizer released at once their own offsets: until then each was
        placed where the text stood before them (bytes of a character not yet complete, or an invalid byte,
        release nothing), but each starts where its own text does (``IncrementalDetokenizer.starts``: the second
        after the first's U+FFFD, and so on)."""
        count, self.unsettled = self.unsettled, 0
        if count < 2:
            return
        starts = self.detok.starts[-count:]
        base = len(self.pending) - count
        for position, shift in enumerate(starts):
            token, start = self.pending[base + position]
            self.pending[base + position] = (token, start + shift)

    def _release(self, update: ChoiceUpdate, everything: bool) -> None:
        """Move pending tokens whose text has begun to be released (all of them when ``everything``) to
        ``update``; with a stop string matched, the rest are the stop string's and are dropped by the caller."""
        pending = self.pending
        while pending and (everything or pending[0][1] < self.emitted_chars):
            token, offset = pending.popleft()
            update.tokens.append(token)
            update.offsets.append(offset)

    def _finish(self, update: ChoiceUpdate, reason: str) -> ChoiceUpdate:
        self.finish_reason = update.finish_reason = reason
        return update
