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
    sampled = SamplingParams(temperature=0.7, top_p=0.9, seed=3)
    plan = StepPlan([work(0), work(1, suppress=[2]), work(2, sampled), work(3, SamplingParams(temperature=0.0, logprobs=2)),
                     work(4, suppress=[10**6]), work(5), work(6, SamplingParams(temperature=1.3, top_k=5, seed=8),
                                                             suppress=[0, 1]),
                     work(7, SamplingParams(temperature=0.9, seed=5, logprobs=1))])
    results = runner.execute(plan)
    # top alternatives (greedy and sampled), and an out-of-range id that fails alone; the plain sampled rows (2, 6)
    # are drawn together (sampled_tokens)
    assert alone == [3, 4, 7]
    assert results[4].error is not None and results[4].token is None
    for i in (0, 1, 2, 5, 6):
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


# -- a sampled token: top-k, min-p and top-p without a sort, then the inverse CDF at u (sample_row.cpp) -----------
_FILTERS = [(0, 1.0, 0.0), (40, 1.0, 0.0), (0, 0.9, 0.0), (0, 1.0, 0.05), (50, 0.8, 0.01), (-1, 0.999, 0.0),
            (1, 1.0, 0.0), (0, 1e-30, 0.0)]


def sample_row_cases() -> list[tuple[torch.Tensor, float, int, float, float, float]]:
    """(logits [V], temperature, top_k, top_p, min_p, u) over vocabularies of 50 to Llama 3's 128,256, a tenth of
    each masked (-inf), temperatures 1, 0.7 and 1.3, every filter of ``_FILTERS`` and draws at the ends of [0, 1)
    and inside it."""
    g = torch.Generator().manual_seed(7)
    cases = []
    for vocab, spread in [(50, 1.0), (1000, 3.0), (49152, 2.0), (128256, 4.0)]:
        logits = torch.randn(vocab, generator=g) * spread
        logits[torch.randint(vocab, (vocab // 10,), generator=g)] = float("-inf")
        for i, (top_k, top_p, min_p) in enumerate(_FILTERS):
            for u in (0.0, 0.37, 0.999999):
                cases.append((logits, (1.0, 0.7, 1.3)[i % 3], top_k, top_p, min_p, u))
    return cases


def sample_row_results() -> list[tuple[int, torch.Tensor]]:
    """What the built ops' sample_row gives each of ``sample_row_cases`` (token, processed row)."""
    from kvserve import native

    ops = native.load_ops(build=False)
    return [ops.sample_row(*case, True) for case in sample_row_cases()]


def _native_ops():
    from kvserve import native

    ops = native.load_ops(build=False)
    if ops is None:
        pytest.skip("the native ops are not built here")
    return ops


@pytest.fixture(params=["kernel", "torch"])
def draw(request, monkeypatch):
    """engine.sampling.draw on the kernel's path (sample_row.cpp) and on torch's (no built ops, or a GPU)."""
    from kvserve.engine import sampling

    if request.param == "kernel":
        _native_ops()
    else:
        monkeypatch.setattr(sampling, "_ops", lambda logits: None)
    return sampling.draw


def _assert_token_at(processed: torch.Tensor, token: int, u: float) -> None:
    """``token`` is where ``u`` falls in softmax(processed)'s CDF in index order (float64; 1e-6 relative slack for
    the kernel's float32 weights)."""
    weights = (processed.double() - processed.max().double()).exp()
    cdf = weights.cumsum(-1)
    target = u * float(cdf[-1])
    assert weights[token] > 0
    assert float(cdf[token]) >= target * (1 - 1e-6)
    assert token == 0 or float(cdf[token - 1]) <= target * (1 + 1e-6) + 1e-12


def test_sample_row_keeps_what_the_torch_filter_keeps_and_picks_the_inverse_cdf_token():
    from kvserve.engine.sampling import filter_logits, finite_logits

    ops = _native_ops()
    for logits, temperature, top_k, top_p, min_p, u in sample_row_cases():
        token, processed = ops.sample_row(logits, temperature, top_k, top_p, min_p, u, True)
        scaled = finite_logits(logits / temperature)  # the kernel's division has torch's bits
        reference = filter_logits(scaled.double(), top_k, top_p, min_p)  # float64: the kernel's sums
        case = (logits.numel(), temperature, top_k, top_p, min_p, u)
        assert torch.equal(processed.isinf(), reference.isinf()), case
        assert torch.equal(processed[~processed.isinf()], scaled[~processed.isinf()]), case
        _assert_token_at(processed, token, u)


def test_the_torch_path_draws_what_the_kernel_draws(monkeypatch):
    """Without the built ops (or on a GPU) ``draw`` filters with torch and takes the same inverse CDF."""
    from kvserve.engine import sampling

    ops = _native_ops()
    cases = sample_row_cases()[::5]
    native = [ops.sample_row(*case, False)[0] for case in cases]
    monkeypatch.setattr(sampling, "_ops", lambda logits: None)
    assert [sampling.draw(*case)[0] for case in cases] == native


def test_draws_on_a_grid_of_u_land_in_proportion_to_the_kept_probabilities(draw):
    """u at (j + 1/2) / N for j < N lands on each token N p_i times, give or take one: the inverse CDF samples
    the filtered distribution (here top-k 5 of 10, renormalized), with no randomness to make the test flaky."""
    logits = torch.tensor([0.3, 2.0, -1.0, 1.5, 0.0, 2.5, -0.5, 1.0, 0.7, -2.0])
    n = 4000
    counts = torch.zeros(10)
    for j in range(n):
        counts[draw(logits, 1.0, 5, 1.0, 0.0, (j + 0.5) / n)[0]] += 1
    kept = torch.zeros(10, dtype=torch.bool)
    kept[logits.topk(5).indices] = True
    expected = torch.where(kept, logits, torch.tensor(float("-inf"))).double().softmax(-1) * n
    assert (counts - expected).abs().max() <= 1.0, (counts, expected)


def test_top_p_ties_keep_the_lowest_index_and_every_filter_keeps_the_most_likely_token(draw):
    logits = torch.tensor([1.0, 3.0, 0.5, 3.0, 3.0, -1.0])
    for u in (0.0, 0.5, 0.999):
        assert draw(logits, 1.0, 0, 1e-9, 0.0, u)[0] == 1  # the first of the tied maxima
        assert draw(logits, 1.0, 0, 1.0, 1.0, u)[0] in (1, 3, 4)  # min_p 1: the maxima alone
        assert draw(logits, 1.0, 2, 1.0, 0.0, u)[0] in (1, 3, 4)  # top-k 2 keeps all three tied at the threshold
    _, processed = draw(logits, 1.0, 0, 1.0, 1.0, 0.5, True)
    assert processed.isinf().tolist() == [True, False, True, False, False, True]


def test_a_row_with_every_token_masked_fails_alone(draw):
    with pytest.raises(RuntimeError, match="masked"):
        draw(torch.full((8,), float("-inf")), 1.0, 0, 1.0, 0.0, 0.5)
    masked = work(0, SamplingParams(temperature=1.0, seed=1), suppress=list(range(50)))
    with pytest.raises(RuntimeError, match="masked"):
        sample_token(torch.randn(50), masked)


def test_a_seeded_sample_is_reproducible_and_a_sampled_logprob_is_log_softmaxs():
    logits = torch.randn(1000) * 3
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=11)
    first = sample_token(logits, work(0, params))
    assert sample_token(logits, work(0, params)) == first
    assert first.logprob == float(torch.log_softmax(logits, -1)[first.token_id]) or \
        abs(first.logprob - float(torch.log_softmax(logits, -1)[first.token_id])) < 1e-5
    asked = sample_token(logits, work(0, SamplingParams(temperature=0.8, top_p=0.95, seed=11, logprobs=2)))
    assert (asked.token_id, asked.logprob) == (first.token_id, first.logprob)  # the same bits either way


def test_a_token_far_below_the_maximum_is_kept_but_never_drawn(draw):
    """More than 87.3 nats below the maximum a weight is 0 (exp(-87.3) ~ 1e-38 is where the kernel's exp stops): such a
    token stays in the processed row (no filter removed it) and is never the draw; a masked one (-inf) is gone."""
    logits = torch.tensor([0.0, -200.0, 5.0, float("-inf"), -90.0])
    for u in (0.0, 0.5, 0.9999999):
        token, processed = draw(logits, 1.0, 0, 1.0, 0.0, u, True)
        assert token in (0, 2)
        assert processed.isinf().tolist() == [False, False, False, True, False]


def test_sampled_tokens_equal_sample_token_row_by_row():
    """The batched draw (rows over the threads) gives each seeded row sample_token's token and logprob bits, at
    Llama 3's vocabulary, every filter, suppressed ids and temperatures whose float32 rounding differs from them."""
    from kvserve.engine.sampling import sampled_tokens

    _native_ops()
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 128256, generator=g) * 4
    settings = [dict(temperature=0.7), dict(temperature=1.0, top_p=0.9), dict(temperature=1.3, top_k=40),
                dict(temperature=0.31, min_p=0.05), dict(temperature=2.0, top_k=5, top_p=0.5, min_p=0.01),
                dict(temperature=1e-4), dict(temperature=0.7, top_p=0.999), dict(temperature=1.0, top_k=-1),
                dict(temperature=0.1 + 1e-9)]
    works = [SeqWork(row, [7], 3, [row], [3], True, SamplingParams(seed=row * 7 + 1, **params), [5, 6], [9] * row,
                     [row, 1000 + row] if row % 2 else []) for row, params in enumerate(settings)]
    batched = sampled_tokens(logits, works, [w.suppress_ids for w in works])
    assert batched == [sample_token(logits[row], w) for row, w in enumerate(works)]
    masked = logits[:2].clone()
    masked[1] = float("-inf")  # every token of a row masked: None, and sample_token fails that row alone
    assert sampled_tokens(masked, works[:2], [[], []]) is None


@pytest.mark.parametrize("top_k", [2**63, 10**30, 50, 64])
def test_a_top_k_past_the_vocabulary_keeps_every_token_alone_and_batched(top_k):
    """The API bounds top_k from below only: one of the vocabulary's size or more is off (filter_logits' reading),
    on the kernel's path too, where 2**63 does not fit an int64 (a crash there failed every request of the step)."""
    from kvserve.engine.sampling import sampled_tokens

    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(2))
    works = [SeqWork(row, [7], 3, [row], [3], True, SamplingParams(temperature=1.0, top_k=top_k, seed=row), [5],
                     [9], []) for row in range(2)]
    off = [SeqWork(row, [7], 3, [row], [3], True, SamplingParams(temperature=1.0, seed=row), [5], [9], [])
           for row in range(2)]
    alone = [sample_token(logits[row], works[row]) for row in range(2)]
    assert alone == [sample_token(logits[row], off[row]) for row in range(2)]
    if _native_ops() is not None:
        assert sampled_tokens(logits, works, [[], []]) == alone


def test_the_kernel_refuses_nan_filters_instead_of_drawing_a_masked_token():
    ops = _native_ops()
    row = torch.tensor([float("-inf"), 0.0, 1.0])
    for top_p, min_p in ((float("nan"), 0.0), (0.5, float("nan"))):
        with pytest.raises(RuntimeError, match="NaN"):
            ops.sample_row(row, 1.0, 0, top_p, min_p, 0.5, False)
