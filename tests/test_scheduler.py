"""Scheduling policy with a fake runner: budgets, chunked prefill, slot refill, preemption, static groups."""

from __future__ import annotations

from kvserve.engine.plan import SamplingParams, SeqResult, StepPlan, TokenLogprob
from kvserve.kvcache.block_manager import BlockManager
from kvserve.scheduler.contract import EngineRequest, FinishReason
from kvserve.scheduler.core import EngineCore
from kvserve.scheduler.offline import run_offline
from kvserve.scheduler.policies import Policy
from kvserve.scheduler.scheduler import Scheduler, SchedulerConfig
from kvserve.scheduler.sequence import SeqStatus, Sequence

GREEDY = SamplingParams(temperature=0.0)


def fake_execute(plan: StepPlan) -> list[SeqResult]:
    """Samples token 7 for every sequence that reached the end of its known tokens."""
    return [SeqResult(w.seq_id, [TokenLogprob(7, 0.0)] if w.sample else []) for w in plan.work]


def make(seq_id: int, prompt_len: int, max_tokens: int, **fields) -> EngineRequest:
    return EngineRequest(request_id=seq_id, prompt_ids=list(range(1, prompt_len + 1)), params=GREEDY,
                         max_tokens=max_tokens, **fields)


def scheduler(num_blocks=64, block_size=4, max_num_seqs=4, budget=16, static=False, caching=True,
              scheduling="fcfs") -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=1024,
                                     policy=Policy.STATIC if static else Policy.CONTINUOUS, scheduling=scheduling),
                     BlockManager(num_blocks, block_size, caching))


def add(s: Scheduler, request: EngineRequest) -> Sequence:
    """Queue ``request``; its scheduler record (which outlives its end, for the test to read)."""
    s.add(request)
    return s.live[request.request_id]


def recording(plans: list[StepPlan], execute=fake_execute):
    """``execute`` that keeps every plan it runs."""
    def run(plan: StepPlan) -> list[SeqResult]:
        plans.append(plan)
        return execute(plan)
    return run


def test_long_prompt_is_chunked_while_decodes_continue():
    s = scheduler(budget=8)
    add(s, make(0, 3, 20))
    s.update(p := s.schedule(), fake_execute(p))       # short prefilled, first token out
    long = add(s, make(1, 30, 5))
    chunks = []
    for _ in range(5):
        plan = s.schedule()
        by_id = {w.seq_id: len(w.token_ids) for w in plan.work}
        assert by_id[0] == 1                              # the decode runs every step
        assert plan.num_tokens <= 8
        chunks.append(by_id.get(1, 0))
        s.update(plan, fake_execute(plan))
    assert chunks == [7, 7, 7, 7, 2]                     # 30 prompt tokens in chunks under the budget
    assert len(long.output_ids) == 1                      # sampled only once the whole prompt is in


def test_freed_slot_is_refilled_at_the_next_step():
    s = scheduler(max_num_seqs=2)
    a, b, c = (add(s, r) for r in (make(0, 2, 1), make(1, 2, 5), make(2, 2, 5)))
    plan = s.schedule()
    assert [w.seq_id for w in plan.work] == [0, 1]
    s.update(plan, fake_execute(plan))                    # a finishes (max_tokens 1)
    assert a.finish_reason is FinishReason.LENGTH
    plan = s.schedule()
    assert [w.seq_id for w in plan.work] == [1, 2]        # c takes a's slot at once


def test_static_group_waits_for_its_last_member():
    s = scheduler(max_num_seqs=2, static=True)
    seqs = [add(s, r) for r in (make(0, 2, 1), make(1, 2, 4), make(2, 2, 1))]
    delivered: list[tuple[int, int]] = []                 # (step, seq_id) of final outputs
    for step in range(8):
        plan = s.schedule()
        if not plan.work:
            break
        assert 2 not in {w.seq_id for w in plan.work} or seqs[1].is_finished
        for output in s.update(plan, fake_execute(plan)):
            if output.finished:
                delivered.append((step, output.request_id))
    # seq 0 finished at step 0 but is released with seq 1 at step 3; seq 2 runs only afterwards
    assert delivered == [(3, 0), (3, 1), (4, 2)]


