"""The GGUF block kernels measured against the machine's own limits (``kernelbench --ggml`` / ``--ggml-model``).

1. ``--ggml``: every format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) on each ISA path this CPU runs (one
   process per path, forced with ``KVSERVE_ISA``), one thread timed in CPU seconds (``time.thread_time``: per core,
   even on a machine shared with other work), on pages the allocator keeps (``KEEP_PAGES``). The work is one layer
   of Llama-3.2-1B (q and o 2048 x 2048, k and v 512 x 2048, gate and up 8192 x 2048, down 2048 x 8192), all seven
   projections in the format, at 1 row (a decode step alone), 8 and 32 (decode batches) and 512 (the scheduler's
   prefill chunk). Reported, the paths side by side: at 1 row the weight GB/s (the layer's bytes read per second;
   a layer is larger than the L3, and copies of it are cycled) and its share of one thread's measured read
   bandwidth; at 8, 32 and 512 rows the rows (tokens) through the layer per second, and at 512 the share of the
   core's measured vpdpbusd peak (AVX-512 path). ``--kinds``, ``--stream-mb`` and ``--budget-s`` make a small run
   (a busy machine); ``--no-write`` leaves BENCHMARKS.md alone.
2. ``--ggml-model``: a decode step's projections of a Q4_K_M file of Llama-3.2-1B's shape (llama.cpp's mixture:
   Q6_K for attn_v and ffn_down in half the layers and for the tied output/embedding table, Q4_K elsewhere; 805 MB),
   all 112 projections and the LM head in a row with the server's threads, at 1, 8 and 32 rows (a decode batch),
   against the read bound: the step's bytes over the read bandwidth the same threads measure; at 1 and 8 rows side
   by side with the same bytes on 4 KiB pages (``on_small_pages``: the packing advises huge pages,
   native/csrc/huge_pages.h, as numpy does for the read probe's buffers).

Both roofline probes are loadtest.engine.roofline's: ``read_bandwidth`` (``kv_read_bytes``) and ``int8_peak_gmacs``
(``kv_vnni_peak``: 16 independent vpdpbusd chains on registers).
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time

import numpy as np
import torch

from kvserve.loadtest.engine.roofline import STREAM_BYTES, int8_peak_gmacs, read_bandwidth

KINDS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k")
# (N, K) of one Llama-3.2-1B layer's projections: q, k, v, o, gate, up, down
LAYER = ((2048, 2048), (512, 2048), (512, 2048), (2048, 2048), (8192, 2048), (8192, 2048), (2048, 8192))
ROWS = (1, 8, 32, 512)
LAYERS, VOCAB, WIDTH = 16, 128256, 2048
# glibc's allocator in the --ggml children: blocks up to 32 MiB from the heap, never handed back, so each call's
# outputs reuse pages already touched. Otherwise fresh outputs (up to 16 MB a call) may come as new pages, zeroed
# by the kernel at their first write, and that cost, in the thread's CPU time, varies with the allocator's state.
KEEP_PAGES = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296"


def _per_call(fn, budget_s: float = 0.3) -> float:
    """CPU seconds of this thread per call of ``fn`` over at least ``budget_s``, after one warm call."""
    fn()
    calls, started = 0, time.thread_time()
    while time.thread_time() - started < budget_s or calls < 2:
        fn()
        calls += 1
    return (time.thread_time() - started) / calls


def _bound_layer(module, kind: str, rng: np.random.Generator) -> tuple[list, int]:
    """The layer's seven projections in ``kind``, bound (``bind_ggml``), and their bytes."""
    from kvserve.native.ggml_leaves import random_units

    bound, nbytes = [], 0
    for N, K in LAYER:
        raw = torch.from_numpy(random_units(kind, N, K, rng))
        bound.append((module.bind_ggml(module.ggml_pack(raw, kind), kind, N, K), K))
        nbytes += raw.numel()
    return bound, nbytes


