"""``python -m kvserve.loadtest ready``: how long ``kvserve serve --model FILE.gguf`` takes to be ready, and its
peak resident memory against the file's size plus the KV pool.

Each start is a fresh ``kvserve serve`` process (the C++ kernels already built: their build is a one-off of its
own), timed from its launch to the first 200 from /health. Then one greedy completion of a ~512-token prompt is
served, so every weight page the model reads has been touched (the file is memory-mapped: a page counts as
resident once read), and the peak resident set (VmHWM, /proc) and the resident set at rest (VmRSS) are read. The
last start then serves prompts of ``--vocab-tokens`` token ids drawn across the vocabulary (seeded), so that the
resident set includes what a server reaches after serving varied text (the embedding's rows a lookup touches, a
prefill chunk's buffers), and reads the peak again before the server is stopped. The first start converts the file's tokenizer into the cache (``--fresh`` empties that entry
first); the ones after find it there.

    python -m kvserve.loadtest randgguf --shape llama-3.2-1b --mix Q4_K_M /tmp/llama-1b-q4_k_m.gguf
    python -m kvserve.loadtest ready --model /tmp/llama-1b-q4_k_m.gguf --kv-cache-memory 1GiB --fresh --starts 2
"""

from __future__ import annotations

import argparse
import random
import shutil
import time
from pathlib import Path

import httpx

from kvserve.kvcache.sizing import parse_bytes
from kvserve.loadtest.argtypes import absolute_path
from kvserve.loadtest.errors import UsageError
from kvserve.loadtest.procs.serverproc import kvserve_command, launch

# The budget for what a server holds beyond the file's bytes and its KV pool (runtime, tokenizer, buffers).
OVERHEAD_BUDGET = 400 * 2**20
# A prompt of about 512 tokens for the request that pages the weights in (a prefill chunk, then a few decode steps).
_PROMPT = "The quick brown fox jumps over the lazy dog. " * 50


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _serve_one(url: str) -> None:
    """One greedy completion through the server (the model it serves, whatever its name)."""
    with httpx.Client(base_url=url, timeout=600) as client:
        model = client.get("/v1/models").raise_for_status().json()["data"][0]["id"]
        client.post("/v1/completions", json={"model": model, "prompt": _PROMPT, "max_tokens": 8,
                                             "temperature": 0}).raise_for_status()


def _across_vocabulary(url: str, vocab: int, tokens: int, seed: int = 0) -> None:
    """Prompts of ``tokens`` token ids in all, drawn uniformly from ``[0, vocab)`` (seeded), each as long as a
    request may be (up to 2,048 ids), one generated token each."""
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=1800) as client:
        model = client.get("/v1/models").raise_for_status().json()["data"][0]
        chunk = min(2048, model.get("max_model_len", 2048) - 1)
        for start in range(0, tokens, chunk):
            ids = [rng.randrange(vocab) for _ in range(min(chunk, tokens - start))]
            client.post("/v1/completions", json={"model": model["id"], "prompt": ids, "max_tokens": 1,
                                                 "temperature": 0}).raise_for_status()


def one_start(model: Path, kv_memory: str, extra: list[str], vocab_tokens: int = 0) -> dict:
    """Start kvserve on ``model``: seconds to ready, then (after one served request) peak and resting resident
    memory in bytes, and with ``vocab_tokens`` the peak after prompts of that many ids across the vocabulary.

    Raises:
        ServerStartError: the server did not come up.
        httpx.HTTPError: the request that pages the weights in failed.
    """
    started = time.perf_counter()
    command = kvserve_command(["--model", str(model), "--kv-cache-memory", kv_memory, *extra])
    with launch(command, name="ready", start_timeout_s=1800) as server:
        ready_s = time.perf_counter() - started
        ready_peak = _status_kib(server.pid, "VmHWM") * 1024
        _serve_one(server.url)
        peak = _status_kib(server.pid, "VmHWM") * 1024
        rest = _status_kib(server.pid, "VmRSS") * 1024
        got = {"ready_s": ready_s, "ready_peak_rss": ready_peak, "peak_rss": peak, "rss": rest}
        if vocab_tokens:
            from kvserve.engine.gguf_file import read_gguf

            vocab = len(read_gguf(model).metadata["tokenizer.ggml.tokens"].values())
            _across_vocabulary(server.url, vocab, vocab_tokens)
            got["vocab_peak_rss"] = _status_kib(server.pid, "VmHWM") * 1024
    return got


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=absolute_path, action="append", required=True,
                        help="a GGUF file (repeat for several, one after another)")
    parser.add_argument("--kv-cache-memory", default="1GiB", help="as kvserve serve's")
    parser.add_argument("--starts", type=int, default=2, help="starts per file, one after another")
    parser.add_argument("--fresh", action="store_true", help="delete each file's cached tokenizer first")
    parser.add_argument("--vocab-tokens", type=int, default=16384,
                        help="the last start then serves prompts of this many random token ids (0: none)")
    parser.add_argument("--write", action="store_true", help="write the table into BENCHMARKS.md (section ready)")
    parser.add_argument("extra", nargs="*", help="more kvserve serve flags (after --)")


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.0f}"


