"""Scheduling policy with a fake runner: budgets, chunked prefill, slot refill, preemption, static groups."""

from __future__ import annotations

from kvserve.engine.plan import SamplingParams, SeqResult, StepPlan, TokenLogprob
from kvserve.kvcache.block_manager import BlockManager
from kvserve.scheduler.offline import run_offline
from kvserve.scheduler.policies import Policy
from kvserve.scheduler.scheduler import Scheduler, SchedulerConfig
from kvserve.scheduler.sequence import FinishReason, SeqStatus, Sequence

GREEDY = SamplingParams(temperature=0.0)


def fake_execute(plan: StepPlan) -> list[SeqResult]:
    """Samples token 7 for every sequence that reached the end of its known tokens."""
    return [SeqResult(w.seq_id, [TokenLogprob(7, 0.0)] if w.sample else []) for w in plan.work]


def make(seq_id: int, prompt_len: int, max_tokens: int) -> Sequence:
    return Sequence(seq_id=seq_id, prompt_ids=list(range(1, prompt_len + 1)), params=GREEDY, max_tokens=max_tokens)


def scheduler(num_blocks=64, block_size=4, max_num_seqs=4, budget=16, static=False, caching=True) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=1024,
                                     policy=Policy.STATIC if static else Policy.CONTINUOUS),
                     BlockManager(num_blocks, block_size, caching))


def test_long_prompt_is_chunked_while_decodes_continue():
    s = scheduler(budget=8)
    short = make(0, 3, 20)
    s.add(short)
    s.update(p := s.schedule(), fake_execute(p))       # short prefilled, first token out
    long = make(1, 30, 5)
    s.add(long)
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
    a, b, c = make(0, 2, 1), make(1, 2, 5), make(2, 2, 5)
    for seq in (a, b, c):
        s.add(seq)
    plan = s.schedule()
    assert [w.seq_id for w in plan.work] == [0, 1]
    s.update(plan, fake_execute(plan))                    # a finishes (max_tokens 1)
    assert a.finish_reason is FinishReason.LENGTH
    plan = s.schedule()
    assert [w.seq_id for w in plan.work] == [1, 2]        # c takes a's slot at once


def test_static_group_waits_for_its_last_member():
    s = scheduler(max_num_seqs=2, static=True)
    seqs = [make(0, 2, 1), make(1, 2, 4), make(2, 2, 1)]
    for seq in seqs:
        s.add(seq)
    delivered: list[tuple[int, int]] = []                 # (step, seq_id) of final events
    for step in range(8):
        plan = s.schedule()
        if not plan.work:
            break
        assert 2 not in {w.seq_id for w in plan.work} or seqs[1].is_finished
        for seq, event in s.update(plan, fake_execute(plan)):
            if event.finish is not None:
                delivered.append((step, seq.seq_id))
    # seq 0 finished at step 0 but is released with seq 1 at step 3; seq 2 runs only afterwards
    assert delivered == [(3, 0), (3, 1), (4, 2)]


def test_pool_exhaustion_preempts_the_newest_and_recomputes_it():
    s = scheduler(num_blocks=4, block_size=4, max_num_seqs=2, budget=16, caching=False)
    a, b = make(0, 4, 6), make(1, 4, 6)                   # each needs 3 blocks in the end; the pool has 4
    recomputes = []
    run_offline(s, fake_execute, {0: [a, b]},
                on_step=lambda step, plan: recomputes.extend((w.seq_id, w.start_pos, len(w.token_ids))
                                                             for w in plan.work if w.seq_id == 1 and step > 0
                                                             and w.start_pos == 0))
    assert s.num_preemptions == 1 and b.num_preemptions == 1 and a.num_preemptions == 0
    assert recomputes == [(1, 0, 9)]                      # prompt + 5 generated tokens recomputed at once
    assert a.output_ids == b.output_ids == [7] * 6
    assert s.blocks.num_free_blocks == 4


