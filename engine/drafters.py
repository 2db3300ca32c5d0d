"""Drafters for speculative decoding: cheap guesses of a sequence's next tokens, verified by the served model.

A draft is only a proposal. The runner computes the served model's distribution at every drafted position in
one forward pass and keeps a draft token only where the model's own sampled token equals it (see
``engine.runner``), so what a drafter proposes changes the speed, never the output.

Prompt lookup (n-gram; Saxena 2023, "Prompt Lookup Decoding", and vLLM's ``ngram`` method): find the most
recent earlier occurrence of the sequence's last n tokens (n from ``max_n`` down to ``min_n``) in its own
prompt and output, and propose the tokens that followed it. No second model, no memory beyond the token ids;
it pays where the output copies its input (extraction, quoting, code edits) and proposes nothing elsewhere.

A draft model (``engine.draft_model.ModelDrafter``) is the other kind: a smaller or quantized model with its own
paged KV cache. Both answer the same two calls that ``speculation.decoder.SpecDecoder`` makes: ``propose_batch``
after a step's sampling, and ``release`` for sequences that ended.
"""

from __future__ import annotations

import enum
from array import array
from dataclasses import dataclass

_ITEM = array("i").itemsize  # bytes per token id in the search buffer


class Drafter(enum.Enum):
    """``--speculative``: which drafter proposes tokens (``off``: none)."""

    OFF = "off"
    NGRAM = "ngram"
    DRAFT = "draft"


@dataclass(slots=True)
class DraftRequest:
    """One sequence's ask for drafts after a step.

    Attributes:
        seq_id: the sequence (a drafter with per-sequence state keys it by this).
        token_ids: the sequence so far, prompt then output; the last token is the one just sampled.
        k: the most tokens to propose.
    """

    seq_id: int
    token_ids: list[int]
    k: int


class NgramDrafter:
    """Prompt-lookup drafts.

    Args:
        min_n, max_n: lengths of the suffix to look up (tokens), longest first.

    Raises:
        ValueError: ``min_n < 1`` or ``max_n < min_n``.
    """

    def __init__(self, min_n: int = 1, max_n: int = 3) -> None:
        if min_n < 1 or max_n < min_n:
            raise ValueError(f"n-gram lengths must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.steps: list[tuple[int, float]] = []  # forwards run while proposing: none (``ModelDrafter.steps``)

    def propose_batch(self, requests: list[DraftRequest]) -> list[list[int]]:
        """Each request's proposal (``propose``), in order."""
        return [self.propose(r.token_ids, r.k) for r in requests]

    def release(self, seq_ids: list[int]) -> None:
        """Nothing to free: prompt lookup keeps no state."""

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching suffix.

        Args:
            token_ids: the sequence so far (prompt then output; the last token is the newest).
            k: the most tokens to propose.

        Returns:
            The proposal (possibly empty: no suffix of ``min_n`` tokens occurred before).
        """
        length = len(token_ids)
        if k <= 0 or length < self.min_n + 1:
            return []
        # bytes.rfind searches in C; a match must start on a token boundary, so misaligned hits are skipped
        data = array("i", token_ids).tobytes()
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            pattern = data[(length - n) * _ITEM:]
            end = (length - 1) * _ITEM  # the occurrence must end before the last token: something follows it
            while True:
                at = data.rfind(pattern, 0, end)
                if at < 0:
                    break
                if at % _ITEM == 0:
                    start = at // _ITEM + n
                    return token_ids[start:start + k]
                end = at + len(pattern) - 1
        return []
