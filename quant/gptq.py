"""GPTQ rounding for the integer schemes, calibrated on text the model writes itself.

Round-to-nearest (``quant.schemes.quantize_int``) rounds every weight on its own. GPTQ (Frantar et al. 2022,
"GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers", arXiv:2210.17323) rounds
the columns of ``W [out, in]`` one at a time and moves each column's rounding error onto the columns not yet
rounded, weighted by the inverse of the layer's input Hessian ``H = X^T X / n`` (``X [n, in]``: the inputs the
layer sees), so that the layer's output ``W_hat X`` stays close to ``W X`` rather than each weight close to
itself. The grid is untouched: the scales are still absmax per row (or per group), fixed before any rounding,
and the codes stay in ``[-qmax, qmax]``; only which neighbouring level a weight goes to changes.

The inputs ``X`` come from the model's own replies to ``CALIBRATION_PROMPTS`` (sampled, fixed seed): a
data-free calibration set, as LLM-QAT builds its training data from the model's own generations (Liu et al.
2023, arXiv:2305.17888). These prompts share nothing with the quality report's held-out text, its agreement
prompts or its questions (``quant.quality``), which are never used to calibrate.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

log = logging.getLogger("kvserve.quant")

# Chat requests of the kind the server answers; chosen once, disjoint from quant.quality's prompts and questions.
CALIBRATION_PROMPTS = (
    "Give me three tips for keeping houseplants alive.", "What is the difference between weather and climate?",
    "Write a haiku about autumn leaves.", "How do I make a simple tomato soup?", "Summarize the plot of Cinderella.",
    "Why is the sky blue?", "Explain what a prime number is to a ten-year-old.",
    "Write an email asking my manager for a day off.", "What are the benefits of regular exercise?",
    "Describe a busy market in a small town.", "How does a bicycle stay upright?",
    "List five animals that live in the desert.", "What should I pack for a weekend camping trip?",
    "Tell me a joke about computers.", "How do bees make honey?", "Write a short poem about the sea.",
    "What causes earthquakes?", "How can I improve my sleep?", "Explain the rules of chess briefly.",
    "What is photosynthesis?", "Write a story opening about a dragon who is afraid of fire.",
    "How do I start learning to play the guitar?", "What is the water cycle?",
    "Give advice to someone starting their first job.", "Describe how a rainbow forms.", "What is a healthy breakfast?",
    "Explain what money is and why people use it.", "Write a thank-you note to a teacher.", "How do airplanes fly?",
    "What are some good habits for studying?", "Tell me about the moon.", "Write a dialogue between a cat and a dog.",
)
CALIBRATION_NEW_TOKENS = 128  # per prompt: 32 x 128 generated tokens plus the prompts, ~5,000 tokens in all
CALIBRATION_SEED = 1234
CALIBRATION_TOP_P = 0.95  # sampled at temperature 1: the model's own distribution, minus its far tail
DAMPING = 0.01  # added to H's diagonal, times its mean (the paper's percdamp)
BLOCK = 128  # columns rounded per lazy batch update (the paper's B)


@torch.no_grad()
def calibration_batch(model: nn.Module, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own replies to ``CALIBRATION_PROMPTS``, left-padded into one batch.

    Args:
        model: a transformers causal LM in full precision (plain attention, CPU or any device).
        tokenizer: its tokenizer, with a chat template.

    Returns:
        ``(ids, mask)``: int64 ``[prompts, width + new]`` and its attention mask (0 on padding); ``new`` is
        ``CALIBRATION_NEW_TOKENS``, or fewer where the model's context (``max_position_embeddings``) ends first.
    """
    if tokenizer.chat_template is None:  # a base model: the bare requests
        prompts = [list(tokenizer(p)["input_ids"]) for p in CALIBRATION_PROMPTS]
    else:
        prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                      tokenize=True, return_dict=True)["input_ids"])
                   for p in CALIBRATION_PROMPTS]
    # a short context (a model with learned positions has no row past it): prompts cut to their last half
    # of it (the end holds the assistant's turn), replies to what is left, at least one token
    context = getattr(model.config, "max_position_embeddings", None)
    if context is not None:
        prompts = [p[-max(1, context // 2):] for p in prompts]
    width = max(len(p) for p in prompts)
    new_tokens = max(1, min(CALIBRATION_NEW_TOKENS, (context or width + CALIBRATION_NEW_TOKENS) - width))
    pad = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)  # masked anyway
    device = next(model.parameters()).device
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)  # [prompts, width]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if device.type == "cuda" else []):
        torch.manual_seed(CALIBRATION_SEED)
        # no eos: every reply runs its full length, so no row needs a second kind of padding
        out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=CALIBRATION_TOP_P,
                             top_k=None, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             eos_token_id=None, pad_token_id=pad)
    full_mask = torch.cat([mask, torch.ones_like(out[:, width:])], dim=1)  # [prompts, width + new]
    return out, full_mask


