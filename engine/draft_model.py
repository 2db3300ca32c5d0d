"""A draft model for speculative decoding: a cheaper model (the served weights quantized, or a smaller model with
the same tokenizer) that proposes tokens greedily over its own paged KV pool.

Per sequence it keeps a block table in its own pool and the ids of the tokens whose K/V that pool holds. To
propose, it first catches up: what the served model verified since the last proposal (the accepted drafts and
the sampled token; the whole prompt the first time) is computed in one ragged forward for every sequence at once,
and that forward's last rows give each sequence its first draft token. Each further draft token is one batched
decode step of the sequences still drafting. Rejected drafts need no undo: the next catch-up starts at the longest
prefix of the held ids that the sequence still has, and later K/V overwrite the rest. A preempted sequence
resumes the same way; an ended one is released (``release``).

Drafts are the draft model's argmax, so its distribution q is one-hot and the runner's verification (keep a draft
token while the served model's own sample equals it) is exactly the rejection rule of Leviathan et al. 2023.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvserve.engine.drafters import DraftRequest
from kvserve.engine.plan import SamplingParams, SeqWork, StepPlan
from kvserve.engine.runner import ModelRunner
from kvserve.kvcache.block_manager import BlockManager

_GREEDY = SamplingParams(temperature=0.0)
# A catch-up of more tokens than this runs as a prefill span (one attention over the span); shorter ones, the
# usual accepted drafts plus one, run as decode rows, batched with every other sequence's.
PREFILL_FROM = 16


@dataclass(slots=True)
class _Held:
    """What the draft pool holds for one sequence: K/V of ``token_ids`` at positions 0.. in ``block_table``."""

    block_table: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case (only new tokens appended), compared in C
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]: bisect until they are neighbours
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class ModelDrafter:
    """Proposes with a draft model's ``ModelRunner`` (its own model and KV pool).

    Args:
        runner: the draft model's runner, built without a drafter of its own.
        max_model_len: the draft model's context (tokens); a sequence that would pass it gets no drafts.

    Attributes:
        steps: ``(rows, seconds)`` of each decode-only draft forward since the caller last cleared it (the
            proposal cost that ``auto`` weighs, learned online).
    """

    def __init__(self, runner: ModelRunner, max_model_len: int) -> None:
        self.runner = runner
        self.blocks = BlockManager(runner.pool.num_blocks, runner.pool.block_size, enable_prefix_caching=False)
        self.max_model_len = max_model_len
        self.held: dict[int, _Held] = {}
        self.steps: list[tuple[int, float]] = []

    def release(self, seq_ids: list[int]) -> None:
        """Free the draft blocks of sequences that ended (or were preempted: they catch up again later)."""
        for seq_id in seq_ids:
            held = self.held.pop(seq_id, None)
            if held is not None:
                self.blocks.free(held.block_table)

    def propose_batch(self, requests: list[DraftRequest]) -> list[list[int]]:
        """Up to ``k`` greedy draft tokens for each request, in order.

        A request past the draft model's context, or one whose blocks do not fit in the draft pool even after
        freeing the sequences not asking now, gets none.
        """
        proposals: list[list[int]] = [[] for _ in requests]
        asking = {r.seq_id for r in requests}
        active: list[tuple[int, DraftRequest, _Held]] = []
        for index, request in enumerate(requests):
            if request.k <= 0 or len(request.token_ids) + request.k > self.max_model_len:
                continue
            held = self.held.setdefault(request.seq_id, _Held())
            # K/V are needed up to the second-to-last draft token (the last one is only proposed)
            if not self._grow(held, len(request.token_ids) + request.k - 1, asking):
                self.release([request.seq_id])
                continue
            keep = min(common_prefix(held.token_ids, request.token_ids), len(request.token_ids) - 1)
            del held.token_ids[keep:]
            active.append((index, request, held))
        if not active:
            return proposals
        # the catch-up: every sequence's unverified-in-draft tokens, one forward; its last rows give draft 1
        works = [self._work(i, r.token_ids[len(h.token_ids):], len(h.token_ids), h, r.token_ids)
                 for i, r, h in active]
        for (index, request, held), result in zip(active, self._run(works)):
            held.token_ids = list(request.token_ids)
            proposals[index].append(result.token.token_id)
        depth = 1
        while True:
            active = [(i, r, h) for i, r, h in active if r.k > depth]
            if not active:
                return proposals
            works = [self._work(i, [proposals[i][-1]], len(h.token_ids), h, r.token_ids) for i, r, h in active]
            for (index, request, held), result in zip(active, self._run(works)):
                held.token_ids.append(proposals[index][-1])
                proposals[index].append(result.token.token_id)
            depth += 1

    def _grow(self, held: _Held, num_tokens: int, asking: set[int]) -> bool:
        """Room for ``num_tokens`` in ``held``'s table, freeing sequences not asking now if the pool is full."""
        while not self.blocks.allocate(held.block_table, num_tokens):
            idle = next((seq_id for seq_id in self.held if seq_id not in asking), None)
            if idle is None:
                return False
            self.release([idle])
        return True

    def _work(self, index: int, token_ids: list[int], start: int, held: _Held, history: list[int]) -> SeqWork:
        bs = self.blocks.block_size
        table = held.block_table
        slots = [table[p // bs] * bs + p % bs for p in range(start, start + len(token_ids))]
        # a long catch-up is a prefill (its "prompt" is the history); a short one, or a draft token, decodes
        prompt = history if len(token_ids) > PREFILL_FROM else history[:start]
        return SeqWork(seq_id=index, token_ids=token_ids, start_pos=start, block_table=table, slot_mapping=slots,
                       sample=True, params=_GREEDY, prompt_ids=prompt, output_ids=[])

    def _run(self, works: list[SeqWork]):
        started = time.perf_counter()
        results = self.runner.execute(StepPlan(works))
        if all(w.is_decode for w in works):
            self.steps.append((sum(len(w.token_ids) for w in works), time.perf_counter() - started))
        return results
