"""``kvserve serve``: load the model, build the stack, run uvicorn."""

from __future__ import annotations

import argparse
import logging
from concurrent.futures import ThreadPoolExecutor

from kvserve import environment
from kvserve.kvcache.hashing import HashAlgo
from kvserve.kvcache.sizing import KVCacheDType, parse_bytes
from kvserve.engine.drafters import Drafter
from kvserve.quant.options import Scheme
from kvserve.server.auth import read_key_file
from kvserve.scheduler.ordering import SchedulingPolicy
from kvserve.server.config import Policy, ServeConfig
from kvserve.server.httpserver import uvicorn_config, uvicorn_impls
from kvserve.server.kv_events import KVEventsConfig, parse_kv_events_config
from kvserve.speculation.policy import AUTO_MAX_DRAFT

log = logging.getLogger("kvserve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``kvserve serve`` (each maps to a ServeConfig field); the environment variables in the epilog."""
    parser.epilog = environment.help_text()
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    d = ServeConfig()
    parser.add_argument("--model", default=None, help="local Hugging Face model directory (default: embedded SmolLM2)")
    parser.add_argument("--host", default=d.host)
    parser.add_argument("--port", type=int, default=d.port)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default=d.device)
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default=d.dtype)
    parser.add_argument("--quantization", choices=[q.value for q in Scheme], default=d.quantization.value,
                        help="the weights computed with: auto (default): a GGUF model's own blocks (the embedded "
                             "SmolLM2's Q4_1/Q8_0), int8 for a float checkpoint; gguf: the GGUF file's own blocks; "
                             "none: full precision (bfloat16 where the CPU has it, else float32); int8, int4, nf4: "
                             "kvserve's own rounding of the float weights")
    parser.add_argument("--kv-cache-memory", default=d.kv_cache_memory,
                        help="KV pool budget, e.g. 1GiB; with --speculative draft it holds the draft model's pool "
                             "too (as many tokens as the served model's, at the draft's dtype and shape)")
    parser.add_argument("--kv-cache-dtype", choices=[d.value for d in KVCacheDType], default=d.kv_cache_dtype.value,
                        help="what the KV cache stores: auto (the model's dtype), float32, bfloat16, or int8 / int4 "
                             "codes with float16 scales per token and head (int4: per 32 channels): about 2x / 3.6x "
                             "the tokens of bfloat16 in the same memory, at a small (int8) or measurable (int4) "
                             "cost in quality (BENCHMARKS.md)")
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="pool size in blocks (overrides memory; a draft model's pool gets as many)")
    parser.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="slots (sequences per step)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                        help="token budget per step (chunked prefill)")
    parser.add_argument("--max-queue", type=int, default=d.max_queue,
                        help="sequences waiting beyond the free slots before 429 (a request with n choices counts n)")
    parser.add_argument("--max-prompts-per-request", type=int, default=d.max_prompts_per_request,
                        help="prompts one /v1/completions request may carry (a 400 beyond); a request whose "
                             "prompts x choices exceed --max-num-seqs + --max-queue is a 400 too, before any is queued")
    parser.add_argument("--max-model-len", type=int, default=None, help="context limit (tokens)")
    parser.add_argument("--max-request-bytes", type=parse_bytes, default=None, metavar="BYTES",
                        help="request body limit, e.g. 4MiB; larger bodies get 413 before they are read or "
                             "tokenized (default: 64 bytes per token of --max-model-len, at least 1MiB)")
    parser.add_argument("--scheduler", choices=[p.value for p in Policy], default=d.policy.value)
    parser.add_argument("--scheduling-policy", choices=[p.value for p in SchedulingPolicy],
                        default=d.scheduling_policy.value,
                        help="who runs first: fcfs (default), arrival order; priority, lower 'priority' of a request "
                             "first (vLLM's field; a request with a priority is refused by the other policies), "
                             "preempting lower priorities to admit higher; fair, equal shares of the slots and of "
                             "each step's token budget per tenant (an API key, or the X-Tenant-ID header without "
                             "keys)")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--prefix-caching-hash-algo", choices=[a.value for a in HashAlgo],
                        default=d.prefix_caching_hash_algo.value,
                        help="the prefix cache's block digests: kvserve (its own), or sha256_cbor (vLLM's: a router "
                             "that tokenizes and hashes prompts itself, as llm-d's precise prefix-cache scorer does, "
                             "finds the digests the KV events publish; NONE_HASH seeded from PYTHONHASHSEED as vLLM's)")
    parser.add_argument("--kv-events-config", type=_kv_events_config, default=None, metavar="JSON",
                        help="publish KV cache events as vLLM does, for KV-aware routers (Dynamo, llm-d, SGLang's "
                             "gateway): vLLM's JSON, e.g. '{\"enable_kv_cache_events\": true, \"endpoint\": "
                             "\"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\", \"topic\": \"kv\"}' "
                             "(fields: publisher, buffer_steps, hwm, max_queue_size; kvserve's event_encoding: map "
                             "or array); default: none")
    parser.add_argument("--api-key", action="append", default=None, metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on /v1 routes and /tokenize, /detokenize, "
                             "/tokenizer_info; repeat for several keys (each key gets its own prefix cache)")
    parser.add_argument("--api-key-file", default=None, metavar="PATH",
                        help="more keys, one a line ('#' starts a comment line)")
    parser.add_argument("--share-cache-across-keys", action="store_true",
                        help="with several keys, let them share cached prefixes (default: a partition per key, so "
                             "one key cannot time another's prompts)")
    parser.add_argument("--no-ui", action="store_true",
                        help="do not serve the live page (/ and /ui: slots, KV blocks, steps, a playground) "
                             "nor its event stream")
    parser.add_argument("--allowed-hosts", type=_host_list, default=None, metavar="NAMES",
                        help="comma list of Host names to answer besides the loopback ones ('*.example.com' for "
                             "subdomains, '*' for any); default: loopback names only when bound to loopback, any "
                             "name otherwise (a guard against DNS rebinding)")
    parser.add_argument("--header-timeout-seconds", type=float, default=d.header_timeout_s,
                        help="close a connection that has not sent a request's headers within this time")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="load pickled checkpoints (*.bin, *.pt); unpickling can run code, so only "
                             "safetensors are loaded by default")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--sse-ping-seconds", type=float, default=d.sse_ping_s,
                        help="keep-alive comment interval on idle streams (0 disables)")
    parser.add_argument("--step-log", default=None, metavar="PATH",
                        help="append one JSON line per engine step (its mix of prefills and decodes, tokens, "
                             "longest context, seconds) to PATH; the simulator fits its step cost to these")
    parser.add_argument("--drain-seconds", type=float, default=d.drain_s,
                        help="on SIGTERM, refuse new requests (503) and let in-flight ones finish for at most "
                             "this long before exiting (0: stop at once)")
    parser.add_argument("--vllm-metric-names", action="store_true",
                        help="on /metrics, repeat every kvserve: series under vLLM's vllm: prefix too, so vLLM's "
                             "Grafana dashboard and autoscaling rules work unchanged")
    parser.add_argument("--speculative", choices=[d.value for d in Drafter], default=ServeConfig().speculative.value,
                        help="speculative decoding: ngram drafts tokens by prompt lookup, draft by a draft model "
                             "(--draft-model, --draft-quantization); the served model verifies them (exact: the "
                             "output is unchanged); off: none")
    parser.add_argument("--draft-model", default=None, metavar="DIR",
                        help="with --speculative draft: a local HF model directory with the same tokenizer "
                             "(default: the served model's own weights, quantized by --draft-quantization)")
    parser.add_argument("--draft-quantization", default=None, choices=[q.value for q in Scheme if q is not Scheme.AUTO],
                        help="with --speculative draft: the draft's weights (default: int4 for the served model's "
                             "own weights, none for --draft-model); rounded to nearest, no calibration")
    parser.add_argument("--num-speculative-tokens", type=_draft_length, default=None, metavar="N|auto",
                        help="draft tokens per sequence per step: a fixed N, or auto (default): 0 to "
                             f"{AUTO_MAX_DRAFT}, chosen each step from measured acceptance and step cost")
    parser.add_argument("--log-level", default="info", type=str.lower, choices=["debug", "info", "warning", "error"])


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    return ServeConfig(model=args.model, host=args.host, port=args.port, device=args.device, dtype=args.dtype,
                       quantization=args.quantization, kv_cache_memory=args.kv_cache_memory,
                       kv_cache_dtype=args.kv_cache_dtype,
                       num_kv_blocks=args.num_kv_blocks, block_size=args.block_size,
                       max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       max_queue=args.max_queue, max_prompts_per_request=args.max_prompts_per_request,
                       max_model_len=args.max_model_len,
                       max_request_bytes=args.max_request_bytes, policy=Policy(args.scheduler),
                       scheduling_policy=SchedulingPolicy(args.scheduling_policy),
                       enable_prefix_caching=not args.no_prefix_caching,
                       prefix_caching_hash_algo=HashAlgo(args.prefix_caching_hash_algo), kv_events=args.kv_events_config,
                       api_keys=_api_keys(args),
                       share_cache_across_keys=args.share_cache_across_keys,
                       served_model_name=args.served_model_name, sse_ping_s=args.sse_ping_seconds,
                       step_log=args.step_log, drain_s=args.drain_seconds,
                       vllm_metric_names=args.vllm_metric_names, ui=not args.no_ui, allowed_hosts=args.allowed_hosts,
                       header_timeout_s=args.header_timeout_seconds, allow_pickle=args.allow_pickle,
                       speculative=Drafter(args.speculative), num_speculative_tokens=args.num_speculative_tokens,
                       draft_model=args.draft_model, draft_quantization=args.draft_quantization)


