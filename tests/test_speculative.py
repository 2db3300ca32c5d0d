"""Speculative decoding is exact: with drafts verified, the output is token for token the output without them.

Greedy and seeded sampling are compared with speculation off (and greedy with transformers' generate), alone and
batched with others admitted at different steps, with chunked prefill, preemption and prefix-cache hits;
logprobs, usage, stop tokens, max_tokens and min_tokens are checked on the scheduler with a scripted engine;
unseeded sampling keeps the served model's distribution (a total-variation bound).
"""

from __future__ import annotations

import collections
import copy
import json
import logging
import time
import types

import httpx
import pytest
import torch

from kvserve.engine.draft_model import ModelDrafter, common_prefix
from kvserve.engine.drafters import DraftRequest, NgramDrafter
from kvserve.engine.loader import wrap_model
from kvserve.engine.plan import SamplingParams, SeqResult, SeqWork, StepPlan, TokenLogprob
from kvserve.engine.runner import ModelRunner
from kvserve.kvcache.block_manager import BlockManager
from kvserve.kvcache.pool import KVPool
from kvserve.engine.constraints import Constraints
from kvserve.scheduler.contract import EngineRequest, FinishReason
from kvserve.scheduler.core import EngineCore
from kvserve.scheduler.offline import run_offline
from kvserve.scheduler.scheduler import Scheduler, SchedulerConfig
from kvserve.scheduler.sequence import Sequence
from kvserve.server.config import ServeConfig
from kvserve.server.serve import load_draft
from kvserve.server.state import ServerState
from kvserve.speculation.decoder import SpecDecoder
from kvserve.speculation.policy import PROBE_EVERY, Candidate, DraftPolicy, StepCost, expected_tokens
from tests.engineutil import (EOS, REPEAT_PROMPT, SERVED, chat_ids, engine_greedy, greedy_references,
                              tiny)
from tests.serverutil import running_server, serving

PROMPTS = [  # text that repeats itself, so prompt lookup finds drafts, and text that does not
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
    "Repeat after me: the rain in Spain stays mainly in the plain. The rain in Spain",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]


def fixed(gamma: int) -> DraftPolicy:
    return DraftPolicy(max_draft=gamma, adaptive=False)


# ---- the drafter ---------------------------------------------------------------------------------------

def test_prompt_lookup_proposes_what_followed_the_latest_occurrence():
    drafter = NgramDrafter(min_n=1, max_n=3)
    #           0  1  2  3  4  5  6  7  8  9
    history = [5, 6, 7, 8, 1, 5, 6, 7, 9, 5, 6, 7]
    # suffix 5 6 7: latest earlier occurrence at 5, followed by 9 5 6 7
    assert drafter.propose(history, 3) == [9, 5, 6]
    assert drafter.propose(history, 10) == [9, 5, 6, 7]
    assert drafter.propose([1, 2, 3, 4], 4) == []        # no suffix occurred before
    assert drafter.propose([4, 2, 3, 4], 2) == [2, 3]    # n = 1
    assert drafter.propose(history, 0) == []


def test_prompt_lookup_matches_whole_token_ids_only():
    # The search runs over the ids' bytes (4 each, little-endian): 256, 512, 768 hold the bytes of 1, 2 one byte
    # off their boundaries (00 01 00 00 | 00 02 00 00 | 00 03 ..). That later, misaligned match must be skipped
    # for the real occurrence at the start, followed by 7.
    drafter = NgramDrafter(min_n=2, max_n=2)
    history = [1, 2, 7, 256, 512, 768, 9, 1, 2]
    assert drafter.propose(history, 1) == [7]


def test_common_prefix_finds_the_first_mismatch():
    assert common_prefix([1, 2, 3, 4], [1, 2, 3, 4, 5]) == 4
    assert common_prefix([1, 2, 9, 4], [1, 2, 3, 4]) == 2
    assert common_prefix([7], [1]) == 0
    assert common_prefix([], [1, 2]) == 0
    assert all(common_prefix(list(range(50)), list(range(i)) + [-1] * 10) == i for i in range(50))


# ---- the policy --------------------------------------------------------------------------------------

def test_auto_drafts_where_a_step_is_bound_by_its_weights_and_not_where_it_is_compute_bound():
    flat = StepCost({1: 0.030, 16: 0.032, 64: 0.040})      # batch 1 on a CPU: tokens nearly free
    steep = StepCost({1: 0.030, 16: 0.080, 64: 0.300})     # every token costs
    eager = Candidate(seq_id=0, available=8, drafted=100, accepted=90)
    doubtful = Candidate(seq_id=1, available=8, drafted=100, accepted=10)
    assert DraftPolicy(8, cost=flat).choose([eager], 1, 1, 512)[0] >= 4
    assert DraftPolicy(8, cost=steep).choose([doubtful], 1, 1, 512) == {}
    # 32 decodes on the steep curve: more tokens per step do not pay even at 90% acceptance
    many = [Candidate(i, 8, 100, 90) for i in range(32)]
    assert DraftPolicy(8, cost=StepCost({32: 0.100, 64: 0.200, 288: 0.900})).choose(many, 32, 32, 480) == {}
    assert DraftPolicy(8, adaptive=False).choose([eager, doubtful], 1, 1, 5) == {0: 5}  # fixed γ, the budget


