"""Build one serving stack from a loaded model and a ServeConfig: pool, runner, blocks, scheduler, metrics."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvserve.engine.compile_worker import CompileSandbox
from kvserve.engine.constraints import GrammarCompiler
from kvserve.engine.draft_model import ModelDrafter
from kvserve.engine.drafters import Drafter, NgramDrafter
from kvserve.engine.loader import LoadedModel, attention_cost_context
from kvserve.engine.runner import ModelRunner
from kvserve.kvcache.block_manager import BlockManager, make_hasher
from kvserve.kvcache.pool import KVPool, storage_dtype
from kvserve.kvcache.sizing import KVShape, parse_bytes
from kvserve.scheduler.contract import EngineRequest, StepOutput, StepRecord
from kvserve.scheduler.core import EngineCore
from kvserve.scheduler.scheduler import Scheduler, SchedulerConfig
from kvserve.scheduler.service import Delivery, SchedulerService
from kvserve.server.chat_template import chat_templates, end_of_turn_ids
from kvserve.server.config import ServeConfig
from kvserve.server.kv_events import EventPublisher
from kvserve.server.reasoning import reasoning_enabled
from kvserve.server.metrics import Metrics
from kvserve.server.snapshot import LiveView
from kvserve.speculation.decoder import SpecDecoder

log = logging.getLogger("kvserve.server")

_PLANNING_CONTEXT = 2048  # tokens per sequence in the start-up capacity line: a round chat-sized context, not the
                          # model's limit (the line is an example; `kvserve plan` answers for any context)


class StepLog:
    """``--step-log``: one JSON line per engine step, the raw material of the simulator's step-cost fit.

    Fields: ``prefills`` (sequences computing prompt tokens), ``decodes`` (sequences computing generated tokens:
    one, plus ``draft_tokens`` in all of them with speculation), ``prefill_tokens``, ``max_context`` (longest
    context among the decodes, tokens; the paged gather pads every decode to it), ``seconds`` (wall time inside the
    runner), ``end_s`` (``time.perf_counter()`` at the step's end, ``StepRecord.ended``: CLOCK_MONOTONIC on Linux,
    so it lines up with other processes' perf_counter() on the same machine, as ``loadtest ui``'s windows need; the
    line itself is written once the event loop takes the step, which may be after the next one has started). All
    come from the step's record (``scheduler.contract.StepRecord``).
    """

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self._file = self.path.open("a", buffering=1)

    def write(self, record: StepRecord) -> None:
        """Append the step's line.

        Raises:
            OSError: the file cannot be written (the service then stops calling this).
        """
        self._file.write(json.dumps({
            "prefills": record.prefills, "decodes": record.decodes, "prefill_tokens": record.prefill_tokens,
            "draft_tokens": record.draft_tokens, "max_context": record.max_context,
            "seconds": round(record.seconds, 6), "end_s": round(record.ended, 6)}) + "\n")


def _allocate_pool(loaded: LoadedModel, num_blocks: int, block_size: int, what: str = "",
                   shape: KVShape | None = None) -> KVPool:
    """A KV pool of ``num_blocks`` for ``shape`` (default: ``loaded``'s geometry in its own dtype), refused before
    allocating if it exceeds the RAM.

    Raises:
        ValueError: more bytes than this machine's memory, or than torch can allocate or index.
    """
    shape = shape or loaded.kv_shape()
    pool_bytes = num_blocks * block_size * shape.bytes_per_token
    ram = _physical_memory()
    if loaded.device.type == "cpu" and ram is not None and pool_bytes > ram:
        # refused here: allocating it would have the kernel kill the process, not raise
        raise ValueError(f"{what}KV pool of {pool_bytes:,} bytes is more than this machine's {ram:,} bytes of "
                         "memory: lower --kv-cache-memory or --num-kv-blocks")
    try:
        return KVPool(shape, num_blocks, block_size, storage_dtype(shape, loaded.dtype), loaded.device)
    except (RuntimeError, TypeError, OverflowError) as exc:  # more than the machine has, or than torch indexes
        raise ValueError(f"cannot allocate {what}KV pool of {num_blocks:,} blocks ({pool_bytes:,} bytes): lower "
                         f"--kv-cache-memory, --num-kv-blocks or --block-size ({type(exc).__name__})") from None


def _num_blocks(config: ServeConfig, shape: KVShape, draft: LoadedModel | None) -> int:
    """Blocks of the served model's pool (geometry ``shape``, at its cache dtype): ``--num-kv-blocks``, or as many
    as ``--kv-cache-memory`` holds, where a draft model's pool (as many blocks, at the draft's bytes per token)
    shares the budget.

    Raises:
        ValueError: the budget holds not even one block (of both pools).
    """
    if config.num_kv_blocks:
        return config.num_kv_blocks
    budget = parse_bytes(config.kv_cache_memory)
    # bytes/token of the pools = the served model's (+ the draft's)  (each 2*L*H_kv*d*b)
    bytes_per_token = shape.bytes_per_token + (draft.kv_shape().bytes_per_token if draft is not None else 0)
    block_bytes = bytes_per_token * config.block_size
    if budget < block_bytes:
        pools = "the KV pool" if draft is None else "the served and the draft model's KV pools"
        raise ValueError(f"--kv-cache-memory {config.kv_cache_memory} ({budget:,} bytes) holds not one block of "
                         f"{pools}: --block-size {config.block_size} tokens x {bytes_per_token:,} bytes/token = "
                         f"{block_bytes:,} bytes; raise --kv-cache-memory or lower --block-size")
    return budget // block_bytes


def _token_id_limit(loaded: LoadedModel) -> int:
    """One past the largest token id a request may name (a prompt's ids, ``logit_bias``, ``stop_token_ids``,
    ``/detokenize``): an id must be both the tokenizer's (to be decoded) and a row of the model's embedding and
    logits (to be computed). A tokenizer with added tokens can outnumber the rows; an embedding padded for speed
    (Qwen2's 151,936 rows for 151,665 tokens) can outnumber the tokenizer."""
    config = loaded.model.config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    rows = getattr(config, "vocab_size", None)
    return min(len(loaded.tokenizer), rows) if rows else len(loaded.tokenizer)


def _physical_memory() -> int | None:
    """This machine's RAM (bytes), or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _as_opened(configured: str | None, opened: str | None) -> str:
    """An endpoint for the log: as configured, with what zmq bound where that differs (a free port, 0.0.0.0)."""
    if configured is None:
        return "off"
    return configured if opened in (None, configured) else f"{configured} (bound: {opened})"


class ServerState:
    """Everything a request handler needs; one per app.

    Args:
        loaded: the model (wired to paged attention, quantized if asked).
        config: serving configuration.
        executor: the one thread that runs engine steps (default: a new thread).
        draft: the draft model of ``--speculative draft`` (``server.serve.load_draft``); it gets a KV pool of its
            own, holding as many tokens as the served model's (at its own dtype and shape), both within
            ``--kv-cache-memory``.

    One server has one KV cache dtype (``--kv-cache-dtype``), so the prefix cache only ever shares blocks between
    requests whose keys and values were stored the same way. A draft model's own pool keeps the draft's dtype.

    Raises:
        ValueError: a KV pool (the served model's or the draft's) more than the machine has or torch can index;
            ``--speculative draft`` without a draft model; a quantized cache the model's head size cannot take.
    """

    def __init__(self, loaded: LoadedModel, config: ServeConfig, executor: ThreadPoolExecutor | None = None,
                 draft: LoadedModel | None = None) -> None:
        self.loaded = loaded
        self.config = config
        self.tokenizer = loaded.tokenizer
        # every name a request may give, the first the one responses carry (vLLM's --served-model-name)
        names = config.served_model_name
        self.model_names = ((names,) if isinstance(names, str) else tuple(names)) or (loaded.name,)
        self.model_name = self.model_names[0]
        shape = loaded.kv_shape(config.kv_cache_dtype)
        num_blocks = _num_blocks(config, shape, draft if config.speculative is Drafter.DRAFT else None)
        self.pool = _allocate_pool(loaded, num_blocks, config.block_size, what="a ", shape=shape)
        self.max_model_len = min(config.max_model_len or loaded.max_model_len, loaded.max_model_len)
        if config.max_model_len is not None and config.max_model_len > loaded.max_model_len:
            log.warning("--max-model-len %d is above the model's context of %d tokens; serving %d",
                        config.max_model_len, loaded.max_model_len, loaded.max_model_len)
        # 64 bytes per token of context covers a full-length prompt as JSON-escaped text (6 bytes per "\uXXXX")
        # or as a list of token ids; 1 MiB at least, for short-context models with long sampling options
        self.max_request_bytes = config.max_request_bytes or max(1 << 20, 64 * self.max_model_len)
        self.live = LiveView(num_blocks) if config.ui else None  # the live page's view of slots, blocks, steps
        publishing = config.kv_events is not None and config.kv_events.enabled and config.enable_prefix_caching
        if config.kv_events is not None and config.kv_events.enabled and not config.enable_prefix_caching:
            log.warning("--kv-events-config is ignored: with --no-prefix-caching no block is cached, so none is "
                        "published")
        self.blocks = blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                            observer=self.live.blocks if self.live is not None else None,
                                            hasher=make_hasher(config.prefix_caching_hash_algo),
                                            record_events=publishing)
        self.runner = ModelRunner(loaded, self.pool, step_tokens=config.max_num_batched_tokens)
        self.constraints = self.runner.constraints  # structured outputs' matchers, by request id
        speculating = config.speculative is not Drafter.OFF
        self.spec = self._spec_decoder(config, draft, num_blocks, blocks) if speculating else None
        scheduler = Scheduler(SchedulerConfig(max_num_seqs=config.max_num_seqs,
                                              max_num_batched_tokens=config.max_num_batched_tokens,
                                              max_model_len=self.max_model_len, policy=config.policy,
                                              scheduling=config.scheduling_policy,
                                              long_prefill_token_threshold=config.long_prefill_token_threshold,
                                              max_num_partial_prefills=config.max_num_partial_prefills,
                                              max_long_partial_prefills=config.max_long_partial_prefills,
                                              attention_cost_context=(
                                                  attention_cost_context(loaded.model.config)
                                                  if config.attention_cost_context is None
                                                  else config.attention_cost_context)),
                              blocks, self.spec)
        self.step_log = StepLog(config.step_log) if config.step_log else None
        execute = self.runner.execute if self.spec is None else self.spec.execute
        self.core = EngineCore(scheduler, execute)
        self.service = SchedulerService(self.core, config.max_queue, on_step=self._on_step, executor=executor)
        cache_info = {"block_size": str(config.block_size), "num_gpu_blocks": str(num_blocks),
                      "cache_dtype": self.pool.cache_dtype, "bytes_per_token": str(shape.bytes_per_token),
                      "enable_prefix_caching": str(config.enable_prefix_caching), "engine": "0"}
        self.metrics = Metrics(self.service, self.model_name, self.max_model_len, cache_info,
                               vllm_names=config.vllm_metric_names,
                               drafts=None if self.spec is None else self.spec.policy)
        self._ids = itertools.count()
        self.request_owners: dict[int, str] = {}  # request id -> its API key's fingerprint, while it is answered
        self.token_ids_below = _token_id_limit(loaded)
        # the chat template(s), compiled and test-rendered now: a broken template stops the start, not every chat
        self.chat_templates = chat_templates(self.tokenizer, self.max_request_bytes)
        self.reasoning = reasoning_enabled(config.reasoning_parser, self.chat_templates)
        self.eos_ids = self._eos_ids()
        # structured outputs, built lazily; a grammar not seen before is compiled in a worker process first, so
        # that a crash of the native compiler refuses that request instead of ending the server
        self.grammars = GrammarCompiler(self.tokenizer, sorted(self.eos_ids),
                                        sandbox=CompileSandbox(self.tokenizer, sorted(self.eos_ids)))
        self.log_capacity()
        self.log_chat()
        # KV cache events for KV-aware routers (server/kv_events.py): sockets bound last, once nothing else can fail
        self.kv_events = EventPublisher(config.kv_events) if publishing else None
        self._resync_queued = False  # a resync of the KV events waits for the gap between two steps
        if self.kv_events is not None:
            self.metrics.count_kv_events_dropped(lambda: self.kv_events.dropped_events)
            log.info("KV events: publishing on %s (replay %s, topic %r, %s digests, %s-encoded events)",
                     _as_opened(config.kv_events.endpoint, self.kv_events.endpoint),
                     _as_opened(config.kv_events.replay_endpoint, self.kv_events.replay_endpoint),
                     config.kv_events.topic, config.prefix_caching_hash_algo.value, config.kv_events.event_encoding)

    def _drafter(self, config: ServeConfig, draft: LoadedModel | None,
                 num_blocks: int) -> NgramDrafter | ModelDrafter:
        """Prompt lookup, or the draft model on a pool of its own with the served pool's token capacity."""
        if config.speculative is Drafter.NGRAM:
            return NgramDrafter()
        if draft is None:
            raise ValueError("--speculative draft needs a draft model (server.serve.load_draft)")
        pool = _allocate_pool(draft, num_blocks, config.block_size, what="the draft model's ")
        log.info("KV pools: the served model's %d blocks, %.1f MiB (%s) + the draft model %s's %d blocks, %.1f MiB "
                 "(%s) = %.1f MiB", num_blocks, self.pool.nbytes / 2**20, self.loaded.dtype, draft.name, num_blocks,
                 pool.nbytes / 2**20, draft.dtype, (self.pool.nbytes + pool.nbytes) / 2**20)
        return ModelDrafter(ModelRunner(draft, pool, step_tokens=config.max_num_batched_tokens),
                            min(draft.max_model_len, self.max_model_len))

    def _spec_decoder(self, config: ServeConfig, draft: LoadedModel | None, num_blocks: int,
                      blocks: BlockManager) -> SpecDecoder:
        """Speculation: its drafter, and its draft length fixed or ``auto`` (step costs measured now)."""
        return SpecDecoder.start(self.runner, blocks, self._drafter(config, draft, num_blocks),
                                 config.num_speculative_tokens, config.max_num_seqs, config.max_num_batched_tokens,
                                 config.speculative.value)

    def _on_step(self, step: StepOutput) -> None:
        """After each engine step (and each abort): the KV events, vLLM's tokens-per-step histogram, the step log when
        asked for, the live page's view."""
        if self.kv_events is not None:
            self._publish_kv_events(step)
        if step.record is not None:
            self.metrics.iteration_tokens.observe(step.record.num_tokens)
            if self.step_log is not None:
                self.step_log.write(step.record)
        if self.live is not None:
            self.live.stepped(step)

    def _publish_kv_events(self, step: StepOutput) -> None:
        """Hand the step's KV events to the publisher; after a drop, the whole cache instead, taken between two steps
        (``SchedulerService.between_steps``: the next step may be running while this observer runs), where the
        block manager holds the state the steps so far led to: it covers their events too."""
        if not self.kv_events.needs_resync:
            self.kv_events.publish(step.kv_events)
        elif not self._resync_queued:
            self._resync_queued = True
            self.service.between_steps(self._resync_kv_events)

    def _resync_kv_events(self) -> None:
        self._resync_queued = False
        self.kv_events.publish(self.blocks.cached_snapshot(), resync=True)

    def close(self) -> None:
        """Release what the state holds outside the engine: the KV events' thread and sockets."""
        if self.kv_events is not None:
            self.kv_events.shutdown()

    def submit(self, requests: list[tuple[EngineRequest, asyncio.Queue[Delivery]]]) -> None:
        """Queue requests with their streams (``SchedulerService.submit``: all or none), and show them on the live
        page.

        Raises:
            QueueFull, RuntimeError: as ``SchedulerService.submit``.
        """
        self.service.submit(requests)
        if self.live is not None:
            self.live.slots.submitted([request for request, _ in requests])

    @property
    def speculating(self) -> bool:
        """Whether speculative decoding is on (``--speculative`` not off): replies report their drafts."""
        return self.spec is not None

    def next_id(self) -> int:
        return next(self._ids)

    def _eos_ids(self) -> frozenset[int]:
        """The tokens that end a reply: the generation config's EOS ids (a list where the model has several, as
        Llama 3's EOS, end-of-turn and end-of-message), the tokenizer's EOS, and the token the chat template closes an
        assistant turn with (``end_of_turn_ids``)."""
        ids = set()
        for source in (self.loaded.model.generation_config.eos_token_id, self.tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(source)
        for template in self.chat_templates.values():
            ids.update(end_of_turn_ids(template, self.tokenizer))
        return frozenset(ids)

    @property
    def pool_tokens(self) -> int:
        """Token capacity of the KV pool."""
        return self.pool.num_slots

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt + completion) one request may ask for: the context, or the whole KV pool where
        that is smaller (``prepare`` refuses more). /v1/models reports it as ``max_model_len``."""
        return min(self.max_model_len, self.pool_tokens)

    def log_chat(self) -> None:
        """Log what a request meets beyond the weights: the context a request may use, the stop tokens, and
        whether replies are split into reasoning and content (``--reasoning-parser``)."""
        stops = ", ".join(f"{self.tokenizer.convert_ids_to_tokens(i)!s} ({i})" for i in sorted(self.eos_ids))
        reasoning = ("on: <think>...</think> comes back as reasoning_content" if self.reasoning else "off")
        if self.max_request_tokens < self.max_model_len:  # max_model_len: the model's context or --max-model-len
            limit = f"the KV pool's {self.pool_tokens} tokens, under a context of {self.max_model_len}"
        else:
            limit = "the context (the model's, or --max-model-len)"
        log.info("requests: at most %d tokens each (prompt + completion; %s; /v1/models' max_model_len); stop "
                 "tokens %s; reasoning parser %s (--reasoning-parser %s); chat template%s %s", self.max_request_tokens,
                 limit, stops or "none", reasoning, self.config.reasoning_parser,
                 "s" if len(self.chat_templates) > 1 else "",
                 ", ".join(self.chat_templates) or "none (completions only)")

    def log_capacity(self) -> None:
        """Log the KV formula, allocated bytes per token (must equal it), blocks and sequences that fit."""
        shape = self.pool.shape
        per_token_allocated = self.pool.nbytes / self.pool.num_slots
        log.info("KV cache (%s): %s", self.pool.cache_dtype, shape.formula())
        log.info("KV pool: %s bytes allocated / %s tokens = %s bytes/token (%s)", f"{self.pool.nbytes:,}",
                 f"{self.pool.num_slots:,}", f"{per_token_allocated:,.0f}",
                 "equal" if per_token_allocated == shape.bytes_per_token else "MISMATCH")
        log.info("KV pool: %d blocks of %d tokens; %d sequences of %d tokens fit", self.pool.num_blocks,
                 self.pool.block_size, self.pool.num_slots // _PLANNING_CONTEXT, _PLANNING_CONTEXT)
        if self.pool_tokens < self.max_model_len:
            log.warning("the KV pool holds %d tokens, less than the context of %d: one request may use at most %d "
                        "tokens (reported as max_model_len)", self.pool_tokens, self.max_model_len, self.pool_tokens)
