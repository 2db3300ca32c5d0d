"""``python -m kvserve.loadtest profile``: where one decode step's time goes on our engine (torch.profiler, CPU).

Runs B sequences with a ``--context``-token cache through ``engine.runner.ModelRunner`` decoding one token,
profiles ``--steps`` steps, and splits the wall time by ATen op (self CPU time, so nested ops are not
counted twice) into: projections (linear/matmul, LM head included), attention (SDPA, or kvserve's C++ paged
decode attention), paged-KV gather and scatter (index/index_put, or the C++ KV write), other ops (norms, RoPE,
activations, copies, sampling), and what no op accounts for: Python and dispatch overhead between ops. The C++
calls are labelled with ``torch.profiler.record_function`` (``kvserve::...``) so they are counted.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvserve.loadtest.argtypes import QUANTIZATIONS, positive_int, positive_ints
from kvserve.loadtest.publish.benchmarks_md import update_section

_CATEGORIES = (
    ("projections (linear/matmul)", ("aten::linear", "aten::addmm", "aten::mm", "aten::matmul", "aten::bmm",
                                     "kvserve::projection")),
    ("attention (SDPA)", ("scaled_dot_product", "kvserve::paged_attention", "kvserve::decode_attention")),
    ("paged KV gather/scatter", ("aten::index", "aten::index_put", "kvserve::kv_write")),
)


def _category(name: str) -> str:
    for label, prefixes in _CATEGORIES:
        if any(name.startswith(p) or p in name for p in prefixes):
            return label
    return "other ops"


def profile_decode(batch: int, context: int, steps: int, loaded=None) -> tuple[float, float, dict[str, float],
                                                                             list[tuple[str, float]]]:
    """Returns (median step ms without the profiler, mean step ms under it, share of the profiled step by category
    in [0, 1], top ops by self CPU ms per profiled step). ``loaded``: the model (default: the embedded one as
    served). The profiler's own cost per call inflates the profiled step: most of it lands in what no op accounts
    for ("Python/dispatch overhead") and in the short ops.

    On a GPU the shares are of host time: kernels run asynchronously, and a wait for them shows up in the op
    that synchronises (``aten::_local_scalar_dense``, ``cudaStreamSynchronize``, a device-to-host copy).
    """
    from kvserve.engine.plan import StepPlan
    from kvserve.loadtest.engine.enginebench import EngineBench, load

    bench = EngineBench(loaded or load(), batch, context + 1)
    for s in range(batch):
        bench.fill(s, context)
    work = [bench.decode(s, context) for s in range(batch)]
    wall_ms = 1000 * bench.time_plan(work, reps=steps, warmup=3)  # without the profiler's own overhead
    plan = StepPlan(work)
    on_gpu = bench.runner.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            bench.runner.execute(plan)
        profiled_ms = 1000 * (time.perf_counter() - start) / steps
    by_category: dict[str, float] = {}
    ops = []
    for event in prof.key_averages():
        self_ms = event.self_cpu_time_total / 1000 / steps
        by_category[_category(event.key)] = by_category.get(_category(event.key), 0.0) + self_ms
        ops.append((event.key, self_ms))
    by_category["Python/dispatch overhead"] = max(0.0, profiled_ms - sum(by_category.values()))
    if on_gpu:  # how busy the GPU was: its kernels' time against the step's wall time
        gpu_ms = sum(getattr(e, "self_device_time_total", 0.0) for e in prof.key_averages()) / 1000 / steps
        print(f"B = {batch}: GPU kernels {gpu_ms:.2f} ms of a {profiled_ms:.2f} ms profiled step")
    shares = {label: ms / profiled_ms for label, ms in by_category.items()}
    return wall_ms, profiled_ms, shares, sorted(ops, key=lambda op: -op[1])[:12]


def add_arguments(parser: argparse.ArgumentParser) -> None:

    parser.add_argument("--batch", type=positive_ints, default=[1, 8, 32], help="comma list of batch sizes")
    parser.add_argument("--context", type=positive_int, default=64, help="cached tokens per sequence")
    parser.add_argument("--steps", type=positive_int, default=7, help="timed and profiled steps per batch size")
    parser.add_argument("--model", default=None, help="as kvserve serve --model (default: the embedded SmolLM2)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--quantization", default="auto", choices=QUANTIZATIONS,
                        help="as kvserve serve --quantization (default auto: the weights the server picks)")
    parser.add_argument("--no-write", action="store_true")


def run(args: argparse.Namespace) -> int:
    torch.set_grad_enabled(False)
    from kvserve.engine.loader import Device, DType
    from kvserve.loadtest.engine.enginebench import check_engine_flags, load_served

    check_engine_flags(args.model, args.device)
    batches = args.batch
    loaded, served = load_served(args.quantization, DType(args.dtype), args.model, Device(args.device))
    results = [(b, *profile_decode(b, args.context, args.steps, loaded)) for b in batches]
    labels = [label for label, _ in _CATEGORIES] + ["other ops", "Python/dispatch overhead"]
    rows = ["| share of a decode step | " + " | ".join(f"B = {b}" for b, *_ in results) + " |",
            "|---" * (len(results) + 1) + "|"]
    rows.append("| step ms (median, no profiler) | " + " | ".join(f"{r[1]:.1f}" for r in results) + " |")
    rows.append("| step ms under the profiler | " + " | ".join(f"{r[2]:.1f}" for r in results) + " |")
    for label in labels:
        cells = [f"{100 * shares.get(label, 0.0):.0f}%" for _, _, _, shares, _ in results]
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    top = results[-1][4]
    text = "\n".join(rows) + ("\n\nShares are of a profiled step (self CPU time per op; the step without the "
                              "profiler is a median, the one under it a mean). The profiler costs time per call, "
                              "spread over every row (Python/dispatch overhead and the small ops most): where the "
                              "step under the profiler is much longer than without it (batch 1: a step makes ~300 "
                              "short calls), the shares are of that longer step, and the projections' real share "
                              "is larger (`python -m kvserve.loadtest quant` replays them alone). On float32 CPU steps "
                              "of decodes only, `kvserve::decode_attention` (counted as attention) also applies "
                              "RoPE and writes the step's K/V. "
                              f"Top ops at B = {results[-1][0]} (self ms per profiled step): "
                              + ", ".join(f"`{name}` {ms:.1f}" for name, ms in top) + ".")
    print(text)
    print(f"{loaded.name}, {loaded.dtype}, {loaded.device}, quantization {args.quantization} ({served})")
    if not args.no_write:
        # each device and quantization gets its own section
        on_cpu, scheme = loaded.device.type == "cpu", args.quantization
        key = "profile" + ("" if on_cpu else f"-{loaded.device.type}") + ("" if scheme == "auto" else f"-{scheme}")
        what = ", ".join(["our engine", f"{args.context}-token caches"] + ([] if on_cpu else [loaded.device.type])
                         + ([f"the default weights ({served})"] if scheme == "auto" else [f"{scheme} weights"]))
        update_section(key, f"Where a decode step's time goes ({what})",
                       "python -m kvserve.loadtest profile" + ("" if on_cpu else f" --device {loaded.device.type}")
                       + ("" if scheme == "auto" else f" --quantization {scheme}"), text)
    return 0