def test_with_a_draft_model_auto_weighs_the_draft_steps_and_counts_depths_not_rows():
    flat = StepCost({1: 0.030, 16: 0.032, 64: 0.040})
    eager = [Candidate(i, 8, 100, 80) for i in range(4)]
    # a draft step a quarter of the target's: drafts pay, and all four sequences draft to the same depth (a
    # further sequence at a depth already run costs a row, not a step)
    cheap = DraftPolicy(8, cost=flat, proposal_cost=StepCost({1: 0.0075, 4: 0.008, 32: 0.016}))
    gammas = cheap.choose(eager, 4, 4, 512)
    assert len(gammas) == 4 and len(set(gammas.values())) == 1 and 2 <= gammas[0] <= 6
    # a draft as slow as the target: one draft token costs a whole step and yields at most 0.8 token
    assert DraftPolicy(8, cost=flat, proposal_cost=StepCost({1: 0.030, 4: 0.031})).choose(eager, 4, 4, 512) == {}
    # the same cheap draft with a 20% acceptance: none
    doubtful = [Candidate(i, 8, 100, 20) for i in range(4)]
    assert cheap.choose(doubtful, 4, 4, 512) == {}


def test_a_draft_models_catch_up_on_a_prompt_is_paid_for_by_the_tokens_it_can_save():
    """The measured curves of a 2-core CPU (ms): a float32 target and its int4 draft."""
    target = StepCost({1: 0.027, 9: 0.037, 17: 0.060, 33: 0.099, 65: 0.251})
    draft = StepCost({1: 0.0066, 4: 0.010, 8: 0.017, 16: 0.031, 32: 0.060})
    policy = DraftPolicy(8, cost=target, proposal_cost=draft)
    policy.recent_drafted, policy.recent_accepted = 100, 75
    alone = Candidate(0, 8, 0, 0, catch_up=120, remaining=96)
    assert policy.choose([alone], 1, 1, 512)  # one stream: a 120-token catch-up pays back over 96 tokens
    assert policy.choose([Candidate(0, 8, 0, 0)], 1, 1, 512)  # and so does one whose draft is in step
    # the same sequence about to end: its catch-up cannot pay back
    assert policy.choose([Candidate(0, 8, 0, 0, catch_up=120, remaining=2)], 1, 1, 512) == {}
    # eight new sequences: the catch-ups and the draft steps cost more than the tokens they would save
    assert policy.choose([Candidate(i, 8, 0, 0, catch_up=120, remaining=96) for i in range(8)], 8, 8, 504) == {}


def test_step_cost_is_made_non_decreasing():
    cost = StepCost({1: 0.026, 2: 0.028, 3: 0.052, 5: 0.031})  # a busy moment measured at 3 tokens
    assert cost(3) == 0.031 and cost(4) == 0.031 and cost(2) == 0.028


def _serve_policy(policy: DraftPolicy, steps: int, accept: bool, busy: bool) -> int:
    """Drive ``policy`` as the scheduler does, one decoding sequence at a time (a new one every 100 steps), on a
    machine whose step costs 30 ms + 0.5 ms a token (idle) or 90 ms + 30 ms a token (busy), with every draft
    accepted or every one rejected; returns how many steps verified drafts."""
    drafting, seq_id, drafted, accepted = 0, 0, 0, 0
    for step in range(steps):
        if step % 100 == 0:
            seq_id, drafted, accepted = step, 0, 0
        gamma = policy.choose([Candidate(seq_id, 8, drafted, accepted)], 1, 1, 512).get(seq_id, 0)
        policy.record(gamma, gamma if accept else 0)
        drafted, accepted = drafted + gamma, accepted + (gamma if accept else 0)
        tokens = 1 + gamma
        policy.cost.observe(tokens, 0.090 + 0.030 * (tokens - 1) if busy else 0.030 + 0.0005 * (tokens - 1))
        drafting += gamma > 0
    return drafting


def test_auto_that_stopped_drafting_in_a_bad_phase_drafts_again_in_a_good_one():
    """A busy machine and drafts that are all rejected switch auto off (but for its probes); once the load goes
    and drafts are accepted again, what it learned has decayed, the probes re-measure, and it drafts again, and
    longer drafts than one probe's."""
    policy = DraftPolicy(8, cost=StepCost({1: 0.030, 2: 0.0305, 3: 0.031, 5: 0.032, 9: 0.034, 17: 0.040}))
    assert _serve_policy(policy, 300, accept=True, busy=False) > 290
    _serve_policy(policy, 3000, accept=False, busy=True)
    assert _serve_policy(policy, 640, accept=False, busy=True) <= 640 // PROBE_EVERY + 1  # only the probes
    assert policy.choose([Candidate(1, 8, 0, 0)], 1, 1, 512) == {}
    _serve_policy(policy, 1000, accept=True, busy=False)
    assert _serve_policy(policy, 300, accept=True, busy=False) == 300
    assert max(policy.choose([Candidate(2, 8, 0, 0)], 1, 1, 512).values()) > 2


