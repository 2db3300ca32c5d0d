"""Speculative decoding as one plug-in: ``SpecDecoder`` owns the drafter (prompt lookup, or a draft model on a KV
pool of its own), the draft-length policy (``speculation.policy.DraftPolicy``) and the step-cost curves that policy
weighs, measured at start-up and then learnt from served steps.

The scheduler knows one rule: a decoding sequence computes its own next token and then the draft tokens granted to
it, from the token budget and blocks left once every sequence's own work is planned; the runner's sampling
verifies them (``engine.runner.ModelRunner._sample``), and the sequence's computed tokens catch up to its tokens
plus the accepted drafts. Around each step this object answers two calls:

- ``propose`` before it: which of its draft tokens each decoding sequence verifies now, and how many the
  drafter proposes for it after the step (``SeqWork.propose``);
- ``observe`` after it: the acceptance of every verify pass, the drafts proposed for the next step, and what the
  step cost.

What speculation knows of each sequence it keeps itself, by request id: the drafts on hand, how many of its drafts
were verified and accepted, how far the draft model has computed it. A sequence that ends or is preempted comes back
in a plan's ``ended_ids``, and its entries go.

In between, ``execute`` runs the step on the engine's thread: the served model's forward and sampling, then the
drafter's proposals for the next step (``SeqResult.draft_ids``).
"""

from __future__ import annotations

import logging
import time

from kvserve.engine.draft_model import ModelDrafter
from kvserve.engine.drafters import DraftRequest, NgramDrafter
from kvserve.engine.plan import SeqResult, StepPlan
from kvserve.engine.runner import ModelRunner
from kvserve.kvcache.block_manager import BlockManager
from kvserve.scheduler.scheduler import SchedulerConfig
from kvserve.scheduler.sequence import Sequence
from kvserve.speculation.policy import AUTO_MAX_DRAFT, Candidate, DraftPolicy, StepCost

log = logging.getLogger("kvserve.speculation")

# A draft model's catch-up on a new sequence (its prompt) is paid back over at most this many output tokens: a
# request's max_tokens is often far more than it generates. A chosen bound, not a tuned one: it covers the longest
# reply of the seed64 workload (231 tokens; loadtest/loadgen/workloads/seed64.json). What draft auto then gains or
# costs against speculation off: BENCHMARKS.md, "Speculative decoding, served side by side".
AMORTIZE_OVER = 256

_CALIBRATION_CONTEXT = 256  # context (tokens) of the rows timed for speculation's step-cost curve: a chat
                            # turn's order of magnitude; the curve is relearned from served steps anyway
_CALIBRATION_ROUNDS = 5     # timed rounds of every size (the median is kept), after a warm-up round: the
                            # fewest whose median ignores two stray slow rounds
_CALIBRATION_BUDGET_S = 10.0  # no further round starts after this long (s): bounded on a loaded machine, where
                              # unbounded rounds once made start-up take 110 s
# The start-up line that gives speculation's measured step costs; `python -m kvserve.loadtest speculative` reads
# the curve back from it.
SPECULATION_LOG = ("speculation (%s), auto length up to %d; step cost by tokens (median of up to %d rounds, made "
                   "non-decreasing; then learnt from served steps): %s%s (measured in %.1f s)")
# Step sizes timed at start-up: the served model's by tokens (doubling, so the curve's bend is seen at every
# scale), a draft model's by rows (powers of two up to the slots); each list is cut at what a step can hold.
_STEP_TOKENS = (1, 2, 3, 5, 9, 17, 33, 65, 129, 257)
_DRAFT_ROWS = (1, 2, 4, 8, 16, 32)