def _api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """``--api-key`` (each) then the keys of ``--api-key-file``."""
    keys = tuple(args.api_key or ())
    return keys + (read_key_file(args.api_key_file) if args.api_key_file else ())


def _draft_length(text: str) -> int | None:
    """``--num-speculative-tokens``: ``auto`` -> None, else a positive integer."""
    if text.strip().lower() == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens or auto, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1 (use --speculative off for none)")
    return value


def _kv_events_config(text: str) -> KVEventsConfig:
    """``--kv-events-config``: vLLM's JSON (``server.kv_events.parse_kv_events_config``)."""
    try:
        return parse_kv_events_config(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _host_list(text: str) -> tuple[str, ...]:
    """``--allowed-hosts a.example,*.b.example`` -> ``("a.example", "*.b.example")``."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def build_state(config: ServeConfig, executor: ThreadPoolExecutor | None = None):
    """Load and (optionally) quantize the model, then build the ServerState (steps run on ``executor``)."""
    from kvserve.engine import weights
    from kvserve.engine.loader import load_model
    from kvserve.server.state import ServerState

    choice = weights.choose(config.quantization, config.model)
    loaded = load_model(config.model, config.dtype, config.device,
                        quantized=choice.scheme is not Scheme.NONE, allow_pickle=config.allow_pickle)
    log.info("model %s loaded: %s on %s (%s)", loaded.name, loaded.dtype, loaded.device,
             dtype_reason(config, loaded, choice.scheme))
    log.info("tokenizer: %s (for clients that tokenize locally, e.g. guidellm --processor; `kvserve model-path` "
             "prints it)", loaded.tokenizer.name_or_path)
    described = weights.apply(loaded, choice.scheme, config.model, loaded.tokenizer)
    log.info("weights: %s (%s; %s)", described, choice.reason, weights.FULL_PRECISION_HINT)
    draft = load_draft(config, loaded) if config.speculative is Drafter.DRAFT else None
    return ServerState(loaded, config, executor, draft)


def dtype_reason(config: ServeConfig, loaded, scheme: Scheme) -> str:
    """Why the model runs in its dtype, and which flag changes it (for the start log); ``scheme``: the weights
    actually served (``--quantization auto`` resolved)."""
    from kvserve import native
    from kvserve.engine.options import DType

    if config.dtype is not DType.AUTO:
        return f"--dtype {config.dtype.value}"
    if loaded.device.type != "cpu":
        return f"--dtype auto: bfloat16 on {loaded.device.type}; --dtype float32 changes it"
    if scheme is not Scheme.NONE:
        return ("--dtype auto: float32 activations for quantized weights on a CPU (the kernels take float32 rows); "
                "--dtype bfloat16 changes it")
    if loaded.bf16_weights:
        return (f"--dtype auto: bfloat16 weights on the AVX512-BF16 kernel with float32 activations and KV cache "
                f"(kernel path {native.isa()}, and this CPU has AVX512-BF16), so the fused float32 ops serve it; "
                "--dtype float32 serves float32 weights, --dtype bfloat16 torch's bfloat16 ops")
    if native.load(build=False) is None:
        return ("--dtype auto: float32 on a CPU (the C++ kernels are off, so torch's float32 ops run); --dtype "
                "bfloat16 runs torch's bfloat16 ops")
    return (f"--dtype auto: float32 weights with the float32 kernels, as no bfloat16 kernel runs on the kernel path "
            f"{native.isa()} (it needs AVX512-BF16 on the avx512 path); --dtype bfloat16 runs torch's bfloat16 ops")


def load_draft(config: ServeConfig, served):
    """The draft model of ``--speculative draft``: ``--draft-model`` or the served model's own weights, loaded
    again and quantized as ``config.draft_scheme`` (rounded to nearest: a draft's codes only change how often it
    is right, and calibrating would add minutes to every start).

    Raises:
        ValueError: as ``load_model``; or the draft's tokenizer maps text to other ids than the served model's.
    """
    from kvserve.engine.loader import load_model

    scheme = config.draft_scheme
    draft = load_model(config.draft_model or config.model, config.dtype, config.device,
                       quantized=scheme is not Scheme.NONE, allow_pickle=config.allow_pickle)
    if draft.tokenizer.get_vocab() != served.tokenizer.get_vocab():
        raise ValueError(f"the draft model {draft.name} has another tokenizer than {served.name}: its drafts would "
                         "be other tokens")
    if scheme is not Scheme.NONE:
        from kvserve.engine import weights

        log.info("draft model %s: %s", draft.name, weights.apply(draft, scheme, config.draft_model or config.model))
    return draft


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvserve.server.app import create_app
    from kvserve.server.drain import Drain, DrainingServer

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        for line in environment.check():  # every switch read once, before anything loads
            log.info("environment: %s", line)
        config = config_from_args(args)
        if config.step_log:
            open(config.step_log, "a").close()  # a bad path fails now, not after the model has loaded
    except (OSError, ValueError) as exc:
        log.error("invalid option: %s", exc)
        return 2
    # All torch work (loading, pool allocation, every step) runs on this one thread. A parallel region on
    # the main thread too would start a second OpenMP team; libgomp then counts more threads than CPUs,
    # stops spinning between regions and sleeps on futexes instead (BENCHMARKS.md, "One engine thread").
    engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-engine")
    try:
        state = engine_thread.submit(build_state, config, engine_thread).result()
    except (OSError, ValueError) as exc:  # a missing model directory, --device cuda without a GPU, --step-log
        log.error("cannot start: %s", exc)
        engine_thread.shutdown()
        return 2
    drain = Drain(config.drain_s)
    app = create_app(state, drain)
    impls = uvicorn_impls()
    log.info("uvicorn: %s event loop, %s HTTP parser", impls["loop"], impls["http"])
    # uvicorn.run, with the server class swapped for one that drains on SIGTERM (server/drain.py); once the
    # drain is over, connections left get a few seconds more before uvicorn closes them
    server = DrainingServer(uvicorn_config(app, config.host, config.port, config.header_timeout_s,
                                           log_level=args.log_level, timeout_graceful_shutdown=5), drain)
    server.run()
    return 0 if server.started else 3  # uvicorn.run's status when it could not start (port in use)
