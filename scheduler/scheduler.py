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

Speculation adds one rule (as vLLM v1's scheduler has it): a sequence's computed tokens catch up to its tokens
plus its speculative tokens (``draft_ids``, proposed by the engine after its previous step). Drafts only get the
token budget and the blocks left over once every sequence's own work is planned, so they never displace a prefill
or preempt anyone; how many each decoding sequence verifies is the one call ``spec.propose`` (a
``speculation.decoder.SpecDecoder``, which owns everything else about speculation). ``update`` appends the
accepted ones, checks stop conditions on each, and keeps the computed count at the known tokens plus the accepted
drafts (the rejected ones' slots are overwritten by later steps; only verified tokens are hashed into the prefix
cache).

Works on token counts and block ids only; never touches a tensor.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from kvserve.engine.plan import SeqResult, SeqWork, StepPlan
from kvserve.kvcache.block_manager import BlockManager
from kvserve.scheduler.finish_rate import FinishRate
from kvserve.scheduler.policies import Policy, make_policy
from kvserve.scheduler.sequence import FinishReason, SeqEvent, SeqStatus, Sequence


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


class Speculation(Protocol):
    """What the scheduler asks of speculative decoding (``speculation.decoder.SpecDecoder`` answers)."""

    def propose(self, plan: StepPlan, running: list[Sequence], budget: int,
                limits: SchedulerConfig) -> dict[int, int]:
        """Draft tokens each decoding sequence of ``plan`` verifies in it, within ``budget`` tokens."""

    def observe(self, plan: StepPlan, results: list[SeqResult], running: list[Sequence],
                seconds: float | None = None) -> None:
        """Learn from a step that ran (called before ``Scheduler.update`` applies it)."""


class Scheduler:
    """Plans steps and applies their results. Synchronous; owned by one asyncio task (SchedulerService).

    Args:
        config: limits and policy.
        blocks: the block manager of the KV pool.
        spec: speculative decoding (a ``speculation.decoder.SpecDecoder``); None: none.
    """

    def __init__(self, config: SchedulerConfig, blocks: BlockManager, spec: Speculation | None = None) -> None:
        self.config = config
        self.blocks = blocks
        self.spec = spec
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
        plan, self._ended = StepPlan(work, ended_ids=self._ended), []
        if self.spec is not None:
            self._add_drafts(plan, budget)
        return plan

    @property
    def ended_ids(self) -> list[int]:
        """Sequences that ended or were preempted since the last plan: the next plan carries them (a plan with
        no work only does that)."""
        return self._ended

    def _add_drafts(self, plan: StepPlan, budget: int) -> None:
        """Speculation's rule: a decoding sequence computes, after its own token, the draft tokens ``spec`` grants
        it from the ``budget`` left, where its blocks can grow to hold them."""
        by_id = {seq.seq_id: seq for seq in self.running}
        drafts = self.spec.propose(plan, self.running, budget, self.config)
        for index, w in enumerate(plan.work):
            num_draft, seq = drafts.get(w.seq_id, 0), by_id.get(w.seq_id)
            if num_draft and self.blocks.allocate(seq.block_table, seq.num_computed + 1 + num_draft):
                plan.work[index] = self._work(seq, 1, num_draft, propose=w.propose)

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
            cached = ([] if seq.params.prompt_logprobs
                      else self.blocks.find_cached_prefix(seq.all_ids, seq.cache_salt))
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

    def _work(self, seq: Sequence, num_new: int, num_draft: int = 0, propose: int = 0) -> SeqWork:
        """The sequence's next ``num_new`` known tokens, then ``num_draft`` of its draft tokens (``propose``: as
        ``SeqWork.propose``, which ``spec`` sets)."""
        start = seq.num_computed
        bs = self.blocks.block_size
        end = start + num_new + num_draft
        slots = [seq.block_table[p // bs] * bs + p % bs for p in range(start, end)]
        sample = start + num_new == seq.num_tokens
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
            seq.draft_ids = result.draft_ids
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
            # K/V are valid for the known tokens and the accepted drafts (speculation's rule); the last new token
            # is computed next step
            seq.num_computed = min(w.context_len - w.num_draft + result.num_accepted, seq.num_tokens - 1
                                   if result.tokens else w.context_len)
            self.blocks.cache_full_blocks(seq.block_table, seq.all_ids, seq.num_computed, seq.block_hashes,
                                          seq.cache_salt)
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
        if self.spec is not None:  # only speculation keeps per-sequence state in the engine (a drafter's)
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