def test_step_cost_follows_the_load_at_sizes_it_does_not_measure():
    cost = StepCost({1: 0.030, 9: 0.034})
    for _ in range(100):
        cost.observe(1, 0.060)  # the machine is twice as busy; only one-token steps run
    assert cost(1) == pytest.approx(0.060, rel=0.01) and cost(9) == pytest.approx(0.068, rel=0.15)
    for _ in range(100):
        cost.observe(1, 0.030)
    assert cost(1) == pytest.approx(0.030, rel=0.01) and cost(9) == pytest.approx(0.034, rel=0.15)
    assert "1: 30.0" in cost.describe()


class _Clock:
    """A fake ``time.perf_counter`` that a fake engine step advances by its cost."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_start_up_step_costs_are_medians_of_interleaved_rounds_within_a_time_bound(monkeypatch):
    """A busy moment (one 2-second step) does not reach the curve, and a machine where every step is slow stops
    measuring at the time bound, after one timed round."""
    from kvserve.engine import runner as runner_module
    clock = _Clock()
    monkeypatch.setattr(runner_module.time, "perf_counter", clock)
    calls = []

    def execute(plan):
        calls.append(len(plan.work))
        spike = 2.0 if len(calls) == 5 else 0.0  # the first timed round's 1-token step
        clock.now += 0.030 + 0.001 * len(plan.work) + spike
    fake = types.SimpleNamespace(pool=types.SimpleNamespace(block_size=16), execute=execute)
    seconds = ModelRunner.time_decode_steps(fake, [1, 2, 3, 5], [0, 1], repeats=5)
    assert seconds == pytest.approx({1: 0.031, 2: 0.032, 3: 0.033, 5: 0.035})
    assert len(calls) == 4 * 6  # a warm-up round and five timed ones, sizes interleaved
    assert calls[:8] == [1, 2, 3, 5, 1, 2, 3, 5]
    calls.clear()
    seconds = ModelRunner.time_decode_steps(fake, [1, 2, 3, 5], [0, 1], repeats=5, budget_s=0.1)
    assert len(calls) == 8 and set(seconds) == {1, 2, 3, 5}  # warm-up, one timed round, then the bound


class _TimedDrafter:
    """Proposes ``k`` copies of token 4, taking ``seconds`` of a fake clock and reporting one draft step."""

    def __init__(self, clock: _Clock, seconds: float) -> None:
        self.clock, self.seconds, self.steps, self.released = clock, seconds, [], []

    def release(self, seq_ids: list[int]) -> None:
        self.released += seq_ids

    def propose_batch(self, requests: list[DraftRequest]) -> list[list[int]]:
        self.clock.now += self.seconds
        self.steps = [(len(requests), 0.004)]
        return [[4] * r.k for r in requests]


def test_the_spec_decoder_learns_step_costs_from_decode_steps_less_their_proposing(monkeypatch):
    """``observe`` teaches the target's curve an all-decode step's time less the drafter's share of it, the draft
    model's curve its decode steps, the policy each verify pass of a live sequence; a prefill step teaches no cost."""
    from kvserve.speculation import decoder
    clock = _Clock()
    monkeypatch.setattr(decoder.time, "perf_counter", clock)
    greedy = SamplingParams(temperature=0.0)
    accepted_one = [TokenLogprob(9, 0.0), TokenLogprob(7, 0.0)]
    runner = types.SimpleNamespace(execute=lambda plan: [SeqResult(w.seq_id, accepted_one) for w in plan.work],
                                   constraints=Constraints())
    drafter = _TimedDrafter(clock, seconds=0.5)
    policy = DraftPolicy(8, cost=StepCost({1: 0.030, 9: 0.034}), proposal_cost=StepCost({1: 0.005, 8: 0.010}))
    spec = SpecDecoder(policy, drafter, runner)
    seq = Sequence(EngineRequest(request_id=0, prompt_ids=[1, 2, 3], params=greedy, max_tokens=20), output_ids=[7, 9])
    work = SeqWork(0, [9, 9], 4, [0, 1], [4, 5], True, greedy, [1, 2, 3], [7], num_draft=1)
    plan = StepPlan([work], ended_ids=[5])
    spec.propose(plan, [seq], budget=100, limits=SchedulerConfig())
    work.propose = 3  # whatever auto chose, the drafter is asked for this many
    results = spec.execute(plan)
    assert drafter.released == [5] and results[0].draft_ids == [4, 4, 4]
    spec.observe(plan, results, [seq], seconds=0.030 + 0.5)
    assert policy.cost(2) == pytest.approx(0.030)  # the step's own time: its 0.5 s of proposing is not counted
    assert policy.proposal_cost(1) < 0.005                    # the draft step's 4 ms pulls its curve down
    assert (policy.drafted, policy.accepted, policy.num_drafts) == (1, 1, 1)
    spec.observe(plan, [SeqResult(0, error="boom")], [seq])   # a failed step teaches nothing
    spec.observe(plan, results, [])                           # nor one of a sequence no longer running
    assert (policy.drafted, policy.accepted) == (1, 1)
    prefill = SeqWork(1, [1, 2, 3], 0, [2], [8, 9, 10], True, greedy, [1, 2, 3], [])
    before = policy.cost.describe()
    spec.observe(StepPlan([prefill]), [SeqResult(1, [TokenLogprob(7, 0.0)])], [], seconds=2.0)
    assert policy.cost.describe() == before


