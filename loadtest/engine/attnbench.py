"""``python -m kvserve.loadtest kernelbench --attention``: the paged attention kernels alone on a prefill chunk.

One call of ``paged_decode_attention`` (native/csrc/decode_ops.cpp: attend_tile.h's tiles for a float32 cache,
attend_bf16.h's for a bfloat16 one) as a prefill step makes it: the last chunk of 512 rows of a prompt of T tokens,
every row a query attending to its own prefix through the block table (rows_alone prefill), on the threads the
server runs. Head shapes of SmolLM2-135M (9 query / 3 KV heads, d = 64), Llama-3.2-1B (32 / 8, d = 64) and
Llama-3.1-8B (32 / 8, d = 128); T = 512, 2,048 and 8,192; random queries, keys and values.

Multiply-adds: 2 H d per (query, key) pair (q.k and the weight times v), as ``loadtest profile`` counts them; the
rate is set against the measured peak of the arithmetic the cache's kernels run (loadtest/engine/profile_step.py
``attention_peak``: float32 FMAs of the kernels' path, or ``vdpbf16ps`` for a bfloat16 cache on AVX-512 BF16),
times the threads. Wall time, the best of ``REPEATS`` calls: the kernels split a call over the threads, so their
CPU seconds would count a thread's wait for the other; the best call is the one the machine's other work
disturbed least. Written into BENCHMARKS.md's "attention-op" section (``--no-write``: printed only).

"""

from __future__ import annotations

import time

import torch

SHAPES = (("SmolLM2-135M", 9, 3, 64), ("Llama-3.2-1B", 32, 8, 64), ("Llama-3.1-8B", 32, 8, 128))
CONTEXTS = (512, 2048, 8192)
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


def macs(heads: int, dim: int, lens: torch.Tensor) -> int:
    """Multiply-adds of one call: 2 heads dim per (query, key) pair, each row attending to its ``lens`` keys."""
    return 2 * heads * dim * int(lens.sum())


def best_time(ops, args: tuple, repeats: int = REPEATS) -> float:
    """The best wall time (s) of ``repeats`` calls of ``ops.paged_decode_attention`` on ``args``, after one warm
    call (the scores buffers and the pages)."""
    ops.paged_decode_attention(*args)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        ops.paged_decode_attention(*args)
        best = min(best, time.perf_counter() - started)
    return best


def measure(write: bool = True) -> list[str]:
    """Time every shape, context and cache dtype; print each row, and write the table unless ``write`` is False.

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
        for dtype, label in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
            peak = attention_peak(label, dim)
            if peak:
                peaks[label] = peak[1]
            cells = []
            for context in CONTEXTS:
                args = chunk_call(heads, kv_heads, dim, context, dtype)
                best = best_time(ops, args)
                gmacs = macs(heads, dim, args[3]) / best / 1e9
                share = f" ({100 * gmacs / (peak[1] * threads):.0f}%)" if peak else ""
                cells.append(f"{best * 1e3:.1f} ms, {gmacs:.0f} GMAC/s{share}")
                print(f"attention {name} {label} T={context}: {cells[-1]}", flush=True)
            peak_text = f"{peak[0]}, {peak[1]:.0f} GMAC/s" if peak else "-"
            lines.append(f"| {name} ({heads} / {kv_heads} heads, d = {dim}) | {label} | {peak_text} | "
                         + " | ".join(cells) + " |")
    body = (f"{path} path, {threads} threads (the server's). One `paged_decode_attention` call: the last chunk of "
            f"{CHUNK} rows of a T-token prompt, each row attending to its own prefix through the block table "
            f"(blocks of {BLOCK_SIZE}), as a prefill step calls it; the best wall time of {REPEATS} calls. GMAC/s: "
            "2 H d multiply-adds per (query, key) pair; in brackets, % of the measured peak of the arithmetic the "
            "cache's kernels run (per core, times the threads). Each row is exact: every query's softmax over all "
            "its keys in a decode row's order (native/csrc/attend_tile.h), so the float32 rows' multiply-adds are "
            "the least work these bits take.\n\n" + "\n".join(lines))
    if peaks.get("bfloat16", 0) and peaks["bfloat16"] < peaks.get("float32", 0):
        body += ("\n\nOn this CPU `vdpbf16ps` multiply-adds at a lower rate than float32 FMAs (the peaks above), so "
                 "the bfloat16 cache's attention, for all its halved reads, runs slower than the float32 cache's "
                 "(docs/kernels.md).")
    if write:
        update_section("attention-op", "Paged attention alone on a prefill chunk, by prompt length",
                       "python -m kvserve.loadtest kernelbench --attention", body)
    return lines
