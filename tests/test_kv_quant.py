"""A quantized KV cache (--kv-cache-dtype int8 / int4) keeps the cache's exactness against its own dtype.

Greedy output with an int8 or int4 cache differs from the float cache's (the keys and values are rounded), but the
engine must still be exact with respect to that cache: alone equals batched, chunked and preempted, a prefix hit
equals a miss, and speculation on equals off, because a token's codes depend on its own vector only and every
attention (prefill, chunk, decode, verify) reads the keys and values as the cache gives them back.
"""

from __future__ import annotations

import pytest

from kvserve.engine.drafters import NgramDrafter
from kvserve.scheduler.speculation import DraftPolicy
from kvserve.server.config import ServeConfig
from kvserve.server.state import ServerState
from tests.engineutil import engine_greedy

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "In 1969, Neil Armstrong became the first person to walk on the Moon. He said that the step was one small "
    "step for a man and one giant leap for mankind. Afterwards, the astronauts of the mission",
]
NEW = 20
CACHES = ["int8", "int4"]


@pytest.fixture(scope="module")
def prompt_ids(smollm2):
    return [smollm2.tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def alone(smollm2, prompt_ids):
    """Each prompt decoded on its own, per cache dtype: the reference of every test below."""
    return {cache: [engine_greedy(smollm2, [ids], NEW, kv_cache_dtype=cache)[0][0] for ids in prompt_ids]
            for cache in CACHES}


@pytest.mark.parametrize("cache", CACHES)
def test_batched_chunked_and_preempted_equal_alone(smollm2, prompt_ids, alone, cache):
    tok = smollm2.tokenizer
    others = [tok(f"Story number {i}: " + "the wind and the rain " * (i % 4 + 1))["input_ids"] for i in range(6)]
    # a 12-block pool of 16 tokens for 9 sequences of up to ~67 tokens, 8 at once: preemption; 16-token chunks
    ours, scheduler = engine_greedy(smollm2, prompt_ids + others, NEW, arrivals_at=[0, 2, 0, 1, 3, 0, 5, 2, 4],
                                    num_blocks=12, budget=16, max_num_seqs=8, kv_cache_dtype=cache)
    assert scheduler.num_preemptions > 0
    assert ours[:len(prompt_ids)] == alone[cache]
    assert scheduler.blocks.num_free_blocks == 12


@pytest.mark.parametrize("cache", CACHES)
def test_prefix_hit_equals_miss(smollm2, prompt_ids, alone, cache):
    shared = prompt_ids[2]  # 47 tokens: two full blocks of 16 to share
    ours, scheduler = engine_greedy(smollm2, [shared, shared], NEW, arrivals_at=[0, 40], kv_cache_dtype=cache)
    assert scheduler.prefix_hits == 32
    assert ours == [alone[cache][2]] * 2


@pytest.mark.parametrize("cache", CACHES)
def test_speculation_on_equals_off(smollm2, prompt_ids, alone, cache):
    ours, scheduler = engine_greedy(smollm2, prompt_ids, NEW, draft=DraftPolicy(max_draft=4, adaptive=False),
                                    drafter=NgramDrafter(), kv_cache_dtype=cache)
    assert scheduler.draft.accepted > 0 and scheduler.draft.drafted > scheduler.draft.accepted
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
