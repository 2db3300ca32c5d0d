"""``python -m kvserve.loadtest kernelbench --attention``: the paged attention kernels alone on a prefill chunk.

One call of ``paged_decode_attention`` (native/csrc/decode_ops.cpp: attend_tile.h's tiles for a float32 cache,
attend_bf16.h's for a bfloat16 one), or of ``paged_decode_attention_quant`` for an int8 or int4 cache (kv_quant.cpp:
attend_tile.h's tiles over each chunk's code rows dequantized once per tile) as a prefill step makes it: the last
chunk of 512 rows of a prompt of T tokens, every row a query attending to its own prefix through the block table
(rows_alone prefill), on the threads the server runs. Head shapes of SmolLM2-135M (9 query / 3 KV heads, d = 64),
Llama-3.2-1B (32 / 8, d = 64) and Llama-3.1-8B (32 / 8, d = 128); T = 512, 2,048 and 8,192; random queries, keys
and values.

Multiply-adds: 2 H d per (query, key) pair (q.k and the weight times v), as ``loadtest profile`` counts them; the
rate is set against the measured peak of the arithmetic the cache's kernels run (loadtest/engine/profile_step.py
``attention_peak``: float32 FMAs of the kernels' path, or ``vdpbf16ps`` for a bfloat16 cache on AVX-512 BF16),
times the threads. Wall time, the best of ``REPEATS`` calls: the kernels split a call over the threads, so their
CPU seconds would count a thread's wait for the other; the best call is the one the machine's other work
disturbed least. Written into BENCHMARKS.md's "attention-op" section (``--no-write``: printed only).

Then decode rows reading the cache from memory (``decode_layout``): 32 sequences at context 1,024 with
Llama-3.2-1B's heads, 16 layers' pools (2.1 GB) attended one after the other as a decode step does, once from the
pool as served ([blocks, block_size, H_kv, d]: a KV head's 256 bytes of every 2 KB key row) and once from one pool
per KV head (the same bytes and arithmetic, each head's rows contiguous in a block): what a head-major block layout
would change.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

SHAPES = (("SmolLM2-135M", 9, 3, 64), ("Llama-3.2-1B", 32, 8, 64), ("Llama-3.1-8B", 32, 8, 128))
CONTEXTS = (512, 2048, 8192)
CACHES = ("float32", "bfloat16", "int8", "int4")  # --kv-cache-dtype's
CHUNK = 512
BLOCK_SIZE = 16
REPEATS = 5


def chunk_call(heads: int, kv_heads: int, dim: int, context: int, dtype: torch.dtype) -> tuple:
    """The arguments of ``paged_decode_attention`` for the last ``CHUNK`` rows of a ``context``-token prompt.

    Returns:
        (q [rows, heads, dim], rows [rows], tables [rows, blocks], lens [rows], k_blocks, v_blocks
        [blocks, BLOCK_SIZE, kv_heads, dim] of ``dtype``, scale, window 0, out [rows, heads, dim]), the prompt's
        blocks in order in the pool, as a fresh prompt's are.
    """
    generator = torch.Generator().manual_seed(0)
    blocks = -(-context // BLOCK_SIZE)
    rows = min(CHUNK, context)
    k_blocks = torch.randn(blocks, BLOCK_SIZE, kv_heads, dim, generator=generator).to(dtype)
    v_blocks = torch.randn(blocks, BLOCK_SIZE, kv_heads, dim, generator=generator).to(dtype)
    q = torch.randn(rows, heads, dim, generator=generator)
    lens = torch.arange(context - rows + 1, context + 1)
    tables = torch.arange(blocks).repeat(rows, 1)
    return (q, torch.arange(rows), tables, lens, k_blocks, v_blocks, dim ** -0.5, 0, torch.empty_like(q))


def cache_call(ops, cache: str, heads: int, kv_heads: int, dim: int,
               context: int) -> tuple[Callable[[], None], torch.Tensor] | None:
    """``chunk_call``'s rows over a ``cache`` pool (one of ``CACHES``): a call of its attention op with no
    arguments, and the rows' context lengths; None where the server would refuse the cache for this head size
    (int4 needs a multiple of ``INT4_GROUP``). int8 and int4 pools hold chunk_call's K and V written by
    ``write_kv_quant`` (a scale per head vector for int8, per ``INT4_GROUP`` elements for int4: kvcache/pool.py's)."""
    from kvserve.kvcache.sizing import INT4_GROUP

    if cache in ("float32", "bfloat16"):
        args = chunk_call(heads, kv_heads, dim, context, getattr(torch, cache))
        return lambda: ops.paged_decode_attention(*args), args[3]
    bits = {"int8": 8, "int4": 4}[cache]
    if bits == 4 and dim % INT4_GROUP:
        return None
    q, rows, tables, lens, k, v, scale, window, out = chunk_call(heads, kv_heads, dim, context, torch.float32)
    group = dim if bits == 8 else INT4_GROUP
    codes = [torch.zeros(*k.shape[:3], dim * bits // 8, dtype=torch.int8 if bits == 8 else torch.uint8)
             for _ in range(2)]
    scales = [torch.zeros(*k.shape[:3], dim // group, dtype=torch.float16) for _ in range(2)]
    ops.write_kv_quant(codes[0].flatten(0, 1), scales[0].flatten(0, 1), codes[1].flatten(0, 1),
                       scales[1].flatten(0, 1), torch.arange(k.shape[0] * k.shape[1]), k.flatten(0, 1),
                       v.flatten(0, 1), bits)
    return (lambda: ops.paged_decode_attention_quant(q, rows, tables, lens, codes[0], scales[0], codes[1], scales[1],
                                                     bits, scale, window, out)), lens


def macs(heads: int, dim: int, lens: torch.Tensor) -> int:
    """Multiply-adds of one call: 2 heads dim per (query, key) pair, each row attending to its ``lens`` keys."""
    return 2 * heads * dim * int(lens.sum())


def best_time(call: Callable[[], None], repeats: int = REPEATS) -> float:
    """The best wall time (s) of ``repeats`` calls of ``call``, after one warm call (the scores buffers and the
    pages)."""
    call()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return best


DECODE_SEQUENCES, DECODE_CONTEXT, DECODE_LAYERS = 32, 1024, 16


def decode_call(heads: int, kv_heads: int, dim: int, generator: torch.Generator) -> tuple:
    """``paged_decode_attention``'s arguments for ``DECODE_SEQUENCES`` decode rows at ``DECODE_CONTEXT`` keys each,
    their blocks scattered over the pool (as a pool's free list hands them out after a while)."""
    per_sequence = DECODE_CONTEXT // BLOCK_SIZE
    blocks = DECODE_SEQUENCES * per_sequence
    k_blocks = torch.randn(blocks, BLOCK_SIZE, kv_heads, dim, generator=generator)
    v_blocks = torch.randn(blocks, BLOCK_SIZE, kv_heads, dim, generator=generator)
    q = torch.randn(DECODE_SEQUENCES, heads, dim, generator=generator)
    tables = torch.randperm(blocks, generator=generator).view(DECODE_SEQUENCES, per_sequence)
    lens = torch.full((DECODE_SEQUENCES,), DECODE_CONTEXT)
    return (q, torch.arange(DECODE_SEQUENCES), tables, lens, k_blocks, v_blocks, dim ** -0.5, 0, torch.empty_like(q))


def decode_layout(ops, heads: int = 32, kv_heads: int = 8, dim: int = 64) -> list[str]:
    """A decode step's attention over ``DECODE_LAYERS`` layers' float32 pools from memory, as served and with one
    pool per KV head; the best of 4 steps each, the two alternating. Returns the markdown lines of the table."""
    generator = torch.Generator().manual_seed(0)
    served = [decode_call(heads, kv_heads, dim, generator) for _ in range(DECODE_LAYERS)]
    per_head = [[decode_call(heads // kv_heads, 1, dim, generator) for _ in range(kv_heads)]
                for _ in range(DECODE_LAYERS)]
    steps = {"as served": lambda: [ops.paged_decode_attention(*c) for c in served],
             "one pool per KV head": lambda: [ops.paged_decode_attention(*c) for layer in per_head for c in layer]}
    best = {name: float("inf") for name in steps}
    for step in steps.values():
        step()
    for _ in range(4):
        for name, step in steps.items():
            started = time.perf_counter()
            step()
            best[name] = min(best[name], time.perf_counter() - started)
    nbytes = DECODE_LAYERS * 2 * DECODE_SEQUENCES * DECODE_CONTEXT * kv_heads * dim * 4
    lines = ["| pool layout | step's attention, ms | GB/s of K and V |", "|---|---:|---:|"]
    for name, seconds in best.items():
        lines.append(f"| {name} | {seconds * 1e3:.1f} | {nbytes / seconds / 1e9:.1f} |")
        print(f"decode attention {name}: {seconds * 1e3:.1f} ms", flush=True)
    return lines


def measure(write: bool = True, decode: bool = True) -> list[str]:
    """Time every shape, context and cache dtype, then (``decode``) ``decode_layout``; print each row, and write the
    tables unless ``write`` is False.

    Returns:
        The markdown lines of the table.

    Raises:
        RuntimeError: the decode ops extension is not built (nothing to measure).
    """
    from kvserve import native
    from kvserve.loadtest.engine.profile_step import attention_peak
    from kvserve.loadtest.publish.benchmarks_md import update_section

    ops = native.load_ops()
    if ops is None:
        raise RuntimeError("the decode ops extension is not built: `python -m kvserve.native --build` says why")
    threads = torch.get_num_threads()
    module = native.load()
    path = module.isa() if module is not None else "scalar"
    peaks: dict[str, float] = {}
    lines = ["| model's heads | cache | peak (per core) | " + " | ".join(f"T = {t:,}" for t in CONTEXTS) + " |",
             "|---|---|---|" + "---:|" * len(CONTEXTS)]
    for name, heads, kv_heads, dim in SHAPES:
        for label in CACHES:
            peak = attention_peak(label, dim)
            if peak:
                peaks[label] = peak[1]
            if cache_call(ops, label, heads, kv_heads, dim, 1) is None:
                continue
            cells = []
            for context in CONTEXTS:
                call, lens = cache_call(ops, label, heads, kv_heads, dim, context)
                best = best_time(call)
                gmacs = macs(heads, dim, lens) / best / 1e9
                share = f" ({100 * gmacs / (peak[1] * threads):.0f}%)" if peak else ""
                cells.append(f"{best * 1e3:.1f} ms, {gmacs:.0f} GMAC/s{share}")
                print(f"attention {name} {label} T={context}: {cells[-1]}", flush=True)
            peak_text = f"{peak[0]}, {peak[1]:.0f} GMAC/s" if peak else "-"
            lines.append(f"| {name} ({heads} / {kv_heads} heads, d = {dim}) | {label} | {peak_text} | "
                         + " | ".join(cells) + " |")
    body = (f"{path} path, {threads} threads (the server's). One `paged_decode_attention` call (for an int8 or int4 "
            "cache `paged_decode_attention_quant`: the float32 tiles over each chunk's code rows dequantized once "
            "per tile, the bits of each row alone): the last chunk of "
            f"{CHUNK} rows of a T-token prompt, each row attending to its own prefix through the block table "
            f"(blocks of {BLOCK_SIZE}), as a prefill step calls it; the best wall time of {REPEATS} calls. GMAC/s: "
            "2 H d multiply-adds per (query, key) pair; in brackets, % of the measured peak of the arithmetic the "
            "cache's kernels run (per core, times the threads). Each row is exact: every query's softmax over all "
            "its keys in a decode row's order (native/csrc/attend_tile.h), so the float32 rows' multiply-adds are "
            "the least work these bits take.\n\n" + "\n".join(lines))
    layout = decode_layout(ops) if decode else []
    body += "" if not decode else (f"\n\nDecode rows from memory: {DECODE_SEQUENCES} sequences at context {DECODE_CONTEXT:,} with "
             f"Llama-3.2-1B's heads, {DECODE_LAYERS} layers' float32 pools "
             f"({DECODE_LAYERS * 2 * DECODE_SEQUENCES * DECODE_CONTEXT * 8 * 64 * 4 / 1e9:.1f} GB) attended one "
             "after the other as a decode step does, the best of 4 steps; as served, a task (one sequence, one KV "
             "head) reads 256 bytes of every 2 KB key row of the pool's [blocks, block_size, H_kv, d]; with one pool "
             "per KV head the same bytes and arithmetic lie contiguous in each block (a head-major block layout).\n\n"
             + "\n".join(layout))
    if peaks.get("bfloat16", 0) and peaks["bfloat16"] < peaks.get("float32", 0):
        body += ("\n\nOn this CPU `vdpbf16ps` multiply-adds at a lower rate than float32 FMAs (the peaks above), so "
                 "the bfloat16 cache's attention, for all its halved reads, runs slower than the float32 cache's "
                 "(docs/kernels.md).")
    if write:
        update_section("attention-op", "Paged attention alone on a prefill chunk, by prompt length",
                       "python -m kvserve.loadtest kernelbench --attention", body)
    return lines
