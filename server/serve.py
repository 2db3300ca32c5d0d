"""``kvserve serve``: load the model, build the stack, run uvicorn."""

from __future__ import annotations

import argparse
import logging
from concurrent.futures import ThreadPoolExecutor

from kvserve import environment
from kvserve.kvcache.hashing import HashAlgo
from kvserve.kvcache.sizing import KVCacheDType, parse_bytes
from kvserve.engine.drafters import Drafter
from kvserve.engine.options import Device, DType
from kvserve.quant.options import Scheme
from kvserve.scheduler.ordering import SchedulingPolicy
from kvserve.server.auth import read_key_file
from kvserve.server.config import DEFAULT_KV_CACHE_MEMORY, REASONING_PARSERS, Policy, ServeConfig
from kvserve.server import preflight
from kvserve.server.httpserver import uvicorn_config, uvicorn_impls
from kvserve.server.kv_events import KVEventsConfig, parse_kv_events_config
from kvserve.speculation.policy import AUTO_MAX_DRAFT

log = logging.getLogger("kvserve")


# The option groups of ``kvserve serve --help``, in order (vLLM's ``serve --help`` groups its options the same way:
# model, cache, scheduler, speculative decoding, frontend, observability); the README's options table follows them.
GROUPS = {
    "model": "which model, where it runs, and in which precision",
    "memory": "the paged KV cache: its budget, dtype and blocks, and the context",
    "scheduling": "how many sequences run and wait, and what one step computes",
    "speculative decoding": "draft tokens verified by the served model (exact: the output is unchanged)",
    "API": "where the server listens and how it streams and stops",
    "security": "who may call, which hosts are answered, and what is loaded",
    "observability": "logs, the step log, metric names, KV cache events for KV-aware routers",
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--help`` with each option's default after its help (``default_text``), and the epilog as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = default_text(action)
        return text if default is None else f"{text} (default: {default})".replace("%", "%%")


def default_text(action: argparse.Action) -> str | None:
    """What an option does when it is not given, in words: its ``default_text`` where one was set (a None default
    whose meaning needs words), else its default value; switches are ``off``. None for --help."""
    if isinstance(action, argparse._HelpAction):
        return None
    if getattr(action, "default_text", None) is not None:
        return action.default_text
    if action.nargs == 0:
        return "on" if action.default else "off"
    return None if action.default is None else str(action.default)


def _option(group: argparse._ArgumentGroup, *flags: str, default_text: str | None = None, **kwargs) -> None:
    """``group.add_argument`` with ``default_text``: how ``--help`` and the README's table word a None default."""
    action = group.add_argument(*flags, **kwargs)
    action.default_text = default_text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``kvserve serve`` (each maps to a ServeConfig field), in the groups of ``GROUPS``; the environment
    variables in the epilog. Every option has help and a default, which ``--help`` prints (tests check both)."""
    parser.epilog = environment.help_text()
    parser.formatter_class = HelpFormatter
    d = ServeConfig()
    group = {name: parser.add_argument_group(f"{name} options", description) for name, description in GROUPS.items()}

    g = group["model"]
    _option(g, "--model", default=None, metavar="DIR|FILE.gguf", default_text="the embedded SmolLM2-135M-Instruct",
            help="a local Hugging Face model directory (config.json and safetensors) or a Llama, Mistral, Qwen2 or "
                 "Qwen3 GGUF file (loaded directly, docs/gguf.md); nothing is downloaded")
    _option(g, "--served-model-name", type=_model_name, nargs="+", default=None, metavar="NAME",
            default_text="the model's own name",
            help="the model's id in /v1/models and the `model` field requests give (the model's own name: a GGUF "
                 "file's general.name, else its file name; docs/api.md); several names, as vLLM takes them: "
                 "requests may give any, responses name the first")
    _option(g, "--device", choices=[v.value for v in Device], default=d.device.value,
            help="where the model runs; auto: a CUDA GPU when torch sees one, else the CPU")
    _option(g, "--dtype", choices=[v.value for v in DType], default=d.dtype.value,
            help="activations and KV cache; auto: float32 on a CPU (full-precision weights in bfloat16 on the "
                 "AVX512-BF16 kernel where the CPU has it), bfloat16 on a GPU; bfloat16: torch's bfloat16 ops")
    _option(g, "--quantization", choices=[q.value for q in Scheme], default=d.quantization.value,
            help="the weights computed with: auto: a GGUF model's own blocks (the embedded SmolLM2's Q4_1/Q8_0), "
                 "int8 for a float checkpoint; gguf: the GGUF file's own blocks; none: full precision; int8, int4, "
                 "nf4: kvserve's own rounding of the float weights (int8 and int4 calibrate at start)")

    g = group["memory"]
    # None: not given (DEFAULT_KV_CACHE_MEMORY), so that --num-kv-blocks can say when it overrides a given budget
    _option(g, "--kv-cache-memory", default=None, metavar="BYTES", default_text=DEFAULT_KV_CACHE_MEMORY,
            help="the KV pool's budget, e.g. 1GiB or 512MiB (a draft model's pool comes out of it too)")
    _option(g, "--num-kv-blocks", type=int, default=None, metavar="N", default_text="from --kv-cache-memory",
            help="the pool's size in blocks; overrides --kv-cache-memory, as vLLM's --num-gpu-blocks-override "
                 "overrides its memory budget (the start log says so when both are given; a draft model's pool "
                 "gets as many)")
    _option(g, "--kv-cache-dtype", choices=[v.value for v in KVCacheDType], default=d.kv_cache_dtype.value,
            help="what the KV cache stores; auto: the activations' dtype (--dtype); bfloat16 under float32 "
                 "activations: 2x the tokens of float32, attended by bfloat16 dot products with float32 sums "
                 "(vdpbf16ps; exact against itself, docs/api.md); int8 / int4: codes with "
                 "float16 scales, 4x / 7.3x the tokens of float32 in the same memory, for some quality "
                 "(kvserve quant report --kv-only measures it)")
    _option(g, "--block-size", type=int, default=d.block_size, metavar="TOKENS", help="tokens per KV block")
    _option(g, "--max-model-len", type=int, default=None, metavar="TOKENS",
            default_text="the model's context length",
            help="the most tokens (prompt + completion) one request may use; the KV pool's capacity bounds it too")
    _option(g, "--no-prefix-caching", action="store_true", default_text="off: the prefix cache is on",
            help="turn off the prefix cache (cached blocks shared by prompts that start alike)")
    _option(g, "--prefix-caching-hash-algo", choices=[a.value for a in HashAlgo],
            default=d.prefix_caching_hash_algo.value,
            help="the prefix cache's block digests: kvserve's own, or sha256_cbor, vLLM's (a router that hashes "
                 "prompts itself, as llm-d's precise prefix-cache scorer does, then finds the hashes the KV events "
                 "carry; seeded from PYTHONHASHSEED as in vLLM)")

    g = group["scheduling"]
    _option(g, "--scheduler", choices=[p.value for p in Policy], default=d.policy.value,
            help="continuous: a finished sequence's slot is refilled at the next step; static: the batch runs "
                 "until its last sequence ends")
    _option(g, "--max-num-seqs", type=int, default=d.max_num_seqs, metavar="N",
            help="slots: sequences decoding at once")
    _option(g, "--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens, metavar="TOKENS",
            help="tokens one step computes at most (longer prompts are prefilled in chunks)")
    _option(g, "--long-prefill-token-threshold", type=int, default=None, metavar="TOKENS",
            default_text="half of --max-num-batched-tokens",
            help="a prompt with more tokens left to prefill is long: its chunk takes at most this many tokens of a "
                 "step before the requests waiting beside it get theirs (what they leave goes back to it), so a "
                 "short request is not stalled for a long prompt's whole prefill; 0: no prompt is long, a chunk "
                 "takes the whole budget")
    _option(g, "--max-num-partial-prefills", type=int, default=None, metavar="N", default_text="--max-num-seqs",
            help="prompts prefilled at once (vLLM's default, 1, queues every prompt behind the one in progress)")
    _option(g, "--max-long-partial-prefills", type=int, default=d.max_long_partial_prefills, metavar="N",
            help="long prompts (see --long-prefill-token-threshold) prefilled at once; a long prompt beyond this "
                 "waits, and shorter prompts behind it in the queue go first")
    _option(g, "--attention-cost-context", type=int, default=None, metavar="TOKENS",
            default_text="from the model's shape and the kernels' measured speeds",
            help="the context length at which a prompt token's attention costs as much as its projections: a "
                 "prefill chunk deep in a long prompt then takes fewer tokens, so each step costs about what a "
                 "--max-num-batched-tokens chunk from the prompt's start costs, and requests sharing the step are "
                 "not held by attention over thousands of keys; 0: chunks are sized by tokens only")
    _option(g, "--scheduling-policy", choices=[p.value for p in SchedulingPolicy], default=d.scheduling_policy.value,
            help="who runs first: fcfs, arrival order; priority, a request's lower 'priority' first (vLLM's field; "
                 "the other policies refuse a request with a priority), preempting lower priorities to admit "
                 "higher; fair, equal shares of the slots and of each step's tokens per tenant (an API key, or the "
                 "X-Tenant-ID header without keys)")
    _option(g, "--max-queue", type=int, default=d.max_queue, metavar="N",
            help="sequences waiting beyond the free slots before new requests get 429 (a request with n choices "
                 "counts n, and one that finds nobody waiting is admitted whatever its n, so it is never refused "
                 "forever; 0 refuses every request)")
    _option(g, "--max-prompts-per-request", type=int, default=d.max_prompts_per_request, metavar="N",
            help="prompts one /v1/completions request may carry (400 beyond); prompts x choices above "
                 "--max-num-seqs + --max-queue is a 400 too, before any is queued")

    g = group["speculative decoding"]
    _option(g, "--speculative", choices=[v.value for v in Drafter], default=d.speculative.value,
            help="ngram: drafts by prompt lookup; draft: by a draft model; the served model verifies every "
                 "draft token, so the output is what it would be without")
    _option(g, "--num-speculative-tokens", type=_draft_length, default=None, metavar="N|auto", default_text="auto",
            help=f"draft tokens per sequence per step: N, or auto: 0 to {AUTO_MAX_DRAFT}, chosen every step from "
                 "the measured acceptance and step cost")
    _option(g, "--draft-model", default=None, metavar="DIR", default_text="the served model's own weights",
            help="with --speculative draft: a local model directory with the same tokenizer")
    _option(g, "--draft-quantization", default=None, choices=[q.value for q in Scheme if q is not Scheme.AUTO],
            default_text="int4, or none with --draft-model",
            help="with --speculative draft: the draft's weights (rounded to nearest, no calibration)")

    g = group["API"]
    _option(g, "--host", default=d.host, help="the address to listen on (0.0.0.0: every interface)")
    _option(g, "--port", type=int, default=d.port, help="the TCP port to listen on")
    _option(g, "--sse-ping-seconds", type=float, default=d.sse_ping_s, metavar="S",
            help="a keep-alive comment on a stream that has sent nothing for this long (0: none)")
    _option(g, "--drain-seconds", type=float, default=d.drain_s, metavar="S",
            help="on SIGTERM, refuse new requests (503) and let those in flight finish for at most this long "
                 "(0: stop at once)")
    _option(g, "--no-ui", action="store_true", default_text="off: the page is served",
            help="do not serve the live page (/ and /ui: slots, KV blocks, steps, a playground) nor its events")
    _option(g, "--default-max-tokens", type=int, default=d.default_max_tokens, metavar="N",
            help="tokens a chat or Responses request that sets no limit may generate at most (never more than "
                 "the context leaves)")
    _option(g, "--reasoning-parser", choices=list(REASONING_PARSERS), default=d.reasoning_parser,
            help="return a model's <think>...</think> text as reasoning_content apart from content: auto when the "
                 "chat template writes </think>, think always, none never")

    g = group["security"]
    _option(g, "--api-key", action="append", default=None, metavar="KEY", default_text="none: every route is open",
            help="require 'Authorization: Bearer KEY' on the /v1 routes, /tokenize, /detokenize and "
                 "/tokenizer_info; repeat for several keys (each gets its own prefix cache)")
    _option(g, "--api-key-file", default=None, metavar="PATH", default_text="none",
            help="more keys, one a line ('#' starts a comment)")
    _option(g, "--share-cache-across-keys", action="store_true",
            help="let several keys share cached prefixes (by default each key has its own, so one cannot time "
                 "another's prompts)")
    _option(g, "--allowed-hosts", type=_host_list, default=None, metavar="NAMES",
            default_text="loopback names when bound to loopback, any otherwise",
            help="comma list of Host names answered besides the loopback ones ('*.example.com', or '*' for any): "
                 "a guard against DNS rebinding")
    _option(g, "--header-timeout-seconds", type=float, default=d.header_timeout_s, metavar="S",
            help="close a connection that has not sent a request's headers within this time")
    _option(g, "--body-timeout-seconds", type=float, default=d.body_timeout_s, metavar="S",
            help="answer 408 and close a connection whose request body has not all arrived within this time")
    _option(g, "--allowed-origins", type=_host_list, default=(), metavar="ORIGINS",
            default_text="none: no CORS headers, OPTIONS is a 405",
            help="comma list of browser origins allowed to call the API cross-origin (CORS, e.g. "
                 "'https://app.example'; '*' for any)")
    _option(g, "--metrics-require-key", action="store_true", default_text="off: /metrics is open, as vLLM's",
            help="with --api-key, /metrics needs a key too")
    _option(g, "--admin-key", action="append", default=None, metavar="KEY", default_text="none",
            help="an API key whose live page shows every key's requests (other keys see their own)")
    _option(g, "--max-request-bytes", type=parse_bytes, default=None, metavar="BYTES",
            default_text="64 bytes per token of context, at least 1MiB",
            help="request body limit, e.g. 4MiB: larger bodies get 413 before they are read")
    _option(g, "--allow-pickle", action="store_true",
            help="load pickled checkpoints (*.bin, *.pt); unpickling can run code, so only safetensors load "
                 "by default")

    g = group["observability"]
    _option(g, "--log-level", default="info", type=str.lower, choices=["debug", "info", "warning", "error"],
            help="the server's log level")
    _option(g, "--step-log", default=None, metavar="PATH", default_text="none",
            help="append one JSON line per engine step (its prefills and decodes, tokens, seconds) to PATH")
    _option(g, "--vllm-metric-names", action="store_true",
            help="on /metrics, repeat every kvserve: series under vLLM's vllm: prefix, for vLLM's dashboards "
                 "and autoscaling rules")
    _option(g, "--kv-events-config", type=_kv_events_config, default=None, metavar="JSON",
            default_text="none: no events",
            help="publish every block stored in or evicted from the prefix cache over ZMQ as vLLM does, for "
                 "KV-aware routers: vLLM's JSON, e.g. '{\"enable_kv_cache_events\": true, \"endpoint\": "
                 "\"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"}' (also topic, buffer_steps, hwm, "
                 "max_queue_size; kvserve's event_encoding: map or array)")


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    return ServeConfig(model=args.model, host=args.host, port=args.port, device=args.device, dtype=args.dtype,
                       quantization=args.quantization,
                       kv_cache_memory=DEFAULT_KV_CACHE_MEMORY if args.kv_cache_memory is None else args.kv_cache_memory,
                       kv_cache_dtype=args.kv_cache_dtype,
                       num_kv_blocks=args.num_kv_blocks, block_size=args.block_size,
                       max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       long_prefill_token_threshold=args.long_prefill_token_threshold,
                       max_num_partial_prefills=args.max_num_partial_prefills,
                       max_long_partial_prefills=args.max_long_partial_prefills,
                       attention_cost_context=args.attention_cost_context,
                       max_queue=args.max_queue, max_prompts_per_request=args.max_prompts_per_request,
                       max_model_len=args.max_model_len,
                       max_request_bytes=args.max_request_bytes, policy=Policy(args.scheduler),
                       scheduling_policy=SchedulingPolicy(args.scheduling_policy),
                       enable_prefix_caching=not args.no_prefix_caching,
                       prefix_caching_hash_algo=HashAlgo(args.prefix_caching_hash_algo), kv_events=args.kv_events_config,
                       api_keys=_api_keys(args),
                       share_cache_across_keys=args.share_cache_across_keys,
                       served_model_name=tuple(dict.fromkeys(args.served_model_name or ())),
                       sse_ping_s=args.sse_ping_seconds,
                       step_log=args.step_log, drain_s=args.drain_seconds,
                       vllm_metric_names=args.vllm_metric_names, ui=not args.no_ui, allowed_hosts=args.allowed_hosts,
                       header_timeout_s=args.header_timeout_seconds, allow_pickle=args.allow_pickle,
                       body_timeout_s=args.body_timeout_seconds, allowed_origins=args.allowed_origins,
                       metrics_require_key=args.metrics_require_key, admin_keys=tuple(args.admin_key or ()),
                       default_max_tokens=args.default_max_tokens, reasoning_parser=args.reasoning_parser,
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


def _model_name(text: str) -> str:
    """``--served-model-name``: a name clients can send as ``model``: not empty, one printable line."""
    if not text.strip() or not text.isprintable():
        raise argparse.ArgumentTypeError(f"{text!r} is not a model name: give one printable line of text")
    return text


def _host_list(text: str) -> tuple[str, ...]:
    """``--allowed-hosts a.example,*.b.example`` -> ``("a.example", "*.b.example")``."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def build_state(config: ServeConfig, executor: ThreadPoolExecutor | None = None):
    """Load and (optionally) quantize the model, then build the ServerState (steps run on ``executor``)."""
    from kvserve.engine import weights
    from kvserve.engine.heap import loading_heap
    from kvserve.engine.loader import load_model
    from kvserve.server.state import ServerState

    with loading_heap():  # what loading frees goes back to the OS: the server's resident set is its own
        choice = weights.choose(config.quantization, config.model)
        loaded = load_model(config.model, config.dtype, config.device, quantized=choice.scheme is not Scheme.NONE,
                            allow_pickle=config.allow_pickle, blocks=choice.scheme is Scheme.GGUF)
        log.info("model %s loaded: %s on %s (%s)", loaded.name, loaded.dtype, loaded.device,
                 dtype_reason(config, loaded, choice.scheme))
        log.info("tokenizer: %s (for clients that tokenize locally, e.g. guidellm --processor; `kvserve model-path` "
                 "prints it)", loaded.tokenizer.name_or_path)
        described = weights.apply(loaded, choice.scheme, config.model, loaded.tokenizer)
        log.info("weights: %s (%s; %s)", described, choice.reason, weights.FULL_PRECISION_HINT)
        draft = load_draft(config, loaded) if config.speculative is Drafter.DRAFT else None
        state = ServerState(loaded, config, executor, draft)
    return state


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
                       quantized=scheme is not Scheme.NONE, allow_pickle=config.allow_pickle,
                       blocks=scheme is Scheme.GGUF)
    if draft.tokenizer.get_vocab() != served.tokenizer.get_vocab():
        raise ValueError(f"the draft model {draft.name} has another tokenizer than {served.name}: its drafts would "
                         "be other tokens")
    if scheme is not Scheme.NONE:
        from kvserve.engine import weights

        log.info("draft model %s: %s", draft.name, weights.apply(draft, scheme, config.draft_model or config.model))
    return draft