@torch.inference_mode()
def ggml_path(kinds: tuple[str, ...] = KINDS, stream_mb: int = STREAM_BYTES >> 20, budget_s: float = 0.3) -> None:
    """In this process (on the ISA path KVSERVE_ISA forces), one thread: ``key=value`` lines, the read bandwidth and
    peak first, then one per (kind, rows).

    Args:
        kinds: the formats to measure.
        stream_mb: MB of copies of the layer cycled at 1 row (past the L3: the weights come from memory).
        budget_s: CPU seconds per measurement, after one warm call.
    """
    from kvserve import native

    torch.set_num_threads(1)
    module = native.load()
    isa = module.isa()
    peak = (int8_peak_gmacs() or 0.0) if isa == "avx512" else 0.0
    print(f"isa={isa} kind=roofline rows=0 gbs={read_bandwidth(nbytes=stream_mb << 20):.2f} gmacs={peak:.1f} "
          "rows_s=0", flush=True)
    rng = np.random.default_rng(0)
    macs = sum(N * K for N, K in LAYER)
    for kind in kinds:
        layer, nbytes = _bound_layer(module, kind, rng)
        copies = [layer] + [_bound_layer(module, kind, rng)[0] for _ in range((stream_mb << 20) // nbytes)]
        for rows in ROWS:
            if isa == "scalar" and rows > 8:
                continue  # minutes of scalar loops: the path is a reference, not a contender
            xs = {K: torch.randn(rows, K) for K in (2048, 8192)}
            turn = iter(range(1 << 62))

            def step():
                for fn, K in copies[next(turn) % len(copies)] if rows == 1 else layer:
                    fn(xs[K])

            seconds = _per_call(step, budget_s)
            print(f"isa={isa} kind={kind} rows={rows} gbs={nbytes / seconds / 1e9:.2f} "
                  f"gmacs={rows * macs / seconds / 1e9:.1f} rows_s={rows / seconds:.1f}", flush=True)
        del layer, copies


def ggml_paths(kinds: tuple[str, ...] = KINDS, stream_mb: int = STREAM_BYTES >> 20, budget_s: float = 0.3,
               write: bool = True) -> None:
    """Each ISA path in its own process (``ggml_path``'s arguments); prints the figures and a table with the paths
    side by side, and writes it into BENCHMARKS.md's "ggml" section unless ``write`` is False.

    Raises:
        subprocess.CalledProcessError: a path's process failed.
    """
    from kvserve import native
    from kvserve.loadtest.publish.benchmarks_md import update_section

    figures: dict[tuple[str, str, int], dict[str, float]] = {}
    isas = native.native_isas()
    for isa in isas:
        command = [sys.executable, "-m", "kvserve.loadtest", "kernelbench", "--mode", "ggml", "--kinds",
                   ",".join(kinds), "--stream-mb", str(stream_mb), "--budget-s", str(budget_s)]
        done = subprocess.run(command, env={**os.environ, "KVSERVE_ISA": isa, "GLIBC_TUNABLES": KEEP_PAGES},
                              capture_output=True, text=True, check=True)
        for line in done.stdout.splitlines():
            print(line, flush=True)
            fields = dict(item.split("=") for item in line.split())
            figures[fields["isa"], fields["kind"], int(fields["rows"])] = {
                key: float(fields[key]) for key in ("gbs", "gmacs", "rows_s")}
    read = figures[isas[-1], "roofline", 0]["gbs"]
    peak = figures.get(("avx512", "roofline", 0), {}).get("gmacs", 0.0)
    paths = " / ".join(isas)
    lines = [f"One thread (core), CPU seconds; each path in its own process, cells {paths} side by side. Read "
             f"bandwidth measured in the same run ({stream_mb} MB of 32-byte loads): {read:.1f} GB/s"
             + (f"; vpdpbusd peak (16 chains on registers): {peak:.0f} GMAC/s" if peak else "") + ". The work: one "
             "Llama-3.2-1B layer's seven projections (60.8 M weights) in the format, outputs on pages the allocator "
             "keeps (GLIBC_TUNABLES: no page faults in the timing). 1 row: weight GB/s (% of the "
             "read bandwidth, best path), over copies of the layer larger than the L3; 8 and 32 rows (decode "
             "batches) and 512 (a prefill chunk): rows through the layer per second"
             + (" (512: % of the vpdpbusd peak, AVX-512 path)" if peak else "") + "; - where a path was not run "
             "(the scalar reference past 8 rows).", "",
             "| kind | 1 row GB/s | 8 rows, rows/s | 32 rows, rows/s | 512 rows, rows/s |", "|---|---:|---:|---:|---:|"]
    for kind in kinds:
        cells = []
        for rows in ROWS:
            got = [figures.get((isa, kind, rows)) for isa in isas]
            key = "gbs" if rows == 1 else "rows_s"
            text = " / ".join("-" if f is None else f"{f[key]:.1f}" if rows == 1 else f"{f[key]:.0f}" for f in got)
            best = got[-1]
            if best is not None and rows == 1:
                text += f" ({100 * best['gbs'] / read:.0f}%)"
            if best is not None and rows == ROWS[-1] and peak:
                text += f" ({100 * best['gmacs'] / peak:.0f}%)"
            cells.append(text)
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    print("\n".join(lines), flush=True)
    if write:
        update_section("ggml", "GGUF block kernels per format and ISA path",
                       "python -m kvserve.loadtest kernelbench --ggml", "\n".join(lines))


def on_small_pages(t: torch.Tensor) -> torch.Tensor:
    """A copy of contiguous ``t`` in an anonymous mapping of its own advised against transparent huge pages
    (MADV_NOHUGEPAGE): a packed weight as it lies without the packing's advice (native/csrc/huge_pages.h). The
    copy's storage keeps the mapping."""
    mapping = mmap.mmap(-1, t.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_NOHUGEPAGE)
    copy = torch.frombuffer(mapping, dtype=t.dtype).view(t.shape)
    copy.copy_(t)
    return copy


def mappings(smaps_path: str = "/proc/self/smaps") -> list[tuple[int, int, dict[str, str]]]:
    """The process's mappings as ``smaps_path`` lists them (Linux's /proc/PID/smaps): (start, end, fields), the
    fields by name without their colon ("AnonHugePages": "4096 kB", "VmFlags": "rd wr mr ...")."""
    found: list[tuple[int, int, dict[str, str]]] = []
    with open(smaps_path) as smaps:
        for line in smaps:
            head, _, rest = line.partition(" ")
            if "-" in head and not head.endswith(":"):  # a mapping's first line: "start-end perms ..."
                start, end = (int(a, 16) for a in head.split("-"))
                found.append((start, end, {}))
            elif found and head.endswith(":"):
                found[-1][2][head[:-1]] = rest.strip()
    return found


def huge_page_bytes(tensors: list[torch.Tensor], smaps_path: str = "/proc/self/smaps") -> int:
    """Bytes on transparent huge pages (AnonHugePages in ``smaps_path``) of the mappings that hold ``tensors``: the
    advice splits a mapping at the whole 2 MiB pages it covers, so those of packed weights are theirs alone."""
    spans = [(t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors]
    return sum(int(fields.get("AnonHugePages", "0 kB").split()[0]) << 10 for start, end, fields in mappings(smaps_path)
               if any(lo < end and start < hi for lo, hi in spans))


def q4_k_m_kinds() -> list[tuple[str, int, int, int]]:
    """(kind, N, K, count) of a Llama-3.2-1B Q4_K_M file's projections and head, as llama.cpp's quantizer mixes
    them (llama-quant.cpp: attn_v and ffn_down get Q6_K in the layers ``use_more_bits`` picks, i < n/8 or
    i >= 7n/8 or (i - n/8) % 3 == 2; the output, here the tied embedding table, Q6_K; the rest Q4_K)."""
    more_bits = [i < LAYERS // 8 or i >= 7 * LAYERS // 8 or (i - LAYERS // 8) % 3 == 2 for i in range(LAYERS)]
    q6 = sum(more_bits)
    return [("q4_k", 2048, 2048, 2 * LAYERS), ("q4_k", 512, 2048, LAYERS), ("q4_k", 8192, 2048, 2 * LAYERS),
            ("q6_k", 512, 2048, q6), ("q4_k", 512, 2048, LAYERS - q6), ("q6_k", 2048, 8192, q6),
            ("q4_k", 2048, 8192, LAYERS - q6), ("q6_k", VOCAB, WIDTH, 1)]


ROUNDS = 7  # ggml_model's alternating rounds where settings are compared side by side
PREFILL_ROWS = 64  # ggml_model's rows from which a step is a prefill chunk (the LM head on its last row only)


@torch.inference_mode()
def ggml_model(rows_list: tuple[int, ...] = (1, 2, 8, 32, 512), write: bool = True) -> None:
    """A Q4_K_M Llama-3.2-1B step's projections with the server's threads on ``rows_list`` rows (decode batches
    against the read bound; 512: a prefill chunk), each of this CPU's kernel settings that matter at those rows
    side by side with it off (the prefetch of one and two rows, Q5_K / Q6_K groups unpacked, AMX tiles); writes "ggml-model"
    unless ``write`` is False."""
    from kvserve import native
    from kvserve.loadtest.publish.benchmarks_md import update_section
    from kvserve.native.ggml_leaves import random_units

    module = native.load()
    threads = torch.get_num_threads()
    rng = np.random.default_rng(0)
    small_pages = any(rows <= 8 for rows in rows_list)
    step_fns, small_fns, step_bytes, weights, packs = [], [], 0, 0, []
    for kind, N, K, count in q4_k_m_kinds():
        for _ in range(count):
            raw = torch.from_numpy(random_units(kind, N, K, rng))
            packed = module.ggml_pack(raw, kind)
            packs.append(packed)
            step_fns.append((module.bind_ggml(packed, kind, N, K), K))
            if small_pages:  # the same bytes on 4 KiB pages, side by side at decode's rows
                small_fns.append((module.bind_ggml(on_small_pages(packed), kind, N, K), K))
            step_bytes += raw.numel()
            weights += N * K
    read = read_bandwidth(threads)
    lines = [f"{module.isa()} path, {threads} threads (the server's); read bandwidth of {threads} threads measured "
             f"in the same run: {read:.1f} GB/s. One step: the {len(step_fns)} projections and the LM head of a "
             f"Q4_K_M Llama-3.2-1B ({step_bytes / 1e6:.0f} MB of blocks, {weights / 1e6:.0f} M weights), one call "
             "each, timed by the process's CPU seconds per thread (wall time in brackets: on a shared machine it "
             "includes other work's turns). Read bound: the step's bytes over the read bandwidth.", "",
             "| rows | step ms | steps/s | GB/s of weights | % of the read bound | wall ms |",
             "|---:|---:|---:|---:|---:|---:|"]
    prefetch = module.gguf_prefetch()  # this CPU's defaults (cpu.h): restored after each comparison
    unpack = module.gguf_unpack()
    amx = module.gguf_amx()
    for rows in rows_list:
        xs = {K: torch.randn(rows, K) for K in (2048, 8192)}

        chunk = rows >= PREFILL_ROWS  # a prefill chunk: the LM head (the last call) on its last row only

        def step(fns=step_fns):
            for i, (fn, K) in enumerate(fns):
                fn(xs[K][-1:] if chunk and i == len(fns) - 1 else xs[K])

        def timed(budget_s: float, fns: list) -> tuple[float, float]:
            """(CPU seconds per thread, wall seconds) per step over ``budget_s`` CPU seconds per thread."""
            step(fns)
            n, cpu0, wall0 = 0, time.process_time(), time.perf_counter()
            while time.process_time() - cpu0 < budget_s * threads or n < 3:
                step(fns)
                n += 1
            return (time.process_time() - cpu0) / threads / n, (time.perf_counter() - wall0) / n

        # this CPU's settings side by side with the one that differs at these rows off, in alternating rounds (the
        # best of each): the prefetch of one and two rows; past a register tile (8 rows), Q5_K / Q6_K groups unpacked once
        # from gguf_amx_rows(), AMX tiles where they run; at decode's rows the weights on 4 KiB pages
        settings = [("", prefetch, unpack, amx, step_fns)]
        if rows <= 2 and prefetch:
            settings.append((", no prefetch", 0, unpack, amx, step_fns))
        if rows <= 8:
            settings.append((", 4 KiB pages", prefetch, unpack, amx, small_fns))
        if 8 < rows < 64 and unpack:
            settings.append((", codes per tile", prefetch, False, amx, step_fns))
        if rows >= module.gguf_amx_rows() and amx:
            settings.append((", no AMX", prefetch, unpack, False, step_fns))
        # a few percent between settings needs more alternations than this machine's slower swings last: seven short
        # rounds (the best of each) in the two seconds one setting alone takes
        best: dict[str, tuple[float, float]] = {}
        for _ in range(ROUNDS if len(settings) > 1 else 1):
            for label, ahead, groups, tiles, fns in settings:
                module.set_gguf_prefetch(ahead)
                module.set_gguf_unpack(groups)
                module.set_gguf_amx(tiles)
                got = timed(2.0 / ROUNDS if len(settings) > 1 else 2.0, fns)
                best[label] = min(best.get(label, got), got)
        module.set_gguf_prefetch(prefetch)
        module.set_gguf_unpack(unpack)
        module.set_gguf_amx(amx)
        for label, *_ in settings:
            busy, wall = best[label]
            gbs = step_bytes / busy / 1e9
            print(f"rows={rows}{label}: {1e3 * busy:.1f} ms/step ({1e3 * wall:.1f} wall), {gbs:.1f} GB/s, "
                  f"{100 * gbs / read:.0f}% of the read bound", flush=True)
            bound = ("- | -" if chunk else f"{gbs:.1f} | {100 * gbs / read:.0f}%")  # a chunk is bound by arithmetic
            lines.append(f"| {rows}{label} | {1e3 * busy:.1f} | {1 / busy:.1f} | {bound} | {1e3 * wall:.1f} |")
    if any(rows >= PREFILL_ROWS for rows in rows_list):
        lines += ["", f"{PREFILL_ROWS}+ rows: a prefill chunk, the LM head on its last row only (as a prefill runs it); "
                  "its time is its arithmetic's, not the read's."]
    if prefetch:
        lines += ["", f"At 1 and 2 rows the K-quant kernels prefetch {prefetch} bytes ahead of the group they read towards "
                  "L1 (this CPU's default, native/csrc/cpu.h); \"no prefetch\" is the same step with it off, the two "
                  f"timed in {ROUNDS} alternating rounds (the best of each)."]
    if small_pages:
        huge = huge_page_bytes(packs)
        lines += ["", f"The kernels' packing advises the whole 2 MiB pages inside each weight's buffer for transparent "
                  f"huge pages (native/csrc/huge_pages.h; numpy advises the read probe's buffers alike): here "
                  f"{huge / 1e6:.0f} MB of the step's {step_bytes / 1e6:.0f} MB lie on them (AnonHugePages), the "
                  "rest at the buffers' unaligned ends on 4 KiB pages; \"4 KiB pages\" is the same step on a copy "
                  f"of the same bytes advised against them (MADV_NOHUGEPAGE), the two timed in {ROUNDS} alternating "
                  "rounds (the best of each)."]
    if unpack:
        lines += ["", "Past 8 rows (a register tile) the Q5_K and Q6_K kernels unpack each group of a panel once for "
                  "every tile of rows (this CPU's default, native/csrc/cpu.h); \"codes per tile\" is the same step "
                  f"with each tile making its codes from the panel, the two timed in {ROUNDS} alternating rounds."]
    if amx:
        lines += ["", f"From {module.gguf_amx_rows()} rows (decode batches, prefill chunks) the Q4_K and Q5_K "
                  "projections, and from 16 the Q6_K ones (here the LM head, some attn_v and ffn_down), run on "
                  "AMX-INT8 tiles, this CPU having them (native/csrc/ukernel_gguf_amx.h); \"no AMX\" is the same "
                  f"step on the AVX-512 kernel alone, the two timed in {ROUNDS} alternating rounds."]
    print("\n".join(lines), flush=True)
    if write:
        update_section("ggml-model", "A Q4_K_M Llama-3.2-1B step's projections against the read bound (decode batches) "
                       "and on a prefill chunk",
                       "python -m kvserve.loadtest kernelbench --ggml-model", "\n".join(lines))


@torch.inference_mode()
def served_split(model: str | None, budget_s: float = 2.0) -> tuple[float, float, float, int]:
    """A batch-1 decode step's projections and LM head of ``model`` as ``kvserve serve`` loads it (its own blocks
    for a GGUF file), each through its bare kernel on one random row, with the server's threads: (ms per step, timed
    by the process's CPU seconds per thread as ``ggml_model``; the read bound in ms: their bytes over the read
    bandwidth the same threads measure; that bandwidth in GB/s; the bytes).
    """
    from kvserve.engine.fastpath import FastDecoder
    from kvserve.loadtest.engine.enginebench import load_served

    loaded, _ = load_served("auto", model=model)
    decoder = FastDecoder(loaded.model)
    projections = [*decoder.all_projections(), decoder.lm_head]
    calls = [(p.kernel if p.kernel is not None else p, torch.randn(1, p.module.in_features)) for p in projections]
    nbytes = sum(t.numel() * t.element_size() for p in projections
                 for t in [*p.module.parameters(recurse=False), *p.module.buffers(recurse=False)])
    threads = torch.get_num_threads()

    def step():
        for call, x in calls:
            call(x)

    step()
    n, cpu0 = 0, time.process_time()
    while time.process_time() - cpu0 < budget_s * threads or n < 3:
        step()
        n += 1
    busy = (time.process_time() - cpu0) / threads / n
    read = read_bandwidth(threads)
    return 1e3 * busy, 1e3 * nbytes / read / 1e9, read, nbytes
