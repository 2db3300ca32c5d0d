"""Batched greedy picks (one device sync a step) give what per-row ``sample_token`` gives."""

from __future__ import annotations

import pytest
import torch

from kvserve.engine import runner as runner_module
from kvserve.engine.plan import SamplingParams, SeqWork, StepPlan
from kvserve.engine.sampling import greedy_tokens, sample_token
from tests.engineutil import tiny

GREEDY = SamplingParams(temperature=0.0)


def work(seq_id: int, params: SamplingParams = GREEDY, suppress: list[int] | None = None) -> SeqWork:
    return SeqWork(seq_id, [7], 3, [seq_id], [4 * seq_id + 3], True, params, [5, 6, 7], [9], suppress or [])


def test_greedy_tokens_equal_sample_token_row_by_row():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    logits[1, [4, 9]] = 10.0  # a tie: the first index wins in both
    logits[2, 3] = 20.0  # the maximum is suppressed: the runner-up is picked
    logits[3] = float("-inf")
    logits[3, 17] = 0.0  # a single finite logit: logprob 0
    suppress = [[], [], [3], [], [0, 1, 2], []]
    batched = greedy_tokens(logits, suppress)
    for row, ids in enumerate(suppress):
        alone = sample_token(logits[row], work(row, suppress=ids))
        # the same bits: both take their logprob from one normalizer (greedy_pick / log_softmax on a CPU)
        assert (batched[row].token_id, batched[row].logprob) == (alone.token_id, alone.logprob)
    assert batched[1].token_id == 4 and batched[2].token_id != 3 and batched[3].token_id == 17
    assert batched[3].logprob == 0.0


def test_a_step_batches_plain_greedy_rows_and_samples_the_rest_alone(monkeypatch):
    from kvserve.engine.loader import wrap_model
    from kvserve.engine.runner import ModelRunner
    from kvserve.kvcache.pool import KVPool

    loaded = wrap_model(tiny("llama"), tokenizer=None, name="llama")
    runner = ModelRunner(loaded, KVPool(loaded.kv_shape(), 16, 4, loaded.dtype))
    captured = {}
    logits_of = runner.logits

    def capture(plan):
        captured["logits"] = logits_of(plan)
        return captured["logits"]

    runner.logits = capture
    alone: list[int] = []
    real = runner_module.sample_token

    def counting(logits, w):
        alone.append(w.seq_id)
        return real(logits, w)

    monkeypatch.setattr(runner_module, "sample_token", counting)
    plan = StepPlan([work(0), work(1, suppress=[2]), work(2, SamplingParams(temperature=0.7, seed=3)),
                     work(3, SamplingParams(temperature=0.0, logprobs=2)), work(4, suppress=[10**6]), work(5)])
    results = runner.execute(plan)
    assert alone == [2, 3, 4]  # seeded, top alternatives, and an out-of-range id that fails alone
    assert results[4].error is not None and results[4].token is None
    for i in (0, 1, 5):
        expected = real(captured["logits"][i], plan.work[i])
        assert results[i].token.token_id == expected.token_id
        assert results[i].token.logprob == expected.logprob
    # a greedy row that asks for top alternatives reports its token's logprob with the same bits as a plain one
    asked = real(captured["logits"][0], work(0, SamplingParams(temperature=0.0, logprobs=3)))
    assert (asked.token_id, asked.logprob) == (results[0].token.token_id, results[0].token.logprob)
    assert asked.top[0] == (asked.token_id, asked.logprob)


@pytest.mark.parametrize("temperature", [1e-45, 1e-300, 9e-6])
def test_a_temperature_near_zero_is_greedy(temperature):
    # logits / 1e-45 overflow float32 to inf and softmax turns inf - inf into NaN: such a request got a 500
    torch.manual_seed(1)
    logits = torch.randn(50) * 30
    picked = sample_token(logits, work(0, SamplingParams(temperature=temperature, seed=4)))
    assert SamplingParams(temperature=temperature).greedy
    assert picked.token_id == int(torch.argmax(logits))


def test_a_small_temperature_above_the_cutoff_still_samples():
    params = SamplingParams(temperature=1e-4)
    assert not params.greedy
    logits = torch.zeros(50)
    logits[7] = 30.0
    assert sample_token(logits, work(0, params)).token_id == 7  # finite: logits / 1e-4 stay below float32's max
