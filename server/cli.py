"""The ``kvserve`` command: ``serve``, ``model-path``, ``plan`` and ``quant report``.

Each subcommand's module owns its flags (``add_arguments``) and its work (``run``); this file only
dispatches, and imports each module lazily so ``kvserve plan`` starts without loading a model.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

from kvserve import environment

# subcommand path -> (module, help)
_COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("serve",): ("kvserve.server.serve", "serve a model over an OpenAI-compatible HTTP API"),
    ("model-path",): ("kvserve.server.model_path", "print the served model's directory (its tokenizer, for clients "
                                                   "that tokenize locally: guidellm --processor)"),
    ("plan",): ("kvserve.planner.capacity", "capacity planner: how much context, for how many users"),
    ("quant", "report"): ("kvserve.server.quant_report", "quantization quality report (error, perplexity, agreement)"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The argument parser; only the chosen subcommand's module is imported to add its flags."""
    parser = argparse.ArgumentParser(prog="kvserve", description="kvserve: LLM inference server")
    top = parser.add_subparsers(dest="command", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for path, (module_name, help_text) in _COMMANDS.items():
        subparsers = top
        for word in path[:-1]:
            if word not in groups:
                groups[word] = top.add_parser(word, help=f"{word} tools").add_subparsers(dest="subcommand",
                                                                                         required=True)
            subparsers = groups[word]
        sub = subparsers.add_parser(path[-1], help=help_text, description=help_text)
        if tuple(argv[:len(path)]) == path:
            module = importlib.import_module(module_name)
            module.add_arguments(sub)
            sub.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvserve`` console script; returns the exit status. SIGINT (Ctrl-C) from here on
    (while the subcommand's modules import, a model loads, or a server runs) ends the process by that signal, as
    an unhandled KeyboardInterrupt would (status 130 in a shell), only without Python's traceback; one in the
    first tens of milliseconds, while Python starts and the console script imports this module, still gets
    Python's own."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        # the default action of SIGINT ends the process at once, which also spares the wait for a model load
        # still running on the engine thread that a normal exit would join
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 130  # not reached


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # before any subcommand imports transformers or huggingface_hub, which read it once, at import (the server's
    # routes import transformers before engine.loader, which sets it too, for library users)
    environment.stay_offline()
    environment.bound_openmp_spin()  # before any subcommand imports torch (libgomp reads it once, at load)
    args = build_parser(argv).parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
