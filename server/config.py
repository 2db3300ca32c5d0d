"""Serving configuration: one validated dataclass, filled from CLI flags (or directly by tests)."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.engine.drafters import Drafter
from kvserve.engine.options import Device, DType
from kvserve.kvcache.hashing import HashAlgo
from kvserve.kvcache.sizing import KVCacheDType, parse_bytes
from kvserve.quant.options import Scheme
from kvserve.scheduler.ordering import SchedulingPolicy
from kvserve.scheduler.policies import Policy, check_policies
from kvserve.scheduler.scheduler import SchedulerConfig
from kvserve.server.kv_events import KVEventsConfig
from kvserve.speculation.policy import AUTO_MAX_DRAFT


REASONING_PARSERS = ("auto", "think", "none")  # server.reasoning: auto follows the chat template
DEFAULT_KV_CACHE_MEMORY = "1GiB"


@dataclass(slots=True)
class ServeConfig:
    """Everything ``kvserve serve`` can be told. Units are in the field comments.

    Raises:
        ValueError: from ``__post_init__`` on an out-of-range value.
    """

    model: str | None = None            # None: the embedded SmolLM2; else a local HF model directory
    host: str = "127.0.0.1"             # loopback unless told otherwise (the container sets 0.0.0.0)
    port: int = 8000
    device: Device = Device.AUTO        # auto | cpu | cuda
    dtype: DType = DType.AUTO           # auto | float32 | bfloat16; auto picks bf16 where the CPU has it
    quantization: Scheme = Scheme.AUTO  # auto | none | gguf | int8 | int4 | nf4 (engine.weights: auto picks per model)
    kv_cache_memory: str = DEFAULT_KV_CACHE_MEMORY  # KV pool budget; blocks = budget // (block_size * bytes/token)
    num_kv_blocks: int | None = None    # overrides kv_cache_memory, as vLLM's num_gpu_blocks_override (tests: tiny pools)
    kv_cache_dtype: KVCacheDType = KVCacheDType.AUTO  # auto (the model's) | float32 | bfloat16 | int8 | int4
    block_size: int = 16                # tokens per KV block
    max_num_seqs: int = 32              # slots: sequences decoding at once
    max_num_batched_tokens: int = 512   # per-step token budget (chunked prefill splits longer prompts)
    long_prefill_token_threshold: int | None = None  # a prefill with more tokens left is long: its chunk is capped
                                        # at this while others wait (tokens); None: half the budget; 0: never
    max_num_partial_prefills: int | None = None  # prompts prefilling at once; None: max_num_seqs
    max_long_partial_prefills: int = 1  # long prompts prefilling at once; a short prompt may pass a waiting long one
    attention_cost_context: int | None = None  # context (tokens) at which a token's attention costs its projections'
                                        # work: prefill chunks are sized by work; None: from the model; 0: by tokens
    max_queue: int = 256                # sequences waiting beyond the free slots before 429
    max_prompts_per_request: int = 128  # prompts in one /v1/completions body (each x n choices is a sequence)
    max_model_len: int | None = None    # context limit (tokens); default: the model's
    max_request_bytes: int | None = None  # request body limit (bytes); default: 64 per token of context, >= 1 MiB
    policy: Policy = Policy.CONTINUOUS  # batching: continuous | static (the baseline)
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS  # order: fcfs | priority | fair (per tenant)
    enable_prefix_caching: bool = True  # share full blocks of common prefixes
    prefix_caching_hash_algo: HashAlgo = HashAlgo.KVSERVE  # block digests: kvserve's, or vLLM's sha256_cbor
    kv_events: KVEventsConfig | None = None  # publish KV cache events as vLLM does (--kv-events-config); None: none
    api_key: str | None = None          # if set, /v1 routes need "Authorization: Bearer <key>"
    api_keys: tuple[str, ...] = ()      # more accepted keys (--api-key repeated, --api-key-file); api_key joins them
    share_cache_across_keys: bool = False  # with keys: one prefix cache for all (default: a partition per key)
    served_model_name: tuple[str, ...] = ()  # names in /v1/models, requests may give any, responses carry the
                                              # first (vLLM's); none: the model's own
    sse_ping_s: float = 15.0            # keep-alive comment interval on idle streams (s); 0 disables
    step_log: str | None = None         # if set, append one JSON line per engine step to this file
    drain_s: float = 30.0               # after SIGTERM: longest wait for in-flight requests (s); 0 stops at once
    vllm_metric_names: bool = False     # also expose every metric under vLLM's "vllm:" prefix (its dashboards)
    ui: bool = True                     # the live page at / and its event stream (--no-ui: off)
    allowed_hosts: tuple[str, ...] | None = None  # Host names answered besides loopback ones (DNS rebinding)
    header_timeout_s: float = 10.0      # a connection must complete a request's headers within this (s)
    body_timeout_s: float = 30.0        # ... and a request's whole body within this after its headers (s)
    allowed_origins: tuple[str, ...] = ()  # CORS: browser origins allowed to call (preflight answered); none: no CORS
    metrics_require_key: bool = False   # with API keys: /metrics needs a key too (default open, as vLLM's)
    admin_keys: tuple[str, ...] = ()    # API keys whose live page shows every key's requests (also valid as keys)
    default_max_tokens: int = 4096      # a chat or Responses request that sets no limit generates at most this many
    reasoning_parser: str = "auto"      # auto | think | none: <think>...</think> returned as reasoning_content
    allow_pickle: bool = False          # load *.bin / *.pt checkpoints (unpickling can run code)
    speculative: Drafter = Drafter.OFF  # off | ngram | draft: who drafts tokens for the served model to verify
    num_speculative_tokens: int | None = None  # drafts per sequence per step; None: auto (0..AUTO_MAX_DRAFT, measured)
    draft_model: str | None = None      # --speculative draft: the draft's HF directory; None: the served model's own
    draft_quantization: Scheme | None = None  # the draft's weights; None: int4 for the served model's own, else none

    def __post_init__(self) -> None:
        if not 1 <= self.port <= 65535:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
        if not self.sse_ping_s >= 0:
            raise ValueError("sse_ping_s must be >= 0 (0 disables the keep-alive comments)")
        if not self.drain_s >= 0:
            raise ValueError("drain_s must be >= 0 (0 stops at once on SIGTERM)")
        if not self.header_timeout_s > 0:
            raise ValueError("header_timeout_s must be > 0")
        if not self.body_timeout_s > 0:
            raise ValueError("body_timeout_s must be > 0")
        if self.default_max_tokens < 1:
            raise ValueError("default_max_tokens must be >= 1")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (one decode token per slot)")
        # the scheduler's own checks of the prefill limits (messages in the fields' names)
        SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                        long_prefill_token_threshold=self.long_prefill_token_threshold,
                        max_num_partial_prefills=self.max_num_partial_prefills,
                        max_long_partial_prefills=self.max_long_partial_prefills,
                        attention_cost_context=self.attention_cost_context or 0)
        if self.max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        if self.max_prompts_per_request < 1:
            raise ValueError("max_prompts_per_request must be >= 1")
        if self.max_request_bytes is not None and self.max_request_bytes < 1:
            raise ValueError("max_request_bytes must be >= 1")
        self.api_keys = tuple(dict.fromkeys(((self.api_key,) if self.api_key else ()) + tuple(self.api_keys)
                                            + tuple(self.admin_keys)))
        if any(not key or key != key.strip() or not key.isprintable() for key in self.api_keys):
            raise ValueError("an API key must be non-empty printable text without surrounding spaces")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        try:
            budget = parse_bytes(self.kv_cache_memory)
        except ValueError as exc:
            raise ValueError(f"kv_cache_memory: {exc}") from None
        if budget < 1 and self.num_kv_blocks is None:
            raise ValueError(f"kv_cache_memory {self.kv_cache_memory!r} is no memory: give a size such as 512MiB or "
                             "1GiB")
        if self.metrics_require_key and not self.api_keys:
            raise ValueError("--metrics-require-key needs API keys to ask for: give --api-key, --api-key-file or "
                             "--admin-key too")
        # strings (tests, flags) become the enums; an unknown value raises ValueError naming it
        self.device, self.dtype, self.quantization = Device(self.device), DType(self.dtype), Scheme(self.quantization)
        self.policy = Policy(self.policy)
        self.scheduling_policy = SchedulingPolicy(self.scheduling_policy)
        check_policies(self.policy, self.scheduling_policy)
        self.kv_cache_dtype = KVCacheDType(self.kv_cache_dtype)
        self.prefix_caching_hash_algo = HashAlgo(self.prefix_caching_hash_algo)
        self.speculative = Drafter(self.speculative)
        if self.num_speculative_tokens is not None and not 1 <= self.num_speculative_tokens <= 64:
            raise ValueError("num_speculative_tokens must be in 1..64 (or auto)")
        if self.draft_quantization is not None:
            self.draft_quantization = Scheme(self.draft_quantization)
            if self.draft_quantization is Scheme.AUTO:
                raise ValueError("draft_quantization names a scheme (auto is for the served model)")
        if self.speculative is not Drafter.DRAFT:
            if self.draft_model is not None or self.draft_quantization is not None:
                raise ValueError("--draft-model and --draft-quantization need --speculative draft")
        elif self.draft_model is None and self.draft_scheme is self.quantization:
            raise ValueError(f"a draft of the served model's own weights as --draft-quantization "
                             f"{self.draft_scheme.value} is the served model itself: it cannot be cheaper")

    @property
    def draft_scheme(self) -> Scheme:
        """The draft model's weight format: ``draft_quantization``, or its default (int4 for a draft of the served
        model's own weights, the chapter's experiment; none for a separate draft model)."""
        if self.draft_quantization is not None:
            return self.draft_quantization
        return Scheme.INT4 if self.draft_model is None else Scheme.NONE
