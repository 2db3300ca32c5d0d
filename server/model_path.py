"""``kvserve model-path``: print the directory that holds the served model's tokenizer and config.

A client that tokenizes locally (guidellm's ``--processor``, lm-eval's ``tokenizer=``) needs a tokenizer; the
served id ``SmolLM2-135M-Instruct`` is no Hugging Face hub id, and the embedded model's converted directory is
named by a hash (``~/.cache/kvserve/SmolLM2-135M-Instruct.Q4_1-<hash>``). This prints it (converting the
embedded GGUF first if no start has done so yet), so ``--processor "$(kvserve model-path)"`` works.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="as kvserve serve's --model (default: embedded SmolLM2)")


def run(args: argparse.Namespace) -> int:
    from kvserve.engine.loader import resolve_model_dir

    try:
        print(resolve_model_dir(args.model))
    except FileNotFoundError as exc:
        print(f"kvserve model-path: {exc}", file=sys.stderr)
        return 2
    return 0