def time_steps(runner: ModelRunner, blocks: BlockManager, sizes: list[int]) -> dict[int, float]:
    """``runner.time_decode_steps`` on scratch blocks of ``blocks`` (freed after).

    Raises:
        ValueError: the pool cannot hold the calibration context.
    """
    table: list[int] = []
    if not blocks.allocate(table, min(_CALIBRATION_CONTEXT, runner.pool.num_slots)):
        raise ValueError("the KV pool is too small to measure step costs for --num-speculative-tokens auto")
    try:
        return runner.time_decode_steps(sizes, table, repeats=_CALIBRATION_ROUNDS, budget_s=_CALIBRATION_BUDGET_S)
    finally:
        blocks.free(table)


class SpecDecoder:
    """Speculative decoding for one server: who drafts, how many draft tokens each sequence verifies, and what
    steps cost (see the module docstring).

    Args:
        policy: the draft-length policy (fixed γ, or ``auto`` with its step-cost curves).
        drafter: proposes draft tokens after a step: an ``NgramDrafter`` or a ``ModelDrafter`` (which owns the
            draft model's runner and KV pool); None where the caller's ``execute`` supplies the drafts itself.
        runner: the served model's runner, which ``execute`` runs (verification is its sampling).

    Attributes:
        policy: as given; its totals (``drafted``, ``accepted``, ``num_drafts``, ``accepted_per_pos``) are the
            server's spec_decode metrics.
        drafter: as given.
    """

    def __init__(self, policy: DraftPolicy, drafter: NgramDrafter | ModelDrafter | None = None,
                 runner: ModelRunner | None = None) -> None:
        self.policy = policy
        self.drafter = drafter
        self.runner = runner
        self._synced: dict[int, int] = {}  # seq_id -> its tokens the draft model has computed, as far as known
        self._drafts: dict[int, list[int]] = {}  # seq_id -> draft tokens proposed after its last step, unverified
        self._verified: dict[int, tuple[int, int]] = {}  # seq_id -> (its draft tokens verified, accepted) so far
        self._proposal_seconds = 0.0        # of the last ``execute``: seconds spent proposing
        self._draft_steps: list[tuple[int, float]] = []  # of the last ``execute``: (rows, s) of each draft step

    @classmethod
    def start(cls, runner: ModelRunner, blocks: BlockManager, drafter: NgramDrafter | ModelDrafter,
              num_speculative_tokens: int | None, max_num_seqs: int, max_num_batched_tokens: int,
              name: str) -> SpecDecoder:
        """A fixed draft length, or ``auto`` (``num_speculative_tokens`` None) over step-cost curves measured now on
        scratch blocks of ``blocks``: the served model's by tokens in a step, and a draft model's by rows.

        Args:
            runner, blocks: the served model's runner and its pool's block manager.
            drafter: who proposes (``name`` is its ``--speculative`` value, for the log).
            num_speculative_tokens: ``--num-speculative-tokens``: N, or None for auto up to ``AUTO_MAX_DRAFT``.
            max_num_seqs, max_num_batched_tokens: the scheduler's limits (the largest step to time).

        Raises:
            ValueError: a pool too small to measure step costs in.
        """
        if num_speculative_tokens is not None:
            return cls(DraftPolicy(max_draft=num_speculative_tokens, adaptive=False), drafter, runner)
        most = min(max_num_batched_tokens, max_num_seqs * (1 + AUTO_MAX_DRAFT))
        sizes = sorted({n for n in (*_STEP_TOKENS, most) if n <= most})
        started = time.perf_counter()
        seconds = time_steps(runner, blocks, sizes)
        proposal = None
        if isinstance(drafter, ModelDrafter):
            rows = sorted({n for n in (*_DRAFT_ROWS, max_num_seqs) if n <= max_num_seqs})
            proposal = StepCost(time_steps(drafter.runner, drafter.blocks, rows))
        cost = StepCost(seconds)
        log.info(SPECULATION_LOG, name, AUTO_MAX_DRAFT, _CALIBRATION_ROUNDS, cost.describe(),
                 "" if proposal is None else "; draft step by rows: " + proposal.describe(),
                 time.perf_counter() - started)
        policy = DraftPolicy(max_draft=AUTO_MAX_DRAFT, adaptive=True, cost=cost, proposal_cost=proposal)
        return cls(policy, drafter, runner)

    # -- before a step (the scheduler's task) -------------------------------------------------------------
    def propose(self, plan: StepPlan, running: list[Sequence], budget: int,
                limits: SchedulerConfig) -> dict[int, list[int]]:
        """The draft tokens each decoding sequence of ``plan`` verifies in it (absent: none), at most ``budget`` in
        all; sets each SeqWork's ``propose``, the tokens the drafter proposes for it after the step.

        Without a draft model (proposing is free) every sampling sequence asks for ``max_draft`` proposals and the
        policy chooses γ now, among the drafts on hand. With one, each proposal costs a draft step per depth, so
        the choice is made when proposing: every proposal is verified in the next step (as the budget allows), and
        γ for the next step is chosen now, as if that step were these sequences decoding.

        Args:
            plan: the step as planned without drafts (its ``ended_ids``: sequences whose draft state is gone).
            running: the scheduler's running sequences (every sequence in ``plan`` among them).
            budget: tokens of the step's budget left after every sequence's own work.
            limits: the scheduler's limits (context, tokens per step).
        """
        for seq_id in plan.ended_ids:  # ended or preempted: a draft model has freed what it held for them
            self._synced.pop(seq_id, None)
            self._drafts.pop(seq_id, None)
            self._verified.pop(seq_id, None)  # a preempted one starts its acceptance history over
        by_id = {seq.seq_id: seq for seq in running}
        for w in plan.work:
            w.propose = self.policy.max_draft if w.sample and not self._constrained(w.seq_id) else 0
        gammas = self._verify_now(plan, by_id, budget, limits)
        if self.policy.proposal_cost is not None:
            self._plan_proposals(plan, by_id, limits)
        return {seq_id: self._drafts[seq_id][:gamma] for seq_id, gamma in gammas.items() if gamma}

    def _constrained(self, seq_id: int) -> bool:
        """A structured-output sequence: its grammar checks one token a step, so it verifies no drafts."""
        return self.runner is not None and self.runner.constraints.get(seq_id) is not None

    def verified(self, seq_id: int) -> tuple[int, int]:
        """Draft tokens verified for ``seq_id`` so far, and accepted (0, 0 for one unknown here)."""
        return self._verified.get(seq_id, (0, 0))

    def _room(self, seq: Sequence, limits: SchedulerConfig, available: int | None = None, ahead: int = 0) -> int:
        """Draft tokens ``seq`` could verify now: its drafts on hand (or ``available``), cut so that every token the
        step might accept stays within max_tokens and the context, and, below min_tokens, so that every sampled row
        has stop tokens suppressed alike; ``ahead``: as if that many more tokens were output first. 0 for a
        constrained sequence (its grammar checks one token a step)."""
        if available is None:
            drafts = self._drafts.get(seq.seq_id)
            if not drafts or seq.num_uncomputed != 1:
                return 0
            available = len(drafts)
        if self._constrained(seq.seq_id):
            return 0
        output = len(seq.output_ids) + ahead
        room = min(available, seq.max_tokens - output - 1, limits.max_model_len - seq.num_tokens - ahead - 1)
        if output < seq.min_tokens:
            room = min(room, seq.min_tokens - output - 1)
        return max(room, 0)

    def _verify_now(self, plan: StepPlan, by_id: dict[int, Sequence], budget: int,
                    limits: SchedulerConfig) -> dict[int, int]:
        """γ of each decoding sequence with drafts on hand: the policy's choice, or with a draft model (whose
        proposals were chosen already) all of them, in plan order, while the budget lasts."""
        candidates = []
        for w in plan.work:
            seq = by_id.get(w.seq_id)
            room = self._room(seq, limits) if seq is not None and w.is_decode else 0
            if room:
                candidates.append(Candidate(seq.seq_id, room, *self.verified(seq.seq_id)))
        if self.policy.proposal_cost is None:
            yield_ = sum(1 for w in plan.work if w.sample)
            return self.policy.choose(candidates, plan.num_tokens, yield_, budget)
        gammas, left = {}, budget
        for c in candidates:
            gammas[c.seq_id] = min(c.available, left)
            left -= gammas[c.seq_id]
        return gammas

    def _plan_proposals(self, plan: StepPlan, by_id: dict[int, Sequence], limits: SchedulerConfig) -> None:
        """With a draft model: how many tokens it drafts after this step for each sampling sequence, γ for its
        next step (``DraftPolicy.choose`` with the proposal cost and each sequence's catch-up)."""
        candidates = []
        for w in plan.work:
            if w.propose:
                seq = by_id[w.seq_id]
                room = self._room(seq, limits, self.policy.max_draft, ahead=1)
                if room:
                    candidates.append(Candidate(seq.seq_id, room, *self.verified(seq.seq_id),
                                                catch_up=seq.num_tokens - self._synced.get(seq.seq_id, 0),
                                                remaining=min(seq.max_tokens - len(seq.output_ids), AMORTIZE_OVER)))
        rows = len(candidates)
        gammas = self.policy.choose(candidates, rows, rows, limits.max_num_batched_tokens - rows)
        for w in plan.work:
            w.propose = gammas.get(w.seq_id, 0)

    # -- the step (the engine's thread) -------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> list[SeqResult]:
        """The served model's step (its sampling verifies the drafts), then each sampling sequence's proposal for
        its next step (``SeqWork.propose`` tokens at most); first, the drafter frees what ``plan.ended_ids`` held.

        Returns:
            The runner's results, with ``draft_ids`` filled in.
        """
        if plan.ended_ids:
            self.drafter.release(plan.ended_ids)
        self._proposal_seconds, self._draft_steps = 0.0, []
        results = self.runner.execute(plan)
        asking = [(w, result) for w, result in zip(plan.work, results) if w.propose and result.tokens]
        if asking:
            started = time.perf_counter()
            requests = [DraftRequest(w.seq_id, w.prompt_ids + w.output_ids + [t.token_id for t in result.tokens],
                                     w.propose) for w, result in asking]
            for (_, result), draft_ids in zip(asking, self.drafter.propose_batch(requests)):
                result.draft_ids = draft_ids
            self._proposal_seconds = time.perf_counter() - started
            self._draft_steps, self.drafter.steps = self.drafter.steps, []
        return results

    # -- after a step (the scheduler's task) --------------------------------------------------------------
    def observe(self, plan: StepPlan, results: list[SeqResult], running: list[Sequence],
                seconds: float | None = None) -> None:
        """Learn from a step that ran: each verify pass's acceptance and the drafts proposed for the next step
        (sequences still running whose step did not fail), and, given its wall time ``seconds``, the step-cost curves ``auto`` weighs: an all-decode step's
        time less its proposing by its tokens, and each draft-model decode step by its rows."""
        live = {seq.seq_id for seq in running}
        for w, result in zip(plan.work, results):
            if w.seq_id not in live or result.error is not None:
                continue
            self.policy.record(w.num_draft, result.num_accepted)
            if w.num_draft:
                drafted, accepted = self.verified(w.seq_id)
                self._verified[w.seq_id] = (drafted + w.num_draft, accepted + result.num_accepted)
            self._drafts[w.seq_id] = result.draft_ids
            if result.draft_ids and w.propose:
                self._synced[w.seq_id] = w.context_len - w.num_draft + len(result.tokens)  # its tokens after it
        cost = self.policy.cost
        if seconds is None or cost is None:
            return
        if all(w.is_decode for w in plan.work):
            cost.observe(plan.num_tokens, seconds - self._proposal_seconds)
        if self.policy.proposal_cost is not None:
            for rows, step_seconds in self._draft_steps:
                self.policy.proposal_cost.observe(rows, step_seconds)
