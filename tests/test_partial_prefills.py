"""Short requests beside a long prompt's chunked prefill, with a fake model through the engine core: the long prompt's
chunk is capped (``long_prefill_token_threshold``) so waiting requests get part of each step's budget, long prompts
prefill a few at a time (``max_long_partial_prefills``) so a short prompt is not queued behind one, decodes keep
their token, and what the short ones leave goes back to the long prompt; with ``attention_cost_context`` chunks are
sized by their work, attention over the keys before them included. Steps are counted, never timed."""

from __future__ import annotations

import pytest

from kvserve.engine.plan import SamplingParams, SeqResult, StepPlan, TokenLogprob
from kvserve.kvcache.block_manager import BlockManager
from kvserve.scheduler.contract import EngineRequest
from kvserve.scheduler.core import EngineCore
from kvserve.scheduler.offline import OfflineRun, run_offline
from kvserve.scheduler.scheduler import (LONE_STEP_WORK, Scheduler, SchedulerConfig, affordable_tokens,
                                         chunk_work, lone_prefill_chunks)

GREEDY = SamplingParams(temperature=0.0)


def fake_execute(plan: StepPlan) -> list[SeqResult]:
    """Samples token 7 for every sequence that reached the end of its known tokens."""
    return [SeqResult(w.seq_id, [TokenLogprob(7, 0.0)] if w.sample else []) for w in plan.work]


def request(request_id: int, prompt_len: int, max_tokens: int = 1, first: int = 1, **fields) -> EngineRequest:
    """A request whose prompt is ``first, first + 1, ...`` (a different ``first``: no shared prefix blocks)."""
    return EngineRequest(request_id=request_id, prompt_ids=list(range(first, first + prompt_len)), params=GREEDY,
                         max_tokens=max_tokens, **fields)


def run(arrivals: dict[int, list[EngineRequest]], budget: int = 512, max_num_seqs: int = 4, block_size: int = 16,
        num_blocks: int = 2048, plans: list[StepPlan] | None = None, **limits) -> OfflineRun:
    """Run ``arrivals`` through a fresh core; ``plans`` (if given) receives every plan executed."""
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=16384,
                             **limits)

    def execute(plan: StepPlan) -> list[SeqResult]:
        assert plan.num_tokens <= budget
        if plans is not None:
            plans.append(plan)
        return fake_execute(plan)

    return run_offline(EngineCore(Scheduler(config, BlockManager(num_blocks, block_size)), execute, timed=False),
                       arrivals)


def chunks(plans: list[StepPlan], seq_id: int) -> list[int]:
    """Tokens ``seq_id`` computed in each step it was in."""
    return [len(w.token_ids) for plan in plans for w in plan.work if w.seq_id == seq_id]


LONG = 8000  # the benchmark's long prompt (loadtest peers --prefill), in chunks of a 512-token budget


def test_a_short_request_arriving_during_a_long_prefill_gets_its_first_token_within_three_steps():
    alone = run({0: [request(0, LONG)]})
    shorts = {step: [request(step, 32, first=10_000 + 100 * step)] for step in (1, 3, 4, 9, 14)}
    beside = run({0: [request(0, LONG)], **shorts})
    for step in shorts:
        assert beside.first_token_step[step] - step < 3, f"short request arriving at step {step} waited"
    assert beside.first_token_step[0] == alone.first_token_step[0] == 15  # 16 steps of 512 hold 8000 + 5 x 32


def test_a_lone_long_prompt_is_chunked_exactly_as_without_the_cap():
    plans: list[StepPlan] = []
    run({0: [request(0, LONG)]}, plans=plans)
    uncapped: list[StepPlan] = []
    run({0: [request(0, LONG)]}, plans=uncapped, long_prefill_token_threshold=0)
    assert chunks(plans, 0) == chunks(uncapped, 0) == [512] * 15 + [320]


def test_decodes_keep_their_token_when_a_prefill_claims_before_them():
    # under priority a higher-priority prefill claims the budget before a lower-priority decode; with no cap on
    # its chunk it still leaves the decode its one token (vLLM's rule: decodes first, then prefills)
    plans: list[StepPlan] = []
    arrivals = {0: [request(0, 4, max_tokens=20, priority=5)], 2: [request(1, 300, priority=0)]}
    run(arrivals, budget=32, plans=plans, scheduling="priority", long_prefill_token_threshold=0)
    during = [plan for plan in plans if any(w.seq_id == 1 and not w.sample for w in plan.work)]
    assert len(during) == 9 and all({w.seq_id for w in plan.work} == {0, 1} for plan in during)
    assert all(plan.num_tokens == 32 for plan in during)  # the prefill takes the rest: 31 tokens a step


