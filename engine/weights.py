"""What a served model computes with (``--quantization``), chosen and put in place at start.

    auto   a GGUF model (the embedded SmolLM2, or ``--model FILE.gguf``): the file's own blocks;
           a float (Hugging Face) checkpoint: FLOAT_DEFAULT, the recipe ``kvserve quant report`` finds lossless
    gguf   the GGUF file's own blocks (engine.gguf_native): no rounding beyond the file's
    none   full precision (float32 on a CPU without a bfloat16 kernel: engine.loader.resolve_dtype)
    int8, int4, nf4   kvserve's own rounding of the float weights (quant.model.quantize_for_serving)
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.engine.loader import LoadedModel, gguf_file
from kvserve.quant.options import Scheme

# A float checkpoint's default: int8 per row, rounded by GPTQ: perplexity +0.06% and 8 bits a weight on SmolLM2
# (BENCHMARKS.md, `kvserve quant report`); the 4-bit recipes cost far more there (int4: +29% perplexity).
FLOAT_DEFAULT = Scheme.INT8
FULL_PRECISION_HINT = "full precision: --quantization none"


@dataclass(slots=True, frozen=True)
class Choice:
    """The scheme to serve and why (the start-up log says both)."""

    scheme: Scheme
    reason: str


def choose(asked: Scheme, model: str | None) -> Choice:
    """Resolve ``--quantization`` for ``--model`` (None: the embedded SmolLM2).

    Raises:
        ValueError: ``gguf`` for a model that is not a GGUF file.
    """
    asked = Scheme(asked)
    gguf = gguf_file(model)
    if asked is Scheme.AUTO:
        if gguf is not None:
            return Choice(Scheme.GGUF, f"auto: {gguf.name} is quantized already, so its own blocks are served")
        return Choice(FLOAT_DEFAULT, f"auto: a float checkpoint gets {FLOAT_DEFAULT.value}/row+gptq, the recipe the "
                                     "quality report finds lossless")
    if asked is Scheme.GGUF and gguf is None:
        raise ValueError(f"--quantization gguf serves a GGUF file's own blocks, and --model {model!r} is not a "
                         ".gguf file")
    return Choice(asked, "--quantization " + asked.value)


def apply(loaded: LoadedModel, scheme: Scheme, model: str | None, tokenizer=None) -> str:
    """Put ``scheme``'s weights into ``loaded`` in place; returns one line describing them.

    Args:
        loaded: the model as ``engine.loader.load_model(model, ...)`` loaded it.
        scheme: a resolved scheme (not AUTO).
        model: the ``--model`` it was loaded from.
        tokenizer: for int8/int4, write GPTQ's calibration replies with it (None: round to nearest).

    Raises:
        ValueError: AUTO, or as ``choose``, ``use_gguf_blocks`` and ``quantize_for_serving``.
    """
    if scheme is Scheme.AUTO:
        raise ValueError("resolve --quantization auto with choose() first")
    if scheme is Scheme.NONE:
        return f"full precision ({str(loaded.dtype).removeprefix('torch.')})"
    if scheme is Scheme.GGUF:
        from kvserve.engine.gguf_native import use_gguf_blocks

        path = gguf_file(model)
        if path is None:
            raise ValueError(f"--model {model!r} is not a GGUF file: it has no blocks of its own")
        return use_gguf_blocks(loaded.model, path).describe()
    from kvserve.quant.model import quantize_for_serving

    return "quantized: " + quantize_for_serving(loaded.model, scheme, tokenizer).describe()
