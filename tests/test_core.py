"""The engine core's contract with a fake model: requests in as values, outputs back by id with a step record, and
a step that costs the same at 100 tokens of context as at 4,000."""

from __future__ import annotations

import pickle
import tracemalloc

from kvserve.engine.plan import SamplingParams, SeqResult, StepPlan, TokenLogprob
from kvserve.kvcache.block_manager import BlockManager
from kvserve.scheduler.contract import EngineRequest, FinishReason
from kvserve.scheduler.core import EngineCore
from kvserve.scheduler.scheduler import Scheduler, SchedulerConfig

GREEDY = SamplingParams(temperature=0.0)


def fake_execute(plan: StepPlan) -> list[SeqResult]:
    """Samples token 7 for every sequence that reached the end of its known tokens."""
    return [SeqResult(w.seq_id, [TokenLogprob(7, -0.25)] if w.sample else []) for w in plan.work]


def core(num_blocks: int = 64, block_size: int = 4, budget: int = 16, max_model_len: int = 1024) -> EngineCore:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=max_model_len)
    return EngineCore(Scheduler(config, BlockManager(num_blocks, block_size)), fake_execute)


def request(request_id: int, prompt_len: int, max_tokens: int, **fields) -> EngineRequest:
    return EngineRequest(request_id=request_id, prompt_ids=list(range(1, prompt_len + 1)), params=GREEDY,
                         max_tokens=max_tokens, **fields)


def test_outputs_come_back_by_request_id_with_what_the_step_changed():
    c = core(budget=8)
    c.add(request(10, 3, 2))
    c.add(request(11, 9, 1))
    first = c.step()  # 10's whole prompt (3) and a chunk of 11's (5): only 10 samples
    by_id = {out.request_id: out for out in first.outputs}
    assert [t.token_id for t in by_id[10].tokens] == [7] and by_id[11].tokens == []
    assert (by_id[10].num_computed_tokens, by_id[11].num_computed_tokens) == (3, 5)
    assert by_id[10].new_block_ids == [0] and by_id[11].new_block_ids == [1, 2]
    record = first.record
    assert (record.index, record.rows, record.prefills, record.prefill_tokens, record.prompt_tokens) == (1, 2, 2, 8, 8)
    assert (record.decode_tokens, record.generated_tokens, record.running, record.waiting) == (0, 1, 2, 0)
    assert (record.blocks_used, record.blocks_free, record.blocks_cached) == (3, 61, 0)
    second = c.step()  # 10 decodes its last token; 11 finishes its prompt and samples its only one
    by_id = {out.request_id: out for out in second.outputs}
    assert by_id[10].finish_reason is FinishReason.LENGTH and by_id[11].finish_reason is FinishReason.LENGTH
    assert by_id[10].new_block_ids == [] and by_id[11].new_block_ids == [3]  # its 9th token opens a block
    assert (second.record.decode_tokens, second.record.prefill_tokens, second.record.running) == (1, 4, 0)
    # the finished requests' full blocks stay in the prefix cache, free: 10's one full block ([1, 2, 3, 7]) and
    # 11's two (its 8 verified prompt tokens)
    assert (second.record.blocks_used, second.record.blocks_cached) == (0, 3)
    assert c.load.running == c.load.waiting == 0 and not c.has_work


def test_an_abort_is_an_output_and_a_request_id_is_live_once():
    c = core()
    c.add(request(1, 4, 10))
    c.step()
    try:
        c.add(request(1, 4, 10))
    except ValueError as exc:
        assert "already" in str(exc)
    else:
        raise AssertionError("a live id was accepted twice")
    out = c.abort(1)
    assert out.request_id == 1 and out.finish_reason is FinishReason.ABORT and out.tokens == []
    assert c.abort(1) is None and c.load.kv_usage == 0.0


def test_a_preempted_request_is_told_and_its_blocks_start_over():
    c = core(num_blocks=4, block_size=4)
    c.add(request(0, 4, 6))
    c.add(request(1, 4, 6))  # each needs 3 blocks in the end; the pool has 4
    preempted = []
    while c.has_work:
        step = c.step()
        preempted += [out for out in step.outputs if out.preempted]
        assert step.record is None or step.record.preemptions == len([o for o in step.outputs if o.preempted])
    assert [(out.request_id, out.num_computed_tokens, out.new_block_ids) for out in preempted] == [(1, 0, [])]


def _decode_step_cost(context: int) -> tuple[int, int]:
    """Bytes allocated at the peak of one decode step of one request with ``context`` tokens in the cache, and the
    pickled size of what the step returned."""
    c = core(num_blocks=512, block_size=16, budget=512, max_model_len=8192)
    c.add(request(0, context, 100))
    while c.scheduler.running == [] or c.scheduler.running[0].num_uncomputed > 1:
        c.step()  # the prompt, in chunks of the budget
    for _ in range(3):
        c.step()  # decoding (the third leaves the block half full: the measured step neither fills nor opens one)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        step = c.step()
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    step.record = None  # its floats (times) differ run to run; the outputs are what must not grow
    return peak, len(pickle.dumps(step))


def test_a_decode_step_costs_the_same_at_100_and_4000_tokens_of_context():
    """Nothing in a step copies the context: not the plan (it refers to the sequence's own lists), not the prefix
    cache's hashing (it reads the new full blocks' tokens only), not the outputs (new tokens and blocks only). A
    copy of 4,000 token ids would be 32 KB."""
    short_peak, short_bytes = _decode_step_cost(100)
    long_peak, long_bytes = _decode_step_cost(4000)
    assert abs(long_bytes - short_bytes) <= 4  # the counts' own width (103 vs 4,003) and nothing else
    assert abs(long_peak - short_peak) < 2048, (short_peak, long_peak)