def test_expected_tokens_is_the_chapters_formula():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert abs(expected_tokens(0.9, 8) - (1 - 0.9 ** 9) / 0.1) < 1e-12
    # the chapter's example: c = 0.1, γ = 8: 90% acceptance gives 3.40x, 30% gives 0.79x
    assert round(expected_tokens(0.9, 8) / (8 * 0.1 + 1), 2) == 3.40
    assert round(expected_tokens(0.3, 8) / (8 * 0.1 + 1), 2) == 0.79


# ---- exactness on the real model -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def prompt_ids(smollm2):
    return [smollm2.tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def references(smollm2, prompt_ids):
    return greedy_references(smollm2, prompt_ids, 48)


@pytest.fixture(scope="module")
def int4_draft(smollm2):
    """SmolLM2's own weights quantized to int4 (rounded to nearest): the default draft of ``--speculative draft``."""
    return load_draft(ServeConfig(speculative="draft", dtype="float32", device="cpu"), smollm2)


def drafter_of(kind: str, draft=None, num_blocks: int = 512, block_size: int = 16):
    """A fresh drafter: prompt lookup, or a draft model on a pool of its own."""
    if kind == "ngram":
        return NgramDrafter()
    pool = KVPool(draft.kv_shape(), num_blocks, block_size, draft.dtype, draft.device)
    return ModelDrafter(ModelRunner(draft, pool), 4096)


FLAT = StepCost({1: 0.03, 64: 0.031})


@pytest.mark.parametrize("kind,draft", [
    ("ngram", fixed(4)), ("ngram", DraftPolicy(8, cost=FLAT)),
    ("model", fixed(3)), ("model", DraftPolicy(8, cost=FLAT, proposal_cost=StepCost({1: 0.004, 32: 0.008}))),
], ids=["ngram-fixed-4", "ngram-auto", "model-fixed-3", "model-auto"])
def test_greedy_with_drafts_equals_generate(smollm2, int4_draft, prompt_ids, references, kind, draft):
    drafter = drafter_of(kind, int4_draft)
    ours, scheduler = engine_greedy(smollm2, prompt_ids, 48, draft=copy.deepcopy(draft), drafter=drafter)
    assert ours == references
    drafts = scheduler.spec.policy
    assert drafts.accepted > 20 and drafts.drafted > drafts.accepted  # both outcomes
    assert scheduler.blocks.num_free_blocks == scheduler.blocks.num_blocks
    if kind == "model":  # the draft pool is all free again, and the draft was mostly right (int4 of itself)
        assert drafter.blocks.num_free_blocks == drafter.blocks.num_blocks and not drafter.held
        assert scheduler.spec.policy.accepted > 0.4 * scheduler.spec.policy.drafted


@pytest.mark.parametrize("kind", ["ngram", "model"])
def test_batched_chunked_preempted_and_prefix_hits_with_drafts_equal_generate(smollm2, int4_draft, prompt_ids,
                                                                            references, kind):
    tok = smollm2.tokenizer
    others = [tok(f"Story number {i}: " + "the wind and the rain " * (i % 5 + 1))["input_ids"] for i in range(12)]
    batch = prompt_ids + [prompt_ids[0]] + others  # the fifth finds the first one's blocks in the prefix cache
    arrivals = [0, 3, 0, 7, 2] + [i % 9 for i in range(12)]
    # the draft pool is small too: sequences not asking for drafts are evicted from it, and catch up later
    drafter = drafter_of(kind, int4_draft, num_blocks=24)
    ours, scheduler = engine_greedy(smollm2, batch, 48, arrivals_at=arrivals, budget=48, num_blocks=40,
                                    max_num_seqs=16, draft=fixed(3), drafter=drafter)
    assert scheduler.num_preemptions > 0 and scheduler.prefix_hits > 0 and scheduler.spec.policy.accepted > 0
    assert ours[:len(prompt_ids)] == references
    assert ours[len(prompt_ids)] == references[0]
    assert scheduler.blocks.num_free_blocks == 40
    if kind == "model":
        assert drafter.blocks.num_free_blocks == 24 and not drafter.held
    # only verified tokens were hashed: every cached block holds the tokens some sequence really has there
    texts = [p + o for p, o in zip(batch, ours)]
    for block in scheduler.blocks.blocks:
        if block.block_hash is not None:
            assert any(tuple(t[i:i + 16]) == block.token_ids for t in texts for i in range(0, len(t), 16))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_k=20, seed=11, logprobs=2),
    SamplingParams(temperature=0.0, presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.1),
], ids=["seeded", "penalties"])
@pytest.mark.parametrize("kind", ["ngram", "model"])
def test_seeded_sampling_and_penalties_with_drafts_equal_those_without(smollm2, int4_draft, prompt_ids, params,
                                                                       kind):
    """Each drafted row is sampled with the output it follows (the accepted drafts before it) and the generator of
    its own output position, so penalties and seeds see exactly what plain decoding shows them."""
    runs = []
    for draft in (None, fixed(4)):
        seqs_out, scheduler = engine_greedy(smollm2, prompt_ids[:2], 32, params=params, draft=draft,
                                            drafter=drafter_of(kind, int4_draft) if draft else None)
        runs.append(seqs_out)
    assert runs[0] == runs[1]
    assert scheduler.spec.policy.accepted > 0


