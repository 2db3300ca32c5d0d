"""``python -m kvserve.loadtest peers``: kvserve side by side with llama.cpp's server and transformers' ``generate``.

Same machine, same model (SmolLM2-135M-Instruct: llama.cpp serves the GGUF file kvserve converts from),
same requests. Servers go through the same load generator; transformers runs in-process.

Figures per system (all outputs pinned to their length with ignore_eos / min_tokens):
- single-stream decode tokens/s: one stream of 128 tokens, (tokens - 1) / (e2e - TTFT);
- TTFT of a 512-token prompt (each prompt starts with a different word, so no prefix cache can help);
- aggregate output tokens/s with 1, 8 and 32 concurrent streams of 128 tokens (one request per stream
  at 8 and 32, two at 1);
- seed64 with 8 slots (all 64 at once; transformers: static batches of 8, as ``generate`` must).
Each is also shown as a ratio to llama.cpp. Systems run one after another; ``--repeats`` alternates them.

    python -m kvserve.loadtest llamacpp          # builds llama-server in /tmp (once, a while on 2 cores)
    flock /tmp/kvserve-cpu.lock python -m kvserve.loadtest peers
    flock /tmp/kvserve-cpu.lock python -m kvserve.loadtest peers --systems kvserve-int8,kvserve-int4   # more later
    python -m kvserve.loadtest randgguf --shape llama-3.2-1b --mix Q4_K_M /tmp/llama-1b-q4_k_m.gguf
    flock /tmp/kvserve-cpu.lock python -m kvserve.loadtest peers --model /tmp/llama-1b-q4_k_m.gguf

    python -m kvserve.loadtest vllm               # vLLM's CPU backend in a venv under /tmp (optional peer)
    flock /tmp/kvserve-cpu.lock python -m kvserve.loadtest peers --prefill   # TTFT by prompt length, the stall

``--prefill``: the figures of ``served/prefillpeers.py`` instead (TTFT at 512, 2,048 and 8,000 tokens, short
requests' TTFT while a long prompt is prefilled), for llama.cpp, kvserve and vLLM where installed.

``--model FILE.gguf``: llama.cpp and kvserve serve that file instead (its own blocks by default; the systems
default to llama.cpp and kvserve-gguf). Results are kept per system in ``loadtest/out/peers.json`` (with
``--model``, ``peers-<file stem>.json``, and a BENCHMARKS.md section of its own), so a table can be built over
several runs.
"""

from __future__ import annotations

import argparse
from datetime import datetime, timezone
import json
import shlex
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvserve.loadtest.argtypes import absolute_path, positive_ints
from kvserve.loadtest.loadgen import report, workloads
from kvserve.loadtest.loadgen.generator import LoadConfig, run_sync
from kvserve.loadtest.loadgen.report import median_over_repeats
from kvserve.loadtest.loadgen.runcmd import server_model
from kvserve.loadtest.peer_systems.llamacpp import find_server
from kvserve.loadtest.procs.serverproc import ServerStartError, kvserve_command, launch
from kvserve.loadtest.publish.benchmarks_md import BENCHMARKS, update_section
from kvserve.loadtest.served import prefillpeers

OUTPUT_TOKENS = 128
TTFT_PROMPT_TOKENS = 512
STREAMS = (1, 8, 32)
SEED64_SLOTS = 8
QUANTIZATIONS = ("none", "gguf", "int8", "int4", "nf4")  # gguf: the GGUF's own blocks, the default
SYSTEMS = ("llama.cpp", "transformers", *(f"kvserve-{q}" for q in QUANTIZATIONS))
MODEL_SYSTEMS = ("llama.cpp", "kvserve-gguf")  # with --model FILE.gguf: both serving the file's own blocks
_FIRST_WORDS = (" apple", " river", " Note", " stone", " cloud", " table")  # one token each in SmolLM2


@dataclass(slots=True)
class PeerFigures:
    """One system's figures (tokens/s, seconds); None where it could not be measured, with ``error`` saying why."""

    system: str
    single_decode_tps: float | None = None
    ttft_512_s: float | None = None
    aggregate_tps: dict[str, float] = field(default_factory=dict)  # str(streams) -> tokens/s
    seed64_tps: float | None = None
    error: str | None = None


