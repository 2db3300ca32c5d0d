"""``kvserve quant report``: load the served model and print quant.report's quality tables for it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``kvserve quant report``."""
    parser.add_argument("--model", default=None,
                        help="local HF model directory or GGUF file (default: the embedded SmolLM2)")
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown report to this file")
    parser.add_argument("--json", action="store_true", help="print JSON instead of markdown")


def run(args: argparse.Namespace) -> int:
    """Load the model in float32 on CPU, measure, print (and write) the report."""
    import copy

    from kvserve.engine.gguf_native import use_gguf_blocks
    from kvserve.engine.loader import Device, DType, gguf_file, load_model
    from kvserve.quant.report import collect, render

    loaded = load_model(args.model, DType.FLOAT32, Device.CPU)
    model = copy.deepcopy(loaded.model)
    model.set_attn_implementation("sdpa")  # plain forward/generate; the paged hook needs serving metadata
    path = gguf_file(args.model)
    own_blocks = None if path is None else (lambda m: use_gguf_blocks(m, path))  # a GGUF: its own blocks too
    data = collect(model, loaded.tokenizer, log=lambda msg: print(msg, file=sys.stderr, flush=True),
                   own_blocks=own_blocks)
    text = json.dumps(data, indent=2) if args.json else render(data)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0