# float32 speculates in every test above (greedy, batched, chunked, preempted, prefix hits, seeded, penalised)
NOT_FLOAT32 = [s for s in SERVED if s.name != "float32"]


@pytest.mark.parametrize("served_model", NOT_FLOAT32, ids=[s.name for s in NOT_FLOAT32], indirect=True)
def test_every_served_configuration_speculates_exactly(served_model):
    """In every dtype and weight format served, greedy (with logprobs), penalised and seeded output with prompt
    lookup's drafts equals the output without: a verify row is computed as a decode row is."""
    tok = served_model.tokenizer
    prompts = [tok(REPEAT_PROMPT)["input_ids"], chat_ids(tok, "Write a poem about the sea.")]
    accepted = {}
    for params in (SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.0, repetition_penalty=1.3),
                   SamplingParams(temperature=0.8, seed=7)):
        plain, _ = engine_greedy(served_model, prompts, 32, params=params, min_tokens=0)
        drafted, scheduler = engine_greedy(served_model, prompts, 32, params=params, min_tokens=0, draft=fixed(4),
                                           drafter=NgramDrafter())
        assert drafted == plain, params
        drafts = scheduler.spec.policy
        accepted[params.repetition_penalty] = accepted.get(params.repetition_penalty, 0) + drafts.accepted
    assert accepted[1.0] > 0, accepted  # greedy and seeded runs accept drafts (a penalty may leave none to draft)


@pytest.mark.parametrize("kind", ["ngram", "model"])
def test_logprobs_of_every_emitted_token_equal_those_without_speculation(smollm2, int4_draft, prompt_ids, kind):
    params = SamplingParams(temperature=0.0, logprobs=3)
    logprobs = []
    for draft in (None, fixed(4)):
        runner = ModelRunner(smollm2, KVPool(smollm2.kv_shape(), 64, 16, smollm2.dtype))
        spec = SpecDecoder(draft, drafter_of(kind, int4_draft), runner) if draft else None
        scheduler = Scheduler(SchedulerConfig(max_model_len=4096), BlockManager(64, 16), spec)
        execute = runner.execute if spec is None else spec.execute
        core = EngineCore(scheduler, execute, timed=False)
        core.add(EngineRequest(request_id=0, prompt_ids=prompt_ids[0], params=params, max_tokens=24))
        seen: list[TokenLogprob] = []
        while core.has_work:
            seen += [token for output in core.step().outputs for token in output.tokens]
        logprobs.append([(t.token_id, t.logprob, t.top) for t in seen])
    assert len(logprobs[1]) == 24 and logprobs[0] == logprobs[1]
    assert all(lp <= 0 for _, lp, _ in logprobs[1]) and all(len(top) == 3 for _, _, top in logprobs[1])
    assert scheduler.spec.policy.accepted > 0


# ---- stop conditions inside an accepted block (a scripted engine) ---------------------------------------

def scripted(tokens: list[int]):
    """An engine whose model always continues with ``tokens`` (by output position) and whose drafter proposes
    exactly those: every draft is accepted."""
    def execute(plan: StepPlan) -> list[SeqResult]:
        results = []
        for w in plan.work:
            if not w.sample:
                results.append(SeqResult(w.seq_id))
                continue
            at = len(w.output_ids)
            new = [TokenLogprob(t, -0.5) for t in tokens[at:at + 1 + w.num_draft]]
            after = at + len(new)
            results.append(SeqResult(w.seq_id, new, draft_ids=tokens[after:after + w.propose]))
        return results
    return execute


def run_scripted(tokens, **fields):
    """One request through the core over ``scripted(tokens)``; its outputs, and the tokens they delivered."""
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), BlockManager(16, 4), SpecDecoder(fixed(4)))
    core = EngineCore(scheduler, scripted(tokens), timed=False)
    core.add(EngineRequest(request_id=0, prompt_ids=[1, 2, 3], params=SamplingParams(temperature=0.0), **fields))
    outputs = []
    while core.has_work:
        outputs += core.step().outputs
    assert scheduler.blocks.num_free_blocks == 16
    return outputs, [token.token_id for output in outputs for token in output.tokens]


def test_tokens_after_eos_inside_an_accepted_block_are_dropped():
    outputs, delivered = run_scripted([10, 11, 12, EOS, 13, 14, 15, 16, 17], max_tokens=20,
                                      stop_token_ids=frozenset({EOS}))
    assert delivered == [10, 11, 12, EOS]
    assert [o.finish_reason for o in outputs].count(FinishReason.STOP) == 1
    assert outputs[-1].finish_reason is FinishReason.STOP
    assert sum(o.num_accepted_tokens for o in outputs) > 0