def ttft_prompts(count: int) -> list[workloads.RequestSpec]:
    """``count`` distinct 512-token prompts asking for one token each."""
    return [workloads.fixed(1, 1, word + workloads.repeated_word_prompt(TTFT_PROMPT_TOKENS - 1))[0]
            for word in _FIRST_WORDS[:count]]


def _load(url: str, specs, streams: int, count: int, label: str) -> report.Summary:
    config = LoadConfig(url=url, concurrency=streams, count=count, duration_s=900, timeout_s=900,
                        model=server_model(url), progress=False)
    summary = report.summarize(run_sync(specs, config, label))
    if summary.ok != summary.sent:
        raise RuntimeError(f"{label}: {summary.sent - summary.ok} of {summary.sent} requests failed")
    print(f"  {label}: {summary.tokens_per_s:.1f} tok/s, ttft {summary.ttft_mean_s:.3f} s, "
          f"decode {summary.decode_tokens_per_s:.1f} tok/s/stream")
    return summary


def measure_server(figures: PeerFigures, command_for_slots) -> None:
    """Fill ``figures`` from a server; ``command_for_slots(slots)`` gives its command line."""
    with launch(command_for_slots(max(STREAMS)), name=f"peers-{figures.system}") as server:
        figures.single_decode_tps = _load(server.url, workloads.fixed(2, OUTPUT_TOKENS), 1, 2,
                                          "single").decode_tokens_per_s
        figures.ttft_512_s = _load(server.url, ttft_prompts(3), 1, 3, "ttft-512").ttft_mean_s
        for streams in STREAMS:
            count = max(streams, 2)
            figures.aggregate_tps[str(streams)] = _load(server.url, workloads.fixed(count, OUTPUT_TOKENS), streams,
                                                        count, f"streams={streams}").tokens_per_s
    with launch(command_for_slots(SEED64_SLOTS), name=f"peers-{figures.system}-seed64") as server:
        figures.seed64_tps = _load(server.url, workloads.seed64(), 64, 64, "seed64").tokens_per_s


def llama_command(binary: Path, gguf: Path, slots: int) -> list[str]:
    """llama-server on 127.0.0.1 with ``slots`` parallel slots (continuous batching is its default)."""
    per_slot = TTFT_PROMPT_TOKENS + OUTPUT_TOKENS + 64
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", "{port}", "-t", "2", "-np", str(slots),
            "-c", str(per_slot * slots), "-cb"]


def measure_transformers(figures: PeerFigures, model: Path | None = None) -> None:
    """transformers' own ``generate`` on the same weights (sdpa attention, its own cache), static batches."""
    from kvserve.loadtest.peer_systems.hfgenerate import HFGenerate

    hf = HFGenerate(None if model is None else str(model))
    figures.single_decode_tps = hf.single_decode_tps(OUTPUT_TOKENS)
    figures.ttft_512_s = statistics.median(hf.ttft_s(spec.prompt) for spec in ttft_prompts(3))
    for streams in STREAMS:
        figures.aggregate_tps[str(streams)] = hf.batch_tps(streams, OUTPUT_TOKENS)
    figures.seed64_tps = hf.seed64_tps(SEED64_SLOTS)
    print(f"  transformers: {asdict(figures)}")


def measure(system: str, model: Path | None = None) -> PeerFigures:
    """Measure one system on ``model`` (a GGUF file; None: the embedded one); a failure (e.g. a quantization
    scheme that does not load) is recorded, not raised."""
    figures = PeerFigures(system)
    print(f"{system}:")
    try:
        if system == "llama.cpp":
            from kvserve.engine.loader import default_gguf_path

            binary = find_server()
            if binary is None:
                raise FileNotFoundError("llama-server not built: run python -m kvserve.loadtest llamacpp")
            gguf = model or default_gguf_path()
            measure_server(figures, lambda slots: llama_command(binary, gguf, slots))
        elif system == "transformers":
            measure_transformers(figures, model)
        else:
            scheme = system.removeprefix("kvserve-")
            chosen = ["--model", str(model)] if model is not None else []
            measure_server(figures, lambda slots: kvserve_command([*chosen, "--quantization", scheme,
                                                                   "--max-num-seqs", str(slots)]))
    except (ServerStartError, RuntimeError, FileNotFoundError, OSError) as exc:
        figures.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        print(f"  failed: {figures.error}")
    return figures


