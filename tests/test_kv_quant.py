"""A quantized KV cache (--kv-cache-dtype int8 / int4), and the bfloat16 one, keep the cache's exactness against
their own dtype.

Greedy output with an int8 or int4 cache differs from the float cache's (the keys and values are rounded), but the
engine must still be exact with respect to that cache: alone equals batched, chunked and preempted, a prefix hit
equals a miss, and speculation on equals off, because a token's codes depend on its own vector only and every
token (prefill, chunk, decode, verify) attends as one row through the C++ kernel that reads the codes (for
bfloat16: attend_bf16.h's kernel over the bfloat16 values). Each test
runs on the float32 weights and on the default ones (the GGUF's own blocks, whose int8 activations turn any
last-bit difference into a near-tie flip).
"""

from __future__ import annotations

import pytest
import torch

from kvserve.engine.drafters import NgramDrafter
from kvserve.speculation.policy import DraftPolicy
from kvserve.server.config import ServeConfig
from kvserve.server.state import ServerState
from kvserve.engine.plan import SeqWork, StepPlan
from kvserve.engine.runner import ModelRunner
from kvserve.kvcache.pool import KVPool, storage_dtype
from kvserve.kvcache.sizing import KVCacheDType
from tests.engineutil import GREEDY, engine_greedy

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "In 1969, Neil Armstrong became the first person to walk on the Moon. He said that the step was one small "
    "step for a man and one giant leap for mankind. Afterwards, the astronauts of the mission",
]
NEW = 20
CACHES = ["int8", "int4", "bfloat16"]