def table(rows: list[dict], vocab_tokens: int = 0) -> str:
    """The markdown table of ``rows`` (one per file: its name, size, pool and its starts' results); the budget is
    judged on the largest peak, after the prompts across the vocabulary where ``vocab_tokens``."""
    across = f"peak resident MiB after {vocab_tokens:,} prompt tokens across the vocabulary | " if vocab_tokens else ""
    lines = ["| file | file MiB | KV pool MiB | first start: ready s | later starts: ready s | resident MiB after a "
             f"request | peak resident MiB | {across}peak beyond file + pool MiB | within +400 MiB |",
             "|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if vocab_tokens else "") + "---:|---|"]
    for row in rows:
        starts = row["starts"]
        later = [s["ready_s"] for s in starts[1:]]
        peak, rest = max(s["peak_rss"] for s in starts), max(s["rss"] for s in starts)
        vocab_peak = max((s.get("vocab_peak_rss", 0) for s in starts), default=0)
        over = max(peak, vocab_peak) - row["size"] - row["pool"]
        cell = f"{_mib(vocab_peak) if vocab_peak else '-'} | " if vocab_tokens else ""
        lines.append(f"| {row['name']} | {_mib(row['size'])} | {_mib(row['pool'])} | {starts[0]['ready_s']:.1f} | "
                     f"{' / '.join(f'{s:.1f}' for s in later) or '-'} | {_mib(rest)} | {_mib(peak)} | {cell}"
                     f"{over / 2**20:+,.0f} | {'yes' if over <= OVERHEAD_BUDGET else 'no'} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Start the server ``--starts`` times per file, print one line per start, and with --write the table.

    Raises:
        UsageError: a model is not a .gguf file.
    """
    for model in args.model:
        if model.suffix != ".gguf" or not model.is_file():
            raise UsageError(f"--model {str(model)!r} is not a .gguf file")
    rows = []
    for model in args.model:
        if args.fresh:
            from kvserve.engine.gguf_file import read_gguf
            from kvserve.engine.gguf_tokenizer import derived_dir

            shutil.rmtree(derived_dir(read_gguf(model)), ignore_errors=True)
        size, pool = model.stat().st_size, parse_bytes(args.kv_cache_memory)
        print(f"{model.name}: {size / 2**20:.0f} MiB file, {pool / 2**20:.0f} MiB KV pool", flush=True)
        starts = []
        for index in range(args.starts):
            vocab_tokens = args.vocab_tokens if index == args.starts - 1 else 0
            got = one_start(model, args.kv_cache_memory, args.extra, vocab_tokens)
            starts.append(got)
            over = got["peak_rss"] - size - pool
            print(f"start {index + 1}: ready in {got['ready_s']:.1f} s (peak RSS {_mib(got['ready_peak_rss'])} MiB); "
                  f"after a request peak RSS {_mib(got['peak_rss'])} MiB (file + pool {over / 2**20:+.0f} MiB), "
                  f"at rest {_mib(got['rss'])} MiB", flush=True)
            if vocab_tokens:
                over = got["vocab_peak_rss"] - size - pool
                print(f"  after {vocab_tokens:,} prompt tokens across the vocabulary: peak RSS "
                      f"{_mib(got['vocab_peak_rss'])} MiB (file + pool {over / 2**20:+.0f} MiB)", flush=True)
        rows.append({"name": model.name, "size": size, "pool": pool, "starts": starts})
    markdown = table(rows, args.vocab_tokens)
    print(markdown)
    if args.write:
        from kvserve.loadtest.publish.benchmarks_md import update_section

        names = " ".join(f"--model {model.name}" for model in args.model)
        fresh = " --fresh" if args.fresh else ""
        body = (markdown + "\n\nEach start: a fresh `kvserve serve` process (kernels already built), timed from "
                "its launch to the first 200 from /health; then one greedy completion of a ~512-token prompt (8 "
                "tokens), so every weight page the model reads is resident (the file is memory-mapped), then the "
                "process's resident set (VmRSS) and its peak since launch (VmHWM), the largest over its starts; "
                + (f"the last start then serves prompts of {args.vocab_tokens:,} token ids drawn across the "
                   "vocabulary (seeded, 2,048 a prompt), as varied text would touch the embedding's rows, and its "
                   "peak is read again; " if args.vocab_tokens else "")
                + "the budget is judged on the largest peak. First start: the file's tokenizer is "
                f"converted into ~/.cache/kvserve{' (emptied first, --fresh)' if args.fresh else ''}; later starts "
                "find it there. The budget: the file's size + the KV pool + 400 MiB.")
        update_section("ready", "Time to ready and resident memory on GGUF files",
                       f"python -m kvserve.loadtest ready {names} --kv-cache-memory {args.kv_cache_memory} "
                       f"--starts {args.starts}{fresh} --vocab-tokens {args.vocab_tokens} --write", body)
    return 0