def _ratio(value: float | None, base: float | None, lower_is_better: bool = False) -> str:
    if value is None or base is None or value == 0 or base == 0:
        return "-"
    return f"{(base / value if lower_is_better else value / base):.2f}x"


def render(results: dict[str, dict], served: str = "the Q4_1 GGUF") -> str:
    """Markdown: one row per system, each figure with its ratio to llama.cpp (higher is better throughout)."""
    base = results.get("llama.cpp")
    head = ("| system | decode tok/s (1 stream) | TTFT 512-token prompt | tok/s @1 | tok/s @8 | tok/s @32 "
            "| seed64 tok/s (8 slots) | measured (UTC) |")
    rows = [head, "|---" * 8 + "|"]
    for name in SYSTEMS:
        r = results.get(name)
        if r is None:
            continue
        if r.get("error"):
            rows.append(f"| {name} | failed: {r['error']} | | | | | | {r.get('measured_utc', '?')} |")
            continue

        def cell(value, key_path, lower=False, unit=""):
            if value is None:
                return "-"
            ref = base
            for key in key_path:
                ref = ref.get(key) if isinstance(ref, dict) else None
            shown = f"{value:.2f} s" if unit == "s" else f"{value:.1f}"
            return f"{shown} ({_ratio(value, ref, lower)})" if base and not base.get("error") else shown

        agg = r.get("aggregate_tps", {})
        rows.append(f"| {name} | {cell(r['single_decode_tps'], ['single_decode_tps'])} | "
                    f"{cell(r['ttft_512_s'], ['ttft_512_s'], lower=True, unit='s')} | "
                    + " | ".join(cell(agg.get(str(s)), ['aggregate_tps', str(s)]) for s in STREAMS)
                    + f" | {cell(r['seed64_tps'], ['seed64_tps'])} | {r.get('measured_utc', 'before 18:00')} |")
    return "\n".join(rows) + (
        "\n\nRatios in brackets are to llama.cpp's server (> 1 is better than llama.cpp; for TTFT the ratio is "
        f"llama.cpp's TTFT over this one). llama.cpp serves {served} with 2 threads and continuous "
        "batching (`-np 32`, or `-np 8` for seed64); kvserve runs at its default dtype for this CPU, "
        "with `--max-num-seqs 32` (8 for seed64); transformers runs `generate` in-process on the same weights.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=absolute_path, default=None,
                        help="a GGUF file llama.cpp and kvserve both serve (default: the embedded SmolLM2)")
    parser.add_argument("--systems", default=None,
                        help=f"comma list of {', '.join(SYSTEMS)} (default: all; with --model, "
                             f"{','.join(MODEL_SYSTEMS)})")
    parser.add_argument("--repeats", type=int, default=1, help="passes over the systems (the median is kept)")
    parser.add_argument("--results", type=Path, default=None,
                        help="per-system results, merged across runs (default: loadtest/out/peers.json, with "
                             "--model peers-<stem>.json)")
    parser.add_argument("--benchmarks", type=Path, default=BENCHMARKS)
    parser.add_argument("--img", type=Path, default=None, help="also save the throughput plot here (e.g. docs/img)")
    parser.add_argument("--render-only", action="store_true",
                        help="measure nothing: rebuild the section from --results")
    parser.add_argument("--prefill", action="store_true",
                        help="measure prefill instead: TTFT by prompt length and short requests during a long one")
    parser.add_argument("--prefill-lengths", type=positive_ints, default=list(prefillpeers.LENGTHS),
                        metavar="TOKENS", help="prompt lengths for --prefill (comma list)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "int8", "int4"],
                        help="with --prefill: kvserve's --kv-cache-dtype; its row is named after it, beside the "
                             "default's")
    parser.add_argument("--kvserve-flags", action="append", default=None, metavar="FLAGS",
                        help="with --prefill: `kvserve serve` flags for a kvserve row of their own, named after them "
                             "(repeat for more rows, side by side in one run; '' is the default's row), e.g. "
                             "--kvserve-flags '' --kvserve-flags '--attention-cost-context 0'")
    parser.add_argument("--no-write", action="store_true")


