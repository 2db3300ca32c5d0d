"""``python -m kvserve.loadtest kvcache``: what each KV cache dtype holds and how fast it decodes, side by side.

Per ``--kv-cache-dtype`` (float32 = the model's own here, bfloat16, int8, int4), in one run:

- capacity: bytes per token (the start-up log's formula, scales included), the blocks a ``--kv-cache-memory``
  budget holds and how many 2,048-token sequences fit (``ServerState.log_capacity``'s count);
- decode speed: tokens/s of an all-decode greedy step of S streams, each attending to its own C-token context
  (its own blocks: no two streams read the same cache lines), for each (S, C) asked (the median of
  ``--repeats`` steps after a warm-up). The cache's contents do not change the work, so the pool is not filled.

The model runs as ``kvserve serve`` runs it by default on a CPU (``--weights gguf``: the GGUF's own blocks, float32
activations; ``--weights float32``: full precision), so ``auto`` is a float32 cache (the C++ paths: float32 and
int8 / int4 caches; a bfloat16 cache under float32 activations takes torch's gather and SDPA).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from kvserve.loadtest.errors import UsageError

CACHES = ("auto", "bfloat16", "int8", "int4")
_SEQUENCE = 2048  # tokens per sequence in the capacity column, as the start-up log counts


def _workloads(text: str) -> list[tuple[int, int]]:
    """``32x2048,8x8192`` -> ``[(32, 2048), (8, 8192)]`` (streams x context tokens)."""
    try:
        pairs = [tuple(int(n) for n in item.lower().split("x")) for item in text.split(",") if item.strip()]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise argparse.ArgumentTypeError(f"expected STREAMSxCONTEXT[,...] such as 32x2048,8x8192, got {text!r}")
    return pairs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-cache-memory", default="1GiB", help="budget of the capacity column (default 1GiB)")
    parser.add_argument("--workloads", type=_workloads, default=_workloads("32x2048,8x8192"),
                        help="decode workloads, STREAMSxCONTEXT comma-separated (default 32x2048,8x8192)")
    parser.add_argument("--caches", default=",".join(CACHES), help=f"cache dtypes (default {','.join(CACHES)})")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per workload, after a warm-up")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--weights", choices=["gguf", "float32"], default="gguf",
                        help="gguf (default, as kvserve serve): the GGUF's own blocks; float32: full precision")


def capacity(loaded, cache: str, budget: int, block_size: int) -> dict:
    """The start-up log's numbers for ``cache``: bytes/token, blocks and 2,048-token sequences in ``budget``."""
    from kvserve.kvcache.sizing import KVCacheDType, num_blocks_for_budget

    shape = loaded.kv_shape(KVCacheDType(cache))
    blocks = num_blocks_for_budget(shape, block_size, budget)
    return {"bytes_per_token": shape.bytes_per_token, "formula": shape.formula(), "blocks": blocks,
            "sequences": blocks * block_size // _SEQUENCE}


def decode_tokens_per_s(loaded, cache: str, streams: int, context: int, block_size: int, repeats: int) -> float:
    """Tokens/s of all-decode steps of ``streams`` rows, each over its own ``context``-token context."""
    from kvserve.engine.plan import SamplingParams, SeqWork, StepPlan
    from kvserve.engine.runner import ModelRunner
    from kvserve.kvcache.pool import KVPool, storage_dtype
    from kvserve.kvcache.sizing import KVCacheDType

    shape = loaded.kv_shape(KVCacheDType(cache))
    per_seq = -(-context // block_size)
    pool = KVPool(shape, streams * per_seq, block_size, storage_dtype(shape, loaded.dtype), loaded.device)
    runner = ModelRunner(loaded, pool)
    greedy = SamplingParams(temperature=0.0)
    work = []
    for s in range(streams):
        table = list(range(s * per_seq, (s + 1) * per_seq))
        position = context - 1
        slot = table[position // block_size] * block_size + position % block_size
        work.append(SeqWork(s, [42], position, table, [slot], True, greedy, [42], []))
    plan = StepPlan(work)
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        runner.execute(plan)
        times.append(time.perf_counter() - started)
    del runner, pool
    gc.collect()
    return streams / statistics.median(times[1:])


def run(args: argparse.Namespace) -> int:
    from kvserve import native
    from kvserve.engine.loader import Device, DType, load_model
    from kvserve.kvcache.sizing import KVCacheDType, parse_bytes

    caches = [c.strip() for c in args.caches.split(",") if c.strip()]
    for cache in caches:
        try:
            KVCacheDType(cache)
        except ValueError:
            raise UsageError(f"--caches: {cache!r} is not one of {', '.join(d.value for d in KVCacheDType)}") from None
    if args.repeats < 1:
        raise UsageError("--repeats must be >= 1")
    budget = parse_bytes(args.kv_cache_memory)
    if args.weights == "gguf":
        from kvserve.engine import weights
        from kvserve.quant.options import Scheme

        loaded = load_model(None, DType.AUTO, Device.CPU, quantized=True, blocks=True)
        described = weights.apply(loaded, Scheme.GGUF, None)
    else:
        loaded = load_model(None, DType.FLOAT32, Device.CPU)
        described = "full precision (float32)"
    rows = []
    for cache in caches:
        row = {"cache": "float32 (auto)" if cache == "auto" else cache,
               **capacity(loaded, cache, budget, args.block_size)}
        for streams, context in args.workloads:
            print(f"{cache}: {streams} streams x {context} tokens ...", flush=True)
            row[f"{streams}x{context}"] = decode_tokens_per_s(loaded, cache, streams, context, args.block_size,
                                                              args.repeats)
        rows.append(row)
    base = rows[0]
    names = [f"{s}x{c}" for s, c in args.workloads]
    print(f"\nSmolLM2-135M, weights: {described}, {str(loaded.dtype).removeprefix('torch.')} activations; "
          f"kernels: {native.isa()}; capacity at --kv-cache-memory "
          f"{args.kv_cache_memory}; decode tokens/s (median of {args.repeats} steps), ratio to {base['cache']}\n")
    print("| KV cache | bytes/token | blocks | 2,048-token sequences | vs float32 | "
          + " | ".join(f"{n} tok/s | vs float32" for n in names) + " |")
    print("|---|---:|---:|---:|---:|" + "---:|---:|" * len(names))
    for r in rows:
        cells = " | ".join(f"{r[n]:.1f} | {r[n] / base[n]:.2f}x" for n in names)
        print(f"| {r['cache']} | {r['bytes_per_token']:,} | {r['blocks']:,} | {r['sequences']} | "
              f"{r['sequences'] / base['sequences']:.2f}x | {cells} |")
    return 0
