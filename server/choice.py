"""One choice's output as the client sees it: its SeqEvents turned into text updates.

A state machine fed one SeqEvent (one token at most) at a time: the token's text comes from the incremental
detokenizer, text that may begin a stop string is held back until it can be told apart, and each token is
released with the first character of its text, so logprobs describe exactly the returned text. The choice
ends on the event that finishes its sequence, or here, on a stop-string match (``stop_matched``: the caller
must then abort the sequence, see server.generation).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from kvserve.engine.constraints import unsatisfied
from kvserve.engine.plan import TokenLogprob
from kvserve.scheduler.sequence import FinishReason, SeqEvent, Sequence
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


class Choice:
    """The returned side of one Sequence.

    Args:
        index: the choice's index in the response.
        seq: its sequence (the scheduler owns it; read here for its id, and for its grammar's verdict once it
            has ended).
        tokenizer: the model's tokenizer.
        prompt_ids: the prompt (the detokenizer's context, and the count of prompt logprobs expected).
        stop_strings: strings that end the choice; the text returned stops before them.

    Attributes:
        completion_tokens: tokens returned (``len(seq.output_ids)`` can be larger after a stop string: the
            scheduler computes on until the abort reaches it).
        finish_reason: the response's finish reason ("stop", "length", "error", "abort"); None while running.
        stop_matched: the choice ended on a stop string, not on its sequence's last event.
        last_token_time: when its last returned token was produced (``time.perf_counter()`` s).
        prompt_logprobs: the prompt's logprobs (echo), once each even if a preemption recomputes them.
    """

    def __init__(self, index: int, seq: Sequence, tokenizer, prompt_ids: list[int], stop_strings: list[str]) -> None:
        self.index = index
        self.seq = seq
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.matcher = StopStringMatcher(stop_strings)
        self.num_prompt_tokens = len(prompt_ids)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.stop_matched = False
        self.last_token_time: float | None = None
        self.prompt_logprobs: list[TokenLogprob] = []
        # Logprobs describe exactly the returned text: a token is released with the first character of its text
        # (text held back as a possible stop string holds its token back too), and tokens wholly inside a matched
        # stop string are dropped with it. Entries: (token, character offset where its text starts).
        self.pending: collections.deque[tuple[TokenLogprob, int]] = collections.deque()
        self.fed_chars = 0      # characters of detokenized text given to the stop-string matcher
        self.emitted_chars = 0  # characters of it released as the choice's text

    def on_event(self, event: SeqEvent) -> ChoiceUpdate | None:
        """Apply one event of this choice's sequence (a finished choice must not be given more).

        Returns:
            The text and tokens it releases (with ``finish_reason`` set when the choice ends); None when the
            client aborted (nothing more is sent).
        """
        missing = self.num_prompt_tokens - 1 - len(self.prompt_logprobs)  # a recompute repeats them
        self.prompt_logprobs.extend(event.prompt_logprobs[:max(missing, 0)])
        update = ChoiceUpdate(index=self.index)
        if event.token is not None:
            self.completion_tokens += 1
            self.last_token_time = event.time
            self.pending.append((event.token, self.fed_chars))
            text = self.detok.add(event.token.token_id)
            self.fed_chars += len(text)
            update.text, hit = self.matcher.feed(text)
            self.emitted_chars += len(update.text)
            self._release(update, everything=False)
            if hit:
                self.pending.clear()  # the tokens of the withheld stop string
                self.stop_matched = True
                return self._finish(update, "stop")
        if event.finish is FinishReason.ERROR:
            self._release(update, everything=True)
            update.error = ApiError(500, event.error or "engine error", code="engine_error")
            return self._finish(update, "error")
        if event.finish is FinishReason.ABORT:
            self.finish_reason = "abort"
            return None
        if event.finish is not None:
            tail = self.detok.flush()
            self.fed_chars += len(tail)
            tail, hit = self.matcher.feed(tail)
            tail += "" if hit else self.matcher.flush()
            update.text += tail
            self.emitted_chars += len(tail)
            self._release(update, everything=not hit)
            if event.finish is FinishReason.STOP and not hit and self.seq.constraint is not None:
                why = unsatisfied(self.seq.constraint)
                if why is not None:  # a stop token where the grammar was not complete: never labelled "stop"
                    update.error = ApiError(400, why, code="constraint_unsatisfied")
                    return self._finish(update, "error")
            return self._finish(update, "stop" if hit else event.finish.value)
        return update

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
