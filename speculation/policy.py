"""How many draft tokens each decoding sequence verifies in the next step (speculative decoding's γ).

A verify pass over γ + 1 positions yields, when each draft token is accepted with probability α independently,

    E(γ) = (1 - α^(γ+1)) / (1 - α)  tokens                (Leviathan et al. 2023, eq. 1)

and costs one step of ``N + γ`` tokens instead of ``N``. So drafts pay when the step is bound by reading the
weights (its time barely grows with the tokens in it: batch 1 on a CPU) and acceptance is high; they lose when
the batch is already compute-bound or acceptance is low. Fixed γ, as peers ship it, loses there; ``auto``
decides every step from two measured things:

- the acceptance rate of each sequence: its accepted / drafted tokens so far, shrunk towards the recent
  rate of all sequences (``PRIOR_TOKENS`` pseudo-tokens), so a new sequence starts from what others saw; that
  shared rate forgets (its counts halve every ``HALF_LIFE_STEPS`` steps that could draft, back towards
  ``PRIOR_RATE``), so a bad phase of the workload does not outlive it;
- the step's cost as a function of the tokens in it (``StepCost``: measured at start-up for a few sizes,
  then updated from every decode-only step the engine runs, so that it follows the machine's load).

It raises the γ of the sequence with the largest marginal expected token α_s^(γ_s+1), one token at a time,
and keeps the prefix of those raises with the highest expected tokens per second for the whole step; drafts
are used only if that beats the step without drafts by ``MARGIN`` (the cost model's error). Sequences
without a proposal (prompt lookup found nothing) get γ = 0.

A policy that stopped drafting would stop learning: no verify pass updates the acceptance, and no step of more
tokens than it runs updates the curve there. So every ``PROBE_EVERY`` steps that could draft, it probes: its
likeliest sequence verifies ``PROBE_DRAFT`` draft tokens more than the best choice (none included). What it
measures there lets a workload that pays get drafts again, and longer ones where they pay more. It does not probe
where not even drafts that were all accepted would pay (a draft model as slow as the target, or one whose
catch-up on a long context costs more than the tokens left could save): no acceptance could change the choice,
and with a draft model such a probe would pay that catch-up.

A draft model's proposals are not free: each draft token at depth j is one more row of the j-th batched draft
decode step, whose cost ``proposal_cost`` is measured the same way (at start-up, then online). So with a draft
model the policy decides before the proposing, when the draft length is still a choice: it chooses γ for the
next step of every sampling sequence, counting for each raise the target's extra token and the draft step's
extra row (a whole draft step for the first sequence at a new depth), and the engine proposes exactly that.
Works on token counts only; ``speculation.decoder.SpecDecoder`` feeds it what the steps measure.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# Where these values come from: none is a peer's default (vLLM and SGLang fix the draft length; llama.cpp's
# server adapts only its n-gram size), and none was tuned on a benchmark. Each is a chosen order of magnitude,
# named so a change is one line; the policy's behaviour with them (drafts on copying prompts, none on prose,
# recovery after a bad phase) is what tests/test_speculative.py asserts, and BENCHMARKS.md's speculation section
# measures their result against speculation off.
AUTO_MAX_DRAFT = 8     # --num-speculative-tokens auto: the longest draft one sequence verifies in a step
PRIOR_TOKENS = 4.0     # pseudo-tokens of the shared acceptance rate in each sequence's estimate: a Beta prior
                       # worth one draft of 4, so a sequence's own first verify outweighs it
PRIOR_RATE = 0.5       # the shared rate before any draft was verified: the uninformed middle
MARGIN = 0.05          # drafts must promise this much more throughput than none (fraction): above the few per
                       # cent by which the start-up step-cost curve's points scatter, so noise alone never drafts
HALF_LIFE_STEPS = 256  # steps that could draft after which the shared rate's counts weigh half: about one long
                       # reply (the decoder's AMORTIZE_OVER, 256 tokens), so the rate follows the last minutes
PROBE_EVERY = 64       # auto steps with candidates between two probes: a probe costs at most PROBE_DRAFT rejected
                       # tokens, so probing costs under 2 / 64 = 3% of drafting steps at worst
PROBE_DRAFT = 2        # draft tokens a probe adds to the best choice: the least that measures a second position
_KEEP = 0.5 ** (1 / HALF_LIFE_STEPS)  # the shared counts' decay per step that could draft
_LOAD_EMA = 0.1        # share of a measurement's ratio to the prediction applied to the whole curve (the load):
                       # a load change is followed within ~10 steps (1 / 0.1)
_EMA = 0.02            # weight of a new measurement in its own size's time (the curve's shape): ~50 steps, so a
                       # stray slow step moves a point by 2%


def expected_tokens(alpha: float, gamma: int) -> float:
    """E(γ): tokens one verify pass yields with ``gamma`` drafts accepted i.i.d. with probability ``alpha``."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


