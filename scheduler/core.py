"""The engine core: requests in, steps out. The one place where a step is planned, executed, observed by speculation
and applied.

    add(EngineRequest) ──▶ ┌────────────── EngineCore.step() ───────────────┐
    abort(request_id)  ──▶ │ plan = scheduler.schedule()                     │
                           │ results = execute(plan)        (the model)      │──▶ StepOutput: RequestOutputs by
                           │ spec.observe(plan, results)    (speculation)    │    request id + a StepRecord
                           │ outputs = scheduler.update(plan, results)       │
                           └─────────────────────────────────────────────────┘

Both drivers call it: the async service (``scheduler.service``, which runs ``step`` on its engine thread and hands
outputs to the server's streams) and the offline runner (``scheduler.offline``: exactness tests, benchmarks, load
tests without HTTP). Synchronous and single-threaded: ``add``, ``abort`` and ``step`` must not overlap (the service
calls the first two between steps), and ``load`` may be read from any thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvserve.engine.plan import SeqResult, StepPlan
from kvserve.scheduler.contract import EngineRequest, FinishReason, Load, RequestOutput, StepOutput, StepRecord
from kvserve.scheduler.scheduler import Scheduler

log = logging.getLogger("kvserve.scheduler")

Execute = Callable[[StepPlan], list[SeqResult]]


class EngineCore:
    """Adds, aborts and steps requests over one scheduler and one model runner.

    Args:
        scheduler: the planning side (its block manager, its speculation plug-in if any).
        execute: computes a StepPlan: the runner's ``execute``, or with speculation the ``execute`` of the
            scheduler's ``spec`` (the runner's, then its drafter's).
        timed: teach speculation the steps' wall times (the service; the offline runner's steps, often on a fake
            model, teach nothing).

    Attributes:
        load: the core's ``Load`` after its last change.
        steps: steps that ran the model so far.
    """

    def __init__(self, scheduler: Scheduler, execute: Execute, timed: bool = True) -> None:
        self.scheduler = scheduler
        self.execute = execute
        self.timed = timed
        self.steps = 0
        self.load = Load(free_slots=scheduler.config.max_num_seqs)

    def add(self, request: EngineRequest) -> None:
        """Queue a request (it runs from the next step on).

        Raises:
            ValueError: its id is already queued or running.
        """
        self.scheduler.add(request)
        self._update_load()

    def abort(self, request_id: int, reason: FinishReason = FinishReason.ABORT) -> RequestOutput | None:
        """End a request wherever it is and free its blocks; its last output, or None if it is unknown or over."""
        output = self.scheduler.abort(request_id, reason)
        self._update_load()
        return output

    @property
    def has_requests(self) -> bool:
        """Requests wait or run."""
        return self.scheduler.has_work

    @property
    def has_work(self) -> bool:
        """Requests wait or run, or ended ones still hold state in the engine (a drafter's)."""
        return self.scheduler.has_work or bool(self.scheduler.ended_ids)

    def step(self) -> StepOutput:
        """Plan a step, run it, let speculation learn from it, apply it.

        A step whose ``execute`` raises fails only its own requests (their outputs carry the error). A plan with no
        work only frees what ended requests held in the engine; a failure there is logged, and serving goes on.

        Raises:
            whatever planning or applying raised: a bug of the core, after which its state is not to be trusted.
        """
        scheduler = self.scheduler
        started = time.perf_counter()
        queries, hits = scheduler.prefix_queries, scheduler.prefix_hits
        preemptions = scheduler.num_preemptions
        plan = scheduler.schedule()
        outputs = scheduler.take_preempted()
        if not plan.work:
            if plan.ended_ids:
                self._free_ended(plan)
            self._update_load()
            return StepOutput(outputs, kv_events=scheduler.blocks.take_events())
        executed = time.perf_counter()
        try:
            results = self.execute(plan)
        except Exception as exc:  # a failed step fails only its own requests
            log.exception("engine step failed")
            for w in plan.work:
                output = scheduler.abort(w.seq_id, FinishReason.ERROR)
                if output is not None:
                    output.error = f"engine step failed: {exc}"
                    outputs.append(output)
            self._update_load()
            return StepOutput(outputs, kv_events=scheduler.blocks.take_events())
        seconds = time.perf_counter() - executed
        if scheduler.spec is not None:  # speculation learns acceptance (and, when timed, step costs)
            scheduler.spec.observe(plan, results, scheduler.running, seconds if self.timed else None)
        outputs += scheduler.update(plan, results)
        self.steps += 1
        record = self._record(plan, results, started, seconds, scheduler.num_preemptions - preemptions,
                              scheduler.prefix_queries - queries, scheduler.prefix_hits - hits)
        self._update_load()
        return StepOutput(outputs, record, scheduler.blocks.take_events())

    def reset_prefix_cache(self) -> StepOutput | None:
        """Empty the prefix cache (vLLM's ``reset_prefix_cache``) when no request holds a block: a StepOutput with no
        outputs and the reset's KV events, or None (nothing changed) while requests run."""
        if not self.scheduler.blocks.reset_prefix_cache():
            return None
        return StepOutput([], kv_events=self.scheduler.blocks.take_events())

    def _free_ended(self, plan: StepPlan) -> None:
        """Run a plan that only frees what ended requests held in the engine (a drafter's K/V). No request waits on
        it, so a failure is logged and serving goes on: that state is at worst left allocated, never served to
        anyone (the next request with that id is a new one)."""
        try:
            self.execute(plan)
        except Exception:
            log.exception("freeing ended requests in the engine failed; serving goes on")

    def _record(self, plan: StepPlan, results: list[SeqResult], started: float, seconds: float, preemptions: int,
                queries: int, hits: int) -> StepRecord:
        prefills = prefill_tokens = prompt_tokens = decode_tokens = max_context = 0
        for w in plan.work:
            if w.is_decode:
                decode_tokens += len(w.token_ids) - w.num_draft
                max_context = max(max_context, w.context_len)
            else:  # a recompute after preemption also recomputes generated tokens: not prompt ones
                prefills += 1
                prefill_tokens += len(w.token_ids)
                prompt_tokens += min(w.context_len, len(w.prompt_ids)) - w.start_pos
        blocks = self.scheduler.blocks
        return StepRecord(
            index=self.steps, rows=len(plan.work), prefills=prefills, prefill_tokens=prefill_tokens,
            prompt_tokens=prompt_tokens, decode_tokens=decode_tokens, draft_tokens=plan.num_draft_tokens,
            accepted_tokens=sum(r.num_accepted for w, r in zip(plan.work, results) if w.num_draft),
            generated_tokens=sum(len(r.tokens) for r in results), max_context=max_context, seconds=seconds,
            started=started, ended=time.perf_counter(), preemptions=preemptions, prefix_queries=queries,
            prefix_hits=hits, running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            blocks_used=blocks.num_blocks - blocks.num_free_blocks,
            blocks_free=blocks.num_free_blocks - blocks.num_cached_free, blocks_cached=blocks.num_cached_free)

    def _update_load(self) -> None:
        scheduler = self.scheduler
        self.load = Load(running=len(scheduler.running), waiting=len(scheduler.waiting),
                         free_slots=scheduler.free_slots(), kv_usage=scheduler.blocks.usage,
                         finish_rate=scheduler.finish_rate.rate())