@torch.no_grad()  # not inference_mode: layers built in the pass keep ordinary tensors
def stream_hessians(model: nn.Module, names: Iterable[str], ids: torch.Tensor, mask: torch.Tensor,
                    consume: Callable[[str, torch.Tensor], None]) -> None:
    """Hand each named linear layer's input Hessian ``H = X^T X / n`` to ``consume`` during one forward pass.

    ``consume(name, H)`` runs as soon as the pass reaches the layer, with H over the unpadded tokens. Layers
    that read the same tensor (q/k/v, gate/up) get the same H, computed once; only one H is alive at a time,
    so memory does not grow with the model's depth (all of them at once, 8 bytes a value, would be ~20 GB for
    28 layers of hidden size 1,536 and MLP size 8,960).
    The pass runs on the model's current weights: ``consume`` may build quantized copies of a layer, but must
    not replace it before the pass ends.

    Args:
        model: the full-precision causal LM (every H comes from its own activations), plain attention.
        names: qualified names of ``nn.Linear`` modules.
        ids, mask: ``[batch, T]`` token ids and attention mask (``calibration_batch``).
        consume: takes the name and float64 ``[in, in]`` H (on the model's device).
    """
    keep = mask.reshape(-1).bool()  # [batch * T]
    count = int(keep.sum())
    last: list = [None, None]  # the input tensor seen last and its H (q, k, v read one tensor in turn)

    def hook(name: str, args: tuple) -> None:
        if args[0] is not last[0]:
            x = args[0].reshape(-1, args[0].shape[-1])[keep].float()  # [n, in]
            last[:] = [None, None]  # free the previous H before the next is made
            last[:] = [args[0], (x.t() @ x).double() / count]  # a float32 GEMM; float64 from here on
        consume(name, last[1])

    handles = [model.get_submodule(name).register_forward_pre_hook(lambda _, args, name=name: hook(name, args))
               for name in names]
    try:
        model(input_ids=ids, attention_mask=mask)
    finally:
        for handle in handles:
            handle.remove()
        last[:] = [None, None]


def gptq_codes(w: torch.Tensor, scales: torch.Tensor, qmax: int, hessian: torch.Tensor) -> torch.Tensor:
    """Integer codes for ``w`` on a fixed grid, rounded by GPTQ (Frantar et al. 2022, Algorithm 1).

    Columns are taken in order of decreasing ``H[j, j]`` (the paper's act-order: the inputs with the most
    energy first, while many columns are left to absorb their error); errors are propagated within blocks of
    ``BLOCK`` columns, then to the rest in one matrix product.

    Args:
        w: float ``[out, in]`` weight.
        scales: float32 ``[out, in]``: each weight's step (the absmax scale expanded to every weight).
        qmax: codes are clamped to ``[-qmax, qmax]``.
        hessian: float64 ``[in, in]``, ``X^T X / n`` of the layer's inputs.

    Returns:
        float32 ``[out, in]`` integer-valued codes in ``[-qmax, qmax]`` (``q * scales`` is ``W_hat``).

    Raises:
        torch.linalg.LinAlgError: H is not positive definite even after damping (a NaN in the activations).
    """
    w = w.detach().float().clone()  # [out, in]; columns are updated in place as errors arrive
    n = w.shape[1]
    h = hessian.double().clone()
    dead = torch.diagonal(h) == 0  # inputs that were always zero: any code will do, nothing propagates
    # their diagonal at the live inputs' scale, so it does not skew the damping below (all dead: any value)
    h[dead, dead] = torch.diagonal(h)[~dead].mean() if bool((~dead).any()) else 1.0
    order = torch.argsort(torch.diagonal(h), descending=True)
    w, steps, h = w[:, order], scales.float()[:, order], h[order][:, order]
    h += DAMPING * torch.diagonal(h).mean() * torch.eye(n, dtype=h.dtype, device=h.device)
    # upper Cholesky factor of H^-1: row i holds how column i's error spreads over the columns after it
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()  # [in, in]
    codes = torch.empty_like(w)
    for start in range(0, n, BLOCK):
        end = min(start + BLOCK, n)
        block = w[:, start:end]  # a view: the updates below land in w
        errors = torch.empty_like(block)  # [out, end - start]
        for i in range(end - start):
            column, step = block[:, i], steps[:, start + i]
            q = torch.round(column / step).clamp_(-qmax, qmax)
            codes[:, start + i] = q
            errors[:, i] = (column - q * step) / u[start + i, start + i]
            block[:, i:] -= errors[:, i:i + 1] * u[start + i, start + i:end]
        w[:, end:] -= errors @ u[start:end, end:]
    return codes[:, torch.argsort(order)]


@contextlib.contextmanager
def plain_attention(model: nn.Module) -> Iterator[None]:
    """Run ``model`` with torch's SDPA inside the block, and give it its own attention back after.

    A model loaded for serving attends through kvserve's paged hook, which needs a step's metadata.
    """
    attention = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(attention)
