"""What a served model computes with (``--quantization``), chosen and put in place at start.

    auto   a GGUF model (the embedded SmolLM2, or ``--model FILE.gguf``): the file's own blocks;
           a float (Hugging Face) checkpoint: FLOAT_DEFAULT, the recipe ``kvserve quant report`` finds lossless
    gguf   the GGUF file's own blocks (engine.gguf_model, loaded so: load_model(..., blocks=True)): no rounding
           beyond the file's
    none   full precision: on a CPU whose kernel path has AVX512-BF16, the model's bfloat16 weights on that kernel
           with float32 activations (quant.bf16), else float32 weights on the float32 kernels
           (engine.loader.serves_bf16_kernel, resolve_dtype)
    int8, int4, nf4   kvserve's own rounding of the float weights (quant.model.quantize_for_serving); int8 on a
           float checkpoint keeps its GPTQ-calibrated codes in the cache, so only the first start calibrates
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

from kvserve.engine.loader import LoadedModel, cache_dir, gguf_file, resolve_model_dir
from kvserve.quant.options import Scheme

# A float checkpoint's default: int8 per row, rounded by GPTQ: perplexity +0.06% and 8 bits a weight on SmolLM2
# (BENCHMARKS.md, `kvserve quant report`); the 4-bit recipes cost far more there (int4: +29% perplexity).
FLOAT_DEFAULT = Scheme.INT8
FULL_PRECISION_HINT = "full precision: --quantization none"
log = logging.getLogger("kvserve.engine")


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
        if loaded.bf16_weights:
            return "full precision (bfloat16 weights on the AVX512-BF16 kernel, float32 activations)"
        return f"full precision ({str(loaded.dtype).removeprefix('torch.')})"
    if scheme is Scheme.GGUF:
        if loaded.gguf is not None:  # loaded with its blocks (load_model(..., blocks=True)): nothing to swap
            return loaded.gguf.describe()
        from kvserve.engine.gguf_model import use_gguf_blocks

        path = gguf_file(model)
        if path is None:
            raise ValueError(f"--model {model!r} is not a GGUF file: it has no blocks of its own")
        return use_gguf_blocks(loaded.model, path).describe()
    if scheme is FLOAT_DEFAULT and tokenizer is not None and gguf_file(model) is None:
        return "quantized: " + cached_calibration(loaded, resolve_model_dir(model), scheme, tokenizer).describe()
    from kvserve.quant.model import quantize_for_serving

    return "quantized: " + quantize_for_serving(loaded.model, scheme, tokenizer).describe()


def checkpoint_hash(directory: Path) -> str:
    """sha256 (16 hex digits) of a checkpoint directory's config and weight files, names and bytes."""
    digest = hashlib.sha256()
    for path in sorted(directory.iterdir()):
        if path.is_file() and (path.name == "config.json" or path.suffix in (".safetensors", ".bin", ".pt", ".pth")):
            digest.update(path.name.encode())
            with path.open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 24), b""):
                    digest.update(chunk)
    return digest.hexdigest()[:16]


def cached_calibration(loaded: LoadedModel, directory: Path, scheme: Scheme, tokenizer):
    """``quantize_for_serving(loaded.model, scheme, tokenizer)``, with the calibrated codes kept in
    ``cache_dir()/codes``, keyed by the checkpoint's hash, the recipe and the code layout: only the first start
    calibrates (over a minute for SmolLM2 on 2 cores); later ones round to nearest, then load the cached codes.

    Returns:
        The ``QuantSummary``.

    Raises:
        ValueError: a cache file whose layers are not the model's (delete it to calibrate again).
    """
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from kvserve import native
    from kvserve.quant.model import quantize_for_serving, quantize_model, serving_quantizes_head

    layout = "kernels" if loaded.device.type == "cpu" and native.load() is not None else "reference"
    recipe = f"{scheme.value}-gptq"
    path = cache_dir() / "codes" / f"{directory.name}-{checkpoint_hash(directory)}-{recipe}-{layout}.safetensors"
    started = time.perf_counter()
    if path.exists():
        summary = quantize_model(loaded.model, scheme, head=serving_quantizes_head(scheme))
        layers = _quantized_layers(loaded.model)
        with safe_open(path, "pt") as f:
            states = json.loads(f.metadata()["layers"])
        if states != {name: m.get_extra_state() for name, m in layers.items()}:
            raise ValueError(f"the cached codes in {path} are not this model's layers: delete the file to calibrate "
                             "again")
        codes = load_file(path, device=str(loaded.device))
        for name, m in layers.items():
            m.weight.copy_(codes[name + ".weight"])
            m.scales.copy_(codes[name + ".scales"])
        log.info("%s codes read from %s in %.1f s (calibrated at the first start)", recipe, path,
                 time.perf_counter() - started)
        return replace(summary, spec_label=summary.spec_label + "+gptq")
    summary = quantize_for_serving(loaded.model, scheme, tokenizer)
    layers = _quantized_layers(loaded.model)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    save_file({f"{name}.{part}": getattr(m, part).contiguous() for name, m in layers.items()
               for part in ("weight", "scales")}, partial,
              metadata={"layers": json.dumps({name: m.get_extra_state() for name, m in layers.items()})})
    partial.rename(path)  # whole or absent: a start killed while writing leaves no half file to read
    log.info("%s: calibrated in %.1f s; codes cached in %s, so later starts skip the calibration", recipe,
             time.perf_counter() - started, path)
    return summary


def _quantized_layers(model) -> dict:
    from kvserve.quant.linear import QuantLinear

    return {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
