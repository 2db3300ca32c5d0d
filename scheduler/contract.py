"""The engine core's contract: what a request is when it enters the core, and what a step gives back.

Plain values, no tensors and no shared objects. The server (or the offline runner, or a load test) hands the core an
``EngineRequest``; each ``EngineCore.step`` returns a ``StepOutput``: one ``RequestOutput`` per request the step
changed, keyed by request id, and one ``StepRecord`` for the step as a whole. Streams, detokenization, stop strings
and per-request timings live with the caller; metrics, the live page and the load tests read records and outputs.

Only what changed crosses: a request's new tokens and new blocks, never its whole output or block table, so what a
step returns costs the same at 100 tokens of context as at 4,000 (tests/test_core.py checks it).

    request ──add──▶ EngineCore ──step──▶ StepOutput(outputs=[RequestOutput, ...], record=StepRecord)
    abort(id) ────▶            ──────▶ RequestOutput(finish_reason=ABORT)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvserve.engine.plan import SamplingParams, TokenLogprob
from kvserve.kvcache.events import KVCacheEvent


class FinishReason(enum.Enum):
    """Why a request ended; the first two are OpenAI's finish_reason values."""

    STOP = "stop"        # EOS, a stop token id (or, decided by the server, a stop string)
    LENGTH = "length"    # max_tokens or the context limit
    ABORT = "abort"      # the caller aborted it (the client went away, or a stop string matched)
    ERROR = "error"      # the engine step failed for it


@dataclass(slots=True, frozen=True)
class EngineRequest:
    """One sequence to generate (a request's choice), as plain data.

    Attributes:
        request_id: unique among live requests; outputs carry it.
        prompt_ids: the prompt's tokens.
        params: sampling settings.
        max_tokens: generated-token limit (tokens).
        min_tokens: stop tokens are suppressed until this many tokens are generated.
        stop_token_ids: tokens that end the request (EOS unless ignored, plus the request's stop_token_ids).
        cache_salt: enters the first block's prefix-cache digest: only requests with the same salt share cached
            blocks (None: the shared, unsalted cache).
        priority: lower runs first under ``--scheduling-policy priority`` (vLLM's ``priority``); 0 otherwise.
        tenant: whose request it is (an API key's fingerprint or a header's value), for
            ``--scheduling-policy fair``; None is one tenant like any other.
        prefix_source: the id of another request with the same prompt (a sibling choice): this one is admitted
            once that one's prompt is in the cache, so the prompt's full blocks are shared, not computed twice.
    """

    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    min_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    cache_salt: str | None = None
    priority: int = 0
    tenant: str | None = None
    prefix_source: int | None = None


@dataclass(slots=True)
class RequestOutput:
    """What one step (or an abort) changed for one request.

    Attributes:
        request_id: the request.
        tokens: the new tokens, in order, with their logprobs (several when the step accepted draft tokens; none
            when it only advanced a prefill chunk). Tokens after a stop token are not included.
        prompt_logprobs: logprobs of the prompt tokens computed in this step (``params.prompt_logprobs``).
        finish_reason: set on the request's last output.
        error: why it failed, with ``FinishReason.ERROR``.
        num_cached_tokens: prompt tokens served from the prefix cache when it was first admitted.
        num_computed_tokens: its tokens whose K/V are now in the cache (0 after a preemption).
        num_draft_tokens, num_accepted_tokens: draft tokens this step verified for it, and how many it accepted.
        preempted: the step took its blocks back; it waits to be recomputed.
        new_block_ids: blocks added to its block table by this step (after a preemption its table starts over).
    """

    request_id: int
    tokens: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    num_computed_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    preempted: bool = False
    new_block_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True, frozen=True)
class StepRecord:
    """One engine step, as metrics, the live page, the step log and load tests see it.

    Attributes:
        index: 1-based count of steps that ran the model.
        rows: sequences in the batch.
        prefills: of which computing prompt tokens (a prompt, a chunk of one, or a recompute after preemption).
        prefill_tokens: tokens those computed.
        prompt_tokens: of them, prompt tokens (a recompute also recomputes generated tokens: those are not counted).
        decode_tokens: tokens computed by decoding sequences, draft tokens excluded.
        draft_tokens, accepted_tokens: draft tokens verified in the step, and accepted.
        generated_tokens: new tokens the step produced (delivered or not).
        max_context: the longest context among the decodes (tokens).
        seconds: wall time inside the model runner (s).
        started, ended: ``time.perf_counter()`` when the step was planned and when its results were applied.
        preemptions: sequences preempted while planning it.
        prefix_queries, prefix_hits: prompt tokens looked up in the prefix cache by its admissions, and found.
        running, waiting: sequences running and waiting after it.
        blocks_used, blocks_free, blocks_cached: KV blocks held by sequences, holding nothing, and free but keeping
            a prefix-cache hash, after it.
    """

    index: int
    rows: int
    prefills: int
    prefill_tokens: int
    prompt_tokens: int
    decode_tokens: int
    draft_tokens: int
    accepted_tokens: int
    generated_tokens: int
    max_context: int
    seconds: float
    started: float
    ended: float
    preemptions: int
    prefix_queries: int
    prefix_hits: int
    running: int
    waiting: int
    blocks_used: int
    blocks_free: int
    blocks_cached: int

    @property
    def num_tokens(self) -> int:
        """Tokens the step computed."""
        return self.prefill_tokens + self.decode_tokens + self.draft_tokens

    @property
    def decodes(self) -> int:
        return self.rows - self.prefills


@dataclass(slots=True)
class StepOutput:
    """What ``EngineCore.step`` returns.

    Attributes:
        outputs: one per request the step changed (a finished request's last output included, a preempted one's).
        record: the step; None when no model step ran (nothing fitted, or only ended requests were released).
        kv_events: the prefix cache's KV events since the previous output, in order (blocks stored and evicted while
            planning and applying the step; a reset's); empty unless the block manager records them.
    """

    outputs: list[RequestOutput]
    record: StepRecord | None = None
    kv_events: list[KVCacheEvent] = field(default_factory=list)


@dataclass(slots=True, frozen=True)
class Load:
    """The core's load after its last change, readable from any thread (a new value replaces the old whole).

    Attributes:
        running, waiting: sequences running and waiting.
        free_slots: slots a waiting sequence could take at the next step (the batching policy's answer).
        kv_usage: the fraction of KV blocks held by sequences, in [0, 1].
        finish_rate: sequences finished per second of busy time, or None before two have finished.
    """

    running: int = 0
    waiting: int = 0
    free_slots: int = 0
    kv_usage: float = 0.0
    finish_rate: float | None = None


@dataclass(slots=True)
class StepTotals:
    """Sums of step records since start (the counters ``/metrics`` and the live page show)."""

    steps: int = 0
    prompt_tokens: int = 0       # prompt tokens computed (prefix-cache hits excluded)
    generation_tokens: int = 0
    engine_s: float = 0.0        # wall time inside the model runner (s)
    loop_s: float = 0.0          # wall time between consecutive steps' runs while work was left (s): planning,
                                 # applying results, delivering them, waking the engine thread
    preemptions: int = 0
    prefix_queries: int = 0      # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0         # of which found cached

    def add(self, record: StepRecord) -> None:
        """Count one step."""
        self.steps += 1
        self.prompt_tokens += record.prompt_tokens
        self.generation_tokens += record.generated_tokens
        self.engine_s += record.seconds
        self.preemptions += record.preemptions
        self.prefix_queries += record.prefix_queries
        self.prefix_hits += record.prefix_hits
