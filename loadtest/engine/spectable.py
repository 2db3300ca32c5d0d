"""The chapter's speculative-decoding table on our engine: each quantized copy of the model as the draft of the
full-precision target (and of the int8 target).

For every (target, draft) pair, single stream, greedy, on the quality report's greedy-agreement prompts
(``quant.quality.AGREEMENT_PROMPTS``, ``AGREEMENT_TOKENS`` tokens each, EOS held back so every run computes the
same positions):

- α: the measured acceptance, accepted / drafted tokens in the γ = 1 runs (each draft is the draft model's
  argmax after the target's own prefix: the greedy agreement of the quality report, measured by verifying);
- c: the measured cost ratio, a draft decode step over a target decode step (one row, 256-token context);
- for γ = 1, 2, 4, 8: E(γ) = (1 - α^(γ+1)) / (1 - α) tokens per verify pass; the chapter's predicted speed-up
  E / (γc + 1), which takes a verify pass of γ + 1 tokens to cost one step; ours, E / (t(1+γ)/t(1) + γc), with
  the verify pass's measured cost; and the measured speed-up: tokens/s with that fixed γ over tokens/s with
  speculation off, in the same process, one after the other.

The runs go through the scheduler and the runner exactly as served steps do (``scheduler.offline``), without
HTTP; ``loadtest.served.speculative`` serves the default draft side by side with prompt lookup. Codes are rounded to
nearest (as ``--draft-quantization`` does; the int8 target too: GPTQ changes code values, not step cost).
"""

from __future__ import annotations

import copy
import dataclasses
import time

from kvserve.engine.draft_model import ModelDrafter
from kvserve.engine.loader import LoadedModel, load_model
from kvserve.engine.options import Device, DType
from kvserve.engine.plan import SamplingParams
from kvserve.engine.runner import ModelRunner
from kvserve.kvcache.block_manager import BlockManager
from kvserve.kvcache.pool import KVPool
from kvserve.quant.model import quantize_for_serving
from kvserve.quant.options import Scheme
from kvserve.quant.quality import AGREEMENT_PROMPTS, AGREEMENT_TOKENS, chat_ids
from kvserve.scheduler.contract import EngineRequest
from kvserve.scheduler.core import EngineCore
from kvserve.scheduler.offline import run_offline
from kvserve.scheduler.scheduler import Scheduler, SchedulerConfig
from kvserve.speculation.decoder import SpecDecoder
from kvserve.speculation.policy import DraftPolicy, expected_tokens

GAMMAS = (1, 2, 4, 8)
PAIRS = ((Scheme.NONE, Scheme.INT8), (Scheme.NONE, Scheme.INT4), (Scheme.NONE, Scheme.NF4),
         (Scheme.INT8, Scheme.INT4), (Scheme.INT8, Scheme.NF4))
_BLOCKS, _BLOCK_SIZE = 64, 16  # 1024 tokens per pool: one sequence at a time
_GREEDY = SamplingParams(temperature=0.0)


def _copy(served: LoadedModel, scheme: Scheme) -> LoadedModel:
    """``served``'s weights again, quantized as ``scheme`` (rounded to nearest)."""
    model = copy.deepcopy(served.model)
    if scheme is not Scheme.NONE:
        quantize_for_serving(model, scheme)
    return dataclasses.replace(served, model=model)


def _runner(loaded: LoadedModel) -> ModelRunner:
    return ModelRunner(loaded, KVPool(loaded.kv_shape(), _BLOCKS, _BLOCK_SIZE, loaded.dtype, loaded.device))