# -- the knobs' edge cases ---------------------------------------------------------------------------------------
def test_a_threshold_above_the_budget_cuts_no_chunk():
    plans: list[StepPlan] = []
    beside = run({0: [request(0, 100)], 1: [request(1, 8, first=500)]}, budget=16, plans=plans,
                 long_prefill_token_threshold=64)
    assert chunks(plans, 0) == [16] * 6 + [4]             # each step's whole budget, as with no threshold
    assert beside.first_token_step[1] == 6                # so the short request waits for the prefill's last chunk


def test_a_second_long_prompt_waits_for_a_long_slot_while_a_short_one_goes_first():
    plans: list[StepPlan] = []
    arrivals = {0: [request(0, 200), request(1, 200, first=1000)], 1: [request(2, 8, first=5000)]}
    beside = run(arrivals, budget=32, plans=plans)        # threshold 16, one long prompt at a time
    assert beside.first_token_step[2] == 1                # overtook the waiting long prompt 1
    first_chunk_of_1 = next(i for i, plan in enumerate(plans) if any(w.seq_id == 1 for w in plan.work))
    left_of_0 = 200 - sum(chunks(plans[:first_chunk_of_1], 0))
    assert 0 < left_of_0 <= 16                            # admitted once 0 had no more than the threshold left
    assert beside.first_token_step[0] < beside.first_token_step[1]


def test_several_long_prompts_prefill_together_when_allowed_each_under_the_threshold():
    plans: list[StepPlan] = []
    run({0: [request(0, 200), request(1, 200, first=1000)]}, budget=32, plans=plans, max_long_partial_prefills=2)
    first = {w.seq_id: len(w.token_ids) for w in plans[0].work}
    assert first == {0: 16, 1: 16}


def test_one_partial_prefill_at_a_time_queues_a_short_prompt_behind_a_long_one():
    # vLLM's default (max_num_partial_prefills 1): the stall the defaults avoid
    beside = run({0: [request(0, 100)], 1: [request(1, 8, first=500)]}, budget=16, max_num_partial_prefills=1)
    assert beside.first_token_step[1] > beside.first_token_step[0]


def test_a_long_prompt_whose_prefix_is_cached_is_short_and_goes_beside_a_long_prefill():
    plans: list[StepPlan] = []
    cached = request(0, 200, first=3000)
    arrivals = {0: [cached], 20: [request(1, 400)],
                22: [request(2, 204, first=3000), request(3, 204, first=7000)]}  # 2 shares 0's first 192 tokens
    beside = run(arrivals, budget=32, block_size=16, plans=plans)
    assert beside.first_token_step[2] - 22 < 2           # 12 tokens left to compute: short, admitted at once
    assert beside.first_token_step[3] > beside.first_token_step[1]  # no hit: long, waits for 1's prefill


@pytest.mark.parametrize("limits, message", [
    ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
    ({"max_num_partial_prefills": 0}, "max_num_partial_prefills"),
    ({"max_long_partial_prefills": 3, "max_num_partial_prefills": 2}, "max_long_partial_prefills"),
    ({"attention_cost_context": -1}, "attention_cost_context"),
])
def test_inconsistent_prefill_limits_are_refused(limits, message):
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, **limits)


def test_the_defaults_cap_at_half_the_budget_with_one_long_prompt_at_a_time():
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512)
    assert (config.long_prefill_token_threshold, config.max_num_partial_prefills,
            config.max_long_partial_prefills) == (256, 4, 1)


def test_a_long_newcomer_the_limit_holds_back_preempts_nobody_in_vain():
    # priority: a higher-priority long prompt finds no slot while a long prompt prefills; preempting the decode
    # beside it would free a slot the long prompts' limit does not let it take (and the decode would come back)
    arrivals = {0: [request(0, 400, priority=5), request(1, 4, max_tokens=60, priority=5, first=900)],
                2: [request(2, 300, priority=0, first=2000)]}
    beside = run(arrivals, budget=32, max_num_seqs=2, scheduling="priority")
    assert sum(record.preemptions for record in beside.records) <= 1
    assert beside.tokens[1] == [7] * 60


def test_prompts_a_little_over_the_threshold_arriving_together_fill_every_step():
    # the budget left once the long prompt in progress has all it needs starts the next one beyond the limit
    plans: list[StepPlan] = []
    arrivals = {0: [request(i, 24, first=100 * i) for i in range(4)]}
    capped = run(arrivals, budget=32, plans=plans)               # threshold 16: each prompt is long
    uncapped = run(arrivals, budget=32, long_prefill_token_threshold=0)
    assert [plan.num_tokens for plan in plans[:3]] == [32, 32, 32]
    assert capped.first_token_step == uncapped.first_token_step == {0: 0, 1: 1, 2: 2, 3: 2}


