"""``python -m kvserve.loadtest agree``: greedy output of kvserve and llama.cpp's server on the same GGUF file.

Both serve the file (llama.cpp: ``python -m kvserve.loadtest llamacpp`` builds it; kvserve: its default
weights, the file's own blocks), one after the other; each prompt goes to both through ``/v1/completions``,
greedy, ``ignore_eos``, the same number of tokens. A prompt agrees when the two texts are equal; otherwise the
line shows where they part. Both tokenize the prompt from the file's own vocabulary, so equal text is equal
tokens. Two implementations agree up to near-ties: activations quantized differently (llama.cpp rounds them to
8 bits per block for every quantized type, kvserve for the types it has kernels for) can flip a token whose
two best logits are nearly equal, and random-weight files (``loadtest randgguf``) are full of such ties, so
agreement there is a smoke check; on real weights it is the test.

    python -m kvserve.loadtest agree --model FILE.gguf --tokens 32
"""

from __future__ import annotations

import argparse
from pathlib import Path

import httpx

from kvserve.loadtest.errors import UsageError
from kvserve.loadtest.peer_systems.llamacpp import find_server
from kvserve.loadtest.procs.serverproc import kvserve_command, launch

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List five prime numbers, separated by commas:",
    "Photosynthesis is the process by which",
    "Q: What is 12 times 12?\nA:",
)


def completions(url: str, prompts: tuple[str, ...], tokens: int) -> list[str]:
    """Greedy completions of ``prompts``, ``tokens`` each (EOS ignored)."""
    texts = []
    with httpx.Client(timeout=600) as client:
        for prompt in prompts:
            reply = client.post(f"{url}/v1/completions", json={
                "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "model": "default"})
            reply.raise_for_status()
            texts.append(reply.json()["choices"][0]["text"])
    return texts


def common_prefix(a: str, b: str) -> int:
    """Characters ``a`` and ``b`` share from the start."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, required=True, help="the GGUF file both serve")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")


def run(args: argparse.Namespace) -> int:
    """Serve the file with each, compare, print one line per prompt; exit 0 (agreement is reported, not
    enforced: see the module docstring).

    Raises:
        UsageError: the file is not a .gguf file, or llama-server has not been built.
    """
    if args.model.suffix != ".gguf" or not args.model.is_file():
        raise UsageError(f"--model {str(args.model)!r} is not a .gguf file")
    binary = find_server()
    if binary is None:
        raise UsageError("llama-server is not built: python -m kvserve.loadtest llamacpp")
    llama_argv = [str(binary), "-m", str(args.model), "--host", "127.0.0.1", "--port", "{port}", "-t", "2",
                  "-np", "1", "-c", "4096"]
    with launch(llama_argv, name="agree-llama.cpp") as server:
        theirs = completions(server.url, PROMPTS, args.tokens)
    with launch(kvserve_command(["--model", str(args.model), "--kv-cache-memory", "256MiB"]),
                name="agree-kvserve") as server:
        ours = completions(server.url, PROMPTS, args.tokens)
    agreed = 0
    for prompt, mine, other in zip(PROMPTS, ours, theirs):
        shared = common_prefix(mine, other)
        agreed += mine == other
        state = "same" if mine == other else f"part after {shared} of {max(len(mine), len(other))} characters"
        print(f"{prompt[:30]!r}: {state}")
        if mine != other:
            print(f"    kvserve:   {mine[shared:shared + 60]!r}\n    llama.cpp: {other[shared:shared + 60]!r}")
    print(f"{agreed} of {len(PROMPTS)} prompts agree over {args.tokens} greedy tokens ({args.model.name})")
    return 0
