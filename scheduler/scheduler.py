"""The scheduling policy: which sequences compute which tokens in the next step.

Policy, in one place: running sequences first (in admission order), each taking the tokens it still
needs (1 for a decode, up to the remaining budget for a prefill in progress: chunked prefill), then
waiting sequences in arrival order while slots (max_num_seqs), the per-step token budget
(max_num_batched_tokens) and free blocks allow; a prefix-cache hit shrinks a newcomer's prefill. When the
pool cannot hold the next step of a running sequence, the most recently admitted running sequence is
preempted: its blocks are freed and it goes back to the head of the waiting queue to be recomputed.

Who may start, and when a finished sequence's last event goes out, is the admission policy's
(``scheduler.policies``: continuous batching, or the static baseline); the finish rate behind Retry-After
is ``scheduler.finish_rate``'s.

With speculation (``draft``: a DraftPolicy), a decoding sequence also verifies draft tokens the engine
proposed after its previous step: the policy chooses how many from the token budget left once every
sequence has its token and the waiting ones are admitted (drafts never displace a prefill or preempt anyone),
and ``update`` appends the accepted ones, checks stop conditions on each, and lowers the computed count
past the rejected ones (their slots are overwritten by later steps; only verified tokens are hashed into
the prefix cache).

Works on token counts and block ids only; never touches a tensor.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from kvserve.engine.plan import SeqResult, SeqWork, StepPlan
from kvserve.kvcache.block_manager import BlockManager
from kvserve.scheduler.finish_rate import FinishRate
from kvserve.scheduler.policies import Policy, make_policy
from kvserve.scheduler.sequence import FinishReason, SeqEvent, SeqStatus, Sequence
from kvserve.scheduler.speculation import Candidate, DraftPolicy

# A draft model's catch-up on a new sequence (its prompt) is paid back over at most this many output tokens: a
# request's max_tokens is often far more than it generates. A chosen bound, not a tuned one: it covers the longest
# reply of the seed64 workload (231 tokens; loadtest/workloads/seed64.json), and with it draft auto measured at
# least 0.98x of speculation off at 1, 8 and 32 streams (BENCHMARKS.md, "Speculative decoding, served side by side").
AMORTIZE_OVER = 256


@dataclass(slots=True)
class SchedulerConfig:
    """Limits of the scheduler.

    Raises:
        ValueError: from ``__post_init__`` on inconsistent limits.
    """

    max_num_seqs: int = 32               # slots: sequences running at once
    max_num_batched_tokens: int = 512    # tokens per step (chunked prefill splits longer prompts)
    max_model_len: int = 2048            # context limit (tokens): prompt + output
    policy: Policy = Policy.CONTINUOUS   # admission: continuous batching, or the static baseline

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_model_len < 1:
            raise ValueError("max_num_seqs and max_model_len must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (one decode token per slot)")


class Scheduler:
    """Plans steps and applies their results. Synchronous; owned by one asyncio task (SchedulerService).

    Args:
        config: limits and policy.
        blocks: the block manager of the KV pool.
        draft: how many draft tokens decoding sequences verify (speculative decoding); None: none.
    """

    def __init__(self, config: SchedulerConfig, blocks: BlockManager, draft: DraftPolicy | None = None) -> None:
        self.config = config
        self.blocks = blocks
        self.draft = draft
        self.policy = make_policy(config.policy, config.max_num_seqs)
        self.finish_rate = FinishRate()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._ended: list[int] = []           # with speculation: ended or preempted since the last plan
        self.prefix_queries = 0                # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0                   # of which found cached

    # -- queue ---------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.finish_rate.work_arrived()
        self.waiting.append(seq)

    def abort(self, seq_id: int, reason: FinishReason = FinishReason.ABORT) -> Sequence | None:
        """End a sequence wherever it is; returns it, or None if it is unknown or already finished."""
        for seq in self.waiting:
            if seq.seq_id == seq_id:
                self.waiting.remove(seq)
                self._finish(seq, reason)
                return seq
        for seq in self.running:
            if seq.seq_id == seq_id:
                self._finish(seq, reason)
                return seq
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- planning ------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Choose the next step's work (possibly empty when nothing fits)."""
        budget = self.config.max_num_batched_tokens
        work: list[SeqWork] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(seq.num_uncomputed, budget)
            if not self._reserve(seq, num_new):
                continue
            work.append(self._work(seq, num_new))
            budget -= num_new
        budget = self._admit(work, budget)
        if self.draft is not None:
            budget = self._add_drafts(work, budget)
            if self.draft.proposal_cost is not None:
                self._plan_proposals(work)
        plan, self._ended = StepPlan(work, ended_ids=self._ended), []
        return plan

    @property
    def ended_ids(self) -> list[int]:
        """Sequences that ended or were preempted since the last plan: the next plan carries them (a plan with
        no work only does that)."""
        return self._ended

    def _draft_room(self, seq: Sequence, available: int | None = None, ahead: int = 0) -> int:
        """Draft tokens ``seq`` could verify now: its proposal (or ``available``), cut so that every token the step
        might accept stays within max_tokens and the context, and, below min_tokens, so that every sampled row has
        stop tokens suppressed alike; ``ahead``: as if that many more tokens were output first. 0 for a
        constrained sequence (its grammar checks one token a step)."""
        if available is None:
            if not seq.draft_ids or seq.num_uncomputed != 1:
                return 0
            available = len(seq.draft_ids)
        if seq.constraint is not None:
            return 0
        output = len(seq.output_ids) + ahead
        room = min(available, seq.max_tokens - output - 1, self.config.max_model_len - seq.num_tokens - ahead - 1)
        if output < seq.min_tokens:
            room = min(room, seq.min_tokens - output - 1)
        return max(room, 0)

    def _plan_proposals(self, work: list[SeqWork]) -> None:
        """With a draft model (proposals cost a draft step per depth), choose how many tokens the engine drafts
        after this step for each sampling sequence: γ for its next step, as if the next step were these
        sequences decoding (``DraftPolicy.choose`` with the proposal cost)."""
        by_id = {seq.seq_id: seq for seq in self.running}
        candidates = []
        for w in work:
            if w.propose:
                seq = by_id[w.seq_id]
                room = self._draft_room(seq, self.draft.max_draft, ahead=1)
                if room:
                    candidates.append(Candidate(seq.seq_id, room, seq.num_draft_tokens, seq.num_accepted_tokens,
                                                catch_up=seq.num_tokens - seq.draft_synced,
                                                remaining=min(seq.max_tokens - len(seq.output_ids), AMORTIZE_OVER)))
        rows = len(candidates)
        gammas = self.draft.choose(candidates, rows, rows, self.config.max_num_batched_tokens - rows)
        for w in work:
            w.propose = gammas.get(w.seq_id, 0)

    def _add_drafts(self, work: list[SeqWork], budget: int) -> int:
        """Give decoding sequences the draft tokens the policy chooses, where their blocks can grow; returns the
        budget left. With a draft model the choice was made when proposing, so every proposal is verified."""
        by_id = {seq.seq_id: seq for seq in self.running}
        candidates = []
        for w in work:
            seq = by_id.get(w.seq_id)
            room = self._draft_room(seq) if seq is not None and w.is_decode else 0
            if room:
                candidates.append(Candidate(seq.seq_id, room, seq.num_draft_tokens, seq.num_accepted_tokens))
        if self.draft.proposal_cost is not None:
            gammas, left = {}, budget
            for c in candidates:
                gammas[c.seq_id] = min(c.available, left)
                left -= gammas[c.seq_id]
        else:
            yield_ = sum(1 for w in work if w.sample)
            gammas = self.draft.choose(candidates, sum(len(w.token_ids) for w in work), yield_, budget)
        for index, w in enumerate(work):
            gamma = gammas.get(w.seq_id, 0)
            seq = by_id.get(w.seq_id)
            if gamma and self.blocks.allocate(seq.block_table, seq.num_computed + 1 + gamma):
                work[index] = self._work(seq, 1, gamma)
                budget -= gamma
        return budget

    def _reserve(self, seq: Sequence, num_new: int) -> bool:
        """Make room for ``num_new`` more tokens of a running sequence, preempting the newest if needed."""
        while not self.blocks.allocate(seq.block_table, seq.num_computed + num_new):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._note_ended(seq)
        self.blocks.free(seq.block_table)
        seq.block_hashes.clear()  # its recomputed blocks are registered again (the old ones may be evicted)
        seq.num_computed = 0
        seq.draft_synced = 0  # the drafter frees its draft K/V too (StepPlan.ended_ids)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _admissible(self, seq: Sequence) -> bool:
        source = seq.prefix_source
        if source is not None and not source.is_finished and source.num_computed < len(source.prompt_ids):
            return False  # wait one step for the sibling's prompt blocks, then share them
        return self.policy.admissible(seq, self.waiting, self.running)

    def _admit(self, work: list[SeqWork], budget: int) -> int:
        """Admit waiting sequences into ``work`` while slots, the token budget and blocks allow; returns the
        budget left."""
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self._admissible(seq):
                break
            first_time = seq.num_cached_tokens is None
            cached = [] if seq.params.prompt_logprobs else self.blocks.find_cached_prefix(seq.all_ids)
            num_cached = len(cached) * self.blocks.block_size
            num_new = min(seq.num_tokens - num_cached, budget)
            if not self.blocks.allocate(seq.block_table, num_cached + num_new, cached):
                break  # no room: wait for blocks to free (FIFO, no overtaking)
            self.waiting.popleft()
            seq.num_computed = num_cached
            seq.status = SeqStatus.RUNNING
            if first_time:
                seq.num_cached_tokens = num_cached
                seq.first_scheduled_time = time.perf_counter()
                self.prefix_queries += len(seq.prompt_ids)
                self.prefix_hits += num_cached
            self.running.append(seq)
            work.append(self._work(seq, num_new))
            budget -= num_new
        return budget

    def _work(self, seq: Sequence, num_new: int, num_draft: int = 0) -> SeqWork:
        """The sequence's next ``num_new`` known tokens, then ``num_draft`` of its draft tokens."""
        start = seq.num_computed
        bs = self.blocks.block_size
        end = start + num_new + num_draft
        slots = [seq.block_table[p // bs] * bs + p % bs for p in range(start, end)]
        sample = start + num_new == seq.num_tokens
        propose = self.draft.max_draft if self.draft is not None and sample and seq.constraint is None else 0
        return SeqWork(seq_id=seq.seq_id, token_ids=seq.all_ids[start:start + num_new] + seq.draft_ids[:num_draft],
                       start_pos=start, block_table=list(seq.block_table), slot_mapping=slots, sample=sample,
                       params=seq.params, prompt_ids=seq.prompt_ids, output_ids=list(seq.output_ids),
                       suppress_ids=seq.suppress_ids, constraint=seq.constraint, num_draft=num_draft,
                       propose=propose)

    # -- results -------------------------------------------------------------------------------------
    def update(self, plan: StepPlan, results: list[SeqResult]) -> list[tuple[Sequence, SeqEvent]]:
        """Apply a step's results; returns the events to deliver, one per new token (finished sequences' blocks
        are freed)."""
        by_id = {seq.seq_id: seq for seq in self.running}
        events: list[tuple[Sequence, SeqEvent]] = []
        now = time.perf_counter()
        for w, result in zip(plan.work, results):
            seq = by_id.get(w.seq_id)
            if seq is None:
                continue  # aborted or preempted during the step
            if result.error is not None:
                self._finish(seq, FinishReason.ERROR)
                events.append((seq, SeqEvent(seq.seq_id, finish=FinishReason.ERROR, error=result.error, time=now)))
                continue
            if w.num_draft:
                seq.num_draft_tokens += w.num_draft
                seq.num_accepted_tokens += result.num_accepted
                self.draft.record(w.num_draft, result.num_accepted)
            seq.draft_ids = result.draft_ids
            if result.draft_ids and w.propose:
                seq.draft_synced = w.context_len - w.num_draft + len(result.tokens)  # its num_tokens after this step
            if result.prompt_logprobs and not result.tokens:
                events.append((seq, SeqEvent(seq.seq_id, prompt_logprobs=result.prompt_logprobs, time=now)))
            reason, delivered = None, []
            for token in result.tokens:
                seq.output_ids.append(token.token_id)
                if seq.first_token_time is None:
                    seq.first_token_time = now
                reason = self._stop_reason(seq, token.token_id)
                delivered.append(SeqEvent(seq.seq_id, token=token, finish=reason, time=now,
                                          prompt_logprobs=[] if delivered else result.prompt_logprobs))
                if reason is not None:
                    break  # tokens accepted after a stop are dropped
            for event in delivered:
                event.step_tokens = len(delivered)
            if reason is not None and self.policy.hold(seq, delivered[-1]):
                delivered.pop()
            events.extend((seq, event) for event in delivered)
            # K/V are valid for the known tokens and the accepted drafts; the last new token is computed next step
            seq.num_computed = min(w.context_len - w.num_draft + result.num_accepted, seq.num_tokens - 1
                                   if result.tokens else w.context_len)
            self.blocks.cache_full_blocks(seq.block_table, seq.all_ids, seq.num_computed, seq.block_hashes)
            if reason is not None:
                self._finish(seq, reason)
        return events + self.policy.release(self.waiting, self.running)

    def _stop_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        if token_id in seq.stop_token_ids and len(seq.output_ids) > seq.min_tokens - 1:
            return FinishReason.STOP
        if len(seq.output_ids) >= seq.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _note_ended(self, seq: Sequence) -> None:
        if self.draft is not None:  # only a drafter keeps per-sequence state in the engine
            self._ended.append(seq.seq_id)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self._note_ended(seq)
        self.blocks.free(seq.block_table)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.finish_rate.finished(still_busy=self.has_work)

    # -- figures -------------------------------------------------------------------------------------
    def free_slots(self) -> int:
        """Slots a waiting sequence could take at the next step (the policy's answer)."""
        return self.policy.free_slots(self.config.max_num_seqs, self.waiting, self.running)
