"""``python -m kvserve.loadtest kernelbench``: the measurements behind the engine's kernel choices, rerunnable.

1. ``f32_linear`` (native/csrc/linear_*.cpp) against torch's GEMM for float32 decode batches: 30 SmolLM2-sized
   576->1536 and 30 1536->576 projections (212 MB, more than the L3), 1 to 128 rows.
2. Quantized layers: the integer kernels against dequantize + GEMM at 1 to 512 rows (why they serve every
   call, prefill chunks included).
3. Python cost of calling a quantized layer as a module against calling its bound kernel.
4. One OpenMP team or two (``--threads``): a batch-8 decode step with every torch call on one thread, and
   with the model loaded on the main thread but steps run on a worker thread (what the server did before
   ``server.serve`` moved all torch work to one thread). Each mode runs in its own process.
5. ``--ggml`` and ``--ggml-model``: the GGUF block kernels against the machine's read bandwidth and int8 peak
   (loadtest/engine/ggmlbench.py); written into BENCHMARKS.md's "ggml" and "ggml-model" sections.
6. ``--bf16``: the bfloat16-weight kernel (native/csrc/linear_bf16.cpp, AVX512-BF16) on SmolLM2's shapes at 1,
   8, 32 and 512 rows, one thread, against the core's measured ``vdpbf16ps`` peak (16 independent chains on
   registers, ``kv_bf16_peak``) and torch's bfloat16 GEMM on the same weights; written into BENCHMARKS.md's "bf16"
   section.
7. ``--attention``: the paged attention kernels alone on a prefill chunk, float32 and bfloat16 caches, against
   their measured peak (loadtest/engine/attnbench.py); written into BENCHMARKS.md's "attention-op" section.
8. ``--sampling``: one sampled token's cost by vocabulary and filter, the kernel against torch's ops
   (loadtest/engine/samplebench.py); written into BENCHMARKS.md's "sampling" section.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.loadtest.engine import ggmlbench
from kvserve.loadtest.errors import UsageError


def _time(fn, reps: int) -> float:
    """Mean wall time of ``fn`` (s) after 3 warm-up calls."""
    for _ in range(3):
        fn()
    started = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - started) / reps


@torch.inference_mode()
def dense_vs_gemm() -> None:
    from kvserve import native

    kernel = native.load()
    if kernel is None:
        print("kernels not built")
        return
    weights = [torch.randn(1536, 576) for _ in range(30)] + [torch.randn(576, 1536) for _ in range(30)]
    for rows in (1, 8, 32, 64, 96, 128):
        xs = [torch.randn(rows, w.shape[1]) for w in weights]
        gemm = _time(lambda: [F.linear(x, w) for x, w in zip(xs, weights)], 10)
        ours = _time(lambda: [kernel.f32_linear(x, w) for x, w in zip(xs, weights)], 10)
        print(f"f32, {rows:2d} rows: torch GEMM {1e3 * gemm:6.1f} ms, f32_linear {1e3 * ours:6.1f} ms "
              f"({gemm / ours:.2f}x)")


@torch.inference_mode()
def quant_kernel_vs_dequantize() -> None:
    import kvserve.quant.layers as ql
    from kvserve.quant.schemes import quantize_activations

    for cls in (ql.Int8Linear, ql.Int4Linear):
        layers = ([cls(nn.Linear(576, 1536, bias=False)) for _ in range(15)]
                  + [cls(nn.Linear(1536, 576, bias=False)) for _ in range(15)])
        kernels_ = [layer.decode_kernel() for layer in layers]
        if any(k is None for k in kernels_):
            print("kernels not built")
            return
        for rows in (1, 8, 32, 128, 512):
            xs = [torch.randn(rows, layer.in_features) for layer in layers]
            ours = _time(lambda: [k(x) for k, x in zip(kernels_, xs)], 3)
            # the reference the layer would otherwise run: the same activation quantization, then a float GEMM
            dequant = _time(lambda: [F.linear(quantize_activations(x, layer.act_block, layer.act_qmax),
                                              layer.dequantize()) for layer, x in zip(layers, xs)], 3)
            print(f"{cls.__name__}, {rows} rows (30 projections): kernel {1e3 * ours:6.1f} ms, "
                  f"dequantize + GEMM {1e3 * dequant:6.1f} ms")
        x = torch.randn(1, 576)
        layer = cls(nn.Linear(576, 192, bias=False))
        bound = layer.decode_kernel()
        module_us = 1e6 * _time(lambda: layer(x), 2000)
        bound_us = 1e6 * _time(lambda: bound(x), 2000)
        print(f"{cls.__name__} 576->192, 1 row: module call {module_us:.1f} us, bound kernel {bound_us:.1f} us")


def one_step_mode(mode: str) -> None:
    """In this process: time batch-8 decode steps with torch work placed as ``mode`` says."""
    worker = ThreadPoolExecutor(1)

    def setup():
        from kvserve.engine.loader import DType, load_model
        from kvserve.engine.plan import StepPlan
        from kvserve.loadtest.engine.enginebench import EngineBench
        bench = EngineBench(load_model(dtype=DType.FLOAT32), 8, 100)
        for seq in range(8):
            bench.fill(seq, 64)
        return bench, StepPlan([bench.decode(seq, 64) for seq in range(8)])

    def timed(bench, plan) -> str:
        for _ in range(3):
            bench.runner.execute(plan)
        before, started = resource.getrusage(resource.RUSAGE_SELF), time.time()
        for _ in range(30):
            bench.runner.execute(plan)
        after, wall = resource.getrusage(resource.RUSAGE_SELF), time.time() - started
        cpu = (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime) / wall
        return (f"{1e3 * wall / 30:.1f} ms/step, CPU {100 * cpu:.0f}%, "
                f"{after.ru_nvcsw - before.ru_nvcsw} voluntary context switches")

    if mode == "one-thread":
        bench, plan = worker.submit(setup).result()
    else:
        bench, plan = setup()
    print(f"{mode}: {worker.submit(timed, bench, plan).result()}")


GGML_ROWS = (1, 8, 32, 512)
GGML_STREAM_BYTES = 96 << 20  # weights cycled at 1 row: past the L3, so GB/s is memory's, not a cache's


def _per_call(fns, x, budget_s: float = 0.3) -> float:
    """CPU seconds of this thread per call of ``fns`` (cycled, each on ``x``), over at least ``budget_s`` after one
    warm pass; the kernels run on this thread (``torch.set_num_threads(1)``)."""
    for fn in fns:
        fn(x)
    calls, started = 0, time.thread_time()
    while time.thread_time() - started < budget_s or calls < len(fns):
        fns[calls % len(fns)](x)
        calls += 1
    return (time.thread_time() - started) / calls


BF16_SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576))  # (N, K): q/o, k/v, gate/up, down, head


@torch.inference_mode()
def bf16_kernel() -> None:
    """The bf16 kernel's GMAC/s per CPU second against the measured peak and torch's bf16 GEMM; writes "bf16"."""
    from kvserve import native
    from kvserve.loadtest.engine.roofline import bf16_peak_gmacs
    from kvserve.loadtest.publish.benchmarks_md import update_section
    from kvserve.quant.bf16 import kernel_runs

    if not kernel_runs():
        print("the AVX512-BF16 kernel does not run on this CPU / ISA path: nothing to measure", file=sys.stderr)
        return
    torch.set_num_threads(1)
    module = native.load()
    peak = bf16_peak_gmacs()
    stream = torch.ones(GGML_STREAM_BYTES // 4)
    read = GGML_STREAM_BYTES / _per_call([torch.sum], stream) / 1e9
    lines = [f"One thread (core), CPU seconds. vdpbf16ps peak measured in the same run (16 independent chains on "
             f"registers, no loads): {peak:.1f} GMAC/s. Read bandwidth (torch.sum over {GGML_STREAM_BYTES >> 20} MB "
             f"of float32): {read:.1f} GB/s. Cells: the kernel's GMAC/s (% of that peak); 1 row: weight GB/s "
             "(% of the read bandwidth), over copies larger than the L3; torch: torch's bfloat16 GEMM on the same "
             "weights (bf16 activations, oneDNN), GMAC/s.", "",
             "| N x K | 1 row | 8 rows | 32 rows | 512 rows | torch bf16, 1 / 32 / 512 rows |",
             "|---|---:|---:|---:|---:|---:|"]
    for N, K in BF16_SHAPES:
        w = (torch.randn(N, K) * 0.05).bfloat16()
        copies = max(1, GGML_STREAM_BYTES // (w.numel() * 2))
        bound = [module.bind_bf16(module.bf16_pack(w), N, K) for _ in range(copies)]
        cells, torch_cells = [], []
        for rows in GGML_ROWS:
            seconds = _per_call(bound if rows == 1 else bound[:1], torch.randn(rows, K))
            gmacs = rows * N * K / seconds / 1e9
            text = f"{gmacs:.1f} ({100 * gmacs / peak:.0f}%)"
            if rows == 1:
                gbs = w.numel() * 2 / seconds / 1e9
                text += f", {gbs:.1f} GB/s ({100 * gbs / read:.0f}%)"
            cells.append(text)
            if rows in (1, 32, 512):
                reference = _per_call([lambda x: F.linear(x, w)], torch.randn(rows, K).bfloat16())
                torch_cells.append(f"{rows * N * K / reference / 1e9:.1f}")
            print(f"bf16 N={N} K={K} rows={rows}: {text}", flush=True)
        lines.append(f"| {N} x {K} | " + " | ".join(cells) + " | " + " / ".join(torch_cells) + " |")
    update_section("bf16", "bfloat16-weight kernel (AVX512-BF16) against its peak",
                   "python -m kvserve.loadtest kernelbench --bf16", "\n".join(lines))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's flags: which measurements to run (``--mode``: one child process's part)."""
    parser.add_argument("--threads", action="store_true", help="only the one-team-or-two comparison")
    parser.add_argument("--ggml", action="store_true", help="only the GGUF block kernels, per format and ISA path")
    parser.add_argument("--ggml-model", action="store_true",
                        help="only a Q4_K_M Llama-3.2-1B decode step's projections against the read bound")
    parser.add_argument("--bf16", action="store_true", help="only the bfloat16-weight kernel against its peak")
    parser.add_argument("--attention", action="store_true",
                        help="only the paged attention kernels on a prefill chunk against their peak")
    parser.add_argument("--sampling", action="store_true",
                        help="only a sampled token's cost by vocabulary and filter, the kernel against torch's ops")
    parser.add_argument("--model", default=None,
                        help="--sampling: also serve this model (as kvserve serve --model) and compare greedy and "
                             "sampled tok/s at 1 and 32 streams")
    parser.add_argument("--kinds", default=",".join(ggmlbench.KINDS),
                        help="--ggml: the formats to measure, comma-separated (default: all)")
    parser.add_argument("--stream-mb", type=int, default=ggmlbench.STREAM_BYTES >> 20,
                        help="--ggml: MB of weights cycled at 1 row (past the L3)")
    parser.add_argument("--budget-s", type=float, default=0.3, help="--ggml: CPU seconds per measurement")
    parser.add_argument("--no-write", action="store_true",
                        help="--ggml, --ggml-model, --attention, --sampling: print only, leave BENCHMARKS.md alone")
    parser.add_argument("--mode", choices=["one-thread", "split", "ggml"], help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    """The measurements ``args`` asks for (all but ``--ggml``, ``--ggml-model``, ``--bf16``, ``--attention`` and
    ``--sampling`` by default), printed.

    Raises:
        UsageError: ``--kinds`` names a format without a kernel.
    """
    if args.bf16:
        bf16_kernel()
        return 0
    if args.sampling:
        from kvserve.loadtest.engine import samplebench

        samplebench.measure(write=not args.no_write, model=args.model)
        return 0
    if args.attention:
        from kvserve.loadtest.engine import attnbench

        attnbench.measure(write=not args.no_write)
        return 0
    kinds = tuple(k for k in args.kinds.split(",") if k)
    unknown = sorted(set(kinds) - set(ggmlbench.KINDS))
    if unknown:
        raise UsageError(f"--kinds: no kernel for {', '.join(unknown)}; the formats are {', '.join(ggmlbench.KINDS)}")
    if args.mode == "ggml":
        ggmlbench.ggml_path(kinds, args.stream_mb, args.budget_s)
        return 0
    if args.ggml_model:
        ggmlbench.ggml_model(write=not args.no_write)
        return 0
    if args.mode:
        one_step_mode(args.mode)
        return 0
    if args.ggml:
        ggmlbench.ggml_paths(kinds, args.stream_mb, args.budget_s, write=not args.no_write)
        return 0
    if not args.threads:
        dense_vs_gemm()
        quant_kernel_vs_dequantize()
    for mode in ("one-thread", "split"):
        subprocess.run([sys.executable, "-m", "kvserve.loadtest", "kernelbench", "--mode", mode], check=True)
    return 0