def plot(results: dict[str, dict], directory: Path, stem: str = "peers", title: str = "SmolLM2-135M") -> Path:
    """Aggregate tokens/s against concurrent streams, one line per system that ran."""
    series = {name: [(int(k), v) for k, v in r["aggregate_tps"].items() if v is not None]
              for name, r in results.items() if not r.get("error") and r.get("aggregate_tps")}
    return report.plot_throughput(series, directory / f"{stem}-throughput.png",
                                  f"{title}, 128-token outputs: throughput vs concurrency")


def run(args: argparse.Namespace) -> int:
    from kvserve.loadtest.errors import UsageError

    model = args.model
    if model is not None and (model.suffix != ".gguf" or not model.is_file()):
        raise UsageError(f"--model {str(model)!r}: not a .gguf file (llama.cpp serves GGUF files only)")
    stem = "peers" if model is None else f"peers-{model.stem}"
    title = "SmolLM2-135M" if model is None else model.name
    if args.prefill:
        return run_prefill(args, model, stem, title)
    results_path = args.results or report.OUT_DIR / f"{stem}.json"
    systems = args.systems or ",".join(SYSTEMS if model is None else MODEL_SYSTEMS)
    chosen = [s for s in systems.split(",") if s]
    unknown = set(chosen) - set(SYSTEMS)
    if unknown:
        raise UsageError(f"unknown systems: {', '.join(sorted(unknown))}")
    passes: dict[str, list[PeerFigures]] = {s: [] for s in chosen} if not args.render_only else {}
    for _ in range(args.repeats if passes else 0):
        for system in chosen:
            passes[system].append(measure(system, model))
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M")
    for system, figures in passes.items():
        results[system] = _median(figures) | {"measured_utc": stamp}  # results merge across runs: say when
    results_path.parent.mkdir(parents=True, exist_ok=True)
    results_path.write_text(json.dumps(results, indent=1))
    text = render(results, "the Q4_1 GGUF" if model is None else f"the same file ({model.name})")
    print(text)
    print("wrote", plot(results, results_path.parent, stem, title))
    if args.img:
        plot(results, args.img, stem, title)
        text += f"\n\n![throughput vs concurrency]({args.img.as_posix()}/{stem}-throughput.png)"
    if not args.no_write:
        # results merge across runs, so the command that reproduces the whole table is the plain one
        command = "python -m kvserve.loadtest peers" + ("" if model is None else f" --model {model.name}")
        update_section(stem, f"kvserve vs llama.cpp's server vs transformers generate ({title})", command, text,
                       args.benchmarks)
    return 0


def _median(figures: list[PeerFigures]) -> dict:
    """The per-figure median over repeats that succeeded (the last error if none did)."""
    return median_over_repeats(figures, ("single_decode_tps", "ttft_512_s", "seed64_tps"), ("aggregate_tps",))


PREFILL_SYSTEMS = ("llama.cpp", "kvserve-gguf", "vllm")


