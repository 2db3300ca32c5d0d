"""Engine helpers shared by the test files: transformers' reference, our engine end to end, tiny random models."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import transformers

from kvserve.engine.options import DType
from kvserve.engine.plan import SamplingParams, SeqWork, StepPlan
from kvserve.engine.runner import ModelRunner
from kvserve.kvcache.block_manager import BlockManager
from kvserve.kvcache.pool import KVPool, storage_dtype
from kvserve.kvcache.sizing import KVCacheDType
from kvserve.quant.options import Scheme
from kvserve.scheduler.contract import EngineRequest
from kvserve.scheduler.core import EngineCore
from kvserve.scheduler.offline import run_offline
from kvserve.scheduler.scheduler import Scheduler, SchedulerConfig
from kvserve.speculation.decoder import SpecDecoder

GREEDY = SamplingParams(temperature=0.0)
BLOCK = 4  # block size of run_both's pool

EOS = 2  # SmolLM2's <|im_end|>, and the tiny configs' eos_token_id


@dataclass(frozen=True, slots=True)
class Served:
    """One configuration of ``kvserve serve``'s arithmetic (``--dtype``, ``--quantization``), as the exactness
    tests load SmolLM2 in it (conftest's ``served_model``; quantized ones rounded to nearest, as a draft is: the
    same kernels as the calibrated codes, without minutes of calibration)."""

    name: str
    dtype: DType
    quantization: Scheme = Scheme.NONE


# Every configuration `kvserve serve` accepts; the exactness tests run over all of them. A new weight format or
# dtype joins the exactness tests by being added here.
# "bf16-kernel" is `--quantization none` as `kvserve serve` runs it on a CPU with AVX512-BF16 (bfloat16 weights on
# that kernel, float32 activations); "bfloat16" is `--dtype bfloat16` (torch's bfloat16 ops).
SERVED = [Served("float32", DType.FLOAT32), Served("bfloat16", DType.BFLOAT16), Served("bf16-kernel", DType.AUTO),
          Served("int8", DType.FLOAT32, Scheme.INT8), Served("int4", DType.FLOAT32, Scheme.INT4),
          Served("nf4", DType.FLOAT32, Scheme.NF4), Served("gguf", DType.FLOAT32, Scheme.GGUF)]
SERVED_IDS = [s.name for s in SERVED]

REPEAT_PROMPT = "Repeat exactly: alpha beta gamma delta alpha beta gamma delta\n"  # prompt lookup finds drafts


def chat_ids(tokenizer, content: str) -> list[int]:
    """The ids of one user message through the chat template, with the assistant's turn opened."""
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]


def reference_model(model):
    """A copy of ``model`` on transformers' own SDPA attention and DynamicCache (a GGUF file's lean modules put into
    transformers' model of their family: ``engine.lean_model.transformers_model``)."""
    from kvserve.engine.lean_model import LeanCausalLM, transformers_model

    ref = copy.deepcopy(model)
    if isinstance(ref, LeanCausalLM):
        ref = transformers_model(ref)
    ref.set_attn_implementation("sdpa")
    return ref


