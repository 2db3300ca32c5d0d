"""The scheduler's record of one request: what scheduling needs, and nothing else.

The request as it came in stays a value (``contract.EngineRequest``); this record adds the scheduler's progress:
generated tokens, computed tokens, block table, prefix-cache chain, status. Streams and timings are the server's,
the grammar matcher is the constraint plug-in's and the draft tokens are speculation's, each keyed by request id.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvserve.engine.plan import SamplingParams
from kvserve.kvcache.block_manager import ChainLink
from kvserve.scheduler.contract import EngineRequest, FinishReason


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """A request moving through the scheduler.

    Attributes:
        request: the request as it was added.
        serial: its place in arrival order (the ordering policies' tie-break: first come, first served).
        output_ids: generated tokens.
        num_computed: tokens whose K/V are in the cache.
        block_table: the sequence's blocks, in order.
        block_hashes: the prefix-cache chain links of its full blocks hashed so far (kvcache's
            ``cache_full_blocks`` extends it, so each block is hashed once).
        num_cached_tokens: prompt tokens served from the prefix cache at first admission (None: not admitted yet).
        num_preemptions: times it gave its blocks back.
        blocks_reported: how many of ``block_table``'s ids its outputs have carried (``new_block_ids``).
    """

    request: EngineRequest
    serial: int = 0
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[ChainLink] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    num_cached_tokens: int | None = None
    num_preemptions: int = 0
    blocks_reported: int = 0

    # the request's fields the scheduler reads on every step, by their scheduling names
    @property
    def seq_id(self) -> int:
        return self.request.request_id

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_ids

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def max_tokens(self) -> int:
        return self.request.max_tokens

    @property
    def min_tokens(self) -> int:
        return self.request.min_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to run through the model before the next sample."""
        return self.num_tokens - self.num_computed

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt then output, without building the whole list (a decode step reads one
        token: its cost must not grow with the context)."""
        prompt = self.request.prompt_ids
        if start >= len(prompt):
            return self.output_ids[start - len(prompt):end - len(prompt)]
        return prompt[start:end] + self.output_ids[:max(end - len(prompt), 0)]

    @property
    def all_ids(self) -> list[int]:
        """Prompt then output tokens (what a lookup in the prefix cache at admission hashes)."""
        return self.request.prompt_ids + self.output_ids

    @property
    def suppress_ids(self) -> list[int]:
        """Stop tokens may not be sampled while fewer than min_tokens are generated."""
        if len(self.output_ids) < self.request.min_tokens:
            return sorted(self.request.stop_token_ids)
        return []

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