def run(args: argparse.Namespace) -> int:
    """``kvserve serve``: check the options, load the model, serve until SIGTERM; returns 0, 2 on a bad option or
    a start that cannot work (said in one line naming the flag, before loading where it can be known before), 3 when
    uvicorn could not start. SIGINT (Ctrl-C), at any point, ends the process by that signal, with one log line."""
    try:
        return _run(args)
    except KeyboardInterrupt:
        # uvicorn.run swallows this; here it reaches server.cli.main, which ends the process by the signal
        log.info("SIGINT: stopped")
        logging.shutdown()
        raise


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        for line in environment.check():  # every switch read once, before anything loads
            log.info("environment: %s", line)
        config = config_from_args(args)
        if config.step_log:
            open(config.step_log, "a").close()  # a bad path fails now, not after the model has loaded
    except OSError as exc:
        log.error("invalid option: --step-log %s: %s", args.step_log, exc.strerror or exc)
        return 2
    except ValueError as exc:
        log.error("invalid option: %s", preflight.in_flags(str(exc)))
        return 2
    if args.num_kv_blocks is not None and args.kv_cache_memory is not None:
        log.warning("--num-kv-blocks %d overrides --kv-cache-memory %s: the KV pool is %d blocks, whatever they "
                    "take (as vLLM's --num-gpu-blocks-override overrides its memory budget)", args.num_kv_blocks,
                    args.kv_cache_memory, args.num_kv_blocks)
    found = preflight.problems(config)  # a model path or a port that cannot work, before seconds of loading
    for line in found:
        log.error("cannot start: %s", line)
    if found:
        return 2
    from kvserve.server.app import create_app  # torch and transformers: imported once the options are known good
    from kvserve.server.drain import Drain, DrainingServer

    # All torch work (loading, pool allocation, every step) runs on this one thread. A parallel region on
    # the main thread too would start a second OpenMP team; libgomp then counts more threads than CPUs,
    # stops spinning between regions and sleeps on futexes instead (BENCHMARKS.md, "One engine thread").
    engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-engine")
    try:
        state = engine_thread.submit(build_state, config, engine_thread).result()
    except (OSError, ValueError) as exc:  # what only loading tells: unreadable weights, a KV pool that does not fit
        log.error("cannot start: %s", preflight.in_flags(str(exc)))
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
