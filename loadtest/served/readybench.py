"""``python -m kvserve.loadtest ready``: how long ``kvserve serve --model FILE.gguf`` takes to be ready, and its
peak resident memory against the file's size plus the KV pool.

Each start is a fresh ``kvserve serve`` process (the C++ kernels already built: their build is a one-off of its
own), timed from its launch to the first 200 from /health; then its peak resident set (VmHWM, /proc) and its
resident set at rest (VmRSS) are read, and the server is stopped. The first start converts the file's tokenizer
into the cache (``--fresh`` empties that entry first); the ones after find it there.

    python -m kvserve.loadtest randgguf --shape llama-3.2-1b --mix Q4_K_M /tmp/llama-1b-q4_k_m.gguf
    python -m kvserve.loadtest ready --model /tmp/llama-1b-q4_k_m.gguf --kv-cache-memory 1GiB --fresh --starts 2
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

from kvserve.loadtest.argtypes import absolute_path
from kvserve.loadtest.errors import UsageError
from kvserve.loadtest.procs.serverproc import kvserve_command, launch


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def parse_bytes(text: str) -> int:
    """``1GiB`` / ``512MiB`` / a plain number of bytes -> bytes."""
    units = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10}
    for unit, size in units.items():
        if text.endswith(unit):
            return int(float(text.removesuffix(unit)) * size)
    return int(text)


def one_start(model: Path, kv_memory: str, extra: list[str]) -> dict:
    """Start kvserve on ``model``; seconds to ready, and peak and resting resident memory (bytes)."""
    started = time.perf_counter()
    command = kvserve_command(["--model", str(model), "--kv-cache-memory", kv_memory, *extra])
    with launch(command, name="ready", start_timeout_s=1800) as server:
        ready_s = time.perf_counter() - started
        peak = _status_kib(server.pid, "VmHWM") * 1024
        rest = _status_kib(server.pid, "VmRSS") * 1024
    return {"ready_s": ready_s, "peak_rss": peak, "rss": rest}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=absolute_path, required=True, help="the GGUF file")
    parser.add_argument("--kv-cache-memory", default="1GiB", help="as kvserve serve's")
    parser.add_argument("--starts", type=int, default=2, help="starts, one after another")
    parser.add_argument("--fresh", action="store_true", help="delete the file's cached tokenizer first")
    parser.add_argument("extra", nargs="*", help="more kvserve serve flags (after --)")


def run(args: argparse.Namespace) -> int:
    """Start the server ``--starts`` times and print one line per start.

    Raises:
        UsageError: the model is not a .gguf file.
    """
    if args.model.suffix != ".gguf" or not args.model.is_file():
        raise UsageError(f"--model {str(args.model)!r} is not a .gguf file")
    if args.fresh:
        from kvserve.engine.gguf_file import read_gguf
        from kvserve.engine.gguf_tokenizer import derived_dir

        shutil.rmtree(derived_dir(read_gguf(args.model)), ignore_errors=True)
    size, pool = args.model.stat().st_size, parse_bytes(args.kv_cache_memory)
    print(f"{args.model.name}: {size / 2**20:.0f} MiB file, {pool / 2**20:.0f} MiB KV pool")
    for index in range(args.starts):
        got = one_start(args.model, args.kv_cache_memory, args.extra)
        over = got["peak_rss"] - size - pool
        print(f"start {index + 1}: ready in {got['ready_s']:.1f} s; peak RSS {got['peak_rss'] / 2**20:.0f} MiB "
              f"(file + pool {over / 2**20:+.0f} MiB), at rest {got['rss'] / 2**20:.0f} MiB")
    return 0
