"""Completions ``suffix``: fill-in-the-middle prompts for models trained with FIM tokens.

A model learns FIM from one token layout, so the prompt must use the model's own tokens; a model without
them cannot fill a middle, and ``suffix`` is then a 400 rather than text that ignores the suffix.
Layouts (prefix-suffix-middle, "PSM", Bavarian et al. 2022): StarCoder/SantaCoder ``<fim_prefix>``,
Qwen2.5-Coder ``<|fim_prefix|>``, CodeLlama ``<PRE>``, DeepSeek-Coder ``<｜fim▁begin｜>``.
"""

from __future__ import annotations

from kvserve.server.errors import ApiError

# (before the prefix, before the suffix, before the middle the model writes)
_LAYOUTS = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("▁<PRE>", "▁<SUF>", "▁<MID>"),
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
)


def fim_tokens(tokenizer) -> tuple[str, str, str] | None:
    """The model's FIM layout (three token strings, each one token of its vocabulary), or None."""
    vocab = tokenizer.get_vocab()
    for layout in _LAYOUTS:
        if all(token in vocab for token in layout):
            return layout
    return None


def fim_prompt(tokenizer, prompt: str, suffix: str) -> str:
    """The text of a fill-in-the-middle prompt: the completion is the middle between ``prompt`` and ``suffix``.

    Raises:
        ApiError: 400 (param ``suffix``) when the model has no FIM tokens.
    """
    layout = fim_tokens(tokenizer)
    if layout is None:
        raise ApiError(400, "suffix: this model has no fill-in-the-middle tokens, so it cannot complete between a "
                            "prompt and a suffix; leave suffix out", param="suffix")
    before_prefix, before_suffix, before_middle = layout
    return f"{before_prefix}{prompt}{before_suffix}{suffix}{before_middle}"
