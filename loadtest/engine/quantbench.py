"""``python -m kvserve.loadtest quant``: single-stream decode speed of each scheme on the real engine, side by side.

For none (torch's bfloat16 ops, bfloat16 weights on the AVX512-BF16 kernel where it runs, and float32), int8,
int4 and NF4 on SmolLM2: decode tokens/s through
``engine.runner.ModelRunner`` over a ``KVPool`` (batch 1, greedy), the weight bytes one step reads, the
bound those bytes give at the read bandwidth measured in the same run, and a breakdown of a step into
projections, LM head and the rest. Then the quality table of ``kvserve quant report``. Writes the
"quant" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time

import torch

from kvserve.quant.linear import QuantLinear
from kvserve.quant.model import quantize_for_serving, weight_bytes_per_token

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
# `--quantization none` on a CPU whose kernel path has AVX512-BF16: bfloat16 weights on that kernel (quant.bf16),
# float32 activations; measured beside `--dtype bfloat16` (torch's bf16 ops, what `none` ran before the kernel)
BF16_KERNEL = "none (bf16 kernel)"
# gguf: the embedded model's own Q4_1 / Q8_0 blocks (int8 activations per block of 32), what `kvserve serve` serves
VARIANTS = (("none", torch.bfloat16), (BF16_KERNEL, torch.float32), ("none", torch.float32),
            ("gguf", torch.float32), ("int8", torch.bfloat16), ("int8", torch.float32), ("int4", torch.float32),
            ("nf4", torch.float32))
PROFILED = ("int8", torch.float32)  # the variant whose decode steps are profiled operator by operator


def read_bandwidth(num_bytes: int = 512 * 2**20, repeats: int = 7) -> float:
    """Best-of-``repeats`` read bandwidth (bytes/s) of summing a float32 tensor far larger than the caches."""
    data = torch.ones(num_bytes // 4)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return num_bytes / best


def best_of(fn, repeats: int = 7) -> float:
    """Fastest of ``repeats`` calls (s)."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