def test_preempted_sequence_recomputes_from_its_cached_blocks():
    s = scheduler(num_blocks=4, block_size=4, max_num_seqs=2, budget=16, caching=True)
    a, b = make(0, 4, 6), make(1, 4, 6)
    plans = []
    run_offline(s, fake_execute, {0: [a, b]}, on_step=lambda step, plan: plans.append(plan))
    assert s.num_preemptions == 1
    assert [(w.seq_id, w.start_pos) for w in plans[5].work] == [(0, 8), (1, 8)]  # b's freed blocks were hits
    assert a.output_ids == b.output_ids == [7] * 6


def test_abort_running_and_waiting_frees_blocks():
    s = scheduler(num_blocks=8, max_num_seqs=1)
    a, b = make(0, 8, 50), make(1, 8, 50)
    s.add(a)
    s.add(b)
    plan = s.schedule()
    s.update(plan, fake_execute(plan))
    assert a.status is SeqStatus.RUNNING and s.blocks.num_free_blocks == 6
    assert s.abort(1) is b and b.finish_reason is FinishReason.ABORT and not s.waiting
    assert s.abort(0) is a and not s.running
    assert s.blocks.num_free_blocks == 8
    assert s.abort(0) is None


def test_prefix_hit_shrinks_prefill_and_is_counted():
    s = scheduler(num_blocks=32, block_size=4, budget=64)
    first = make(0, 10, 1)
    run_offline(s, fake_execute, {0: [first]})
    second = make(1, 10, 1)
    s.add(second)
    plan = s.schedule()
    assert plan.work[0].start_pos == 8 and len(plan.work[0].token_ids) == 2
    assert second.num_cached_tokens == 8
    assert (s.prefix_queries, s.prefix_hits) == (20, 8)


def test_stop_token_respects_min_tokens():
    s = scheduler()
    seq = Sequence(seq_id=0, prompt_ids=[1, 2], params=GREEDY, max_tokens=10, stop_token_ids=frozenset({7}),
                   min_tokens=3)
    run_offline(s, fake_execute, {0: [seq]})
    assert seq.output_ids == [7, 7, 7] and seq.finish_reason is FinishReason.STOP


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
    assert s.finish_rate.rate() is None
    run_offline(s, ticking, {0: [make(0, 4, 1)]})   # one step: a finish at busy time 0.5
    assert s.finish_rate.rate() is None                    # one finish is no rate
    clock[0] += 3600.0                               # an idle hour
    run_offline(s, ticking, {0: [make(1, 4, 1), make(2, 4, 1)]})
    assert s.finish_rate.rate() == 2.0                     # 3 finishes over 1.0 s of busy time


def test_choices_of_one_request_share_the_prompt_blocks():
    s = scheduler(num_blocks=32, block_size=4, budget=64)
    a, b = make(0, 10, 3), make(1, 10, 3)
    b.prefix_source = a
    s.add(a)
    s.add(b)
    plan = s.schedule()
    assert [w.seq_id for w in plan.work] == [0]           # b waits one step for a's prompt blocks
    s.update(plan, fake_execute(plan))
    plan = s.schedule()
    assert [(w.seq_id, w.start_pos) for w in plan.work] == [(0, 10), (1, 8)]
    assert b.block_table[:2] == a.block_table[:2]
    assert [s.blocks.blocks[i].ref_count for i in a.block_table[:2]] == [2, 2]