def test_pool_exhaustion_preempts_the_newest_and_recomputes_it():
    s = scheduler(num_blocks=4, block_size=4, max_num_seqs=2, budget=16, caching=False)
    a, b = make(0, 4, 6), make(1, 4, 6)                   # each needs 3 blocks in the end; the pool has 4
    plans: list[StepPlan] = []
    run = run_offline(EngineCore(s, recording(plans)), {0: [a, b]})
    recomputes = [(w.seq_id, w.start_pos, len(w.token_ids)) for plan in plans[1:] for w in plan.work
                  if w.seq_id == 1 and w.start_pos == 0]
    assert s.num_preemptions == 1 and sum(r.preemptions for r in run.records) == 1
    assert recomputes == [(1, 0, 9)]                      # prompt + 5 generated tokens recomputed at once
    assert run.tokens == {0: [7] * 6, 1: [7] * 6}
    assert s.blocks.num_free_blocks == 4


def test_preempted_sequence_recomputes_from_its_cached_blocks():
    s = scheduler(num_blocks=4, block_size=4, max_num_seqs=2, budget=16, caching=True)
    a, b = make(0, 4, 6), make(1, 4, 6)
    plans: list[StepPlan] = []
    run = run_offline(EngineCore(s, recording(plans)), {0: [a, b]})
    assert s.num_preemptions == 1
    assert [(w.seq_id, w.start_pos) for w in plans[5].work] == [(0, 8), (1, 8)]  # b's freed blocks were hits
    assert run.tokens == {0: [7] * 6, 1: [7] * 6}


def test_abort_running_and_waiting_frees_blocks():
    s = scheduler(num_blocks=8, max_num_seqs=1)
    a, b = add(s, make(0, 8, 50)), add(s, make(1, 8, 50))
    plan = s.schedule()
    s.update(plan, fake_execute(plan))
    assert a.status is SeqStatus.RUNNING and s.blocks.num_free_blocks == 6
    assert s.abort(1).finish_reason is FinishReason.ABORT and b.finish_reason is FinishReason.ABORT and not s.waiting
    assert s.abort(0).request_id == 0 and a.is_finished and not s.running
    assert s.blocks.num_free_blocks == 8
    assert s.abort(0) is None


def test_prefix_hit_shrinks_prefill_and_is_counted():
    s = scheduler(num_blocks=32, block_size=4, budget=64)
    run_offline(EngineCore(s, fake_execute), {0: [make(0, 10, 1)]})
    second = add(s, make(1, 10, 1))
    plan = s.schedule()
    assert plan.work[0].start_pos == 8 and len(plan.work[0].token_ids) == 2
    assert second.num_cached_tokens == 8
    assert (s.prefix_queries, s.prefix_hits) == (20, 8)


def test_stop_token_respects_min_tokens():
    s = scheduler()
    request = make(0, 2, 10, stop_token_ids=frozenset({7}), min_tokens=3)
    run = run_offline(EngineCore(s, fake_execute), {0: [request]})
    assert run.tokens[0] == [7, 7, 7] and run.finish[0] is FinishReason.STOP


