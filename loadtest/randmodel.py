"""A model directory with a real model's config and tokenizer but random weights, for speed runs elsewhere.

Step time depends on a model's shapes, not on its weights, so a machine that cannot receive the weights (the
GPU machine this project borrows takes 64 MiB of files per call; SmolLM2's GGUF is 94 MB) can still measure
the engine and the server on the same architecture. Greedy text from such a model is noise; use it with
``ignore_eos``/``min_tokens`` workloads (seed64 pins every length) and never for quality figures.

    python -m kvserve.loadtest.randmodel --shape-of smollm2 --shape-only DIR      # config + tokenizer, no weights
    python -m kvserve.loadtest.randmodel --from DIR OUT                           # OUT: DIR's files + random weights
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def copy_shape(model_dir: Path, out: Path) -> Path:
    """Copy ``model_dir``'s config, generation config, tokenizer and chat template (no weights) to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    for path in model_dir.iterdir():
        if path.is_file() and path.name not in WEIGHT_FILES and not path.name.startswith("model-"):
            shutil.copy2(path, out / path.name)
    return out


def with_random_weights(shape_dir: Path, out: Path, seed: int = 0) -> Path:
    """Write ``shape_dir``'s files plus float32 weights drawn from the config's initializer (seed ``seed``).

    Raises:
        FileNotFoundError: ``shape_dir`` has no config.json.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (shape_dir / "config.json").exists():
        raise FileNotFoundError(f"{shape_dir} has no config.json")
    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(shape_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    copy_shape(shape_dir, out)
    model.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvserve.loadtest.randmodel", description=__doc__.splitlines()[0])
    source_group = parser.add_mutually_exclusive_group(required=True)
    source_group.add_argument("--shape-of", default=None,
                              help="model whose shape to copy ('smollm2' or a directory)")
    source_group.add_argument("--from", dest="source", type=Path, default=None,
                              help="a directory made with --shape-only (or any model directory)")
    parser.add_argument("--shape-only", action="store_true", help="with --shape-of: copy config and tokenizer only")
    parser.add_argument("out", type=Path, help="output directory (created)")
    args = parser.parse_args(argv)
    if args.shape_only and args.shape_of is None:
        parser.error("--shape-only goes with --shape-of")
    if args.source is not None and not (args.source / "config.json").exists():
        parser.error(f"--from {str(args.source)!r} has no config.json")
    if args.shape_of is not None:
        from kvserve.engine.loader import resolve_model_dir

        try:
            source = resolve_model_dir(args.shape_of)
        except FileNotFoundError:
            parser.error(f"--shape-of {args.shape_of!r}: not 'smollm2' and not a model directory with config.json")
    else:
        source = args.source
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"{args.out} exists and is not a directory")
    try:
        args.out.mkdir(parents=True, exist_ok=True)  # before any work: a bad path fails now
    except OSError as exc:
        parser.error(f"{args.out}: {exc.strerror or exc}")
    if args.shape_only:
        print(copy_shape(source, args.out))
        return 0
    print(with_random_weights(source, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