@pytest.fixture(scope="module")
def prompt_ids(served):
    return [served.tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def alone(served, prompt_ids):
    """Each prompt decoded on its own, per cache dtype: the reference of every test below."""
    return {cache: [engine_greedy(served, [ids], NEW, kv_cache_dtype=cache)[0][0] for ids in prompt_ids]
            for cache in CACHES}


def _last_logits(loaded, cache: str, ids: list[int], cuts: list[int]) -> torch.Tensor:
    """The logits after ``ids``, its prompt computed in steps ending at each of ``cuts`` (then the rest): one
    runner over a fresh ``cache`` pool."""
    shape = loaded.kv_shape(KVCacheDType(cache))
    pool = KVPool(shape, 8, 16, storage_dtype(shape, loaded.dtype), loaded.device)
    runner = ModelRunner(loaded, pool)
    table = list(range(8))
    start = 0
    for end in [*cuts, len(ids)]:
        work = SeqWork(0, ids[start:end], start, table, list(range(start, end)), end == len(ids), GREEDY,
                       ids, [])
        if end < len(ids):
            runner.execute(StepPlan([work]))
        start = end
    return runner.logits(StepPlan([work]))[0]


@pytest.mark.parametrize("cache", CACHES)
def test_every_token_attends_through_the_codes_kernel_so_chunking_changes_no_bit(served, prompt_ids, cache):
    ids = prompt_ids[2]  # 40-odd tokens
    shape = served.kv_shape(KVCacheDType(cache))
    assert ModelRunner(served, KVPool(shape, 1, 16, storage_dtype(shape, served.dtype))).rows_alone
    whole = _last_logits(served, cache, ids, [])
    for cuts in ([16], [5, 21, 33], [len(ids) - 1]):
        assert torch.equal(_last_logits(served, cache, ids, cuts), whole), cuts


@pytest.mark.parametrize("cache", CACHES)
def test_batched_chunked_and_preempted_equal_alone(served, prompt_ids, alone, cache):
    tok = served.tokenizer
    others = [tok(f"Story number {i}: " + "the wind and the rain " * (i % 4 + 1))["input_ids"] for i in range(6)]
    # a 12-block pool of 16 tokens for 9 sequences of up to ~67 tokens, 8 at once: preemption; 16-token chunks
    ours, scheduler = engine_greedy(served, prompt_ids + others, NEW, arrivals_at=[0, 2, 0, 1, 3, 0, 5, 2, 4],
                                    num_blocks=12, budget=16, max_num_seqs=8, kv_cache_dtype=cache)
    assert scheduler.num_preemptions > 0
    assert ours[:len(prompt_ids)] == alone[cache]
    assert scheduler.blocks.num_free_blocks == 12


@pytest.mark.parametrize("cache", CACHES)
def test_prefix_hit_equals_miss(served, prompt_ids, alone, cache):
    shared = prompt_ids[2]  # 47 tokens: two full blocks of 16 to share
    ours, scheduler = engine_greedy(served, [shared, shared], NEW, arrivals_at=[0, 40], kv_cache_dtype=cache)
    assert scheduler.prefix_hits == 32
    assert ours == [alone[cache][2]] * 2


@pytest.mark.parametrize("cache", CACHES)
def test_speculation_on_equals_off(served, prompt_ids, alone, cache):
    ours, scheduler = engine_greedy(served, prompt_ids, NEW, draft=DraftPolicy(max_draft=4, adaptive=False),
                                    drafter=NgramDrafter(), kv_cache_dtype=cache)
    assert scheduler.spec.policy.accepted > 0 and scheduler.spec.policy.drafted > scheduler.spec.policy.accepted
    assert ours == alone[cache]


def test_one_server_has_one_cache_dtype_so_its_prefix_cache_shares_only_like_blocks(smollm2, caplog):
    # the prefix cache lives in one server's BlockManager over one pool: every block it can share was written
    # in the pool's one dtype, which the start log and /metrics (cache_config_info) name with its bytes per token
    caplog.set_level("INFO", logger="kvserve.server")
    state = ServerState(smollm2, ServeConfig(kv_cache_dtype="int8", kv_cache_memory="64MiB"))
    assert state.pool.cache_dtype == "int8" and state.pool.quantized
    assert "KV cache (int8): 2 x 30 layers x 3 kv_heads x (64 head_dim x 1 B + 1 scale x 2 B) = 11,880" in caplog.text
    assert "= 11,880 bytes/token (equal)" in caplog.text
    (info,) = [m for m in state.metrics.registry.collect() if m.name.endswith("cache_config_info")]
    assert info.samples[0].labels["cache_dtype"] == "int8" and info.samples[0].labels["bytes_per_token"] == "11880"
    with pytest.raises(ValueError, match="'int2' is not a valid"):
        ServeConfig(kv_cache_dtype="int2")


def test_the_quant_reports_kv_caches_attend_to_what_each_cache_gives_back(smollm2):
    # kvserve quant report --kv-only: one transformers attention per cache dtype, SDPA over the round-tripped K/V
    from transformers import AttentionInterface

    from kvserve.quant.report import kv_table
    from kvserve.server.quant_report import register_kv_caches

    caches = register_kv_caches(smollm2.model.config)
    assert caches == {"int8": ("kvserve-kv-int8", 11_880), "int4": ("kvserve-kv-int4", 6_480)}
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 9, 5, 64), torch.randn(1, 3, 5, 64), torch.randn(1, 3, 5, 64)
    module = smollm2.model.model.layers[0].self_attn
    shape = smollm2.kv_shape(KVCacheDType.INT4)
    pool = KVPool(shape, 1, 1, storage_dtype(shape, torch.float32))
    ours, _ = AttentionInterface()["kvserve-kv-int4"](module, q, k, v, None, scaling=0.125, is_causal=True)
    expected = torch.nn.functional.scaled_dot_product_attention(q, pool.roundtrip(k), pool.roundtrip(v),
                                                                is_causal=True, scale=0.125, enable_gqa=True)
    torch.testing.assert_close(ours, expected.transpose(1, 2))
    row = {"weights": "float32", "kv_cache": "int4", "kv_bytes_per_token": 6480, "perplexity": 31.8, "facts_right": 7,
           "agreement": 0.794, "heldout_top1": 0.792, "heldout_kl": 0.1166}
    base = {"perplexity": 28.3, "facts_right": 9}
    assert "| float32 | int4 | 6,480 | 31.800 | +12.37% | 7 | 79.4% | 79.2% | 116.60 |" in kv_table(
        {"baseline": base, "kv_rows": [row]})
