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


# -- every sampling field at its extremes: a token, finite logprobs, and tiny values behave like their limit -----
_EXTREMES = {
    "temperature": [0.0, 5e-324, 1e-300, 1e-6, 2.0],
    "top_p": [5e-324, 1e-300, 1e-30, 0.5, 1.0],
    "top_k": [-1, 0, 1, 10**6],
    "min_p": [0.0, 5e-324, 1.0],
    "presence_penalty": [-2.0, 2.0],
    "frequency_penalty": [-2.0, 2.0],
    "repetition_penalty": [5e-324, 1e-39, 1e-6, 10.0],
    "logit_bias": [{5: 100.0}, {5: -100.0}, {i: -100.0 for i in range(50)}],
}


def _extreme_work(**params) -> SeqWork:
    from kvserve.engine.plan import SamplingParams

    return SeqWork(seq_id=0, token_ids=[1], start_pos=0, block_table=[0], slot_mapping=[0], sample=True,
                   params=SamplingParams(seed=3, logprobs=5, **params), prompt_ids=[1, 2, 3], output_ids=[2, 7])


@pytest.mark.parametrize("name,value", [(name, value) for name, values in _EXTREMES.items() for value in values])
@pytest.mark.parametrize("processed", [False, True])
def test_every_sampling_field_at_its_extremes_samples_with_finite_logprobs(name, value, processed):
    import math

    torch.manual_seed(0)
    logits = torch.randn(64) * 8
    logits[3] = 40.0  # a prompt token, and by far the most likely: repetition penalties act on it
    token = sample_token(logits.clone(), _extreme_work(**{name: value}, processed_logprobs=processed))
    assert 0 <= token.token_id < 64
    assert math.isfinite(token.logprob) and all(math.isfinite(v) for _, v in token.top)


@pytest.mark.parametrize("params", [{"top_p": 5e-324}, {"top_p": 1e-300}, {"temperature": 1e-300},
                                    {"min_p": 1.0}, {"top_k": 1}])
def test_tiny_values_behave_like_their_limit_greedy(params):
    torch.manual_seed(1)
    for _ in range(5):
        logits = torch.randn(64)
        token = sample_token(logits.clone(), _extreme_work(**({"temperature": 1.0} | params)))
        assert token.token_id == int(torch.argmax(logits)), params


def test_a_tiny_repetition_penalty_picks_the_best_seen_token():
    logits = torch.full((64,), -5.0)
    logits[[1, 2, 3, 7]] = torch.tensor([0.5, 2.0, 1.0, -1.0])  # seen: prompt 1, 2, 3 and output 2, 7
    logits[40] = 30.0  # unseen and far ahead without a penalty
    token = sample_token(logits.clone(), _extreme_work(repetition_penalty=1e-39, temperature=1.0))
    assert token.token_id in (1, 2, 3)  # positive seen logits overflow to the largest float: one of them


def test_more_alternatives_than_the_vocabulary_are_all_of_it():
    """top_logprobs (at most 20) past a tiny vocabulary: every token, not torch.topk's RuntimeError."""
    from kvserve.engine.sampling import token_logprob

    logprobs = torch.log_softmax(torch.tensor([0.5, 2.0, -1.0, 0.0, 1.0]), -1)
    picked = token_logprob(logprobs, 1, 20)
    assert [token for token, _ in picked.top] == [1, 4, 0, 3, 2]
