"""Drive the scheduler synchronously, without HTTP or asyncio: for exactness tests and engine benchmarks."""

from __future__ import annotations

from collections.abc import Callable

from kvserve.engine.plan import SeqResult, StepPlan
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.sequence import SeqEvent, Sequence


def run_offline(scheduler: Scheduler, execute: Callable[[StepPlan], list[SeqResult]],
                arrivals: dict[int, list[Sequence]], max_steps: int = 100_000,
                on_step: Callable[[int, StepPlan], None] | None = None) -> int:
    """Run steps until every sequence has finished.

    Args:
        scheduler: the scheduler (its block manager sized for the test).
        execute: the runner's ``execute``.
        arrivals: step index -> sequences that arrive just before that step (step 0: the start).
        max_steps: safety bound.
        on_step: called with (step index, plan) before each step runs.

    Returns:
        The number of steps run.

    Raises:
        RuntimeError: work remains after ``max_steps``, or nothing can be scheduled (a deadlock).
    """
    pending = dict(arrivals)
    step = 0
    while step < max_steps:
        for seq in pending.pop(step, []):
            scheduler.add(seq)
        if not scheduler.has_work:
            if scheduler.ended_ids:
                execute(scheduler.schedule())  # frees what ended sequences held in the engine
            if not pending:
                return step
            step += 1
            continue
        plan = scheduler.schedule()
        if not plan.work:
            raise RuntimeError("nothing schedulable: the pool is too small for one sequence")
        if on_step is not None:
            on_step(step, plan)
        run_step(scheduler, execute, plan)
        step += 1
    raise RuntimeError(f"work left after {max_steps} steps")


def run_step(scheduler: Scheduler, execute: Callable[[StepPlan], list[SeqResult]],
             plan: StepPlan) -> list[tuple[Sequence, SeqEvent]]:
    """Run one planned step and apply it as the service does (speculation observes it first, without its time:
    offline steps teach no step costs); returns ``Scheduler.update``'s events."""
    results = execute(plan)
    if scheduler.spec is not None:
        scheduler.spec.observe(plan, results, scheduler.running)
    return scheduler.update(plan, results)
