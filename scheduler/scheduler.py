"""The scheduler: which sequences compute which tokens in the next step, and what a step's results change.

Planning, in one place: running sequences first (in the scheduling policy's order), each taking the tokens it still
needs (1 for a decode, up to the remaining budget for a prefill in progress: chunked prefill), then waiting
sequences in the policy's order while slots (max_num_seqs), the per-step token budget (max_num_batched_tokens) and
free blocks allow; a prefix-cache hit shrinks a newcomer's prefill. When the pool cannot hold the next step of a
running sequence, the last running sequence in the policy's order is preempted: its blocks are freed and it goes
back to the waiting queue to be recomputed. The scheduling policy (``scheduler.ordering``: FCFS, priority, fair
share per tenant) decides those orders, which running sequence a waiting one may displace, and each sequence's
share of the budget; the batching policy (``scheduler.policies``: continuous, or the static baseline) decides
when a waiting sequence may start and when a finished one's last output goes out; the finish rate behind
Retry-After is ``scheduler.finish_rate``'s.

Sharing a step between prompts (vLLM's partial-prefill limits, by their names): a prefill with more than
``long_prefill_token_threshold`` tokens left is long, and computes at most that many in the first pass of a step,
so requests that arrive while it is chunk-prefilled get the rest of the budget instead of waiting for its whole
prompt; whatever they leave goes back to it at the end of the pass, so a long prompt alone still fills every step.
At most ``max_num_partial_prefills`` prompts prefill at once, of which ``max_long_partial_prefills`` long ones: a
long prompt that finds the long ones' limit reached waits, and a short prompt behind it in the queue goes first (the
one exception to no overtaking; the long one keeps its place and goes next). Only a budget left once every prefill
got all it needs may start a long prompt beyond the limit, so steps stay full when several such prompts arrive
together. Decodes keep their token: a prefill leaves one for each decode after it in the claim order (vLLM plans
decodes first; here the policy's order stays the claim order, since preemption takes from its end).

Sizing chunks by work (Sarathi-Serve's stall-free batching: a budget of work per step, not of tokens): a prompt
token costs its projections plus attention over the keys before it, so a chunk of the budget's tokens at position
8,000 costs several times one at position 0, and everyone sharing or waiting for that step waits that much longer.
With ``attention_cost_context`` C > 0 (the context at which a token's attention costs as much as its projections;
``kvserve serve`` derives it from the model's shape and the kernels' measured speeds,
``engine.loader.attention_cost_context``), n tokens from position p cost n (1 + (p + n / 2) / C) token-equivalents
(``chunk_work``; a decode's token likewise, and it keeps its token whatever the work left). A step may do the work of
a whole budget's chunk from position 0 (``LONE_STEP_WORK`` times that while one sequence is live, so a lone long
prompt is not cut into many small steps), a long prefill's first-pass chunk the work of
``long_prefill_token_threshold`` tokens from 0, and the top-up fills the step's work, not only its tokens; the token
budget holds as well. A step's first prefill chunk gets one token however deep, so every prompt progresses. Chunk
boundaries change no token (attention is chunk-invariant; tests/test_exactness.py). 0: chunks by tokens only.

Speculation adds one rule (as vLLM v1's scheduler has it): a sequence's computed tokens catch up to its tokens plus
its speculative tokens. Drafts only get the token budget and the blocks left over once every sequence's own work is
planned, so they never displace a prefill or preempt anyone; which draft tokens each decoding sequence verifies is
the one call ``spec.propose`` (a ``speculation.decoder.SpecDecoder``, which keeps the drafts and owns everything
else about speculation). ``update`` appends the accepted ones, checks stop conditions on each, and keeps the
computed count at the known tokens plus the accepted drafts (the rejected ones' slots are overwritten by later
steps; only verified tokens are hashed into the prefix cache).

Works on token counts and block ids only; never touches a tensor.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Protocol

from kvserve.engine.plan import SeqResult, SeqWork, StepPlan
from kvserve.kvcache.block_manager import BlockManager
from kvserve.scheduler.contract import EngineRequest, FinishReason, RequestOutput
from kvserve.scheduler.finish_rate import FinishRate
from kvserve.scheduler.ordering import SchedulingPolicy, make_ordering
from kvserve.scheduler.policies import Policy, check_policies, make_policy
from kvserve.scheduler.sequence import SeqStatus, Sequence


@dataclass(slots=True)
class SchedulerConfig:
    """Limits of the scheduler.

    Raises:
        ValueError: from ``__post_init__`` on inconsistent limits.
    """

    max_num_seqs: int = 32               # slots: sequences running at once
    max_num_batched_tokens: int = 512    # tokens per step (chunked prefill splits longer prompts)
    max_model_len: int = 2048            # context limit (tokens): prompt + output
    policy: Policy = Policy.CONTINUOUS   # batching: continuous, or the static baseline
    scheduling: SchedulingPolicy = SchedulingPolicy.FCFS  # order: fcfs | priority | fair (per tenant)
    long_prefill_token_threshold: int | None = None  # a prefill with more tokens left is long (tokens); its chunk is
                                                     # capped at this while others want the budget. None: half the
                                                     # budget; 0: no prompt is long, no chunk capped
    max_num_partial_prefills: int | None = None  # prompts prefilling at once; None: max_num_seqs
    max_long_partial_prefills: int = 1           # long prompts prefilling at once (<= max_num_partial_prefills)
    attention_cost_context: int = 0  # context (tokens) at which a prompt token's attention costs as much as its
                                     # projections: prefill chunks are sized by work, not tokens; 0: by tokens only

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_model_len < 1:
            raise ValueError("max_num_seqs and max_model_len must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (one decode token per slot)")
        if self.long_prefill_token_threshold is None:
            self.long_prefill_token_threshold = self.max_num_batched_tokens // 2
        if self.max_num_partial_prefills is None:
            self.max_num_partial_prefills = self.max_num_seqs
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0 (0: no prompt is long)")
        if self.max_num_partial_prefills < 1:
            raise ValueError("max_num_partial_prefills must be >= 1")
        if self.attention_cost_context < 0:
            raise ValueError("attention_cost_context must be >= 0 (0: chunks are sized by tokens only)")
        if not 1 <= self.max_long_partial_prefills <= self.max_num_partial_prefills:
            raise ValueError(f"max_long_partial_prefills must be in 1..max_num_partial_prefills "
                             f"({self.max_num_partial_prefills})")
        self.policy, self.scheduling = Policy(self.policy), SchedulingPolicy(self.scheduling)
        check_policies(self.policy, self.scheduling)


# A step's work with one sequence live, in steps' work with more: a lone long prompt's chunks take fewer, larger
# steps (each step has a fixed overhead: at 1 a lone 4,096-token prompt took 21 steps instead of 8 and its TTFT grew
# past the few percent allowed; at 2, 11), and a request arriving during such a step waits for it, then shares a
# step of the usual work (the lone TTFT and step times: `loadtest peers --prefill` with and without
# --attention-cost-context 0).
LONE_STEP_WORK = 2


def chunk_work(start: int, tokens: int, context: int) -> int:
    """The work of computing ``tokens`` tokens at positions ``start``, ``start + 1``, ... of a sequence, in units of
    ``1 / (2 * context)`` of one token's projections: ``tokens * (2 * (context + start) + tokens)``, i.e.
    ``tokens * (1 + (start + tokens / 2) / context)`` token-equivalents. Each token's projections cost one; its
    attention over the ``position`` keys before it costs ``position / context`` (``context``: the context length at
    which attention costs as much as the projections, ``SchedulerConfig.attention_cost_context``, > 0). Additive:
    ``chunk_work(p, a) + chunk_work(p + a, b) == chunk_work(p, a + b)``, so a chunk's work does not depend on how
    the tokens before it were chunked. Integers, so planning is exact."""
    return tokens * (2 * (context + start) + tokens)


def affordable_tokens(start: int, work: int, context: int) -> int:
    """The most tokens a chunk starting at position ``start`` may compute for at most ``work`` (``chunk_work``'s
    units; <= 0: none): the largest n with ``chunk_work(start, n, context) <= work``, from ``(a + n)^2 <= a^2 +
    work`` with ``a = context + start``."""
    if work <= 0:
        return 0
    a = context + start
    return math.isqrt(a * a + work) - a


def lone_prefill_chunks(length: int, budget: int, context: int) -> list[int]:
    """The chunk sizes (tokens) the scheduler gives a ``length``-token prompt prefilled alone, with
    ``max_num_batched_tokens`` = ``budget`` and ``attention_cost_context`` = ``context`` (0: by tokens only): each
    step the most tokens within the budget and a lone step's work (``LONE_STEP_WORK`` budgets' work from position
    0), one at least. For benchmarks that replay a prefill as the server runs it (``loadtest profile --prefill``)."""
    sizes, start = [], 0
    work = chunk_work(0, budget, context) * LONE_STEP_WORK if context else None
    while start < length:
        n = min(budget, length - start)
        if work is not None:
            n = max(1, min(n, affordable_tokens(start, work, context)))
        sizes.append(n)
        start += n
    return sizes


class Speculation(Protocol):
    """What the scheduler asks of speculative decoding (``speculation.decoder.SpecDecoder`` answers)."""

    def propose(self, plan: StepPlan, running: list[Sequence], budget: int,
                limits: SchedulerConfig) -> dict[int, list[int]]:
        """The draft tokens each decoding sequence of ``plan`` verifies in it, within ``budget`` tokens in all."""

    def observe(self, plan: StepPlan, results: list[SeqResult], running: list[Sequence],
                seconds: float | None = None) -> None:
        """Learn from a step that ran (called before ``Scheduler.update`` applies it)."""


class Scheduler:
    """Plans steps and applies their results. Synchronous; driven by one ``core.EngineCore``.

    Args:
        config: limits and policies.
        blocks: the block manager of the KV pool.
        spec: speculative decoding (a ``speculation.decoder.SpecDecoder``); None: none.
    """

    def __init__(self, config: SchedulerConfig, blocks: BlockManager, spec: Speculation | None = None) -> None:
        self.config = config
        self.blocks = blocks
        self.spec = spec
        self.policy = make_policy(config.policy, config.max_num_seqs)
        self.waiting = make_ordering(config.scheduling, config.max_num_seqs)
        self.finish_rate = FinishRate()
        self.running: list[Sequence] = []
        self.live: dict[int, Sequence] = {}   # waiting and running, by request id
        self._serials = itertools.count()
        self._ended: list[int] = []           # with speculation: ended or preempted since the last plan
        self._preempted: list[Sequence] = []  # preempted while planning the coming step (their outputs say so)
        # totals since start (the core's step records carry each step's share)
        self.num_preemptions = 0
        self.prefix_queries = 0                # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0                   # of which found cached
        # the step being planned: its work left (chunk_work's units; None: chunks are sized by tokens only), and
        # whether a prefill has a chunk in it yet
        self._work_left: int | None = None
        self._prefilled = False

    # -- queue ---------------------------------------------------------------------------------------
    def add(self, request: EngineRequest) -> None:
        """Queue a request.

        Raises:
            ValueError: its id is already live.
        """
        if request.request_id in self.live:
            raise ValueError(f"request id {request.request_id} is already queued or running")
        seq = Sequence(request, serial=next(self._serials))
        self.finish_rate.work_arrived()
        self.live[seq.seq_id] = seq
        self.waiting.add(seq)

    def abort(self, request_id: int, reason: FinishReason = FinishReason.ABORT) -> RequestOutput | None:
        """End a request wherever it is; returns its last output, or None if it is unknown or already finished."""
        seq = self.live.get(request_id)
        if seq is None:
            return None
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self._finish(seq, reason)
        return RequestOutput(request_id, finish_reason=reason, num_cached_tokens=seq.num_cached_tokens or 0)

    @property
    def has_work(self) -> bool:
        return bool(self.live)

    # -- planning ------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Choose the next step's work (possibly empty when nothing fits)."""
        budget = self.config.max_num_batched_tokens
        context = self.config.attention_cost_context
        # a whole budget's chunk from position 0; LONE_STEP_WORK times that for a sequence alone
        self._work_left = (chunk_work(0, budget, context) * (LONE_STEP_WORK if len(self.live) == 1 else 1)
                           if context else None)
        self._prefilled = False
        self.waiting.begin(self.running, budget)
        self._displace()
        work: list[SeqWork] = []
        short_of: list[int] = []  # indices in work of prefills given less than they need (topped up at the end)
        order = self.waiting.order(self.running)
        decoding = [seq.num_uncomputed == 1 for seq in order]
        decodes_after = sum(decoding)  # decodes later in the claim order: a prefill leaves each its token
        decode_work = [chunk_work(seq.num_computed, 1, context) if d and context else 0
                       for seq, d in zip(order, decoding)]
        decode_work_after = sum(decode_work)  # ... and the work of it
        for seq, is_decode, own_work in zip(order, decoding, decode_work):
            decodes_after -= is_decode
            decode_work_after -= own_work
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            need, start = seq.num_uncomputed, seq.num_computed
            num_new = min(need, budget - decodes_after, self.waiting.cap(seq), self._chunk_cap(start, need))
            if not is_decode:  # a decode keeps its token whatever the work left
                num_new = self._affordable(start, num_new, decode_work_after)
            if num_new <= 0 or not self._reserve(seq, num_new, order):
                continue
            if num_new < need:
                short_of.append(len(work))
            work.append(self._work(seq, num_new))
            self.waiting.charge(seq, num_new)
            self._spend(start, num_new, prefill=not is_decode)
            budget -= num_new
        budget = self._top_up(work, self._admit(work, budget, short_of), short_of)
        if budget:  # every prefill got all it needs: what is left may start a long prompt beyond the limit
            budget = self._top_up(work, self._admit(work, budget, short_of, limit_longs=False), short_of)
        plan, self._ended = StepPlan(work, ended_ids=self._ended), []
        if self.spec is not None:
            self._add_drafts(plan, budget)
        return plan

    def take_preempted(self) -> list[RequestOutput]:
        """Outputs for the sequences preempted since the last call (planning the step preempts them; one may be
        admitted again in the same step, and its output for the step then follows this one)."""
        preempted, self._preempted = self._preempted, []
        return [RequestOutput(seq.seq_id, num_cached_tokens=seq.num_cached_tokens or 0, preempted=True)
                for seq in preempted]

    @property
    def ended_ids(self) -> list[int]:
        """Sequences that ended or were preempted since the last plan: the next plan carries them (a plan with
        no work only does that)."""
        return self._ended

    def _displace(self) -> None:
        """Preempt running sequences the scheduling policy says a waiting one may displace, while that one finds no
        free slot or not the blocks its first chunk needs."""
        while self.running:
            newcomer = self.waiting.head()
            if newcomer is None:
                return
            first_chunk = min(newcomer.num_tokens, self.config.max_num_batched_tokens)
            if (len(self.running) < self.config.max_num_seqs
                    and self.blocks.blocks_needed(first_chunk) <= self.blocks.num_free_blocks):
                return
            prefills, longs = self._prefilling()
            if not self._may_start(newcomer, self._lookup(newcomer), prefills,
                                   longs < self.config.max_long_partial_prefills):
                return  # the prefill limits would keep it waiting anyway: preempting would free nothing it can use
            victim = self.waiting.displace(self.running, newcomer)
            if victim is None:
                return
            self._preempt(victim)

    def _add_drafts(self, plan: StepPlan, budget: int) -> None:
        """Speculation's rule: a decoding sequence computes, after its own token, the draft tokens ``spec`` grants
        it from the ``budget`` left, where its blocks can grow to hold them."""
        drafts = self.spec.propose(plan, self.running, budget, self.config)
        for index, w in enumerate(plan.work):
            draft_ids, seq = drafts.get(w.seq_id), self.live.get(w.seq_id)
            if draft_ids and self.blocks.allocate(seq.block_table, seq.num_computed + 1 + len(draft_ids)):
                plan.work[index] = self._work(seq, 1, draft_ids, propose=w.propose)

    def _reserve(self, seq: Sequence, num_new: int, order: list[Sequence]) -> bool:
        """Make room for ``num_new`` more tokens of a running sequence, preempting from the end of ``order`` (the
        step's claim order) if needed."""
        while not self.blocks.allocate(seq.block_table, seq.num_computed + num_new):
            victim = next(s for s in reversed(order) if s.status is SeqStatus.RUNNING)
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._note_ended(seq)
        self.blocks.free(seq.block_table)
        seq.block_hashes.clear()  # its recomputed blocks are registered again (the old ones may be evicted)
        seq.num_computed = seq.blocks_reported = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._preempted.append(seq)
        self.waiting.requeue(seq)

    def _admissible(self, seq: Sequence) -> bool:
        source = self.live.get(seq.request.prefix_source) if seq.request.prefix_source is not None else None
        if source is not None and source.num_computed < len(source.prompt_ids):
            return False  # wait one step for the sibling's prompt blocks, then share them
        return self.policy.admissible(seq, self.waiting, self.running)

    def _admit(self, work: list[SeqWork], budget: int, short_of: list[int], limit_longs: bool = True) -> int:
        """Admit waiting sequences into ``work`` while slots, the token budget, the prefill limits and blocks allow;
        returns the budget left. A newcomer given less than its prompt is noted in ``short_of``.

        ``limit_longs=False``: the long prompts' limit is not applied. The planner admits so only with the budget
        nobody in the step could take (the prefills given less than they need were topped up first), so prompts a
        little over the threshold arriving together fill the steps as they did without it; a long prompt started
        so takes all that budget, and the prompts before it finish theirs in this step."""
        prefills, longs = self._prefilling()
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            long_room = not limit_longs or longs < self.config.max_long_partial_prefills
            found = self._next_newcomer(prefills, long_room)
            if found is None:
                break
            seq, cached = found
            first_time = seq.num_cached_tokens is None
            num_cached = len(cached) * self.blocks.block_size
            need = seq.num_tokens - num_cached
            num_new = min(need, budget, self.waiting.cap(seq), self._chunk_cap(num_cached, need))
            num_new = self._affordable(num_cached, num_new)
            if num_new <= 0 or not self.blocks.allocate(seq.block_table, num_cached + num_new, cached):
                break  # no room: wait for blocks to free (no overtaking)
            self.waiting.pop(seq)
            seq.num_computed = num_cached
            seq.status = SeqStatus.RUNNING
            if first_time:
                seq.num_cached_tokens = num_cached
                self.prefix_queries += len(seq.prompt_ids)
                self.prefix_hits += num_cached
            self.running.append(seq)
            prefills += need > 1
            longs += self._is_long(need)
            if num_new < need:
                short_of.append(len(work))
            work.append(self._work(seq, num_new))
            self.waiting.charge(seq, num_new, admitted=True)
            self._spend(num_cached, num_new, prefill=need > 1)
            budget -= num_new
        return budget

    def _next_newcomer(self, prefills: int, long_room: bool) -> tuple[Sequence, list[int]] | None:
        """The waiting sequence to admit next and its cached prefix blocks: the policy's head; or, when the head is
        a long prompt and ``long_room`` is False (the long ones' limit is reached), the first short prompt behind
        it; None: none may start now (``prefills``: prompts in progress, for their limit)."""
        head = self.waiting.head()
        if head is None or not self._admissible(head):
            return None
        cached = self._lookup(head)
        if self._may_start(head, cached, prefills, long_room):
            return head, cached
        if prefills >= self.config.max_num_partial_prefills:
            return None
        for seq in self.waiting:  # the policy's order; a prompt this long only goes as short on a prefix hit
            if (seq is not head and not self._is_long(seq.num_tokens) and self.waiting.cap(seq) > 0
                    and self._admissible(seq)):
                return seq, self._lookup(seq)
        return None

    def _lookup(self, seq: Sequence) -> list[int]:
        """The prefix-cache blocks ``seq`` would start from (none when it asks for prompt logprobs)."""
        if seq.params.prompt_logprobs:
            return []
        return self.blocks.find_cached_prefix(seq.all_ids, seq.request.cache_salt)

    def _prefilling(self) -> tuple[int, int]:
        """Running sequences with more than one token to compute (prompts, or recomputes, in progress), and of
        them the long ones."""
        prefills = [seq.num_uncomputed for seq in self.running if seq.num_uncomputed > 1]
        return len(prefills), sum(self._is_long(need) for need in prefills)

    def _may_start(self, seq: Sequence, cached: list[int], prefills: int, long_room: bool) -> bool:
        """The prefill limits let ``seq`` (whose prefix ``cached`` is in the cache) start beside ``prefills``
        prompts in progress; ``long_room``: a long one may start."""
        if prefills >= self.config.max_num_partial_prefills:
            return False
        return long_room or not self._is_long(seq.num_tokens - len(cached) * self.blocks.block_size)

    def _is_long(self, tokens_left: int) -> bool:
        threshold = self.config.long_prefill_token_threshold
        return 0 < threshold < tokens_left

    def _chunk_cap(self, start: int, tokens_left: int) -> int:
        """The most tokens a prefill at position ``start`` with ``tokens_left`` may take in the first pass of a
        step: a long one's chunk takes at most ``long_prefill_token_threshold`` tokens, and with
        ``attention_cost_context`` at most the work of that many from position 0 (but one token at least)."""
        if not self._is_long(tokens_left):
            return tokens_left
        threshold, context = self.config.long_prefill_token_threshold, self.config.attention_cost_context
        if not context:
            return threshold
        return max(1, min(threshold, affordable_tokens(start, chunk_work(0, threshold, context), context)))

    def _affordable(self, start: int, tokens: int, reserved: int = 0) -> int:
        """The most of ``tokens`` a prefill's chunk from position ``start`` may take within the step's work left,
        less ``reserved`` (the decodes' after it in the claim order). The step's first prefill chunk gets at least
        one token, so a prompt deeper than one step's work still progresses."""
        if self._work_left is None:
            return tokens
        num_new = min(tokens, affordable_tokens(start, self._work_left - reserved,
                                                self.config.attention_cost_context))
        return num_new if num_new > 0 or self._prefilled else min(tokens, 1)

    def _spend(self, start: int, tokens: int, prefill: bool) -> None:
        """Charge the step's work left for ``tokens`` tokens computed from position ``start``."""
        if self._work_left is not None:
            self._work_left -= chunk_work(start, tokens, self.config.attention_cost_context)
        self._prefilled |= prefill

    def _top_up(self, work: list[SeqWork], budget: int, short_of: list[int]) -> int:
        """Give the budget nobody else claimed to the prefills in ``short_of`` (indices in ``work``), in claim
        order, where their blocks can grow without preempting anyone; returns the budget left. A long prompt alone
        thus fills the step as if its chunk had no cap."""
        for index in short_of:
            if budget == 0:
                break
            w = work[index]
            seq = self.live[w.seq_id]
            planned = len(w.token_ids)
            start = seq.num_computed + planned
            extra = min(seq.num_uncomputed - planned, budget, self.waiting.cap(seq))
            extra = self._affordable(start, extra)
            if extra <= 0 or not self.blocks.allocate(seq.block_table, start + extra):
                continue
            work[index] = self._work(seq, planned + extra)
            self.waiting.charge(seq, extra)
            self._spend(start, extra, prefill=True)
            budget -= extra
        return budget

    def _work(self, seq: Sequence, num_new: int, draft_ids: list[int] = (), propose: int = 0) -> SeqWork:
        """The sequence's next ``num_new`` known tokens, then ``draft_ids`` to verify (``propose``: as
        ``SeqWork.propose``, which ``spec`` sets). The plan refers to the sequence's own lists (its block table,
        its prompt and output): nothing changes them while the step runs, and a copy would grow with the context."""
        start = seq.num_computed
        bs = self.blocks.block_size
        end = start + num_new + len(draft_ids)
        table = seq.block_table
        slots = [table[p // bs] * bs + p % bs for p in range(start, end)]
        sample = start + num_new == seq.num_tokens
        return SeqWork(seq_id=seq.seq_id, token_ids=seq.tokens(start, start + num_new) + list(draft_ids),
                       start_pos=start, block_table=table, slot_mapping=slots, sample=sample, params=seq.params,
                       prompt_ids=seq.prompt_ids, output_ids=seq.output_ids, suppress_ids=seq.suppress_ids,
                       num_draft=len(draft_ids), propose=propose)

    # -- results -------------------------------------------------------------------------------------
    def update(self, plan: StepPlan, results: list[SeqResult]) -> list[RequestOutput]:
        """Apply a step's results; returns one output per sequence of the step (tokens, progress, its end), then
        those the batching policy releases. Finished sequences' blocks are freed."""
        outputs: list[RequestOutput] = []
        for w, result in zip(plan.work, results):
            seq = self.live.get(w.seq_id)
            if seq is None or seq.status is not SeqStatus.RUNNING:
                continue  # aborted or preempted during the step
            if result.error is not None:
                self._finish(seq, FinishReason.ERROR)
                outputs.append(RequestOutput(seq.seq_id, finish_reason=FinishReason.ERROR, error=result.error,
                                             num_cached_tokens=seq.num_cached_tokens or 0))
                continue
            reason, delivered = None, []
            for token in result.tokens:
                seq.output_ids.append(token.token_id)
                delivered.append(token)
                reason = self._stop_reason(seq, token.token_id)
                if reason is not None:
                    break  # tokens accepted after a stop are dropped
            # K/V are valid for the known tokens and the accepted drafts (speculation's rule); the last new token
            # is computed next step
            seq.num_computed = min(w.context_len - w.num_draft + result.num_accepted, seq.num_tokens - 1
                                   if result.tokens else w.context_len)
            self._cache_full_blocks(seq)
            output = RequestOutput(seq.seq_id, tokens=delivered, prompt_logprobs=result.prompt_logprobs,
                                   finish_reason=reason, num_cached_tokens=seq.num_cached_tokens or 0,
                                   num_computed_tokens=seq.num_computed, num_draft_tokens=w.num_draft,
                                   num_accepted_tokens=result.num_accepted if w.num_draft else 0,
                                   new_block_ids=seq.block_table[seq.blocks_reported:])
            seq.blocks_reported = len(seq.block_table)
            if reason is not None:
                self._finish(seq, reason)
                if self.policy.hold(output):
                    continue
            outputs.append(output)
        return outputs + self.policy.release(self.waiting, self.running)

    def _cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's newly full, verified blocks in the prefix cache, reading only their tokens."""
        bs = self.blocks.block_size
        first, full = len(seq.block_hashes), seq.num_computed // bs
        if full > first:
            self.blocks.cache_full_blocks(seq.block_table, seq.tokens(first * bs, full * bs), seq.num_computed,
                                          seq.block_hashes, seq.request.cache_salt, offset=first * bs)

    def _stop_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        if token_id in seq.request.stop_token_ids and len(seq.output_ids) > seq.min_tokens - 1:
            return FinishReason.STOP
        if len(seq.output_ids) >= seq.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _note_ended(self, seq: Sequence) -> None:
        if self.spec is not None:  # only speculation keeps per-sequence state in the engine (a drafter's)
            self._ended.append(seq.seq_id)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self._note_ended(seq)
        self.blocks.free(seq.block_table)
        del self.live[seq.seq_id]
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.finish_rate.finished(still_busy=self.has_work)

    # -- figures -------------------------------------------------------------------------------------
    def free_slots(self) -> int:
        """Slots a waiting sequence could take at the next step (the batching policy's answer)."""
        return self.policy.free_slots(self.config.max_num_seqs, self.waiting, self.running)