# -- chunks sized by work (attention_cost_context) ---------------------------------------------------------------
COST_CONTEXT = 922  # SmolLM2-135M's: 106.2 M multiply-adds of projections per token / 34,560 per pair x 0.3
STEP_WORK = chunk_work(0, 512, COST_CONTEXT)  # a whole budget's chunk from position 0


def positions_and_sizes(plans: list[StepPlan], seq_id: int) -> list[tuple[int, int]]:
    return [(w.start_pos, len(w.token_ids)) for plan in plans for w in plan.work if w.seq_id == seq_id]


def step_work(plan: StepPlan) -> int:
    return sum(chunk_work(w.start_pos, len(w.token_ids), COST_CONTEXT) for w in plan.work)


def test_a_chunks_work_counts_attention_over_the_keys_before_it():
    assert STEP_WORK == 512 * (2 * 922 + 512)  # 512 * (1 + 256 / 922) token-equivalents, in 1 / (2 * 922) units
    assert [affordable_tokens(p, STEP_WORK, COST_CONTEXT) for p in (0, 512, 2048, 7936)] == [512, 372, 196, 67]
    assert chunk_work(100, 30, 922) + chunk_work(130, 70, 922) == chunk_work(100, 100, 922)  # chunking-invariant
    assert affordable_tokens(5000, 0, COST_CONTEXT) == affordable_tokens(0, -5, COST_CONTEXT) == 0


def test_the_context_where_attention_costs_the_projections_comes_from_the_models_shape():
    from types import SimpleNamespace

    from kvserve.engine.loader import attention_cost_context

    smollm2 = SimpleNamespace(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                              intermediate_size=1536)
    assert attention_cost_context(smollm2) == COST_CONTEXT


def test_a_lone_long_prompts_chunks_shrink_with_depth_within_the_lone_steps_work():
    plans: list[StepPlan] = []
    alone = run({0: [request(0, LONG)]}, plans=plans, attention_cost_context=COST_CONTEXT)
    sizes = chunks(plans, 0)
    assert sizes[:6] == [512, 512, 512, 449, 388, 347]  # by tokens: [512] * 15 + [320]
    assert sizes[-3:] == [139, 137, 79] and len(sizes) == 34 and alone.first_token_step[0] == 33
    assert all(step_work(plan) <= LONE_STEP_WORK * STEP_WORK for plan in plans)
    # what loadtest profile --prefill replays: the same chunks, by tokens too
    assert lone_prefill_chunks(LONG, 512, COST_CONTEXT) == sizes
    assert lone_prefill_chunks(LONG, 512, 0) == [512] * 15 + [320]


def test_a_short_request_beside_a_deep_prefill_shares_a_step_of_bounded_work():
    plans: list[StepPlan] = []
    run({0: [request(0, LONG)], 20: [request(1, 32, first=10_000)]}, plans=plans,
        attention_cost_context=COST_CONTEXT)
    # alone: 178 tokens at 5753 (twice a step's work); beside the short prompt, the long chunk's first pass gets the
    # work of 256 tokens from 0 (39 at 5931), the short one its 32, and what is left tops the long chunk up by 44
    # (by tokens: 256 + 32, then 224 more)
    assert positions_and_sizes(plans[19:22], 0) == [(5753, 178), (5931, 83), (6014, 171)]
    assert positions_and_sizes(plans, 1) == [(0, 32)]
    assert step_work(plans[20]) <= STEP_WORK < step_work(plans[20]) + chunk_work(6014, 1, COST_CONTEXT)


def test_a_decode_keeps_its_token_and_its_attention_counts_in_the_steps_work():
    plans: list[StepPlan] = []
    run({0: [request(1, 20, max_tokens=200, first=50_000)], 2: [request(0, LONG)]}, plans=plans,
        attention_cost_context=COST_CONTEXT)
    assert [(w.seq_id, w.start_pos, len(w.token_ids)) for w in plans[10].work] == [(1, 29, 1), (0, 2312, 181)]
    assert step_work(plans[10]) <= STEP_WORK


def test_a_prompt_deeper_than_a_steps_work_still_gets_a_token_a_step():
    plans: list[StepPlan] = []
    deep = run({0: [request(0, 1200)]}, budget=32, plans=plans, attention_cost_context=1)
    sizes = chunks(plans, 0)
    # past position 1086 one token costs more than a lone step's work (2 x 32 x 34): the step's first chunk gets one
    assert sizes[:3] == [32, 24, 16] and sizes[-113:] == [1] * 113
    assert sum(sizes) == 1200 and deep.first_token_step[0] == 814
