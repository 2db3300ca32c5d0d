"""``python -m kvserve.loadtest tables``: the chapter's KV-cache tables, measured on our engine.

1. head: one attention head (d = 64, float32), one decode step against a cache of n keys vs recomputing
   the full causal n x n attention; time and score-matrix bytes (4 B per score).
2. macs: multiply-accumulates to generate T tokens from a cold start, with and without a cache, for
   SmolLM2's geometry (``loadtest.engine.macs``, closed form checked against a count on the real model).
3. prefill/decode: our runner over a KVPool: prefill time per prompt token for P = 16..1024, and one decode
   step's time against a cache of C = 16..1024 tokens.
4. batch: B = 1..32 sequences, each with a 64-token cache, decoding one token in one step: step latency and
   throughput, as multiples of B = 1, and the elbow (below).
5. memory: peak memory beyond the weights for 256 generated tokens, with and without the cache
   (``loadtest.engine.memprobe``, one subprocess each).

Timings are medians of ``--reps`` runs after a warm-up, taken round-robin across the sizes of a table.
Results are kept in ``loadtest/out/tables.json``, so ``--only NAME`` refreshes one table of the
``tables`` section of BENCHMARKS.md and leaves the others.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvserve.loadtest.engine import macs
from kvserve.loadtest.loadgen.report import OUT_DIR
from kvserve.loadtest.procs.serverproc import REPO
from kvserve.loadtest.publish.benchmarks_md import BENCHMARKS, update_section

TABLES = ("head", "macs", "prefill", "batch", "memory")
FULL = {"head": [64, 128, 256, 512, 1024, 2048, 4096], "macs": [16, 64, 256, 1024, 4096],
        "prefill": [16, 32, 64, 128, 256, 512, 1024], "batch": [1, 2, 4, 8, 16, 32], "memory": 256}
QUICK = {"head": [16, 64], "macs": [4, 16], "prefill": [16, 32], "batch": [1, 2], "memory": 16}
MAC_CHECK_TOKENS = 8  # counted on the real model at this T, compared with the closed form


def _median_time(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def head_table(sizes: list[int], reps: int, d: int = 64) -> list[dict]:
    """One head: cached decode (1 query x n keys) vs full recompute (n x n causal scores), float32."""
    torch.manual_seed(0)
    rows = []
    for n in sizes:
        q, k, v = (torch.randn(n, d) for _ in range(3))  # [n, d] each
        mask = torch.ones(n, n, dtype=torch.bool).tril()  # [n, n] causal

        def cached() -> torch.Tensor:
            scores = (q[-1:] @ k.T) / math.sqrt(d)  # [1, n]
            return scores.softmax(-1) @ v  # [1, d]

        def recompute() -> torch.Tensor:
            scores = (q @ k.T) / math.sqrt(d)  # [n, n]
            return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v  # [n, d]

        with torch.inference_mode():
            t_cached, t_full = _median_time(cached, reps), _median_time(recompute, reps)
        rows.append({"n": n, "cached_ms": 1000 * t_cached, "recompute_ms": 1000 * t_full,
                     "cached_score_bytes": 4 * n, "recompute_score_bytes": 4 * n * n})
    return rows


def macs_table(tokens: list[int], loaded) -> tuple[list[dict], dict]:
    """Closed-form MACs for SmolLM2 at each T, and a count on the real model at ``MAC_CHECK_TOKENS``."""
    g = macs.Geometry.of(loaded.model.config)
    rows = [{"T": t, "with_cache": macs.macs_with_cache(g, t), "without_cache": macs.macs_without_cache(g, t)}
            for t in tokens]
    return rows, count_macs(loaded, MAC_CHECK_TOKENS)


def count_macs(loaded, tokens: int) -> dict:
    """Generate ``tokens`` tokens both ways under ``MacCounter``; returns counted and closed-form MACs."""
    import copy

    from kvserve.engine.plan import StepPlan
    from kvserve.loadtest.engine.enginebench import EngineBench

    g = macs.Geometry.of(loaded.model.config)
    # Block size 1: decodes gather whole blocks and mask the tail, so larger blocks add masked keys to the count.
    bench = EngineBench(loaded, 1, tokens + 1, block_size=1)
    fast = bench.runner.fast
    # the C++ projection kernels are invisible to dispatch: count on torch's own ops
    with macs.MacCounter() as cached, (fast.aten_ops() if fast else contextlib.nullcontext()):
        ids = [1]
        for t in range(1, tokens + 1):
            work = bench.prefill(0, ids) if t == 1 else bench.decode(0, t - 1, ids[-1])
            ids.append(bench.runner.execute(StepPlan([work]))[0].token.token_id)
    plain = copy.deepcopy(loaded.model)
    plain.set_attn_implementation("sdpa")
    with macs.MacCounter() as full, torch.inference_mode():
        ids = [1]
        for _ in range(tokens):
            logits = plain(input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=1).logits  # [1, 1, V]
            ids.append(int(logits[0, -1].argmax()))
    return {"T": tokens, "counted_with_cache": cached.macs, "formula_with_cache": macs.macs_with_cache(g, tokens),
            "counted_without_cache": full.macs, "formula_without_cache": macs.macs_without_cache(g, tokens)}


def prefill_decode_table(sizes: list[int], loaded, reps: int) -> list[dict]:
    """Prefill of P tokens (per-token time) and one decode step against a cache of C = P tokens."""
    from kvserve.loadtest.engine.enginebench import EngineBench, dummy_ids

    bench = EngineBench(loaded, 2, max(sizes) + 1)
    bench.fill(1, max(sizes))  # sequence 1 holds the longest cache; a decode at C reads its first C slots
    prefill_s = bench.time_plans([[bench.prefill(0, dummy_ids(n))] for n in sizes], reps=reps)
    decode_s = bench.time_plans([[bench.decode(1, n)] for n in sizes], reps=reps)
    return [{"tokens": n, "prefill_ms": 1000 * p, "prefill_ms_per_token": 1000 * p / n, "decode_step_ms": 1000 * d}
            for n, p, d in zip(sizes, prefill_s, decode_s)]


def batch_table(batches: list[int], loaded, reps: int, context: int = 64) -> tuple[list[dict], int | None]:
    """Decode steps of B sequences with ``context``-token caches; returns rows and the elbow (``find_elbow``)."""
    from kvserve.loadtest.engine.enginebench import EngineBench

    bench = EngineBench(loaded, max(batches), context + 1)
    for s in range(max(batches)):
        bench.fill(s, context)
    latencies = bench.time_plans([[bench.decode(s, context) for s in range(b)] for b in batches], reps=reps)
    rows = [{"B": b, "step_ms": 1000 * latency, "tokens_per_s": b / latency} for b, latency in zip(batches, latencies)]
    for row in rows:
        row["latency_x"] = row["step_ms"] / rows[0]["step_ms"]
        row["throughput_x"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
    return rows, find_elbow([(r["B"], r["step_ms"]) for r in rows])


def find_elbow(points: list[tuple[int, float]]) -> int | None:
    """The batch from which batching stops paying: the smallest B such that every doubling from B on
    multiplies step latency by sqrt(2) or more. ``points`` are (B, step latency), B doubling each time.

    Doubling B multiplies throughput by 2 / g when latency grows by g; from g = sqrt(2) on, the throughput
    gained is no larger than the latency paid. None when the sweep's last doubling still pays.
    """
    elbow = None
    for (b, latency), (b_next, latency_next) in reversed(list(zip(points, points[1:]))):
        if b_next != 2 * b or latency_next / latency < math.sqrt(2):
            break
        elbow = b
    return elbow


def memory_table(tokens: int) -> list[dict]:
    """Run ``loadtest.engine.memprobe`` for both modes in fresh subprocesses."""
    rows = []
    for mode in ("nocache", "cache"):
        out = subprocess.run([sys.executable, "-m", "kvserve.loadtest.engine.memprobe", mode, str(tokens)], cwd=REPO,
                             capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return rows


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} KB"


def render(results: dict, kv_bytes_per_token: int | None) -> str:
    """Markdown for whichever tables were run."""
    parts = []
    if "head" in results:
        rows = ["| n | cached step ms | recompute ms | time x | cached scores | recomputed scores |",
                "|---|---|---|---|---|---|"]
        rows += [f"| {r['n']} | {r['cached_ms']:.3f} | {r['recompute_ms']:.2f} "
                 f"| {r['recompute_ms'] / r['cached_ms']:.0f} | {_mb(r['cached_score_bytes'])} "
                 f"| {_mb(r['recompute_score_bytes'])} |" for r in results["head"]]
        parts.append("### One head (d = 64): decode step with a cache vs full recompute\n\n" + "\n".join(rows))
    if "macs" in results:
        rows_, check = results["macs"]
        rows = ["| T | MACs with cache | MACs without | ratio |", "|---|---|---|---|"]
        rows += [f"| {r['T']} | {r['with_cache']:.3e} | {r['without_cache']:.3e} | "
                 f"{r['without_cache'] / r['with_cache']:.1f}x |" for r in rows_]
        agree = (check["counted_with_cache"] == check["formula_with_cache"]
                 and check["counted_without_cache"] == check["formula_without_cache"])
        parts.append("### MACs to generate T tokens from a cold start (SmolLM2-135M)\n\n" + "\n".join(rows)
                     + f"\n\nCounted on the model at T = {check['T']} "
                       "(ATen-level matmul/SDPA counter, 1-token blocks): "
                       f"{check['counted_with_cache']:,} with cache, {check['counted_without_cache']:,} without; "
                       f"the closed form {'agrees exactly' if agree else 'DISAGREES'}.")
    if "prefill" in results:
        rows = ["| P or C (tokens) | prefill ms | prefill ms/token | decode step ms (cache C) |", "|---|---|---|---|"]
        rows += [f"| {r['tokens']} | {r['prefill_ms']:.1f} | {r['prefill_ms_per_token']:.2f} "
                 f"| {r['decode_step_ms']:.1f} |" for r in results["prefill"]]
        first, last = results["prefill"][0], results["prefill"][-1]
        parts.append("### Prefill time per prompt token, decode step time per cache length\n\n" + "\n".join(rows)
                     + f"\n\nFrom {first['tokens']} to {last['tokens']} tokens prefill grows "
                       f"{last['prefill_ms'] / first['prefill_ms']:.1f}x and a decode step "
                       f"{last['decode_step_ms'] / first['decode_step_ms']:.2f}x.")
    if "batch" in results:
        rows_ = results["batch"][0]
        elbow = find_elbow([(r["B"], r["step_ms"]) for r in rows_])
        rows = ["| B | step ms | tokens/s | latency x B=1 | throughput x B=1 |", "|---|---|---|---|---|"]
        rows += [f"| {r['B']} | {r['step_ms']:.1f} | {r['tokens_per_s']:.1f} | {r['latency_x']:.2f} | "
                 f"{r['throughput_x']:.2f} |" for r in rows_]
        parts.append("### Batch sweep: B sequences with 64-token caches, one decode step\n\n" + "\n".join(rows)
                     + "\n\nElbow (the B from which every doubling costs >= sqrt(2) x step latency, so "
                       f"throughput gains no more than latency loses): **{elbow if elbow else 'not reached'}**.")
    if "memory" in results:
        tokens = results["memory"][0]["tokens"]
        rows = [f"| generation of {tokens} tokens | peak tensor bytes beyond weights | RSS high-water beyond load |",
                "|---|---|---|"]
        rows += [f"| {'with KV cache' if r['mode'] == 'cache' else 'without cache (recompute)'} | "
                 f"{_mb(r['peak_tensor_bytes'])} | {_mb(r['rss_extra_bytes'])} |" for r in results["memory"]]
        note = f" The cache itself: {kv_bytes_per_token:,} bytes/token." if kv_bytes_per_token else ""
        parts.append("### Peak memory beyond the weights\n\n" + "\n".join(rows) + "\n\n"
                     "Method: `loadtest/engine/memprobe.py` (peak of live tensors created while generating; RSS is "
                     "noisier because the allocator reuses memory freed while loading)." + note)
    return "\n\n".join(parts)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", default=",".join(TABLES), help=f"comma list of {', '.join(TABLES)}")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CI smoke); does not touch BENCHMARKS.md")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per point")
    parser.add_argument("--results", type=Path, default=OUT_DIR / "tables.json",
                        help="results kept across runs, so --only refreshes one table of the section")
    parser.add_argument("--benchmarks", type=Path, default=BENCHMARKS)
    parser.add_argument("--no-write", action="store_true")


def run(args: argparse.Namespace) -> int:
    chosen = [name for name in args.only.split(",") if name]  # none: rebuild the section from --results
    unknown = set(chosen) - set(TABLES)
    if unknown:
        raise SystemExit(f"unknown tables: {', '.join(sorted(unknown))}")
    sizes = QUICK if args.quick else FULL
    results: dict = {}
    loaded = None
    if set(chosen) & {"macs", "prefill", "batch", "memory"}:
        from kvserve.loadtest.engine.enginebench import load

        loaded = load()
    for name in chosen:
        if name == "head":
            results[name] = head_table(sizes[name], args.reps)
        elif name == "macs":
            results[name] = macs_table(sizes[name], loaded)
        elif name == "prefill":
            results[name] = prefill_decode_table(sizes[name], loaded, args.reps)
        elif name == "batch":
            results[name] = batch_table(sizes[name], loaded, args.reps)
        else:
            results[name] = memory_table(sizes[name])
    if not args.quick:
        results = _merge(results, args.results)
    text = render(results, _kv_bytes_per_token(loaded))
    print(text)
    if not (args.quick or args.no_write):
        dtype = str(loaded.dtype).removeprefix("torch.") if loaded else "float32"
        update_section("tables", f"The chapter's KV-cache tables on our engine (SmolLM2-135M, {dtype})",
                       "python -m kvserve.loadtest tables", text, args.benchmarks)
    return 0


def _merge(results: dict, path: Path) -> dict:
    """Overlay this run's tables on those kept in ``path`` and save; returns every table known."""
    kept = json.loads(path.read_text()) if path.exists() else {}
    kept.update(results)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(kept, indent=1))
    return {name: kept[name] for name in TABLES if name in kept}


def _kv_bytes_per_token(loaded) -> int:
    """KV bytes per token of the model as loaded (or, without loading it, at the default dtype)."""
    if loaded is not None:
        return loaded.kv_shape().bytes_per_token
    from transformers import AutoConfig

    from kvserve.engine.loader import DType, kv_shape_of, resolve_dtype, resolve_model_dir

    config = AutoConfig.from_pretrained(resolve_model_dir(None))
    return kv_shape_of(config, resolve_dtype(DType.AUTO, torch.device("cpu"))).bytes_per_token