def test_drain_rate_is_measured_on_the_busy_clock(monkeypatch):
    """Sequences finishing every 0.5 s of work drain at 2/s, and idle time between two bursts does not dilute it."""
    import types

    import kvserve.scheduler.finish_rate as module

    clock = [100.0]
    monkeypatch.setattr(module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def ticking(plan: StepPlan) -> list[SeqResult]:
        clock[0] += 0.5  # each step takes 0.5 s
        return fake_execute(plan)

    s = scheduler(max_num_seqs=1)
    core = EngineCore(s, ticking)
    assert core.load.finish_rate is None
    run_offline(core, {0: [make(0, 4, 1)]})         # one step: a finish at busy time 0.5
    assert core.load.finish_rate is None                   # one finish is no rate
    clock[0] += 3600.0                               # an idle hour
    run_offline(core, {0: [make(1, 4, 1), make(2, 4, 1)]})
    assert core.load.finish_rate == 2.0                    # 3 finishes over 1.0 s of busy time


def test_choices_of_one_request_share_the_prompt_blocks():
    s = scheduler(num_blocks=32, block_size=4, budget=64)
    a, b = add(s, make(0, 10, 3)), add(s, make(1, 10, 3, prefix_source=0))
    plan = s.schedule()
    assert [w.seq_id for w in plan.work] == [0]           # b waits one step for a's prompt blocks
    s.update(plan, fake_execute(plan))
    plan = s.schedule()
    assert [(w.seq_id, w.start_pos) for w in plan.work] == [(0, 10), (1, 8)]
    assert b.block_table[:2] == a.block_table[:2]
    assert [s.blocks.blocks[i].ref_count for i in a.block_table[:2]] == [2, 2]


def test_a_sampling_error_ends_only_its_own_sequence():
    s = scheduler()
    good = add(s, make(0, 3, 4))
    add(s, make(1, 3, 4))

    def execute(plan: StepPlan) -> list[SeqResult]:
        return [SeqResult(w.seq_id, error="sampling failed: boom") if w.seq_id == 1
                else SeqResult(w.seq_id, [TokenLogprob(7, 0.0)]) for w in plan.work]

    plan = s.schedule()
    outputs = s.update(plan, execute(plan))
    assert [(out.request_id, out.finish_reason, out.error) for out in outputs] == [
        (0, None, None), (1, FinishReason.ERROR, "sampling failed: boom")]
    run_offline(EngineCore(s, execute), {})
    assert good.output_ids == [7] * 4 and good.finish_reason is FinishReason.LENGTH
    assert s.blocks.num_free_blocks == s.blocks.num_blocks


def test_drain_rate_ignores_idle_time(monkeypatch):
    """Retry-After divides the queue by this rate: time with nothing to do must not dilute it."""
    import kvserve.scheduler.finish_rate as finish_rate_module

    now = [100.0]
    monkeypatch.setattr(finish_rate_module.time, "perf_counter", lambda: now[0])
    s = scheduler()
    for start in (0.0, 60.0):  # two bursts a minute apart, the server idle between them
        now[0] = 100.0 + start
        seqs = [add(s, make(int(start) * 10 + i, 4, 4)) for i in range(2)]
        for seq in seqs:
            now[0] += 0.5
            s.abort(seq.seq_id)
        assert not s.has_work
    assert s.finish_rate.rate() == 3 / 1.5  # 4 finishes, 0.5 s apart while busy; the idle minute does not count


def test_free_slots_counts_what_the_next_step_can_admit():
    s = scheduler(max_num_seqs=4)
    assert s.free_slots() == 4
    for i in range(6):
        add(s, make(i, 4, 4))
    s.schedule()
    assert len(s.running) == 4 and s.free_slots() == 0
    s.abort(0)
    assert s.free_slots() == 1
    static = scheduler(max_num_seqs=4, static=True)
    for i in range(2):
        add(static, make(i, 4, 4))
    static.schedule()
    assert len(static.running) == 2 and static.free_slots() == 0  # the next group waits for this one


# -- the service: every admitted sequence hears of a failure, wherever it happens ----------------------------
def _run_service(break_it, seqs_per_request=(1, 1, 1), execute=fake_execute, speculating=False):
    """Start a SchedulerService, break it with ``break_it(service)``, submit requests; returns each request's
    outputs (all of them, as the service delivered them) and whether the service is still healthy."""
    import asyncio

    from kvserve.scheduler.service import SchedulerService

    async def main():
        sched = scheduler()
        if speculating:  # a scheduler with a drafter hands ended sequences to the engine in plans that only free
            from kvserve.speculation.decoder import SpecDecoder
            from kvserve.speculation.policy import DraftPolicy

            sched = Scheduler(sched.config, sched.blocks, SpecDecoder(DraftPolicy(max_draft=1, adaptive=False)))
        service = SchedulerService(EngineCore(sched, execute), max_queue=16)
        break_it(service)
        service.start()
        streams, next_id = {}, 0
        for count in seqs_per_request:
            requests = [make(next_id + i, 6, 3) for i in range(count)]
            next_id += count
            stream = asyncio.Queue()
            service.submit([(request, stream) for request in requests])
            streams |= {request.request_id: stream for request in requests}
        outputs: dict[int, list] = {request_id: [] for request_id in streams}
        for request_id, stream in streams.items():  # each stream ends within one step: no wait beyond seconds
            while not any(out.finished for out in outputs[request_id]):
                output, _ = await asyncio.wait_for(stream.get(), timeout=5)
                outputs[output.request_id].append(output)
        await asyncio.sleep(0.05)  # let the loop finish dying, if it dies
        healthy = service.healthy
        await service.stop()
        return outputs, healthy

    return asyncio.run(main())


def test_a_loop_that_dies_on_admission_fails_the_sequences_still_in_its_inbox():
    def break_it(service):
        add = service.core.scheduler.add

        def failing_add(request):
            if request.request_id == 1:
                raise SystemError("scheduler bug on admission")
            add(request)
        service.core.scheduler.add = failing_add

    outputs, healthy = _run_service(break_it)
    assert not healthy
    for request_id in (1, 2):  # 1 failed in add; 2 was still in the inbox behind it
        assert [out.finish_reason for out in outputs[request_id]] == [FinishReason.ERROR], request_id
        assert "scheduler bug on admission" in outputs[request_id][-1].error
    assert outputs[0][-1].finish_reason is FinishReason.ERROR  # admitted before the failure, running: it hears too


def test_a_loop_that_dies_while_applying_results_fails_the_sequences_of_that_step():
    def break_it(service):
        update = service.core.scheduler.update

        def failing_update(plan, results):
            outputs = update(plan, results)
            if any(out.finished for out in outputs):
                raise SystemError("bug applying results")  # the finished ones left running, their outputs lost
            return outputs
        service.core.scheduler.update = failing_update

    outputs, healthy = _run_service(break_it, seqs_per_request=(2, 1))
    assert not healthy
    for outs in outputs.values():  # tokens, then the step that finished one of them failed: all hear of it
        assert [o.finish_reason for o in outs] == [None] * (len(outs) - 1) + [FinishReason.ERROR] and len(outs) >= 2
        assert "bug applying results" in outs[-1].error


def test_a_failed_free_only_step_does_not_kill_the_loop():
    calls = {"free_only": 0}

    def execute(plan):
        if not plan.work:
            calls["free_only"] += 1
            raise RuntimeError("drafter could not free")
        return fake_execute(plan)

    outputs, healthy = _run_service(lambda service: None, seqs_per_request=(1,), execute=execute, speculating=True)
    assert outputs[0][-1].finish_reason is FinishReason.LENGTH and sum(len(o.tokens) for o in outputs[0]) == 3
    assert calls["free_only"] >= 1 and healthy  # the failure was logged; the loop serves on


# -- speculation's one rule: drafts get only what is left over ----------------------------------------------
class _Greedy:
    """A stand-in for speculation that keeps drafts by id and grants every draft token on hand while the budget lasts
    (the contract), and records the budget it was offered."""

    def __init__(self) -> None:
        self.offered: list[int] = []
        self.drafts: dict[int, list[int]] = {}

    def propose(self, plan, running, budget, limits):
        self.offered.append(budget)
        granted = {}
        for w in plan.work:
            if w.is_decode and budget:
                granted[w.seq_id] = self.drafts.get(w.seq_id, [])[:budget]
                budget -= len(granted[w.seq_id])
        return granted

    def observe(self, plan, results, running, seconds=None):
        pass


def _decoding_and_newcomer(num_blocks: int):
    """A scheduler (8 tokens a step, blocks of 4) whose sequence 0 decodes with 6 draft tokens on hand while
    sequence 1 (a 5-token prompt) arrives; returns it, its stand-in speculation, sequence 0 and the next plan."""
    spec = _Greedy()
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=1024),
                  BlockManager(num_blocks, 4), spec)
    decoding = add(s, make(0, 3, 20))
    s.update(p := s.schedule(), fake_execute(p))
    spec.drafts[0] = [9] * 6                            # more drafts than the budget will leave
    add(s, make(1, 5, 5))
    return s, spec, decoding, s.schedule()