def test_max_tokens_inside_a_block_ends_with_length_and_min_tokens_holds_eos_back():
    outputs, delivered = run_scripted(list(range(10, 30)), max_tokens=6)
    assert delivered == list(range(10, 16)) and outputs[-1].finish_reason is FinishReason.LENGTH  # usage: emitted only
    # EOS at output position 1 is below min_tokens: drafts never cross the min_tokens boundary (every sampled
    # row suppresses stop tokens alike), and no sampled EOS ends the sequence early
    _, delivered = run_scripted([10, 11, 12, 13, 14, EOS, 15, 16], max_tokens=8, min_tokens=4,
                                stop_token_ids=frozenset({EOS}))
    assert delivered == [10, 11, 12, 13, 14, EOS]


def test_one_step_delivers_several_tokens_in_one_output():
    outputs, delivered = run_scripted(list(range(10, 30)), max_tokens=12)
    assert max(len(o.tokens) for o in outputs) > 1 and delivered == list(range(10, 22))
    assert all(len(o.tokens) == o.num_accepted_tokens + 1 for o in outputs if o.num_draft_tokens)


def test_aborts_and_preemptions_with_drafts_free_every_block():
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4), BlockManager(12, 4),
                          SpecDecoder(fixed(4)))
    core = EngineCore(scheduler, scripted(tokens := [20 + i % 7 for i in range(40)]), timed=False)
    requests = [EngineRequest(request_id=i, prompt_ids=[1, 2, 3, 4, 5], params=SamplingParams(temperature=0.0),
                              max_tokens=30) for i in range(4)]
    run = run_offline(core, {0: requests[:3], 2: requests[3:]}, max_steps=500,
                      on_step=lambda step, out: step == 4 and core.abort(1))
    assert run.steps > 0 and scheduler.num_preemptions > 0 and scheduler.spec.policy.accepted > 0
    assert scheduler.blocks.num_free_blocks == 12
    assert [run.tokens[i] for i in (0, 2, 3)] == [tokens[:30]] * 3


def test_a_draft_model_frees_its_blocks_after_aborts_preemptions_and_rejections(smollm2, int4_draft, prompt_ids):
    """Aborted, preempted and finished sequences all give their draft blocks back (StepPlan.ended_ids), and the
    survivors' output is still the output without speculation."""
    drafter = drafter_of("model", int4_draft, num_blocks=10)
    runner = ModelRunner(smollm2, KVPool(smollm2.kv_shape(), 12, 16, smollm2.dtype))
    spec = SpecDecoder(fixed(3), drafter, runner)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=4096),
                          BlockManager(12, 16), spec)
    requests = [EngineRequest(request_id=i, prompt_ids=p, params=SamplingParams(temperature=0.0), max_tokens=40,
                              min_tokens=40) for i, p in enumerate(prompt_ids)]
    core = EngineCore(scheduler, spec.execute, timed=False)
    run = run_offline(core, {0: requests[:3], 2: requests[3:]}, on_step=lambda step, out: step == 6 and core.abort(1))
    drafts = scheduler.spec.policy
    assert run.steps > 0 and scheduler.num_preemptions > 0 and 0 < drafts.accepted < drafts.drafted
    assert scheduler.blocks.num_free_blocks == 12
    assert drafter.blocks.num_free_blocks == 10 and not drafter.held
    alone, _ = engine_greedy(smollm2, [prompt_ids[0], prompt_ids[2], prompt_ids[3]], 40)
    assert [run.tokens[0], run.tokens[2], run.tokens[3]] == alone


# ---- unseeded sampling keeps the distribution -------------------------------------------------------------

class OracleDrafter(NgramDrafter):
    """Drafts the reference model's own greedy continuation (so drafts are often, but not always, accepted)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model
        self.known: dict[tuple[int, ...], list[int]] = {}  # top-k sampling reaches few distinct histories

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        key = (*token_ids, -k)
        if key not in self.known:
            with torch.no_grad():
                out = self.model.generate(torch.tensor([token_ids]), max_new_tokens=k, do_sample=False,
                                          pad_token_id=0)
            self.known[key] = out[0, len(token_ids):].tolist()
        return self.known[key]


def test_unseeded_sampling_with_drafts_keeps_the_models_distribution():
    """The first three sampled tokens of 800 sequences: the empirical joint distribution with drafts is within a
    total variation of 0.15 of the one without. With top_k = 2 there are at most 8 outcomes; two samples of 800
    from one such distribution differ by at most about 0.06 in expectation (0.5 sqrt(4 / (pi N)) sum sqrt(p)),
    while a wrong rule (accepting every draft) moves the mass of a rejected draft's outcomes, about 0.3 here."""
    model = tiny("llama")
    loaded = wrap_model(copy.deepcopy(model), tokenizer=None, name="llama")
    prompt = [5, 17, 33, 5, 17, 33, 5, 17]
    params = SamplingParams(temperature=1.0, top_k=2)
    counts = []
    for draft in (None, fixed(2)):
        torch.manual_seed(1234)
        outs, scheduler = engine_greedy(loaded, [prompt] * 800, 3, block_size=4, num_blocks=2048, max_num_seqs=64,
                                        budget=1024, params=params, draft=draft,
                                        drafter=OracleDrafter(model) if draft else None)
        counts.append(collections.Counter(tuple(o) for o in outs))
    assert scheduler.spec.policy.accepted > 100 and scheduler.spec.policy.drafted - scheduler.spec.policy.accepted > 100
    outcomes = set(counts[0]) | set(counts[1])
    tv = sum(abs(counts[0][o] - counts[1][o]) for o in outcomes) / (2 * 800)
    assert tv < 0.15, tv


