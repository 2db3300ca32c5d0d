"""What the scheduler hands the runner for one step, and what comes back. Plain Python: no tensors.

A step is a ragged batch: each ``SeqWork`` contributes ``len(token_ids)`` tokens, and all of them are
flattened into one ``[1, num_tokens]`` forward. A sequence is *prefilling* while its prompt is not all in the
cache (a whole prompt, a chunk of one, or a recompute after preemption), and *decoding* once it is: then every
token it computes is generated, and a step gives it ``1 + num_draft`` tokens (the last sampled token, then
draft tokens to verify; speculative decoding, Leviathan et al. 2023). Decode = 1 is the case
``num_draft == 0``; ``SeqWork.is_decode`` is the one definition, for the runner, the scheduler and the server.

    token_ids of a decoding sequence, k = 1 + num_draft:   | last | draft 1 | ... | draft k-1 |
    rows sampled (each predicts the next position):         |  r0  |   r1    | ... |   rk-1    |
    accepted: the sampled tokens up to and including the first that differs from the draft it checks
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
        processed_logprobs: report logprobs of the distribution sampled from (after penalties, temperature and
            top-k/top-p/min-p; vLLM's ``processed_logprobs``: a teacher's soft labels for distillation) instead of
            the model's own (raw, the default, as OpenAI reports them).
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
    processed_logprobs: bool = False

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
        num_draft: the last ``num_draft`` of ``token_ids`` are draft tokens to verify (0: plain decode or prefill);
            only a decoding sequence carries drafts.
        propose: how many draft tokens the engine should propose for this sequence's next step (0: none; set by
            speculation, ``speculation.decoder.SpecDecoder.propose``).
        prompt_ids: the prompt (for repetition penalty and prompt logprobs).
        output_ids: tokens generated so far (for penalties and seeds).
        suppress_ids: tokens that may not be sampled now (EOS while below min_tokens).

    ``block_table``, ``prompt_ids`` and ``output_ids`` are the scheduler's own lists, not copies (nothing changes them
    while the step runs, and a copy per step would grow with the context): the runner only reads them. A
    structured-output sequence's grammar matcher is the runner's constraint plug-in's, by ``seq_id``
    (``engine.constraints.Constraints``).
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
    num_draft: int = 0
    propose: int = 0

    @property
    def context_len(self) -> int:
        """Tokens in the cache once this step has run."""
        return self.start_pos + len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        """Its prompt is all in the cache: every token computed now is a generated or a draft token."""
        return self.start_pos >= len(self.prompt_ids)

    @property
    def draft_ids(self) -> list[int]:
        """The draft tokens this step verifies (``token_ids[1:]`` of a decoding sequence)."""
        return self.token_ids[len(self.token_ids) - self.num_draft:] if self.num_draft else []

    @property
    def num_sampled_rows(self) -> int:
        """Rows whose next token is sampled: ``1 + num_draft`` when sampling, else 0."""
        return 1 + self.num_draft if self.sample else 0


@dataclass(slots=True)
class StepPlan:
    """One engine step: the ragged batch in scheduler order.

    Attributes:
        work: the sequences' shares, in scheduler order.
        ended_ids: sequences that ended or were preempted since the last plan (a drafter frees their state).
    """

    work: list[SeqWork]
    ended_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(w.token_ids) for w in self.work)

    @property
    def num_draft_tokens(self) -> int:
        return sum(w.num_draft for w in self.work)


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
        tokens: the new tokens, in order: the accepted draft tokens, then the one sampled where the first draft
            was rejected (or after the last draft); empty if this step only advanced a prefill chunk. Without
            drafts, at most one.
        prompt_logprobs: logprobs of the prompt tokens computed in this step (position >= 1), in order.
        error: why sampling failed for this sequence alone (its batch-mates are unaffected).
        draft_ids: draft tokens proposed for the next step (at most ``SeqWork.propose``); not yet verified.
    """

    seq_id: int
    tokens: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    error: str | None = None
    draft_ids: list[int] = field(default_factory=list)

    @property
    def token(self) -> TokenLogprob | None:
        """The last new token, or None (what a caller stepping one token at a time reads)."""
        return self.tokens[-1] if self.tokens else None

    @property
    def num_accepted(self) -> int:
        """Draft tokens accepted (every new token but the last was a draft token)."""
        return max(len(self.tokens) - 1, 0)