def _generate(target: LoadedModel, prompts: list[list[int]], draft: LoadedModel | None,
              gamma: int) -> tuple[float, int, int, int]:
    """Seconds to generate ``AGREEMENT_TOKENS`` per prompt, one prompt at a time, and the drafted and accepted
    tokens and the verify passes; ``draft`` None: speculation off."""
    runner = _runner(target)
    policy = None if draft is None else DraftPolicy(max_draft=gamma, adaptive=False)
    spec = None if draft is None else SpecDecoder(policy, ModelDrafter(_runner(draft), 4096), runner)
    seconds = 0.0
    for seq_id, prompt in enumerate(prompts):
        scheduler = Scheduler(SchedulerConfig(max_num_seqs=1, max_model_len=4096),
                              BlockManager(_BLOCKS, _BLOCK_SIZE, enable_prefix_caching=False), spec)
        request = EngineRequest(request_id=seq_id, prompt_ids=prompt, params=_GREEDY, max_tokens=AGREEMENT_TOKENS,
                                min_tokens=AGREEMENT_TOKENS)
        started = time.perf_counter()
        run_offline(EngineCore(scheduler, runner.execute if spec is None else spec.execute, timed=False), {0: [request]})
        seconds += time.perf_counter() - started
    if policy is None:
        return seconds, 0, 0, 0
    return seconds, policy.drafted, policy.accepted, policy.num_drafts


def _step_ms(loaded: LoadedModel, sizes: list[int]) -> dict[int, float]:
    runner = _runner(loaded)
    return {n: s * 1000 for n, s in runner.time_decode_steps(sizes, list(range(16)), repeats=5).items()}


def table() -> str:
    """Run every pair and return the Markdown table (rows below 1x measured in bold)."""
    full = load_model(None, DType.FLOAT32, Device.CPU)
    prompts = [chat_ids(full.tokenizer, p) for p in AGREEMENT_PROMPTS]
    models = {Scheme.NONE: full}
    for scheme in {s for pair in PAIRS for s in pair} - {Scheme.NONE}:
        models[scheme] = _copy(full, scheme)
    # warm-up: the first run of each model pays one-time costs
    for scheme in models:
        _step_ms(models[scheme], [1])
    lines = ["| target | draft | α (drafts) | c | γ | E(γ) | tokens per verify, measured | chapter's E/(γc+1) | "
             "ours, with the verify cost | measured | measured vs ours |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for target_scheme, draft_scheme in PAIRS:
        target, draft = models[target_scheme], models[draft_scheme]
        target_ms = _step_ms(target, [1 + g for g in (0, *GAMMAS)])
        c = _step_ms(draft, [1])[1] / target_ms[1]
        off_s, _, _, _ = _generate(target, prompts, None, 0)
        rows = []
        alpha = None
        for gamma in GAMMAS:
            seconds, drafted, accepted, verifies = _generate(target, prompts, draft, gamma)
            if gamma == 1:
                alpha, alpha_drafts = accepted / drafted, drafted
            e = expected_tokens(alpha, gamma)
            chapter = e / (gamma * c + 1)
            ours = e / (target_ms[1 + gamma] / target_ms[1] + gamma * c)
            measured = off_s / seconds
            shown = f"**{measured:.2f}x**" if measured < 1 else f"{measured:.2f}x"
            per_verify = (accepted + verifies) / verifies
            rows.append(f"| {gamma} | {e:.2f} | {per_verify:.2f} | {chapter:.2f}x | {ours:.2f}x | {shown} | "
                        f"{measured / ours:.2f} |")
            print(f"{target_scheme.value} <- {draft_scheme.value}, γ={gamma}: α {alpha:.2f}, c {c:.2f}, "
                  f"measured {measured:.2f}x, ours {ours:.2f}x", flush=True)
        name = "float32" if target_scheme is Scheme.NONE else target_scheme.value
        for i, row in enumerate(rows):
            lead = (f"| {name} | {draft_scheme.value} | {alpha:.0%} ({alpha_drafts}) | {c:.2f} " if i == 0
                    else "| | | | ")
            lines.append(lead + row)
    positions = len(prompts) * AGREEMENT_TOKENS
    return ("\n".join(lines) + f"\n\nSingle stream, greedy, {len(prompts)} prompts x {AGREEMENT_TOKENS} tokens "
            f"({positions} generated positions per run), through the scheduler and the runner in one process (no "
            "HTTP). α: accepted / drafted in the γ = 1 runs (drafts in brackets). c: draft decode step / target "
            "decode step, one row. E(γ) assumes each draft is accepted independently with α; tokens per verify "
            "measured: (accepted + verify passes) / verify passes in that run (below E where a draft's mistakes "
            "come in runs). Measured: tokens/s with fixed γ over tokens/s with speculation off, run just "
            "before. Measured below 1x in bold.\n")
