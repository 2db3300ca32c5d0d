"""``python -m kvserve.loadtest profile``: where one decode step's time goes on our engine (torch.profiler, CPU);
with ``--prefill 128,512,2048,8192``, where a prompt's prefill goes instead.

Runs B sequences with a ``--context``-token cache through ``engine.runner.ModelRunner`` decoding one token,
profiles ``--steps`` steps, and splits the wall time by ATen op (self CPU time, so nested ops are not
counted twice) into: projections (linear/matmul, LM head included), attention (SDPA, or kvserve's C++ paged
decode attention), paged-KV gather and scatter (index/index_put, or the C++ KV write), other ops (norms, RoPE,
activations, copies, sampling), and what no op accounts for: Python and dispatch overhead between ops. The C++
calls are labelled with ``torch.profiler.record_function`` (``kvserve::...``) so they are counted.

A prefill is profiled as the server runs it: one sequence, its prompt in chunks of ``--chunk`` tokens (the
server's ``--max-num-batched-tokens``), each chunk a step attending to the chunks before it. Each part's time is
set against its work: the projections' multiply-adds (``macs.Geometry.per_token`` per prompt token, the LM head
once) as GMAC/s and a share of the measured int8 peak of the path the kernels run (``int8_peak``: independent
``vpdpbusd`` chains on registers on the AVX-512 path, ``vpmaddubsw`` ones on the AVX2 path, times the threads the
kernels use), and attention's causal (query, key) pairs as GMAC/s and a
share of its own measured peak (``attention_peak``: float32 FMA chains on the path the kernels run, or
``vdpbf16ps`` for a bfloat16 cache on the AVX-512 BF16 path).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvserve.kvcache.sizing import KVCacheDType
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


@dataclasses.dataclass
class DecodeProfile:
    """One batch size's decode step: ``wall_ms`` median step without the profiler; ``profiled_ms`` mean step under
    it; ``shares`` of the profiled step by category in [0, 1]; ``top`` ops by self CPU ms per profiled step;
    ``alone_ms`` every projection and the LM head replayed alone (``replay_projections``), so ``rest_ms``, the
    step less them, is attention, norms, RoPE, sampling and the Python around them."""

    wall_ms: float
    profiled_ms: float
    shares: dict[str, float]
    top: list[tuple[str, float]]
    alone_ms: float

    @property
    def rest_ms(self) -> float:
        return self.wall_ms - self.alone_ms


LAYER_PATHS = ("loop", "stack")  # FastDecoder's per-layer loop, and its layer stack (one C++ call per step)


def replay_projections(decoder, rows: int, reps: int = 7) -> float:
    """Median ms of one step's projections and LM head replayed alone on ``rows`` random float32 rows, each
    through its bare kernel where it has one (what the layer stack calls, plus a Python call and an output
    tensor each: ~1 us, about 0.1 ms a step) and its Projection otherwise."""
    calls = [(p.kernel if p.kernel is not None and rows <= p.max_rows else p, torch.randn(rows, p.module.in_features))
             for p in [*decoder.all_projections(), decoder.lm_head]]
    times = []
    with torch.inference_mode():
        for _ in range(reps + 1):
            start = time.perf_counter()
            for call, x in calls:
                call(x)
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[1:])


def profile_decode(batch: int, context: int, steps: int, loaded=None, layers: str = "stack",
                   cache_dtype: str = "auto") -> DecodeProfile:
    """Time and profile a decode step of ``batch`` sequences. ``loaded``: the model (default: the embedded one as
    served); ``layers``: which of ``LAYER_PATHS`` all-decode steps run ("stack" is what the engine runs where
    the layer stack applies, else the loop runs either way). The profiler's own cost per call inflates the
    profiled step: most of it lands in what no op accounts for ("Python/dispatch overhead") and in the short ops.

    On a GPU the shares are of host time: kernels run asynchronously, and a wait for them shows up in the op
    that synchronises (``aten::_local_scalar_dense``, ``cudaStreamSynchronize``, a device-to-host copy).
    """
    from kvserve.engine.plan import StepPlan
    from kvserve.loadtest.engine.enginebench import EngineBench, load

    if layers not in LAYER_PATHS:
        raise ValueError(f"layers must be one of {LAYER_PATHS}, got {layers!r}")
    bench = EngineBench(loaded or load(), batch, context + 1, cache_dtype=cache_dtype)
    for s in range(batch):
        bench.fill(s, context)
    work = [bench.decode(s, context) for s in range(batch)]
    decoder = bench.runner.fast
    path = decoder.layer_loop_only() if decoder is not None and layers == "loop" else contextlib.nullcontext()
    plan = StepPlan(work)
    on_gpu = bench.runner.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with path:
        wall_ms = 1000 * bench.time_plan(work, reps=steps, warmup=3)  # without the profiler's own overhead
        alone_ms = replay_projections(decoder, batch) if decoder is not None and not on_gpu else float("nan")
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
    return DecodeProfile(wall_ms, profiled_ms, shares, sorted(ops, key=lambda op: -op[1])[:12], alone_ms)


_PREFILL_PARTS = (("projections", ("projections (linear/matmul)",)), ("attention", ("attention (SDPA)",)),
                  ("norms, RoPE, KV writes and glue", ("paged KV gather/scatter", "other ops",
                                                       "Python/dispatch overhead")))


def _prefill_plans(length: int, chunk: int, loaded, cache_dtype: str = "auto"):
    """The steps the server plans for one ``length``-token prompt alone (token ids of a fixed pattern): ``chunk``
    tokens a step (--max-num-batched-tokens), fewer deep in a long prompt where the scheduler sizes chunks by work
    (``scheduler.scheduler.lone_prefill_chunks``, with the model's attention_cost_context), over a ``cache_dtype``
    KV cache (as --kv-cache-dtype).

    Returns:
        a function running every step of the prefill in order and returning its wall seconds.
    """
    from kvserve.engine.loader import attention_cost_context
    from kvserve.engine.plan import StepPlan
    from kvserve.loadtest.engine.enginebench import EngineBench, dummy_ids
    from kvserve.scheduler.scheduler import lone_prefill_chunks

    bench = EngineBench(loaded, 1, length + 1, cache_dtype=cache_dtype)
    ids = dummy_ids(length)
    # as the scheduler plans it: only the chunk that reaches the prompt's end samples a token
    plans, start = [], 0
    for size in lone_prefill_chunks(length, chunk, attention_cost_context(loaded.model.config)):
        plans.append(StepPlan([dataclasses.replace(bench.work(0, ids[start:start + size], start),
                                                   sample=start + size >= length)]))
        start += size

    def prefill() -> float:
        started = time.perf_counter()
        for plan in plans:
            bench.runner.execute(plan)
        return time.perf_counter() - started

    return prefill


def profile_prefill(length: int, chunk: int, loaded, reps: int = 1,
                    cache_dtype: str = "auto") -> tuple[float, dict[str, float]]:
    """One ``length``-token prompt prefilled in the steps the server plans for it alone (``_prefill_plans``).

    Returns:
        (wall seconds of the whole prefill without the profiler, the median over ``reps`` runs; seconds per part
        under the profiler, keyed by the ``_CATEGORIES`` labels plus "other ops" and "Python/dispatch overhead",
        scaled so the parts sum to the profiled prefill's wall time).
    """
    prefill = _prefill_plans(length, chunk, loaded, cache_dtype)
    prefill()  # warm-up: first calls allocate and probe
    wall = sorted(prefill() for _ in range(reps))[reps // 2]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled = prefill()
    seconds: dict[str, float] = {}
    for event in prof.key_averages():
        label = _category(event.key)
        seconds[label] = seconds.get(label, 0.0) + event.self_cpu_time_total / 1e6
    seconds["Python/dispatch overhead"] = max(0.0, profiled - sum(seconds.values()))
    return wall, seconds


def step_thread_table(lengths: list[int], chunk: int, loaded, rounds: int, cache_dtype: str = "auto") -> str:
    """A prefill on the calling thread against the same prefill on a thread of its own, as the server runs every
    step (its one-thread step executor, scheduler/service.py), alternating for ``rounds`` rounds per prompt length.

    The kernels' speed must not depend on the thread that calls them: buffers a thread allocates come from its own
    malloc arena, and a buffer that lands off a cache line once made the server's steps ~10% slower than
    ``profile --prefill`` measured them (native/csrc/aligned_vector.h).

    Returns:
        a Markdown table: per length the median wall seconds on each thread and the median of the rounds' ratios
        (step thread / calling thread; 1.00 = no difference).
    """
    from concurrent.futures import ThreadPoolExecutor

    rows = ["| prompt tokens | calling thread, s | step thread, s | step / calling (median of rounds) |",
            "|---:|---:|---:|---:|"]
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-step") as step_thread:
        for length in lengths:
            prefill = _prefill_plans(length, chunk, loaded, cache_dtype)
            prefill()
            step_thread.submit(prefill).result()  # each thread's first calls allocate its buffers
            here, there = [], []
            for _ in range(rounds):
                here.append(prefill())
                there.append(step_thread.submit(prefill).result())
            ratio = statistics.median(b / a for a, b in zip(here, there))
            rows.append(f"| {length} | {statistics.median(here):.3f} | {statistics.median(there):.3f} | "
                        f"{ratio:.2f} |")
    return "\n".join(rows)


def attention_peak(cache_dtype: str, head_dim: int) -> tuple[str, float] | None:
    """The measured peak per core that prefill attention over a ``cache_dtype`` KV cache is set against, as
    (name, GMAC/s): ``vdpbf16ps`` where a bfloat16 cache runs its AVX-512 BF16 path (``kv_bf16_peak``, 16 chains
    of 32 MACs a round), else the float32 FMA peak of the path the kernels run (the float32 tiles' arithmetic,
    and the float32 FMAs a quantized or bfloat16 cache's other paths run after widening); None without a probe
    for that path (the scalar one, or no kernel build)."""
    from kvserve import native
    from kvserve.loadtest.engine.roofline import bf16_peak_gmacs, fma_peak_gmacs

    ops = native.load_ops()
    if ops is None:
        return None
    if cache_dtype == KVCacheDType.BFLOAT16.value and ops.bf16_attention_path(head_dim) == "avx512":
        gmacs = bf16_peak_gmacs()
        return ("vdpbf16ps", gmacs) if gmacs else None
    module = native.load()
    path = module.isa() if module is not None else "scalar"
    gmacs = fma_peak_gmacs(path)
    return (f"{path} float32 FMA", gmacs) if gmacs else None


def int8_peak() -> tuple[str, float] | None:
    """The measured int8 peak per core that the projections' kernels are set against, as (instruction, GMAC/s):
    the instruction the path they run multiplies with (``vpdpbusd`` on AVX-512 VNNI, ``vpmaddubsw`` on AVX2);
    None for the scalar path or without a kernel build."""
    from kvserve import native
    from kvserve.loadtest.engine.roofline import INT8_PROBES, int8_peak_gmacs

    module = native.load()
    path = module.isa() if module is not None else "scalar"
    gmacs = int8_peak_gmacs(path)
    return (INT8_PROBES[path][0], gmacs) if gmacs else None


def prefill_table(lengths: list[int], chunk: int, loaded, cache_dtype: str = "auto") -> str:
    """The prefill profile as markdown: per prompt length, wall time (median of 3 runs up to 2,048 tokens, one
    run past that) and per part its seconds, share and rate, over a ``cache_dtype`` KV cache."""
    from kvserve import native
    from kvserve.loadtest.engine.macs import Geometry

    geometry = Geometry.of(loaded.model.config)
    int8 = int8_peak()
    peak = int8[1] if int8 else None
    attn_peak = attention_peak(cache_dtype, geometry.head_dim)
    threads = torch.get_num_threads()
    rows = ["| prompt tokens | prefill s (no profiler) | tokens/s | " + " | ".join(
        f"{part} s (share)" for part, _ in _PREFILL_PARTS) + " | projections GMAC/s" + (
        " (% of int8 peak)" if peak else "") + " | attention GMAC/s" + (
        f" (% of {attn_peak[0]} peak)" if attn_peak else "") + " |" + (
        " at the peaks s |" if peak and attn_peak else ""),
        "|---:" * (4 + len(_PREFILL_PARTS)) + "|---:|" + ("---:|" if peak and attn_peak else "")]
    for length in lengths:
        wall, seconds = profile_prefill(length, chunk, loaded, 3 if length <= 2048 else 1, cache_dtype)
        total = sum(seconds.values())
        parts = {part: sum(seconds.get(label, 0.0) for label in labels) for part, labels in _PREFILL_PARTS}
        # the profiler's own cost is spread over the parts: scale them to the prefill without it
        scaled = {part: wall * s / total for part, s in parts.items()}
        proj_macs = length * geometry.per_token + geometry.hidden * geometry.vocab
        proj_gmacs = proj_macs / scaled["projections"] / 1e9
        pairs = length * (length + 1) // 2
        attn_gmacs = geometry.per_pair * pairs / scaled["attention"] / 1e9 if scaled["attention"] else float("nan")
        proj = f"{proj_gmacs:.3g}" + (f" ({100 * proj_gmacs / (peak * threads):.0f}%)" if peak else "")
        attn = f"{attn_gmacs:.3g}" + (f" ({100 * attn_gmacs / (attn_peak[1] * threads):.0f}%)" if attn_peak else "")
        at_peaks = ""
        if peak and attn_peak:  # projections and attention at 100% of their peaks, the rest as measured
            at_peaks = " {:.3g} |".format(
                proj_macs / (peak * threads * 1e9) + geometry.per_pair * pairs / (attn_peak[1] * threads * 1e9)
                + wall - scaled["projections"] - scaled["attention"])
        rows.append(f"| {length} | {wall:.3g} | {length / wall:.0f} | " + " | ".join(
            f"{scaled[part]:.3g} ({100 * parts[part] / total:.0f}%)" for part, _ in _PREFILL_PARTS)
            + f" | {proj} | {attn} |" + at_peaks)
        if attn_peak:  # attention at the peak, the rest as measured
            floor = geometry.per_pair * pairs / (attn_peak[1] * threads * 1e9)
            bound = (length, floor, floor / (floor + wall - scaled["attention"]))
    peak_text = (f"int8 peak measured in the same run: {peak:.0f} GMAC/s per core (`{int8[0]}`, independent chains on "
                 f"registers), x {threads} threads" if int8 else "int8 peak not measured (no probe for this path)")
    if attn_peak:
        name, gmacs = attn_peak
        peak_text += (f"; attention's peak likewise: {gmacs:.0f} GMAC/s per core (`vdpbf16ps`, 16 chains)"
                      if name == "vdpbf16ps" else
                      f"; attention's peak likewise: {gmacs:.0f} GMAC/s per core ({name}: `vfmadd231ps`, independent "
                      "chains on registers)") + f", x {threads} threads"
    else:
        peak_text += "; attention's peak not measured (no probe for its path)"
    return ("\n".join(rows) + f"\n\nSteps as the server plans a prompt alone: chunks of {chunk} tokens (its "
            "--max-num-batched-tokens), fewer deep in a long prompt (chunks sized by work, attention counted: "
            "--attention-cost-context, the model's default), kernels "
            f"{native.isa()}, {threads} threads; {peak_text}. Shares are of the profiled prefill (self CPU time per "
            "op); seconds are those shares of the prefill without the profiler"
            + ("; at the peaks: the prefill with its projections and attention at 100% of their peaks and the rest "
               "as measured, the least time these exact ops could take" if peak and attn_peak else "")
            + ". Projections: q/k/v/o and the MLP "
            "for every prompt token plus the LM head once; attention: 2 L H d multiply-adds per causal (query, key) "
            + ("pair, in float32." if cache_dtype in ("auto", "float32") else
               f"pair, over a {cache_dtype} KV cache (bfloat16: bf16 dot products, float32 sums).")
            + (" Attention is exact (every query's softmax over all its keys, in a decode row's order), so its "
               f"multiply-adds set a floor: at {bound[0]} tokens, at 100% of its peak it would take {bound[1]:.3g} s, "
               f"{100 * bound[2]:.0f}% of the prefill with the rest as measured." if attn_peak else ""))


def add_arguments(parser: argparse.ArgumentParser) -> None:

    parser.add_argument("--batch", type=positive_ints, default=[1, 8, 32], help="comma list of batch sizes")
    parser.add_argument("--context", type=positive_int, default=64, help="cached tokens per sequence")
    parser.add_argument("--steps", type=positive_int, default=7, help="timed and profiled steps per batch size")
    parser.add_argument("--model", default=None, help="as kvserve serve --model (default: the embedded SmolLM2)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--quantization", default="auto", choices=QUANTIZATIONS,
                        help="as kvserve serve --quantization (default auto: the weights the server picks)")
    parser.add_argument("--prefill", type=positive_ints, default=None, metavar="TOKENS",
                        help="profile a prefill of each prompt length instead (comma list, e.g. 128,512,2048,8192)")
    parser.add_argument("--chunk", type=positive_int, default=512,
                        help="tokens per prefill step (as kvserve serve --max-num-batched-tokens)")
    parser.add_argument("--layers", default="stack", choices=[*LAYER_PATHS, "both"],
                        help="what all-decode steps run: the layer stack (one C++ call a step, the default where "
                             "it applies), the per-layer loop, or both side by side in alternating rounds")
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="with --layers both: rounds, each running the loop then the stack per batch size")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=[d.value for d in KVCacheDType],
                        help="as kvserve serve --kv-cache-dtype (default auto: the model's dtype)")
    parser.add_argument("--step-thread", action="store_true",
                        help="with --prefill: time each prefill on this thread and on a step thread as the server "
                             "runs it, alternating for --rounds rounds, instead of profiling it")
    parser.add_argument("--no-write", action="store_true")


def run(args: argparse.Namespace) -> int:
    torch.set_grad_enabled(False)
    from kvserve.engine.loader import Device, DType
    from kvserve.loadtest.engine.enginebench import check_engine_flags, load_served

    check_engine_flags(args.model, args.device)
    batches = args.batch
    loaded, served = load_served(args.quantization, DType(args.dtype), args.model, Device(args.device))
    if args.prefill:
        return _run_prefill(args, loaded, served)
    paths = LAYER_PATHS if args.layers == "both" else (args.layers,)
    results, runs = _profiles(batches, paths, args.rounds if args.layers == "both" else 1, args, loaded)
    labels = [label for label, _ in _CATEGORIES] + ["other ops", "Python/dispatch overhead"]
    heads = [f"{_PATH_NAMES[path]}, B = {b}" if len(paths) > 1 else f"B = {b}" for b, path, _ in results]
    rows = ["| share of a decode step | " + " | ".join(heads) + " |", "|---" * (len(results) + 1) + "|"]
    rows.append("| step ms (median, no profiler) | " + " | ".join(f"{r.wall_ms:.2f}" for *_, r in results) + " |")
    rows.append("| projections + LM head alone, ms | " + " | ".join(f"{r.alone_ms:.2f}" for *_, r in results) + " |")
    rows.append("| rest ms (step - them) | " + " | ".join(f"{r.rest_ms:.2f}" for *_, r in results) + " |")
    rows.append("| step ms under the profiler | " + " | ".join(f"{r.profiled_ms:.1f}" for *_, r in results) + " |")
    for label in labels:
        cells = [f"{100 * r.shares.get(label, 0.0):.0f}%" for *_, r in results]
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    top = results[-1][2].top
    rounds = (f" Both paths side by side: {args.rounds} alternating rounds (per batch size the loop, then the stack), "
              "the round with the median step per column; the two give the same bits. The table after the notes has "
              "every round's rest and its ratio stack / loop, and the median of those ratios: the figure to quote "
              "on a busy machine." if len(paths) > 1 else "")
    text = "\n".join(rows) + ("\n\nRest: the step without the profiler less every projection and the LM head "
                              "replayed alone on as many rows (median of 7, through their bare kernels): "
                              "attention, norms, RoPE, SwiGLU, sampling and the Python around them." + rounds +
                              " Shares are of a profiled step (self CPU time per op; the step without the "
                              "profiler is a median, the one under it a mean). The profiler costs time per call, "
                              "spread over every row (Python/dispatch overhead and the small ops most): where the "
                              "step under the profiler is much longer than without it (batch 1: a step makes ~300 "
                              "short calls), the shares are of that longer step, and the projections' real share "
                              "is larger (`python -m kvserve.loadtest quant` replays them alone). On float32 CPU steps "
                              "of decodes only, `kvserve::decode_attention` (counted as attention) also applies "
                              "RoPE and writes the step's K/V. "
                              f"Top ops at B = {results[-1][0]} (self ms per profiled step): "
                              + ", ".join(f"`{name}` {ms:.1f}" for name, ms in top) + ".")
    if len(paths) > 1:
        text += "\n\n" + rest_rounds_table(batches, runs)
    print(text)
    print(f"{loaded.name}, {loaded.dtype}, {loaded.device}, quantization {args.quantization} ({served})")
    if not args.no_write and args.layers != "stack":
        print("not written to BENCHMARKS.md: its section shows what the engine runs (--layers stack)")
    elif not args.no_write:
        # each device and quantization gets its own section
        on_cpu, scheme = loaded.device.type == "cpu", args.quantization
        cache = args.kv_cache_dtype
        key = ("profile" + ("" if on_cpu else f"-{loaded.device.type}") + ("" if scheme == "auto" else f"-{scheme}")
               + ("" if cache == "auto" else f"-kv-{cache}"))
        what = ", ".join(["our engine", f"{args.context}-token caches"] + ([] if on_cpu else [loaded.device.type])
                         + ([f"the default weights ({served})"] if scheme == "auto" else [f"{scheme} weights"])
                         + ([] if cache == "auto" else [f"{cache} KV cache"]))
        update_section(key, f"Where a decode step's time goes ({what})",
                       "python -m kvserve.loadtest profile" + ("" if on_cpu else f" --device {loaded.device.type}")
                       + ("" if scheme == "auto" else f" --quantization {scheme}")
                       + ("" if cache == "auto" else f" --kv-cache-dtype {cache}"), text, per_kernel_path=on_cpu)
    return 0


_PATH_NAMES = {"loop": "layer loop", "stack": "layer stack"}


def _profiles(batches: list[int], paths: tuple[str, ...], rounds: int, args: argparse.Namespace, loaded
              ) -> tuple[list[tuple[int, str, DecodeProfile]], dict[tuple[int, str], list[DecodeProfile]]]:
    """Per batch size and path, the profile of the round whose step (no profiler) is the median, and every
    round's profile in round order; rounds alternate the paths, so a busy spell of the machine falls on both
    alike."""
    runs: dict[tuple[int, str], list[DecodeProfile]] = {}
    for _ in range(rounds):
        for batch in batches:
            for path in paths:
                runs.setdefault((batch, path), []).append(profile_decode(batch, args.context, args.steps, loaded,
                                                                          path, args.kv_cache_dtype))
    return [(batch, path, sorted(runs[batch, path], key=lambda r: r.wall_ms)[rounds // 2])
            for batch in batches for path in paths], runs


def rest_rounds_table(batches: list[int], runs: dict[tuple[int, str], list[DecodeProfile]]) -> str:
    """The rest of the layer loop and of the layer stack in every round, side by side, and their ratio (stack /
    loop) per round; its last row has the median of each column, the ratio's being the median of the rounds'
    ratios (of the rounds that have one: a loop rest <= 0 has none). Each round ran the two paths one after the
    other, so a ratio is taken within one spell of the machine, and a slow round moves one ratio of several
    rather than the figure (the main table's columns are each path's median round, which may be different
    rounds)."""
    heads = [f"{head}, B = {b}" for b in batches for head in ("layer loop", "layer stack", "stack / loop")]
    rows = ["| rest ms per round | " + " | ".join(heads) + " |", "|---" + "|---:" * len(heads) + "|"]
    rounds = len(runs[batches[0], "loop"])
    columns: list[list[float]] = [[] for _ in heads]
    for index in range(rounds):
        cells = []
        for b in batches:
            loop, stack = runs[b, "loop"][index].rest_ms, runs[b, "stack"][index].rest_ms
            cells += [loop, stack, stack / loop if loop > 0 else float("nan")]
        for column, value in zip(columns, cells):
            column.append(value)
        rows.append(f"| round {index + 1} | " + " | ".join(f"{v:.2f}" for v in cells) + " |")
    # a round whose loop rest came out <= 0 (the machine's noise larger than the rest) has no ratio
    rows.append("| median (ratio: of the rounds' ratios) | " + " | ".join(
        f"{_median_of_finite(column):.2f}" for column in columns) + " |")
    return "\n".join(rows)


def _median_of_finite(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.median(finite) if finite else float("nan")


def _run_prefill(args: argparse.Namespace, loaded, served: str) -> int:
    if args.step_thread:
        return _run_step_thread(args, loaded, served)
    text = prefill_table(args.prefill, args.chunk, loaded, args.kv_cache_dtype)
    print(text)
    print(f"{loaded.name}, {loaded.dtype}, {loaded.device}, quantization {args.quantization} ({served}), "
          f"KV cache {args.kv_cache_dtype}")
    if not args.no_write:
        scheme = "" if args.quantization == "auto" else f" --quantization {args.quantization}"
        cache = "" if args.kv_cache_dtype == "auto" else f" --kv-cache-dtype {args.kv_cache_dtype}"
        update_section("profile-prefill" + scheme.replace(" --quantization ", "-")
                       + cache.replace(" --kv-cache-dtype ", "-kv-"),
                       f"Where a prefill's time goes (our engine, {loaded.name}, {served} weights"
                       + (f", {args.kv_cache_dtype} KV cache" if cache else "") + ")",
                       "python -m kvserve.loadtest profile --prefill " + ",".join(map(str, args.prefill))
                       + (f" --chunk {args.chunk}" if args.chunk != 512 else "") + scheme + cache, text)
    return 0


def _run_step_thread(args: argparse.Namespace, loaded, served: str) -> int:
    text = step_thread_table(args.prefill, args.chunk, loaded, args.rounds, args.kv_cache_dtype)
    text += (f"\n\n{args.rounds} rounds per length, each the prefill on the calling thread then on the step thread "
             f"(the same steps, the same bits); kernels {_kernel_path()}, {torch.get_num_threads()} threads.")
    print(text)
    print(f"{loaded.name}, {loaded.dtype}, {loaded.device}, quantization {args.quantization} ({served})")
    if not args.no_write:
        update_section("profile-step-thread", f"A step on the server's thread ({loaded.name}, {served} weights)",
                       "python -m kvserve.loadtest profile --step-thread --prefill " + ",".join(map(str, args.prefill))
                       + f" --rounds {args.rounds}" + (f" --model {args.model}" if args.model else ""), text)
    return 0


def _kernel_path() -> str:
    from kvserve import native

    module = native.load()
    return module.isa() if module is not None else "scalar (no kernel build)"
