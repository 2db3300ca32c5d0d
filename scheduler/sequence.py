"""One request's generation state: token ids, progress through the cache, block table, status."""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

from kvserve.engine.plan import SamplingParams, TokenLogprob
from kvserve.kvcache.block_manager import ChainLink


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    """Why a sequence ended; the first two are OpenAI's finish_reason values."""

    STOP = "stop"        # EOS, a stop token id, or a stop string
    LENGTH = "length"    # max_tokens or the context limit
    ABORT = "abort"      # the client went away
    ERROR = "error"      # the engine step failed


@dataclass(slots=True)
class SeqEvent:
    """What the scheduler tells a request's stream after a step.

    Attributes:
        seq_id: the sequence it belongs to (the choices of one request share a queue).
        token: the new token (None when only finishing or failing).
        finish: set on the sequence's last event.
        error: a message when the step failed.
        prompt_logprobs: prompt-token logprobs computed in this step.
        time: when the event was produced (``time.perf_counter()`` seconds); the events of one step share it.
        step_tokens: tokens this step delivers to the sequence (several when it accepted draft tokens).
    """

    seq_id: int
    token: TokenLogprob | None = None
    finish: FinishReason | None = None
    error: str | None = None
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    time: float = field(default_factory=time.perf_counter)
    step_tokens: int = 1


@dataclass(slots=True, eq=False)
class Sequence:
    """A request (one choice) moving through the scheduler.

    Attributes:
        seq_id: unique id.
        prompt_ids: the prompt's tokens.
        params: sampling settings.
        max_tokens: generated-token limit (tokens).
        stop_token_ids: tokens that end the sequence (EOS unless ignore_eos, plus stop_token_ids).
        min_tokens: stop tokens are suppressed until this many tokens are generated.
        output_ids: generated tokens.
        num_computed: tokens whose K/V are in the cache.
        block_table: the sequence's blocks, in order.
        block_hashes: the prefix-cache chain links (digest and cached serial) of its full blocks hashed so far
            (kvcache's ``cache_full_blocks`` extends it, so each block is hashed once).
        cache_salt: enters the first block's digest: only sequences with the same salt share cached blocks
            (the request's ``cache_salt``, or its API key's; None is the shared, unsalted cache).
        num_cached_tokens: prompt tokens served from the prefix cache at first admission.
        events: the request's stream of SeqEvents (consumed by the server).
        prefix_source: another choice of the same request; this one is admitted only once the source's
            prompt is in the cache, so the prompt's full blocks are shared through the prefix cache.
        constraint: the grammar matcher of a structured-output request (engine.constraints.Constraint), carried
            opaquely into the plan; the engine keeps it in step with ``output_ids``.
        draft_ids: draft tokens the engine proposed after the last step, not yet verified (speculation).
        num_draft_tokens, num_accepted_tokens: draft tokens verified for this sequence so far, and how many of
            them were accepted (its acceptance rate; the final ``timings``).
    """

    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    min_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[ChainLink] = field(default_factory=list)
    cache_salt: str | None = None
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    num_cached_tokens: int | None = None
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    prefix_source: Sequence | None = None
    constraint: object | None = None
    draft_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def all_ids(self) -> list[int]:
        """Prompt then output tokens (what a recompute after preemption must prefill)."""
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to run through the model before the next sample."""
        return self.num_tokens - self.num_computed

    @property
    def suppress_ids(self) -> list[int]:
        """Stop tokens may not be sampled while fewer than min_tokens are generated."""
        return sorted(self.stop_token_ids) if len(self.output_ids) < self.min_tokens else []

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