def measure_prefill(system: str, model: Path | None, lengths: list[int], kv_cache_dtype: str = "auto",
                    kvserve_flags: str = "") -> prefillpeers.PrefillFigures:
    """One system's prefill figures on ``model`` (None: the embedded GGUF), kvserve's with a ``kv_cache_dtype``
    KV cache (its --kv-cache-dtype) and ``kvserve_flags`` (more serve flags, shell words); a failure is recorded,
    not raised."""
    from kvserve.engine.loader import default_gguf_path
    from kvserve.loadtest.peer_systems import vllmcpu

    gguf = model or default_gguf_path()
    context = prefillpeers.context_tokens(lengths)
    slots = prefillpeers.SLOTS
    print(f"{system} (prefill{', ' + kvserve_flags if kvserve_flags else ''}):")
    step_log = None
    try:
        if system == "llama.cpp":
            binary = find_server()
            if binary is None:
                raise FileNotFoundError("llama-server not built: run python -m kvserve.loadtest llamacpp")
            command, env = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", "{port}", "-t", "2",
                            "-np", str(slots), "-c", str(context * slots), "-cb"], None
        elif system == "kvserve-gguf":
            chosen = ["--model", str(model)] if model is not None else []
            cache = [] if kv_cache_dtype == "auto" else ["--kv-cache-dtype", kv_cache_dtype]
            step_log = report.OUT_DIR / "peers-prefill-steps.jsonl"
            step_log.parent.mkdir(parents=True, exist_ok=True)
            step_log.write_text("")
            command = kvserve_command([*chosen, *cache, "--max-num-seqs", str(slots), "--step-log", str(step_log),
                                       *shlex.split(kvserve_flags)])
            env = None
        elif system == "vllm":
            command, env = vllmcpu.serve_command(gguf, slots, context)
        else:
            raise ValueError(f"unknown prefill system {system!r}")
        with launch(command, name=f"peers-prefill-{system}", env=env, start_timeout_s=900) as server:
            return prefillpeers.measure_server(system, server.url, lengths, step_log)
    except (ServerStartError, RuntimeError, FileNotFoundError, OSError, ValueError) as exc:
        figures = prefillpeers.PrefillFigures(system, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        print(f"  failed: {figures.error}")
        return figures


def run_prefill(args: argparse.Namespace, model: Path | None, stem: str, title: str) -> int:
    """``peers --prefill``: measure, merge into ``<stem>-prefill.json``, write the BENCHMARKS.md section."""
    from kvserve.loadtest.errors import UsageError

    chosen = [s for s in (args.systems or ",".join(PREFILL_SYSTEMS)).split(",") if s]
    unknown = set(chosen) - set(PREFILL_SYSTEMS)
    if unknown:
        raise UsageError(f"unknown systems for --prefill: {', '.join(sorted(unknown))} (choose from "
                         f"{', '.join(PREFILL_SYSTEMS)})")
    lengths = sorted(args.prefill_lengths)
    path = args.results or prefillpeers.results_path(report.OUT_DIR, stem)
    results = json.loads(path.read_text()) if path.exists() else {}  # merged across runs, as the decode table
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M")
    runs = [(system, flags) for system in chosen
            for flags in (args.kvserve_flags or [""] if system.startswith("kvserve") else [""])]
    for system, flags in runs if not args.render_only else []:
        passes = [measure_prefill(system, model, lengths, args.kv_cache_dtype, flags) for _ in range(args.repeats)]
        # a kvserve row with another cache dtype or more flags stands beside the default one (ratios stay to the
        # default's)
        named = " ".join(([f"--kv-cache-dtype {args.kv_cache_dtype}"] if args.kv_cache_dtype != "auto" else [])
                         + ([flags.strip()] if flags.strip() else []))
        name = system if not named or not system.startswith("kvserve") else f"{system} ({named})"
        results[name] = prefillpeers.median(passes) | {"measured_utc": stamp}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    served = "the embedded Q4_1 GGUF (vLLM: its bfloat16 weights)" if model is None else f"{model.name}"
    text = prefillpeers.render(results, lengths, served)
    print(text)
    if not args.no_write:
        command = ("python -m kvserve.loadtest peers --prefill" + ("" if model is None else f" --model {model.name}")
                   + ("" if lengths == list(prefillpeers.LENGTHS) else " --prefill-lengths "
                      + ",".join(map(str, lengths)))
                   + ("" if args.kv_cache_dtype == "auto" else f" --kv-cache-dtype {args.kv_cache_dtype}")
                   + "".join(f" --kvserve-flags {shlex.quote(flags)}" for flags in args.kvserve_flags or []))
        update_section(f"{stem}-prefill", f"Prefill side by side: TTFT by prompt length and the stall ({title})",
                       command, text, args.benchmarks)
    return 0
