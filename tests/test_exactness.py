"""The KV cache is exact: paged, batched, chunked and preempted greedy decoding equals transformers' generate."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from kvserve.engine.loader import wrap_model
from kvserve.quant.linear import QuantLinear
from kvserve.engine.runner import ModelRunner
from kvserve.kvcache.block_manager import BlockManager
from kvserve.kvcache.pool import KVPool
from kvserve.scheduler.contract import EngineRequest
from kvserve.scheduler.core import EngineCore
from kvserve.scheduler.offline import run_offline
from kvserve.scheduler.scheduler import Scheduler, SchedulerConfig
from tests.engineutil import (GREEDY, NEAR_TIE_LOGITS, REPEAT_PROMPT, SERVED, chat_ids, engine_greedy,
                              greedy_references, reference_greedy, reference_model, reference_shortfall)

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):",
    "List five prime numbers, separated by commas:",
    "Photosynthesis is the process by which",
    "Q: What is 12 times 12?\nA:",
    "The quick brown fox jumps over the lazy dog. The dog",
    "In 1969, Neil Armstrong became the first person to walk on the Moon. He said that the step was one small "
    "step for a man and one giant leap for mankind. Afterwards, the astronauts of the mission",
]

NEW_TOKENS = 32  # greedy tokens per prompt: long enough that a wrong cache entry shows, short enough for CI


@pytest.fixture(scope="module")
def prompt_ids(served):
    return [served.tokenizer(p)["input_ids"] for p in PROMPTS]


def quantized_activations(loaded) -> bool:
    return any(isinstance(m, QuantLinear) and m.act_block is not None for m in loaded.model.modules())


@pytest.fixture(scope="module")
def references(served, prompt_ids):
    """transformers' generate; for quantized activations, the engine's run of each prompt alone, which every
    batched, chunked, preempted or prefix-cached run must equal token for token (transformers' float path differs
    in last bits, which quantized activations can turn into another token at a near-tie)."""
    if quantized_activations(served):
        return [engine_greedy(served, [ids], NEW_TOKENS)[0][0] for ids in prompt_ids]
    return greedy_references(served, prompt_ids, NEW_TOKENS)


def test_each_prompt_alone_matches_generate(served, prompt_ids, references):
    if quantized_activations(served):  # the engine's runs alone against transformers', up to near-ties
        ref = reference_model(served.model)
        for ids, ours in zip(prompt_ids, references):
            assert reference_shortfall(ref, ids, ours) <= NEAR_TIE_LOGITS
        return
    for ids, ref in zip(prompt_ids, references):
        ours, _ = engine_greedy(served, [ids], NEW_TOKENS)
        assert ours[0] == ref


@pytest.mark.parametrize("attention_cost_context", [0, 16])
def test_batched_with_others_admitted_at_different_steps(served, prompt_ids, references, attention_cost_context):
    # 16: chunks sized by work, so they shrink with their position and depend on who shares the step
    tok = served.tokenizer
    others = [tok(f"Story number {i}: " + "the wind and the rain " * (i % 5 + 1))["input_ids"] for i in range(15)]
    batch = prompt_ids + others
    arrivals = [0, 3, 0, 7, 1, 12, 5, 2] + [i % 9 for i in range(15)]
    ours, _ = engine_greedy(served, batch, NEW_TOKENS, arrivals_at=arrivals, budget=64,
                            attention_cost_context=attention_cost_context)
    assert ours[:len(prompt_ids)] == references


def test_chunked_prefill_and_preemption_keep_tokens(served, prompt_ids, references):
    # 8 sequences of ~47 tokens (375 in all) in a 16-block pool of 16 tokens: preemption must happen; 16-token
    # chunks.
    ours, scheduler = engine_greedy(served, prompt_ids, NEW_TOKENS, num_blocks=16, budget=16, max_num_seqs=8)
    assert scheduler.num_preemptions > 0
    assert ours == references
    assert scheduler.blocks.num_free_blocks == 16


def step_logits(served, ids: list[int], budget: int, new_tokens: int = 4) -> list[torch.Tensor]:
    """The float32 logits of each sampled row of ``ids``' greedy run with a ``budget``-token step (prefill chunks
    of ``budget`` tokens)."""
    pool = KVPool(served.kv_shape(), 64, 16, served.dtype, served.device)
    runner = ModelRunner(served, pool)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=4096),
                          BlockManager(64, 16, True), None)
    request = EngineRequest(request_id=0, prompt_ids=ids, params=GREEDY, max_tokens=new_tokens, min_tokens=new_tokens)
    rows, logits = [], runner.logits

    def recording(plan):
        out = logits(plan)
        if out is not None:
            rows.append(out[-1].clone())
        return out

    runner.logits = recording
    run_offline(EngineCore(scheduler, runner.execute), {0: [request]})
    return rows


def test_a_rows_bits_do_not_depend_on_where_its_prompt_was_cut(served, prompt_ids):
    # chunks of 7 start inside blocks and give SDPA other query and key counts than one chunk does: every row
    # attends as a decode row does (engine/runner.py _rows_alone), so the logits are bitwise those of one chunk
    ids = prompt_ids[7]
    whole = step_logits(served, ids, 512)
    for budget in (7, 16, 33):
        assert all(torch.equal(a, b) for a, b in zip(whole, step_logits(served, ids, budget))), budget


def test_prefix_cache_hit_gives_same_tokens(served, prompt_ids, references):
    shared = prompt_ids[7]  # 47 tokens: two full blocks of 16 to share
    ours, scheduler = engine_greedy(served, [shared, shared], NEW_TOKENS, arrivals_at=[0, 70])
    assert scheduler.prefix_hits == 32
    assert ours == [references[7], references[7]]


TINY = {
    "llama": transformers.LlamaConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,  # q/k RMSNorm per head (the lean forward's one family-specific step)
    "mistral": transformers.MistralConfig,
    "gemma": transformers.GemmaConfig,
}


@pytest.mark.parametrize("arch", sorted(TINY))
def test_tiny_random_architectures_match_generate(arch):
    torch.manual_seed(0)
    config = TINY[arch](vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    loaded = wrap_model(copy.deepcopy(model), tokenizer=None, name=arch)
    prompts = [[5 + (7 * i + j) % 200 for j in range(n)] for i, n in enumerate((3, 17, 33))]
    ours, _ = engine_greedy(loaded, prompts, 24, block_size=4, num_blocks=64, budget=16, max_num_seqs=4)
    ref = reference_model(model)
    assert ours == [reference_greedy(ref, p, 24) for p in prompts]


# the configurations the tests above do not run (they run float32 and the GGUF default, on eight prompts)
OTHER_SERVED = [s for s in SERVED if s.name not in ("float32", "gguf")]


@pytest.mark.parametrize("served_model", OTHER_SERVED, ids=[s.name for s in OTHER_SERVED], indirect=True)
def test_every_served_configuration_is_exact_batched_preempted_and_on_a_prefix_hit(served_model):
    """In every dtype and weight format served, a sequence's greedy tokens alone equal its tokens batched with
    others admitted later (chunked prefill, preemption) and on a prefix-cache hit (a chat prompt of 35 tokens,
    its first 32 cached: the rest computed as a shorter prefill). EOS may end them after min_tokens."""
    tok = served_model.tokenizer
    chat, text = chat_ids(tok, "Repeat exactly: alpha beta"), tok(REPEAT_PROMPT)["input_ids"]
    alone = [engine_greedy(served_model, [p], 32, min_tokens=16)[0][0] for p in (chat, text)]
    hit, scheduler = engine_greedy(served_model, [chat, chat], 32, min_tokens=16, arrivals_at=[0, 60])
    assert scheduler.prefix_hits == 32 and hit == [alone[0], alone[0]]
    others = [tok(f"Story number {i}: " + "the wind and the rain " * (i % 4 + 1))["input_ids"] for i in range(6)]
    batched, scheduler = engine_greedy(served_model, [chat, text] + others, 32, min_tokens=16, num_blocks=14,
                                       budget=24, max_num_seqs=8, arrivals_at=[2, 0, 0, 1, 1, 3, 5, 8],
                                       prefix_caching=False)
    assert scheduler.num_preemptions > 0
    assert batched[:2] == alone