@torch.inference_mode()
def decode_steps(loaded, num_tokens: int, profile: bool = False) -> tuple[list[float], list[int], str]:
    """Prefill PROMPT, then decode ``num_tokens`` greedy tokens one step at a time.

    Returns:
        Per-step wall times (s), the generated token ids, and (``profile``) torch.profiler's table of the
        decode steps' operators by self CPU time ("" otherwise).
    """
    from kvserve.engine.plan import SamplingParams, SeqWork, StepPlan
    from kvserve.engine.runner import ModelRunner
    from kvserve.kvcache.pool import KVPool

    block_size = 16
    prompt = loaded.tokenizer(PROMPT)["input_ids"]
    num_blocks = (len(prompt) + num_tokens) // block_size + 1
    runner = ModelRunner(loaded, KVPool(loaded.kv_shape(), num_blocks, block_size, loaded.dtype))
    table = list(range(num_blocks))
    greedy = SamplingParams(temperature=0.0)
    output: list[int] = []

    def work(tokens: list[int], start: int) -> StepPlan:
        slots = [table[p // block_size] * block_size + p % block_size for p in range(start, start + len(tokens))]
        return StepPlan([SeqWork(0, tokens, start, table, slots, True, greedy, prompt, output)])

    output.append(runner.execute(work(prompt, 0))[0].token.token_id)
    times = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile else \
            contextlib.nullcontext() as prof:
        for _ in range(num_tokens):
            started = time.perf_counter()
            result = runner.execute(work([output[-1]], len(prompt) + len(output) - 1))
            times.append(time.perf_counter() - started)
            output.append(result[0].token.token_id)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15) if profile else ""
    return times, output, table


@torch.inference_mode()
def layer_times(model, dtype: torch.dtype) -> tuple[float, float]:
    """(all projections, LM head) of one decode step replayed alone with batch-1 inputs (s, best of 7).

    The projections are the runner's lean forward's own (``engine.fastpath``: q/k/v fused, and gate/up when
    quantized; the f32_linear kernel for float32 weights, the layer's kernel otherwise); for a model without
    the lean forward, every linear layer alone.
    """
    from kvserve.engine.fastpath import fast_decoder
    from kvserve.engine.kernelbind import Projection

    head = model.get_output_embeddings()
    decoder = fast_decoder(model)
    if decoder is not None:
        projections = decoder.all_projections()
    else:
        projections = [Projection(m) for m in model.modules()
                       if isinstance(m, (QuantLinear, torch.nn.Linear)) and m is not head]
    inputs = [torch.randn(1, p.module.in_features, dtype=dtype) for p in projections]
    head_call, x_head = Projection(head), torch.randn(1, head.in_features, dtype=dtype)
    return (best_of(lambda: [p(x) for p, x in zip(projections, inputs)]), best_of(lambda: head_call(x_head)))


def run_speed(loaded, num_tokens: int, bandwidth: float, log) -> list[dict]:
    """Measure every variant; one row dict each."""
    from kvserve.engine.loader import LoadedModel

    from kvserve.quant.bf16 import kernel_runs, use_bf16_kernel

    rows = []
    for scheme, dtype in VARIANTS:
        if scheme == BF16_KERNEL:
            if not kernel_runs():
                log(f"{scheme}: skipped, the AVX512-BF16 kernel does not run on this CPU / ISA path")
                continue
            model = copy.deepcopy(loaded.model).to(torch.bfloat16)
            use_bf16_kernel(model)  # as `kvserve serve --quantization none` loads it here
            bits = 16.0
        elif scheme == "gguf":
            from kvserve.engine.gguf_model import use_gguf_blocks
            from kvserve.engine.loader import default_gguf_path

            model = copy.deepcopy(loaded.model).to(dtype)
            installed = use_gguf_blocks(model, default_gguf_path())  # the default: the file's own blocks
            bits = 8 * installed.bytes_after / sum(m.in_features * m.out_features for m in model.modules()
                                                   if isinstance(m, QuantLinear))
        else:
            model = copy.deepcopy(loaded.model).to(dtype)
            bits = quantize_for_serving(model, scheme).bits_per_weight  # rounded to nearest: the same cost
        variant = LoadedModel(model=model, tokenizer=loaded.tokenizer, name=loaded.name, device=loaded.device,
                              dtype=dtype, bf16_weights=scheme == BF16_KERNEL)
        times, tokens, _ = decode_steps(variant, num_tokens)
        step = statistics.median(times)
        projections, head = layer_times(model, dtype)
        read = weight_bytes_per_token(model)
        rows.append({"scheme": scheme, "dtype": str(dtype).removeprefix("torch."), "step_s": step,
                     "tokens_per_s": 1 / step, "bytes_per_token": read, "bound_s": read / bandwidth,
                     "projections_s": projections, "head_s": head, "bits": bits,
                     "text": loaded.tokenizer.decode(tokens[:12]),
                     "profile": decode_steps(variant, 8, profile=True)[2] if (scheme, dtype) == PROFILED else ""})
        log(f"{scheme}/{rows[-1]['dtype']}: {1 / step:.1f} tokens/s, step {step * 1e3:.1f} ms "
            f"(projections {projections * 1e3:.1f} ms, head {head * 1e3:.1f} ms), {rows[-1]['text']!r}")
        del model, variant
    return rows


def _rest(row: dict) -> float:
    """Step time (s) not spent in the projections or the LM head."""
    return row["step_s"] - row["projections_s"] - row["head_s"]


def speed_table(rows: list[dict], bandwidth: float) -> str:
    """Markdown table of the speed rows."""
    bf16 = next(r for r in rows if r["scheme"] == "none" and r["dtype"] == "bfloat16")
    fp32 = next(r for r in rows if r["scheme"] == "none" and r["dtype"] == "float32")
    lines = [f"Read bandwidth measured in the same run: {bandwidth / 1e9:.1f} GB/s.", "",
             "| scheme | activations | tokens/s | vs bf16 | vs fp32 | step ms | projections ms | LM head ms "
             "| rest ms | MB read/token | bound ms (bytes/bandwidth) | % of bound |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['scheme']} | {r['dtype']} | {r['tokens_per_s']:.1f} | "
                     f"{r['tokens_per_s'] / bf16['tokens_per_s']:.2f}x | "
                     f"{r['tokens_per_s'] / fp32['tokens_per_s']:.2f}x | "
                     f"{r['step_s'] * 1e3:.1f} | {r['projections_s'] * 1e3:.1f} | {r['head_s'] * 1e3:.1f} | "
                     f"{_rest(r) * 1e3:.1f} | {r['bytes_per_token'] / 1e6:.0f} | {r['bound_s'] * 1e3:.1f} | "
                     f"{100 * r['bound_s'] / r['step_s']:.0f}% |")
    kernel = next((r for r in rows if r["scheme"] == BF16_KERNEL), None)
    if kernel is not None:
        lines += ["", f"`--quantization none` with the AVX512-BF16 kernel against torch's bfloat16 ops (what it ran "
                  f"before): {kernel['tokens_per_s'] / bf16['tokens_per_s']:.2f}x the tokens/s, the same bfloat16 "
                  f"weights ({kernel['bytes_per_token'] / 1e6:.0f} MB read per token)."]
    lines += ["", "What limits the speed-up: the rest of a step (attention over the paged pool, norms, RoPE, "
              "sampling and the Python that dispatches the layers' calls) does not shrink with the weights, and "
              "the kernels do not reach the bandwidth (% of bound). With the weights read at the measured "
              "bandwidth and that rest unchanged, the best each scheme could do is:"]
    for r in rows:
        if not r["scheme"].startswith("none"):
            best = r["bound_s"] + _rest(r)
            lines.append(f"- {r['scheme']} ({r['dtype']} activations): {fp32['step_s'] / best:.2f}x fp32 (measured "
                         f"{r['tokens_per_s'] / fp32['tokens_per_s']:.2f}x), {bf16['step_s'] / best:.2f}x bf16 "
                         f"(measured {r['tokens_per_s'] / bf16['tokens_per_s']:.2f}x)")
    return "\n".join(lines)


QUALITY_START = "\nQuality (as `kvserve quant report`"


def previous_quality() -> str:
    """The quality part of BENCHMARKS.md's current "quant" section (from its "Quality" paragraph on), or ""."""
    from kvserve.loadtest.publish.benchmarks_md import BENCHMARKS

    text = BENCHMARKS.read_text() if BENCHMARKS.exists() else ""
    section = text.partition("<!-- BEGIN quant -->")[2].partition("<!-- END quant -->")[0]
    start = section.find(QUALITY_START)
    if start < 0:
        return ""
    return section[start:].rstrip()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``python -m kvserve.loadtest quant``."""
    parser.add_argument("--tokens", type=int, default=32, help="decode steps per variant")
    parser.add_argument("--skip-quality", action="store_true",
                        help="speed only: the section keeps the quality table of its previous run, marked as such")
    parser.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark, print it, and write the "quant" section of BENCHMARKS.md."""
    from kvserve.engine.loader import Device, DType, cpu_has_bf16, load_model
    from kvserve.loadtest.publish.benchmarks_md import update_section
    from kvserve import native
    from kvserve.quant.report import collect, margin_note, quality_table

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    path = native.isa()
    loaded = load_model(None, DType.FLOAT32, Device.CPU)
    bandwidth = read_bandwidth()
    rows = run_speed(loaded, args.tokens, bandwidth, log)
    from kvserve.quant.bf16 import kernel_runs

    native_bf16 = cpu_has_bf16()
    auto = ("bfloat16 weights on the AVX512-BF16 kernel with float32 activations" if kernel_runs()
            else "float32 weights on the float32 kernels")
    baseline = ("`--dtype bfloat16` (torch's bf16 ops, what `--quantization none` ran before its kernel) is the "
                "baseline" if native_bf16 else
                "this CPU emulates bfloat16, so the fair baseline is the float32 column")
    body = [f"Single-stream decode through ModelRunner + KVPool (batch 1, greedy, {args.tokens} steps per "
            f"variant, median step). C++ kernel path: {path}; torch threads: {torch.get_num_threads()}. "
            f"This CPU {'has' if native_bf16 else 'has no'} native bfloat16 (AVX-512 BF16 / AMX); "
            f"`kvserve serve --quantization none` serves {auto} here. Quantized variants are served as `kvserve serve --quantization` serves "
            "them (the step's cost does not depend on how the codes were rounded): gguf, the default, computes "
            "with the file's own Q4_1 / Q8_0 blocks and int8 activations per block of 32 (native/csrc/ukernel.h); int8 "
            "projections multiply int16 activations (quantized per block of 64) and int4 projections int8 "
            "activations (per block of 32) with integer dot products, "
            "NF4 multiplies float32 activations through a 16-level table; with the 4-bit schemes the LM head "
            "gets an int8 per-row copy (the embedding keeps float32), with int8 it stays float32. Float32 runs use kvserve's f32_linear kernel and the fused "
            "C++ norms / RoPE / paged attention (native/csrc/decode_ops.cpp); the none (bf16 kernel) row "
            "computes the projections and LM head with the model's bfloat16 weights through kvserve's vdpbf16ps kernel "
            "(native/csrc/ukernel_bf16.h) and the rest in float32 with the same fused ops; bfloat16 runs torch's "
            f"bf16 matmuls and torch ops throughout (the fused ops are float32-only); {baseline}. Projections and LM head are replayed alone (best of 7); rest = step - both "
            "(attention, norms, sampling, Python).", "", speed_table(rows, bandwidth)]
    profile = next(r["profile"] for r in rows if r["profile"])
    body += ["", f"Where one {PROFILED[0]} decode step goes (torch.profiler, 8 steps; the C++ kernels are not aten "
             "operators, so the runner labels each projection call `kvserve::projection`):", "",
             "```", profile.strip(), "```"]
    if args.skip_quality:
        kept = previous_quality()
        if kept:
            body += ["", "(The quality table below is the section's previous run, kept: this run measured speed only, "
                     "`--skip-quality`.)", kept]
    else:
        model = copy.deepcopy(loaded.model)
        model.set_attn_implementation("sdpa")
        data = collect(model, loaded.tokenizer, log)
        body += ["", f"Quality (as `kvserve quant report`; perplexity on {data['heldout']}, greedy agreement over "
                 f"{data['agreement_positions']} positions):", "", quality_table(data), "", margin_note(data)]
    text = "\n".join(body)
    print(text)
    if not args.no_write:
        update_section("quant", "Quantized weights: decode speed and quality", "python -m kvserve.loadtest quant", text)
    return 0
