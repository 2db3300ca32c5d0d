"""``python -m kvserve.loadtest COMMAND``: load runs, static vs continuous, the simulator, engine tables, peers.

Each command's module owns its flags (``add_arguments``) and its work (``run``); this file only dispatches,
importing each module lazily so ``run`` starts without torch. Three modules also run as child processes of
other commands, never by hand: ``loadgen.fakeserver`` (a stand-in server command), ``engine.memprobe`` and
``procs.kvrouter`` (the cluster's KV-aware router).
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

# command -> (module, help)
_COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("kvserve.loadtest.loadgen.runcmd", "drive a workload at an OpenAI-compatible server"),
    "compare": ("kvserve.loadtest.served.compare", "kvserve static vs continuous batching on seed64, measured"),
    "simulate": ("kvserve.loadtest.sim.simulate", "static vs continuous on seed64, replayed at measured step costs"),
    "tables": ("kvserve.loadtest.engine.tables", "the chapter's KV-cache tables, measured on our engine"),
    "peers": ("kvserve.loadtest.served.peers", "kvserve vs llama.cpp's server vs transformers generate"),
    "profile": ("kvserve.loadtest.engine.profile_step", "where a decode step's (or with --prefill, a prompt's) time goes on our engine"),
    "overhead": ("kvserve.loadtest.served.overhead", "where a served token's time and CPU go beyond the model step"),
    "quant": ("kvserve.loadtest.engine.quantbench", "decode speed and quality of each weight quantization, side by side"),
    "cluster": ("kvserve.loadtest.served.cluster", "replicas behind a router: round robin, KV events, cache-aware; kill, drain"),
    "structured": ("kvserve.loadtest.served.structured", "grammar compile time and the throughput cost of constrained decoding"),
    "prefill": ("kvserve.loadtest.engine.prefillbench", "prefill time with every row attending as a decode row, against SDPA"),
    "corestep": ("kvserve.loadtest.engine.corebench", "the engine core's own cost per step, at 100 and 4,000 tokens of context"),
    "hashbench": ("kvserve.loadtest.engine.hashbench", "prefix-cache hashing cost per full block: hash() vs SHA-256"),
    "ui": ("kvserve.loadtest.served.uibench", "serving throughput with the live page open, against without it"),
    "kvcache": ("kvserve.loadtest.engine.kvbench", "KV cache dtypes side by side: sequences that fit, decode tokens/s"),
    "speculative": ("kvserve.loadtest.served.speculative", "speculative decoding: the chapter's table of quantized drafts; off, auto and fixed, served"),
    "backpressure": ("kvserve.loadtest.served.backpressure", "overload (4x) and disconnect drills against a small server"),
    "prefix": ("kvserve.loadtest.served.prefixbench", "prefix cache: TTFT of a shared 1,024-token prefix, cold vs warm"),
    "fairness": ("kvserve.loadtest.served.fairness", "scheduling policies under a flood: fair share per tenant, priorities"),
    "kernelbench": ("kvserve.loadtest.engine.kernelbench", "the measurements behind the engine's kernel choices"),
    "llamacpp": ("kvserve.loadtest.peer_systems.llamacpp", "build llama.cpp's llama-server outside the repo (peers needs it)"),
    "vllm": ("kvserve.loadtest.peer_systems.vllmcpu", "install vLLM's CPU backend outside the repo (peers --prefill uses it)"),
    "randmodel": ("kvserve.loadtest.fixtures.randmodel", "a model directory with a real model's shapes and random weights"),
    "agree": ("kvserve.loadtest.served.agree", "greedy output of kvserve and llama.cpp's server on the same GGUF file"),
    "actblocks": ("kvserve.loadtest.engine.actblocks", "what one activation scale per 256 costs a Q4_K / Q5_K file's distributions (KL)"),
    "ready": ("kvserve.loadtest.served.readybench", "time to ready and peak resident memory of kvserve serve on a GGUF file"),
    "randgguf": ("kvserve.loadtest.fixtures.randgguf", "a GGUF file with a real model's shapes and random blocks, in llama.cpp's mixtures"),
    "requant": ("kvserve.loadtest.fixtures.requant", "the embedded model requantized by llama.cpp's llama-quantize (real weights in K-quant mixtures)"),
}


def _terminated(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen command; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m kvserve.loadtest", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_module, help_text) in _COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] not in _COMMANDS:
        parser.parse_args(argv)  # prints usage and exits
    from kvserve import environment

    environment.bound_openmp_spin()  # as kvserve serve does, before the command imports torch
    module = importlib.import_module(_COMMANDS[argv[0]][0])
    command = argparse.ArgumentParser(prog=f"python -m kvserve.loadtest {argv[0]}", description=_COMMANDS[argv[0]][1])
    module.add_arguments(command)
    from kvserve.loadtest.errors import UsageError

    # SIGTERM (timeout, docker stop, kill) unwinds like Ctrl-C: the servers a command started are stopped by
    # its `finally` blocks instead of outliving it in their own sessions.
    signal.signal(signal.SIGTERM, _terminated)
    try:
        return int(module.run(command.parse_args(argv[1:])) or 0)
    except UsageError as exc:
        command.error(str(exc))  # usage line and the message on stderr, exit status 2


if __name__ == "__main__":
    sys.exit(main())
