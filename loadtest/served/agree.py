"""``python -m kvserve.loadtest agree``: greedy output of kvserve and llama.cpp's server on the same GGUF file.

Both serve the file (llama.cpp: ``python -m kvserve.loadtest llamacpp`` builds it; kvserve: its default
weights, the file's own blocks), one after the other; each prompt goes to both through ``/v1/completions``,
greedy, ``ignore_eos``, the same number of tokens. A prompt agrees when the two texts are equal; otherwise the
line shows where they part. Both tokenize the prompt from the file's own vocabulary, so equal text is equal
tokens. Two implementations agree up to near-ties: activations quantized differently (llama.cpp rounds them to
8 bits per block for every quantized type, kvserve for the types it has kernels for) can flip a token whose
two best logits are nearly equal, and random-weight files (``loadtest randgguf``) are full of such ties, so
agreement there is a smoke check; on real weights it is the test. So each reply comes with its top-5 logprobs,
and where two replies part the line says how far below its own pick each server ranks the other's token: a
parting where both gaps are within ``NEAR_TIE`` nats (the exactness tests' bound) is a near-tie, one where either
is wider, or where the other's token is outside a server's top 5, is a disagreement worth a look.

    python -m kvserve.loadtest agree --model FILE.gguf [--model OTHER.gguf ...] --tokens 32 [--write]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvserve.loadtest.argtypes import absolute_path
from kvserve.loadtest.errors import UsageError
from kvserve.loadtest.peer_systems.llamacpp import find_server
from kvserve.loadtest.procs.serverproc import kvserve_command, launch
from kvserve.loadtest.publish.benchmarks_md import update_section

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List five prime numbers, separated by commas:",
    "Photosynthesis is the process by which",
    "Q: What is 12 times 12?\nA:",
)


NEAR_TIE = 0.5  # nats (= logits) between a server's pick and the other's token: a near-tie within it
TOP = 5  # the OpenAI completions API's largest logprobs


@dataclass(frozen=True)
class Reply:
    """One greedy completion: its text, and per generated token the token's text and the server's top
    logprobs there (token text -> logprob)."""

    text: str
    tokens: list[str]
    top: list[dict[str, float]]


def parse_reply(choice: dict) -> Reply:
    """A completion choice in either logprobs format: the OpenAI completions API's (``tokens`` and
    ``top_logprobs`` dicts, as kvserve and vLLM send) or the chat API's ``content`` list (llama.cpp's server)."""
    logprobs = choice.get("logprobs") or {}
    if "content" in logprobs:
        content = logprobs["content"] or []
        return Reply(choice["text"], [c["token"] for c in content],
                     [{t["token"]: t["logprob"] for t in c.get("top_logprobs", [])} for c in content])
    return Reply(choice["text"], list(logprobs.get("tokens", [])), [dict(t or {}) for t in logprobs.get(
        "top_logprobs", [])])


def completions(url: str, prompts: tuple[str, ...], tokens: int, extra: dict | None = None) -> list[Reply]:
    """Greedy completions of ``prompts``, ``tokens`` each (EOS ignored), with their top logprobs; ``extra``
    fields go into every request."""
    replies = []
    with httpx.Client(timeout=600) as client:
        for prompt in prompts:
            reply = client.post(f"{url}/v1/completions", json={
                "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "model": "default",
                "logprobs": TOP, **(extra or {})})
            reply.raise_for_status()
            replies.append(parse_reply(reply.json()["choices"][0]))
    return replies


def parting(mine: Reply, other: Reply) -> tuple[int, float | None, float | None] | None:
    """Where two replies' tokens first differ, and how far below its own pick each ranks the other's token there
    (logprob gap >= 0, nats; None where the other's token is outside its top logprobs). None if no token differs.
    """
    for i, (a, b) in enumerate(zip(mine.tokens, other.tokens)):
        if a != b:
            gap_mine = mine.top[i][a] - mine.top[i][b] if b in mine.top[i] and a in mine.top[i] else None
            gap_other = other.top[i][b] - other.top[i][a] if a in other.top[i] and b in other.top[i] else None
            return i, gap_mine, gap_other
    return None


def near_tie(gaps: tuple[int, float | None, float | None] | None) -> bool:
    """Whether a parting is a near-tie: both servers rank the other's token within ``NEAR_TIE`` of their own."""
    return gaps is not None and all(g is not None and g <= NEAR_TIE for g in gaps[1:])


def common_prefix(a: str, b: str) -> int:
    """Characters ``a`` and ``b`` share from the start."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=absolute_path, required=True, action="append",
                        help="a GGUF file both serve (repeat for several: one row each)")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--write", action="store_true",
                        help="also write the table into BENCHMARKS.md (section agree-llamacpp)")


@dataclass(frozen=True)
class Agreement:
    """One file's comparison: prompts whose replies are equal, and of the others those that part at a
    near-tie; the largest gap either server has at a parting (None: the other's token outside a top 5)."""

    file: str
    prompts: int
    same: int
    near_ties: int
    widest_gap: float | None


def compare_file(model: Path, tokens: int, binary: Path) -> Agreement:
    """Serve ``model`` with llama.cpp's server, then with kvserve; print one line per prompt."""
    llama_argv = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", "{port}", "-t", "2",
                  "-np", "1", "-c", "4096"]
    with launch(llama_argv, name="agree-llama.cpp") as server:
        theirs = completions(server.url, PROMPTS, tokens)
    with launch(kvserve_command(["--model", str(model), "--kv-cache-memory", "256MiB"]),
                name="agree-kvserve") as server:
        # llama.cpp's ignore_eos bans end-of-generation tokens; vLLM's (and kvserve's) only keeps going after
        # one, while min_tokens bans them until the last token: the two replies then choose among the same tokens
        ours = completions(server.url, PROMPTS, tokens, {"ignore_eos": False, "min_tokens": tokens})
    same = ties = 0
    widest: float | None = 0.0
    for prompt, mine, other in zip(PROMPTS, ours, theirs):
        if mine.text == other.text:
            same += 1
            print(f"{prompt[:30]!r}: same")
            continue
        shared = common_prefix(mine.text, other.text)
        gaps = parting(mine, other)
        ties += near_tie(gaps)
        if gaps is None or None in gaps[1:]:
            widest = None
        elif widest is not None:
            widest = max(widest, *gaps[1:])
        where = "" if gaps is None else f", token {gaps[0]}: " + "; ".join(
            f"{who} ranks the other's token {'outside its top %d' % TOP if g is None else f'{g:.3f} nats below its own'}"
            for who, g in (("kvserve", gaps[1]), ("llama.cpp", gaps[2])))
        print(f"{prompt[:30]!r}: part after {shared} of {max(len(mine.text), len(other.text))} characters{where}"
              f"{' (a near-tie)' if near_tie(gaps) else ''}")
        print(f"    kvserve:   {mine.text[shared:shared + 60]!r}\n    llama.cpp: {other.text[shared:shared + 60]!r}")
    print(f"{same} of {len(PROMPTS)} prompts agree over {tokens} greedy tokens ({model.name}); "
          f"{ties} of the other {len(PROMPTS) - same} part at a near-tie (both gaps <= {NEAR_TIE} nats)")
    return Agreement(model.name, len(PROMPTS), same, ties, widest)


def render(rows: list[Agreement], tokens: int) -> str:
    """The BENCHMARKS.md table of ``rows``."""
    lines = ["| file | prompts equal | the others: parting at a near-tie | widest gap at a parting (nats) |",
             "|---|---:|---:|---:|"]
    for r in rows:
        widest = "outside a top 5" if r.widest_gap is None else f"{r.widest_gap:.3f}"
        lines.append(f"| {r.file} | {r.same} of {r.prompts} | {r.near_ties} of {r.prompts - r.same} | {widest} |")
    return "\n".join(lines) + (
        f"\n\nEach file served by llama.cpp's server (2 threads) and by kvserve (its default weights for the file, the "
        f"file's own blocks), one after the other; {len(PROMPTS)} prompts, {tokens} greedy tokens each, end-of-"
        "generation tokens banned on both. Where two replies part, each server's gap is how far below its own pick "
        f"it ranks the other's token (logprobs, nats); a near-tie is a parting where both gaps are <= {NEAR_TIE}: "
        "activations quantized in other blocks (both: 8 bits per 256 for the K-quants, per 32 for Q4_0 to Q8_0; "
        "their rounding and sums differ in detail) move logits by about that much. Random-weight files "
        "(`loadtest randgguf`) are all near-ties and say little; real weights (the embedded model requantized by "
        "llama.cpp's `llama-quantize`) are the test.")


def run(args: argparse.Namespace) -> int:
    """Serve each file with each server, compare, print one line per prompt and a summary per file; exit 0
    (agreement is reported, not enforced: see the module docstring).

    Raises:
        UsageError: a file is not a .gguf file, or llama-server has not been built.
    """
    for model in args.model:
        if model.suffix != ".gguf" or not model.is_file():
            raise UsageError(f"--model {str(model)!r} is not a .gguf file")
    binary = find_server()
    if binary is None:
        raise UsageError("llama-server is not built: python -m kvserve.loadtest llamacpp")
    rows = [compare_file(model, args.tokens, binary) for model in args.model]
    text = render(rows, args.tokens)
    print(text)
    if args.write:
        command = "python -m kvserve.loadtest agree " + " ".join(f"--model {m.name}" for m in args.model) + \
            f" --tokens {args.tokens} --write"
        update_section("agree-llamacpp", "Greedy agreement with llama.cpp's server on the same GGUF file", command,
                       text)
    return 0