def test_drafts_get_only_the_budget_left_after_every_sequences_own_work():
    s, spec, decoding, plan = _decoding_and_newcomer(num_blocks=8)
    by_id = {w.seq_id: w for w in plan.work}
    assert spec.offered == [8 - 3, 8 - 1 - 5]          # the decode's token and the whole prompt come first
    assert len(by_id[1].token_ids) == 5 and by_id[0].num_draft == 2 and plan.num_tokens == 8
    assert by_id[0].token_ids == [7, 9, 9] and by_id[0].slot_mapping[-1] == by_id[0].block_table[1] * 4 + 1
    outputs = s.update(plan, [SeqResult(0, [TokenLogprob(9, 0.0), TokenLogprob(5, 0.0)]),
                              SeqResult(1, [TokenLogprob(7, 0.0)])])
    # one draft accepted: computed tokens are the known ones plus it (the rejected draft's slot is reused)
    assert decoding.output_ids == [7, 9, 5] and decoding.num_computed == 5
    assert (outputs[0].num_draft_tokens, outputs[0].num_accepted_tokens, outputs[0].num_computed_tokens) == (2, 1, 5)


def test_drafts_get_only_the_blocks_left_and_never_preempt():
    s, _, decoding, plan = _decoding_and_newcomer(num_blocks=3)  # the newcomer's prompt takes the last 2 blocks
    assert {w.seq_id: w.num_draft for w in plan.work} == {0: 0, 1: 0}
    assert [len(w.token_ids) for w in plan.work] == [1, 5] and s.num_preemptions == 0
    assert len(decoding.block_table) == 1