def test_a_sampling_error_ends_only_its_own_sequence():
    s = scheduler()
    good, bad = make(0, 3, 4), make(1, 3, 4)
    s.add(good)
    s.add(bad)

    def execute(plan: StepPlan) -> list[SeqResult]:
        return [SeqResult(w.seq_id, error="sampling failed: boom") if w.seq_id == 1
                else SeqResult(w.seq_id, [TokenLogprob(7, 0.0)]) for w in plan.work]

    plan = s.schedule()
    events = s.update(plan, execute(plan))
    assert [(seq.seq_id, e.finish, e.error) for seq, e in events] == [
        (0, None, None), (1, FinishReason.ERROR, "sampling failed: boom")]
    run_offline(s, execute, {})
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
        seqs = [make(int(start) * 10 + i, 4, 4) for i in range(2)]
        for seq in seqs:
            s.add(seq)
        for seq in seqs:
            now[0] += 0.5
            s.abort(seq.seq_id)
        assert not s.has_work
    assert s.finish_rate.rate() == 3 / 1.5  # 4 finishes, 0.5 s apart while busy; the idle minute does not count


def test_free_slots_counts_what_the_next_step_can_admit():
    s = scheduler(max_num_seqs=4)
    assert s.free_slots() == 4
    for i in range(6):
        s.add(make(i, 4, 4))
    s.schedule()
    assert len(s.running) == 4 and s.free_slots() == 0
    s.abort(0)
    assert s.free_slots() == 1
    static = scheduler(max_num_seqs=4, static=True)
    for i in range(2):
        static.add(make(i, 4, 4))
    static.schedule()
    assert len(static.running) == 2 and static.free_slots() == 0  # the next group waits for this one


# -- the service: every admitted sequence hears of a failure, wherever it happens ----------------------------
def _run_service(break_it, seqs_per_request=(1, 1, 1), execute=fake_execute, speculating=False):
    """Start a SchedulerService, break it with ``break_it(service)``, submit requests; returns each sequence's
    events (all of them, as the service delivered them) and the service."""
    import asyncio

    from kvserve.scheduler.service import SchedulerService

    async def main():
        sched = scheduler()
        if speculating:  # a scheduler with a drafter hands ended sequences to the engine in plans that only free
            from kvserve.speculation.decoder import SpecDecoder
            from kvserve.speculation.policy import DraftPolicy

            sched = Scheduler(sched.config, sched.blocks, SpecDecoder(DraftPolicy(max_draft=1, adaptive=False)))
        service = SchedulerService(sched, execute, max_queue=16)
        break_it(service)
        service.start()
        seqs, next_id = [], 0
        for count in seqs_per_request:
            request = [make(next_id + i, 6, 3) for i in range(count)]
            next_id += count
            service.submit(request)
            seqs += request
        events: dict[int, list] = {s.seq_id: [] for s in seqs}
        for seq in seqs:  # each stream ends within one step: no wait longer than a few seconds
            while not events[seq.seq_id] or events[seq.seq_id][-1].finish is None:
                events[seq.seq_id].append(await asyncio.wait_for(seq.events.get(), timeout=5))
        await asyncio.sleep(0.05)  # let the loop finish dying, if it dies
        healthy = service.healthy
        await service.stop()
        return events, healthy

    return asyncio.run(main())


def test_a_loop_that_dies_on_admission_fails_the_sequences_still_in_its_inbox():
    def break_it(service):
        add = service.scheduler.add

        def failing_add(seq):
            if seq.seq_id == 1:
                raise SystemError("scheduler bug on admission")
            add(seq)
        service.scheduler.add = failing_add

    events, healthy = _run_service(break_it)
    assert not healthy
    for seq_id in (1, 2):  # 1 failed in add; 2 was still in the inbox behind it
        assert [e.finish for e in events[seq_id]] == [FinishReason.ERROR], seq_id
        assert "scheduler bug on admission" in events[seq_id][-1].error
    assert events[0][-1].finish is FinishReason.ERROR  # admitted before the failure, running: it hears too