def reference_greedy(ref, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """transformers' own generate, greedy, EOS suppressed until ``new_tokens`` (min_new_tokens)."""
    out = ref.generate(torch.tensor([prompt_ids], device=ref.device), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=EOS)
    return out[0, len(prompt_ids):].tolist()


# Where activations are quantized (the GGUF's own blocks: int8 per block of 32), a last-bit difference between two
# float paths (the C++ RMSNorm and attention against transformers' modules) can move one activation code and so
# flip a near-tie: there, "the same model" means every token the engine picks is one the reference scores within
# this many logits of its own best, given the same prefix.
NEAR_TIE_LOGITS = 0.5


@torch.inference_mode()
def reference_shortfall(ref, prompt_ids: list[int], tokens: list[int], suppressed: frozenset[int] = frozenset({EOS})
                        ) -> float:
    """The largest gap (logits) between the reference's best token and ``tokens``' own, teacher-forced on them
    (0 where every token is the reference's greedy choice). ``suppressed`` ids are out of the reference's choice,
    as they were out of the engine's: ``engine_greedy`` suppresses EOS until its last token (min_tokens), so a
    step where the reference's best is EOS compares the engine's pick with the best token it could pick."""
    ids = torch.tensor([prompt_ids + tokens[:-1]], device=ref.device)
    logits = ref(input_ids=ids).logits[0, len(prompt_ids) - 1:].float()  # [len(tokens), vocab]
    logits[:, list(suppressed)] = float("-inf")
    chosen = logits.gather(1, torch.tensor(tokens, device=ref.device)[:, None])[:, 0]
    return float((logits.amax(dim=-1) - chosen).max())


def greedy_references(loaded, prompt_ids: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (``reference_greedy`` on a copy of the model)."""
    ref = reference_model(loaded.model)
    return [reference_greedy(ref, ids, new_tokens) for ids in prompt_ids]


def engine_greedy(loaded, prompts: list[list[int]], new_tokens: int, num_blocks: int = 512, block_size: int = 16,
                  max_num_seqs: int = 32, budget: int = 512, arrivals_at: list[int] | None = None,
                  prefix_caching: bool = True, draft=None, drafter=None, params: SamplingParams = GREEDY,
                  min_tokens: int | None = None, kv_cache_dtype: str = "auto",
                  attention_cost_context: int = 0) -> tuple[list[list[int]], Scheduler]:
    """Our engine end to end (the engine core's step: scheduler + paged runner), greedy unless ``params`` say
    otherwise, EOS suppressed until ``min_tokens`` (default: all ``new_tokens``); with ``draft`` (a DraftPolicy) and
    ``drafter``, speculative decoding; ``kv_cache_dtype`` as ``--kv-cache-dtype``; ``attention_cost_context`` as
    ``--attention-cost-context`` (0: chunks sized by tokens)."""
    shape = loaded.kv_shape(KVCacheDType(kv_cache_dtype))
    pool = KVPool(shape, num_blocks, block_size, storage_dtype(shape, loaded.dtype), loaded.device)
    runner = ModelRunner(loaded, pool)
    spec = None if draft is None else SpecDecoder(draft, drafter, runner)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                          max_model_len=4096, attention_cost_context=attention_cost_context),
                          BlockManager(num_blocks, block_size, prefix_caching),
                          spec)
    requests = [EngineRequest(request_id=i, prompt_ids=p, params=params, max_tokens=new_tokens,
                              stop_token_ids=frozenset({EOS}), min_tokens=new_tokens if min_tokens is None else min_tokens)
                for i, p in enumerate(prompts)]
    arrivals: dict[int, list[EngineRequest]] = {}
    for request, step in zip(requests, arrivals_at or [0] * len(requests)):
        arrivals.setdefault(step, []).append(request)
    run = run_offline(EngineCore(scheduler, runner.execute if spec is None else spec.execute, timed=False), arrivals)
    return [run.tokens[r.request_id] for r in requests], scheduler


def tiny(arch: str, **overrides):
    """A 2-layer random model of ``arch`` (256-token vocabulary, seeded), float32."""
    torch.manual_seed(0)
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                    "qwen3": transformers.Qwen3Config, "mistral": transformers.MistralConfig,
                    "gemma": transformers.GemmaConfig}[arch]
    config = config_class(**{**dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0),
                             **overrides})
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def mixed_plan() -> list[SeqWork]:
    """Seq 0 prefills 9 tokens from 0; seq 1 decodes at position 6 (its 6-token prompt cached); seq 2 prefills
    a 5-token chunk at 4."""
    def work(seq, ids, start, context):
        table = list(range(seq * 8, seq * 8 + 8))
        slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + len(ids))]
        return SeqWork(seq, ids, start, table, slots, True, GREEDY, list(range(3, 3 + context)), [])
    return [work(0, list(range(10, 19)), 0, 9), work(1, [77], 6, 6), work(2, list(range(40, 45)), 4, 9)]


def run_both(loaded) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Logits of the plan's sampled rows and the written KV pool, with the fast path and without it."""
    results = []
    for fast in (True, False):
        pool = KVPool(loaded.kv_shape(), 32, BLOCK, loaded.dtype, loaded.device)
        runner = ModelRunner(loaded, pool)
        assert runner.fast is not None
        if not fast:
            runner.fast = None
        # prefill the cached part of seqs 1 and 2 first, then the mixed step
        warm = [SeqWork(1, list(range(3, 9)), 0, list(range(8, 16)), [32 + p for p in range(6)], False, GREEDY,
                        list(range(3, 10)), []),
                SeqWork(2, list(range(3, 7)), 0, list(range(16, 24)), [64 + p for p in range(4)], False, GREEDY,
                        list(range(3, 12)), [])]
        runner.execute(StepPlan(warm))
        results.append((runner.logits(StepPlan(mixed_plan())), pool.data.clone()))
    return results[0], results[1]
