"""``python -m kvserve.loadtest.kernelbench``: the measurements behind the engine's kernel choices, rerunnable.

1. ``f32_linear`` (kernels/csrc/linear_*.cpp) against torch's GEMM for float32 decode batches: 30 SmolLM2-sized
   576->1536 and 30 1536->576 projections (212 MB, more than the L3), 1 to 128 rows.
2. Quantized layers: the integer kernels against dequantize + GEMM at 1 to 512 rows (why they serve every
   call, prefill chunks included).
3. Python cost of calling a quantized layer as a module against calling its bound kernel.
4. One OpenMP team or two (``--threads``): a batch-8 decode step with every torch call on one thread, and
   with the model loaded on the main thread but steps run on a worker thread (what the server did before
   ``server.serve`` moved all torch work to one thread). Each mode runs in its own process.
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
    from kvserve import kernels

    kernel = kernels.load()
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
    import kvserve.quant.linear as ql
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
        from kvserve.loadtest.enginebench import EngineBench
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", action="store_true", help="only the one-team-or-two comparison")
    parser.add_argument("--mode", choices=["one-thread", "split"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mode:
        one_step_mode(args.mode)
        return 0
    if not args.threads:
        dense_vs_gemm()
        quant_kernel_vs_dequantize()
    for mode in ("one-thread", "split"):
        subprocess.run([sys.executable, "-m", "kvserve.loadtest.kernelbench", "--mode", mode], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