class StepCost:
    """Seconds of an engine step as a function of the tokens it computes: measured sizes, interpolated
    linearly between them and extrapolated from the last two beyond. Measured times are made non-decreasing.

    Every observed step moves the whole curve by a share (``_LOAD_EMA``) of its ratio to the prediction, and
    then its own size's time a little further towards what it measured (``_EMA``): a change of the machine's
    load moves every size, also those no step has run lately, while each size's own measurements slowly set the
    curve's shape. So a curve measured on a busy machine recovers when the load goes.

    Args:
        samples: ``{tokens: seconds}`` measured, e.g. at start-up (at least one size).

    Raises:
        ValueError: no samples.
    """

    def __init__(self, samples: dict[int, float]) -> None:
        if not samples:
            raise ValueError("StepCost needs at least one measured step size")
        self.sizes = sorted(samples)
        # a step of more tokens never costs less: a spike (the machine was busy for one size) is cut down to the
        # time of the next larger size
        self.seconds = [min(samples[m] for m in self.sizes[i:]) for i in range(len(self.sizes))]

    def observe(self, tokens: int, seconds: float) -> None:
        """Fold in a measured step of ``tokens`` tokens (see the class docstring), keeping the curve
        non-decreasing."""
        predicted = self(tokens)
        if predicted > 0 and seconds > 0:
            drift = 1.0 + _LOAD_EMA * (seconds / predicted - 1.0)
            self.seconds = [s * drift for s in self.seconds]
        i = bisect.bisect_left(self.sizes, tokens)
        if i < len(self.sizes) and self.sizes[i] == tokens:
            self.seconds[i] += _EMA * (seconds - self.seconds[i])
        else:
            self.sizes.insert(i, tokens)
            self.seconds.insert(i, seconds)
        # smaller steps no slower than this one; larger ones no faster, and no slower than in proportion to their
        # tokens (a step's fixed part only amortizes): a size measured in a busy phase comes back within reach
        at, seconds_at = self.sizes[i], self.seconds[i]
        for j in range(i):
            self.seconds[j] = min(self.seconds[j], seconds_at)
        for j in range(i + 1, len(self.sizes)):
            self.seconds[j] = min(max(self.seconds[j], seconds_at), seconds_at * self.sizes[j] / at)

    def __call__(self, tokens: int) -> float:
        sizes, secs = self.sizes, self.seconds
        if len(sizes) == 1:
            return secs[0] * max(tokens, 1) / sizes[0] if tokens > sizes[0] else secs[0]
        i = bisect.bisect_left(sizes, tokens)
        if i < len(sizes) and sizes[i] == tokens:
            return secs[i]
        lo = min(max(i - 1, 0), len(sizes) - 2)  # the segment around tokens, or the nearest end segment
        slope = max((secs[lo + 1] - secs[lo]) / (sizes[lo + 1] - sizes[lo]), 0.0)
        return max(secs[lo] + slope * (tokens - sizes[lo]), secs[0] if tokens >= sizes[0] else 0.0)

    def describe(self) -> str:
        """The curve as it stands, for the log: ``"1: 27.0, 2: 27.4, ... ms"``."""
        return ", ".join(f"{n}: {s * 1000:.1f}" for n, s in zip(self.sizes, self.seconds)) + " ms"


@dataclass(slots=True)
class Candidate:
    """A decoding sequence that could verify drafts in the next step.

    Attributes:
        seq_id: the sequence.
        available: draft tokens on hand (proposed by the engine), already capped by the sequence's limits.
        drafted, accepted: its draft tokens verified so far, and how many were accepted.
        catch_up: tokens a draft model must compute before it can propose (the whole prompt for a new sequence;
            0 when it drafted last step); its cost is shared among the sequence's ``remaining`` tokens.
        remaining: output tokens the sequence may still generate (the catch-up is amortized over them).
    """

    seq_id: int
    available: int
    drafted: int
    accepted: int
    catch_up: int = 0
    remaining: int = 1


