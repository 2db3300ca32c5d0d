"""What the scheduler hands the runner for one step, and what comes back. Plain Python: no tensors.

A step is a ragged batch: each ``SeqWork`` contributes ``len(token_ids)`` tokens (a whole or partial
prefill, or one decode token), and all of them are flattened into one ``[1, num_tokens]`` forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field


# Temperatures below this sample greedily, as vLLM does (its _SAMPLING_EPS): logits / 1e-45 overflow float32
# to inf, and softmax of inf - inf is NaN.
GREEDY_TEMPERATURE = 1e-5


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling settings (OpenAI/vLLM semantics).

    Attributes:
        temperature: below ``GREEDY_TEMPERATURE`` (0 included) means greedy (argmax).
        top_p: nucleus mass in (0, 1]; 1 disables.
        top_k: keep the k most likely tokens; 0 disables.
        min_p: drop tokens whose probability is below min_p x the top probability; 0 disables.
        seed: makes sampling reproducible; the generator is re-derived from (seed, output length) each
            step, so a preempted and recomputed sequence draws the same tokens.
        presence_penalty, frequency_penalty: OpenAI's additive penalties on generated tokens.
        repetition_penalty: CTRL's multiplicative penalty (Keskar et al. 2019) on prompt and output tokens.
        logprobs: how many top alternatives to return per sampled token; None returns none.
        prompt_logprobs: return the logprob of every prompt token (completions ``echo`` + ``logprobs``).
        logit_bias: OpenAI's ``logit_bias``: token id -> value in [-100, 100] added to that token's logit;
            None adds nothing.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: bool = False
    logit_bias: dict[int, float] | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


@dataclass(slots=True)
class SeqWork:
    """One sequence's share of a step.

    Attributes:
        seq_id: the scheduler's id for the sequence.
        token_ids: tokens to compute now (tokens).
        start_pos: position of ``token_ids[0]``; tokens before it are already in the cache.
        block_table: the sequence's blocks, in order.
        slot_mapping: one pool slot per token in ``token_ids`` (see kvcache.pool).
        sample: whether to sample a next token (the chunk reaches the end of the known tokens).
        params: sampling settings.
        prompt_ids: the prompt (for repetition penalty and prompt logprobs).
        output_ids: tokens generated so far (for penalties and seeds).
        suppress_ids: tokens that may not be sampled now (EOS while below min_tokens).
        constraint: the sequence's grammar matcher (``engine.constraints.Constraint``), or None when unconstrained;
            opaque to the scheduler, which only carries it.
    """

    seq_id: int
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    slot_mapping: list[int]
    sample: bool
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    suppress_ids: list[int] = field(default_factory=list)
    constraint: object | None = None

    @property
    def context_len(self) -> int:
        """Tokens in the cache once this step has run."""
        return self.start_pos + len(self.token_ids)


@dataclass(slots=True)
class StepPlan:
    """One engine step: the ragged batch in scheduler order."""

    work: list[SeqWork]

    @property
    def num_tokens(self) -> int:
        return sum(len(w.token_ids) for w in self.work)


@dataclass(slots=True)
class TokenLogprob:
    """A token with its log-probability (natural log) and, optionally, the top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class SeqResult:
    """What a step produced for one sequence.

    Attributes:
        seq_id: the sequence.
        token: the sampled token, or None if this step only advanced a prefill chunk.
        prompt_logprobs: logprobs of the prompt tokens computed in this step (position >= 1), in order.
        error: why sampling failed for this sequence alone (its batch-mates are unaffected).
    """

    seq_id: int
    token: TokenLogprob | None
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    error: str | None = None
