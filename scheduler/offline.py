"""Drive the engine core synchronously, without HTTP or asyncio: exactness tests, engine benchmarks, load tests.

The same ``EngineCore.step`` the server's service runs; requests arrive at given step indices, and what comes back
is collected by request id.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.scheduler.contract import EngineRequest, FinishReason, StepOutput, StepRecord
from kvserve.scheduler.core import EngineCore


@dataclass(slots=True)
class OfflineRun:
    """What ``run_offline`` collected.

    Attributes:
        steps: loop iterations run (the step indices ``arrivals`` counts in; an idle one waits for an arrival).
        tokens: request id -> its generated token ids, as delivered.
        finish: request id -> why it ended.
        first_token_step: request id -> the step index that delivered its first token.
        records: every step that ran the model, in order.
    """

    steps: int = 0
    tokens: dict[int, list[int]] = field(default_factory=dict)
    finish: dict[int, FinishReason] = field(default_factory=dict)
    first_token_step: dict[int, int] = field(default_factory=dict)
    records: list[StepRecord] = field(default_factory=list)

    def collect(self, step: int, out: StepOutput) -> None:
        """Take in step ``step``'s output."""
        for output in out.outputs:
            tokens = self.tokens.setdefault(output.request_id, [])
            if output.tokens and not tokens:
                self.first_token_step[output.request_id] = step
            tokens.extend(t.token_id for t in output.tokens)
            if output.finish_reason is not None:
                self.finish[output.request_id] = output.finish_reason
        if out.record is not None:
            self.records.append(out.record)


def run_offline(core: EngineCore, arrivals: dict[int, list[EngineRequest]], max_steps: int = 100_000,
                on_step: Callable[[int, StepOutput], None] | None = None) -> OfflineRun:
    """Run steps until every request has finished.

    Args:
        core: the engine core (its block manager sized for the test).
        arrivals: step index -> requests that arrive just before that step (step 0: the start).
        max_steps: safety bound.
        on_step: called with (step index, its output) after each step.

    Returns:
        What the steps delivered, by request id.

    Raises:
        RuntimeError: work remains after ``max_steps``, or nothing can be scheduled (a deadlock).
    """
    pending = dict(arrivals)
    run = OfflineRun()
    while run.steps < max_steps:
        for request in pending.pop(run.steps, []):
            core.add(request)
        if not core.has_work:
            if not pending:
                return run
            run.steps += 1
            continue
        out = core.step()
        if out.record is None and not out.outputs and core.has_requests:
            raise RuntimeError("nothing schedulable: the pool is too small for one sequence")
        run.collect(run.steps, out)
        if on_step is not None:
            on_step(run.steps, out)
        run.steps += 1
    raise RuntimeError(f"work left after {max_steps} steps")
