"""Completions with several prompts, and ``best_of``: many ``Generation``s behind one choice numbering.

OpenAI and vLLM accept a list of prompts (strings or token-id lists) in one ``/v1/completions`` request and
number the choices prompt-major: prompt i's choice j is index ``i * n + j``. Each prompt runs as its own
``Generation`` (its own prompt, prefix-sharing among its choices); ``PromptGroups`` merges their updates into
one stream with those indices, sums usage, and, for ``best_of`` above ``n`` (vLLM v0's semantics), keeps the
``n`` candidates of each prompt with the highest cumulative logprob once all have finished.

    request: prompt=["A", "B"], n=2          choices: 0 = A#0, 1 = A#1, 2 = B#0, 3 = B#1
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from kvserve.engine.plan import TokenLogprob
from kvserve.server.choice import ChoiceUpdate
from kvserve.server.detok import whole_text
from kvserve.server.generation import Generation
from kvserve.server.prepare import Prepared, prepare
from kvserve.server.schemas import CompletionRequest
from kvserve.server.state import ServerState


def prepare_prompts(state: ServerState, request: CompletionRequest) -> list[Prepared]:
    """Tokenize and check every prompt of ``request``; each asks for ``request.candidates`` sequences.

    Raises:
        ApiError: the first prompt that fails ``prepare``'s checks (the message is ``prepare``'s).
    """
    return [prepare(state, request.model_copy(update={"prompt": prompt, "n": request.candidates}))
            for prompt in request.prompts]


class PromptGroups:
    """One completions request's prompts in flight, with the interface of a ``Generation``.

    Args:
        state: the server.
        prepared: one per prompt, in request order; each with ``n`` = the candidates per prompt.
        n: choices returned per prompt (below the candidates when ``best_of`` > ``n``).
        prompts: the prompts as the client sent them (for ``echo``).
    """

    def __init__(self, state: ServerState, prepared: list[Prepared], n: int,
                 prompts: list[str | list[int]]) -> None:
        self.state = state
        self.groups = [Generation(state, p) for p in prepared]
        self.candidates = prepared[0].n
        self.n = n
        self.prompts = prompts
        self.created = self.groups[0].created
        # returned index -> (prompt, candidate); identity until best_of has picked
        self._origin: Callable[[int], tuple[int, int]] = lambda index: divmod(index, self.candidates)

    @property
    def num_choices(self) -> int:
        """Choices being generated (all candidates)."""
        return len(self.groups) * self.candidates

    def start(self) -> None:
        """Queue every request of every prompt at once: all are admitted, or none (QueueFull)."""
        for generation in self.groups:
            generation.register()
        try:
            self.state.submit([pair for g in self.groups for pair in g.submissions])
        except BaseException:
            for generation in self.groups:
                generation.release()
            raise
        for generation in self.groups:
            self.state.metrics.request_admitted(self.n, generation.prepared.max_tokens_asked)

    def abort(self) -> None:
        for generation in self.groups:
            generation.abort()

    @property
    def done(self) -> bool:
        return all(g.done for g in self.groups)

    async def updates(self) -> AsyncIterator[ChoiceUpdate]:
        """Every prompt's updates as they come, with the request-wide index ``prompt * candidates + choice``."""
        merged: asyncio.Queue[tuple[int, ChoiceUpdate | None]] = asyncio.Queue()

        async def pump(prompt: int, generation: Generation) -> None:
            try:
                async for update in generation.updates():
                    await merged.put((prompt, update))
            finally:
                merged.put_nowait((prompt, None))

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(self.groups)]
        try:
            running = len(tasks)
            while running:
                prompt, update = await merged.get()
                if update is None:
                    running -= 1
                    continue
                update.index += prompt * self.candidates
                yield update
        finally:
            for task in tasks:
                task.cancel()

    def pick_best(self, texts: dict[int, str], tokens: dict[int, list[TokenLogprob]], reasons: dict[int, str],
                  offsets: dict[int, list[int]]) -> tuple[dict, dict, dict, dict]:
        """``best_of``: per prompt, the ``n`` candidates with the highest cumulative logprob, renumbered
        ``prompt * n + rank``. Call once all candidates have finished; returns (texts, tokens, reasons,
        offsets), each keyed by the returned index."""
        if self.candidates == self.n:
            return texts, tokens, reasons, offsets
        origin: dict[int, tuple[int, int]] = {}
        for prompt in range(len(self.groups)):
            first = prompt * self.candidates
            ranked = sorted(range(first, first + self.candidates),
                            key=lambda i: sum(t.logprob for t in tokens[i]), reverse=True)
            for rank, index in enumerate(ranked[:self.n]):
                origin[prompt * self.n + rank] = (prompt, index - first)
        keep = {new: prompt * self.candidates + candidate for new, (prompt, candidate) in origin.items()}
        self._origin = origin.__getitem__
        return tuple({new: field[old] for new, old in keep.items()} for field in (texts, tokens, reasons, offsets))

    # -- figures for responses, by returned index ---------------------------------------------------------
    def prompt_ids(self, index: int) -> list[int]:
        return self.groups[self._origin(index)[0]].prepared.prompt_ids

    def prompt_text(self, index: int) -> str:
        """The prompt as sent (``echo``); token ids are decoded, without a character their last tokens only begin
        (the completion's text starts with it: ``server.detok.whole_text``)."""
        prompt = self.prompts[self._origin(index)[0]]
        return prompt if isinstance(prompt, str) else whole_text(self.state.tokenizer, prompt)

    def prompt_logprobs(self, index: int) -> list[TokenLogprob]:
        prompt, candidate = self._origin(index)
        return self.groups[prompt].prompt_logprobs(candidate)

    def timings(self, index: int) -> dict:
        prompt, candidate = self._origin(index)
        return self.groups[prompt].timings(candidate)

    def usage(self) -> dict:
        """Summed over prompts; every candidate's tokens count (``best_of`` costs what it generates)."""
        parts = [g.usage() for g in self.groups]
        prompt = sum(p["prompt_tokens"] for p in parts)
        completion = sum(p["completion_tokens"] for p in parts)
        cached = sum(p["prompt_tokens_details"]["cached_tokens"] for p in parts)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}