# ---- served over HTTP --------------------------------------------------------------------------------------

def _chat(url: str, content: str, **extra) -> dict:
    body = {"messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 40, **extra}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("gamma", [4, None], ids=["fixed-4", "auto"])
def test_served_with_prompt_lookup_the_answers_streams_timings_and_metrics_are_exact(smollm2, server_url, gamma):
    quote = ("Copy this sentence exactly, twice: The rain in Spain stays mainly in the plain, said the professor "
             "to the class on Tuesday.")
    plain = [_chat(server_url, quote), _chat(server_url, "Name three colours.", temperature=0.7, seed=5)]
    with running_server(smollm2, ServeConfig(kv_cache_memory="64MiB", speculative="ngram",
                                             num_speculative_tokens=gamma)) as url:
        drafted = [_chat(url, quote), _chat(url, "Name three colours.", temperature=0.7, seed=5)]
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=300, json={
                "messages": [{"role": "user", "content": quote}], "temperature": 0, "max_tokens": 40,
                "stream": True, "stream_options": {"include_usage": True}}) as response:
            chunks = [json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith("data: {")]
        metrics = httpx.get(url + "/metrics").text
    for a, b in zip(plain, drafted):
        assert a["choices"][0]["message"] == b["choices"][0]["message"]
        assert a["choices"][0]["finish_reason"] == b["choices"][0]["finish_reason"]
        assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert streamed == plain[0]["choices"][0]["message"]["content"]
    final = next(c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
    timings = final["timings"]
    assert 0 < timings["accepted_tokens"] <= timings["draft_tokens"]
    assert chunks[-1]["usage"]["completion_tokens"] == timings["completion_tokens"]
    accepted = _metric(metrics, 'kvserve:spec_decode_num_accepted_tokens_total{model_name="SmolLM2-135M-Instruct"}')
    drafts = _metric(metrics, 'kvserve:spec_decode_num_draft_tokens_total{model_name="SmolLM2-135M-Instruct"}')
    first = _metric(metrics, 'kvserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="SmolLM2-135M-'
                             'Instruct",position="0"}')
    assert 0 < first <= accepted <= drafts
    assert _metric(metrics, 'kvserve:spec_decode_num_drafts_total{model_name="SmolLM2-135M-Instruct"}') >= first


def test_served_with_a_draft_model_the_answers_equal_those_without(smollm2, int4_draft, server_url):
    prompts = ["Explain how rainbows form.", "Write a haiku about the sea."]
    sampled = {"temperature": 0.7, "seed": 5, "n": 2}
    plain = [_chat(server_url, p) for p in prompts] + [_chat(server_url, prompts[0], **sampled)]
    config = ServeConfig(kv_cache_memory="64MiB", speculative="draft", num_speculative_tokens=3)
    state = ServerState(smollm2, config, draft=int4_draft)
    with serving(state) as url:
        drafted = [_chat(url, p) for p in prompts] + [_chat(url, prompts[0], **sampled)]
        metrics = httpx.get(url + "/metrics").text
        # once idle, the engine has been handed the ended sequences and the draft pool is all free again
        deadline = time.monotonic() + 10
        while state.spec.drafter.held and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not state.spec.drafter.held
        assert state.spec.drafter.blocks.num_free_blocks == state.spec.drafter.blocks.num_blocks
    assert len(drafted[-1]["choices"]) == 2
    for a, b in zip(plain, drafted):
        assert a["choices"] == b["choices"]
        assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"]
    accepted = _metric(metrics, 'kvserve:spec_decode_num_accepted_tokens_total{model_name="SmolLM2-135M-Instruct"}')
    drafts = _metric(metrics, 'kvserve:spec_decode_num_draft_tokens_total{model_name="SmolLM2-135M-Instruct"}')
    # an int4 copy of the model agrees with it on a third of its drafts or more (a draft checked against the wrong
    # positions would agree on almost none); the exact figure moves with the arithmetic of either model
    assert 0.3 * drafts < accepted <= drafts


def test_a_draft_models_pool_holds_as_many_tokens_within_the_kv_budget(smollm2, int4_draft, caplog):
    """The draft's pool (float32 for the int4 draft) has the served pool's blocks, and both fit in
    --kv-cache-memory: one more block of each would not."""
    config = ServeConfig(kv_cache_memory="64MiB", speculative="draft", num_speculative_tokens=3)
    with caplog.at_level(logging.INFO, logger="kvserve"):
        state = ServerState(smollm2, config, draft=int4_draft)
    served, draft = state.pool, state.spec.drafter.runner.pool
    assert served.num_blocks == draft.num_blocks == state.spec.drafter.blocks.num_blocks
    both = served.nbytes + draft.nbytes
    assert both <= 64 * 2**20 < both + (served.nbytes + draft.nbytes) // served.num_blocks
    assert "KV pools: the served model's" in caplog.text and f"= {both / 2**20:.1f} MiB" in caplog.text
    alone = ServerState(smollm2, ServeConfig(kv_cache_memory="64MiB"))
    assert alone.pool.num_blocks > served.num_blocks


def test_draft_flags_without_a_draft_model_or_of_the_served_model_itself_are_refused(smollm2):
    with pytest.raises(ValueError, match="need --speculative draft"):
        ServeConfig(speculative="ngram", draft_quantization="int4")
    with pytest.raises(ValueError, match="need --speculative draft"):
        ServeConfig(draft_model="/some/dir")
    with pytest.raises(ValueError, match="cannot be cheaper"):
        ServeConfig(speculative="draft", quantization="int4")  # its own weights as int4: itself
    assert ServeConfig(speculative="draft").draft_scheme.value == "int4"
    assert ServeConfig(speculative="draft", draft_model="/d").draft_scheme.value == "none"


def test_a_draft_model_with_another_tokenizer_is_refused(smollm2, tmp_path):
    other = copy.copy(smollm2)
    other.tokenizer = copy.deepcopy(smollm2.tokenizer)
    other.tokenizer.add_tokens(["<an-extra-token>"])
    with pytest.raises(ValueError, match="another tokenizer"):
        load_draft(ServeConfig(speculative="draft", dtype="float32", device="cpu"), other)


def _metric(text: str, series: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(series + " "))
    return float(line.rsplit(" ", 1)[1])


def test_processed_logprobs_are_soft_labels_at_the_temperature(server_url):
    """The chapter's arithmetic on a real prompt: p_top / p_third at T = 2 is the square root of that ratio at
    T = 1 (logprob differences halve), and raw logprobs, the default, do not depend on the temperature."""
    def top(temperature: float, mode: str | None) -> list[float]:
        body = {"prompt": "The capital of France is", "max_tokens": 1, "logprobs": 5, "temperature": temperature,
                "seed": 1, **({"logprobs_mode": mode} if mode else {})}
        response = httpx.post(server_url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        # the 5 most likely (a sampled token outside them is listed too, after them)
        return sorted(response.json()["choices"][0]["logprobs"]["top_logprobs"][0].values(), reverse=True)[:5]

    t1, t2 = top(1.0, "processed_logprobs"), top(2.0, "processed_logprobs")
    assert abs((t2[0] - t2[2]) - (t1[0] - t1[2]) / 2) < 1e-4
    assert (t1[0] - t1[2]) > 0.5  # a real gap, so the halving is visible
    assert top(1.0, None) == top(2.0, None) == t1
    response = httpx.post(server_url + "/v1/completions", json={"prompt": "x", "logprobs_mode": "raw_logits"})
    assert response.status_code == 400 and "logprobs_mode" in response.text


def test_the_speculation_benchmark_reads_the_curve_the_server_logs():
    """`loadtest speculative` prints the auto server's start-up curve from its log: the line it parses is the
    one the server writes (with a draft model's curve after it)."""
    from kvserve.loadtest.served.speculative import _step_costs
    from kvserve.speculation.decoder import SPECULATION_LOG

    target, draft = StepCost({1: 0.0249, 2: 0.0251, 9: 0.0312}), StepCost({1: 0.0101, 2: 0.0121})
    line = SPECULATION_LOG % ("draft", 8, 5, target.describe(), "; draft step by rows: " + draft.describe(), 8.8)
    assert _step_costs("INFO kvserve.server: " + line + "\n") == {1: 24.9, 2: 25.1, 9: 31.2}


def test_auto_never_probes_where_even_accepted_drafts_could_not_pay():
    """A draft model slower than the target (an int4 copy of a 4-bit target): no acceptance makes its drafts
    pay, so auto never probes it (a probe would also pay the draft's catch-up on the context); with a cheap
    draft the same policy still probes."""
    target = StepCost({1: 0.0117, 5: 0.0153, 9: 0.0180})
    slow = DraftPolicy(8, cost=target, proposal_cost=StepCost({1: 0.0142, 4: 0.0180}))
    cheap = DraftPolicy(8, cost=target, proposal_cost=StepCost({1: 0.0020, 4: 0.0030}))
    for policy in (slow, cheap):
        policy.recent_drafted = 1000  # all rejected lately: the best choice is none, only probes draft
    doubtful = [Candidate(0, 8, 100, 0, catch_up=0, remaining=200)]
    slow_drafts = sum(bool(slow.choose(doubtful, 1, 1, 512)) for _ in range(4 * PROBE_EVERY))
    cheap_drafts = sum(bool(cheap.choose(doubtful, 1, 1, 512)) for _ in range(4 * PROBE_EVERY))
    assert slow_drafts == 0 and cheap_drafts == 4