def test_a_loop_that_dies_while_applying_results_fails_the_sequences_of_that_step():
    def break_it(service):
        update = service.scheduler.update

        def failing_update(plan, results):
            events = update(plan, results)
            if any(event.finish is not None for _, event in events):
                raise SystemError("bug applying results")  # the finished ones left running, their events lost
            return events
        service.scheduler.update = failing_update

    events, healthy = _run_service(break_it, seqs_per_request=(2, 1))
    assert not healthy
    for evs in events.values():  # tokens, then the step that finished one of them failed: all hear of it
        assert [e.finish for e in evs] == [None] * (len(evs) - 1) + [FinishReason.ERROR] and len(evs) >= 2
        assert "bug applying results" in evs[-1].error


def test_a_failed_free_only_step_does_not_kill_the_loop():
    calls = {"free_only": 0}

    def execute(plan):
        if not plan.work:
            calls["free_only"] += 1
            raise RuntimeError("drafter could not free")
        return fake_execute(plan)

    events, healthy = _run_service(lambda service: None, seqs_per_request=(1,), execute=execute, speculating=True)
    assert [e.finish for e in events[0]][-1] is FinishReason.LENGTH and len(events[0]) == 3
    assert calls["free_only"] >= 1 and healthy  # the failure was logged; the loop serves on


# -- speculation's one rule: drafts get only what is left over ----------------------------------------------
class _Greedy:
    """A stand-in for speculation that grants every draft token on hand while the budget lasts (the contract) and
    records the budget it was offered."""

    def __init__(self) -> None:
        self.offered: list[int] = []

    def propose(self, plan, running, budget, limits):
        self.offered.append(budget)
        by_id, drafts = {seq.seq_id: seq for seq in running}, {}
        for w in plan.work:
            if w.is_decode and budget:
                drafts[w.seq_id] = min(len(by_id[w.seq_id].draft_ids), budget)
                budget -= drafts[w.seq_id]
        return drafts

    def observe(self, plan, results, running, seconds=None):
        pass


def _decoding_and_newcomer(num_blocks: int):
    """A scheduler (8 tokens a step, blocks of 4) whose sequence 0 decodes with 6 draft tokens on hand while
    sequence 1 (a 5-token prompt) arrives; returns it, its stand-in speculation, sequence 0 and the next plan."""
    spec = _Greedy()
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=1024),
                  BlockManager(num_blocks, 4), spec)
    decoding = make(0, 3, 20)
    s.add(decoding)
    s.update(p := s.schedule(), fake_execute(p))
    decoding.draft_ids = [9] * 6                        # more drafts than the budget will leave
    s.add(make(1, 5, 5))
    return s, spec, decoding, s.schedule()


def test_drafts_get_only_the_budget_left_after_every_sequences_own_work():
    s, spec, decoding, plan = _decoding_and_newcomer(num_blocks=8)
    by_id = {w.seq_id: w for w in plan.work}
    assert spec.offered == [8 - 3, 8 - 1 - 5]          # the decode's token and the whole prompt come first
    assert len(by_id[1].token_ids) == 5 and by_id[0].num_draft == 2 and plan.num_tokens == 8
    assert by_id[0].token_ids == [7, 9, 9] and by_id[0].slot_mapping[-1] == by_id[0].block_table[1] * 4 + 1
    s.update(plan, [SeqResult(0, [TokenLogprob(9, 0.0), TokenLogprob(5, 0.0)]), SeqResult(1, [TokenLogprob(7, 0.0)])])
    # one draft accepted: computed tokens are the known ones plus it (the rejected draft's slot is reused)
    assert decoding.output_ids == [7, 9, 5] and decoding.num_computed == 5
    assert decoding.num_draft_tokens == 2 and decoding.num_accepted_tokens == 1


def test_drafts_get_only_the_blocks_left_and_never_preempt():
    s, _, decoding, plan = _decoding_and_newcomer(num_blocks=3)  # the newcomer's prompt takes the last 2 blocks
    assert {w.seq_id: w.num_draft for w in plan.work} == {0: 0, 1: 0}
    assert [len(w.token_ids) for w in plan.work] == [1, 5] and s.num_preemptions == 0
    assert len(decoding.block_table) == 1