@dataclass(slots=True)
class DraftPolicy:
    """Chooses γ per sequence per step (``--num-speculative-tokens N|auto``).

    Attributes:
        max_draft: the most draft tokens one sequence verifies in a step (and the engine proposes).
        adaptive: ``auto``: choose γ in [0, max_draft] to maximise expected tokens per second; else every
            sequence verifies all of its available drafts up to max_draft (fixed γ, as peers do).
        cost: the step-cost model (``auto`` needs one; None: fixed γ is used).
        proposal_cost: seconds of one batched draft-model decode step by its rows; None: proposing is free
            (prompt lookup), and γ is chosen when the drafts are verified.
        drafted, accepted: totals over all sequences (the metrics).
        recent_drafted, recent_accepted: the same counts decayed by ``HALF_LIFE_STEPS`` (the shared prior).
        steps_to_probe: ``auto`` steps with candidates until the next probe.
    """

    max_draft: int
    adaptive: bool = True
    cost: StepCost | None = None
    proposal_cost: StepCost | None = None
    drafted: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    num_drafts: int = 0
    recent_drafted: float = 0.0
    recent_accepted: float = 0.0
    steps_to_probe: int = PROBE_EVERY

    def __post_init__(self) -> None:
        if self.max_draft < 1:
            raise ValueError("max_draft must be >= 1 (speculation off is no DraftPolicy)")

    @property
    def shared_rate(self) -> float:
        return (self.recent_accepted + PRIOR_TOKENS * PRIOR_RATE) / (self.recent_drafted + PRIOR_TOKENS)

    def acceptance(self, candidate: Candidate) -> float:
        """The sequence's estimated per-token acceptance rate α (its counts shrunk towards the shared rate)."""
        return (candidate.accepted + PRIOR_TOKENS * self.shared_rate) / (candidate.drafted + PRIOR_TOKENS)

    def choose(self, candidates: list[Candidate], base_tokens: int, base_yield: int, budget: int) -> dict[int, int]:
        """γ for each candidate (absent: 0): ``auto``'s best choice, every ``PROBE_EVERY`` calls with a probe.

        Args:
            candidates: decoding sequences with drafts available.
            base_tokens: tokens the step computes without drafts (decodes, prefill chunks).
            base_yield: tokens the step yields without drafts (its sampling sequences).
            budget: the most draft tokens the step may add (its token budget left).
        """
        if not candidates or budget <= 0:
            return {}
        if not self.adaptive or self.cost is None:
            gammas: dict[int, int] = {}
            for c in candidates:
                take = min(c.available, self.max_draft, budget)
                if take:
                    gammas[c.seq_id] = take
                    budget -= take
            return gammas
        self.recent_drafted *= _KEEP
        self.recent_accepted *= _KEEP
        gammas = self._best(candidates, base_tokens, base_yield, budget)
        self.steps_to_probe -= 1
        if self.steps_to_probe > 0:
            return gammas
        self.steps_to_probe = PROBE_EVERY
        if not self._best(candidates, base_tokens, base_yield, budget, certain=True):
            return gammas  # not even drafts that were all accepted would pay here: a probe has nothing to learn
        likeliest = max(candidates, key=self.acceptance)
        more = min(gammas.get(likeliest.seq_id, 0) + PROBE_DRAFT, likeliest.available, self.max_draft,
                   budget - sum(gammas.values()) + gammas.get(likeliest.seq_id, 0))
        if more > 0:
            gammas[likeliest.seq_id] = more
        return gammas

    def _best(self, candidates: list[Candidate], base_tokens: int, base_yield: int,
              budget: int, certain: bool = False) -> dict[int, int]:
        """The γs that maximise expected tokens per second (see the module docstring), or {} when no drafts
        beat none by ``MARGIN``; ``certain``: as if every draft were accepted (the most drafts could pay)."""
        alphas = {c.seq_id: 1.0 if certain else self.acceptance(c) for c in candidates}
        by_id = {c.seq_id: c for c in candidates}
        # every raise (seq, its γ-th draft token) with its marginal expected tokens alpha^γ, best first
        raises = sorted(((alphas[c.seq_id] ** g, c.seq_id) for c in candidates
                         for g in range(1, min(c.available, self.max_draft) + 1)), reverse=True)
        base_rate = base_yield / self.cost(base_tokens)
        tokens, best_rate, best_count = float(base_yield), base_rate, 0
        depth_rows: dict[int, int] = {}   # draft-model rows at each depth so far
        proposing = 0.0                   # seconds of those draft steps
        gammas_so_far: dict[int, int] = {}
        raises = raises[:budget]
        left = sum(gain for gain, _ in raises)  # expected tokens the raises not yet taken could add
        for count, (gain, seq_id) in enumerate(raises, start=1):
            tokens += gain
            left -= gain
            if self.proposal_cost is not None:
                depth = gammas_so_far[seq_id] = gammas_so_far.get(seq_id, 0) + 1
                rows = depth_rows.get(depth, 0)
                added = 1
                if depth == 1 and by_id[seq_id].catch_up:
                    # its catch-up joins the first draft step; this step carries the share of one verify pass
                    candidate = by_id[seq_id]
                    share = (1 + alphas[seq_id]) / max(candidate.remaining, 1)
                    added += candidate.catch_up * min(share, 1.0)
                proposing += self.proposal_cost(rows + added) - (self.proposal_cost(rows) if rows else 0.0)
                depth_rows[depth] = rows + added
            seconds = self.cost(base_tokens + count) + proposing
            rate = tokens / seconds
            if rate > best_rate:
                best_rate, best_count = rate, count
            elif (tokens + left) / seconds <= best_rate:
                break  # costs only grow from here: even every further token could not beat the best
        if best_count == 0 or best_rate < base_rate * (1.0 + MARGIN):
            return {}
        gammas = {}
        for _, seq_id in raises[:best_count]:
            gammas[seq_id] = gammas.get(seq_id, 0) + 1
        return gammas

    def record(self, num_draft: int, num_accepted: int) -> None:
        """Count one verify pass of ``num_draft`` drafts, of which the first ``num_accepted`` were accepted."""
        if num_draft == 0:
            return
        self.num_drafts += 1
        self.drafted += num_draft
        self.accepted += num_accepted
        self.recent_drafted += num_draft
        self.recent_accepted += num_accepted
        if len(self.accepted_per_pos) < num_draft:
            self.accepted_per_pos.extend([0] * (num_draft - len(self.accepted_per_pos)))
        for position in range(num_accepted):
            self.accepted_per_pos[position] += 1
