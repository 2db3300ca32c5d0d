"""Admission policies: when waiting sequences may start, and when a finished sequence's last event is delivered.

The scheduler asks its policy three narrow questions and knows nothing else of it; a new policy (priorities,
fairness) is a new class here, not branches in the scheduler:

- ``admissible(seq, waiting, running)``: may the head of the queue start now (slots and blocks permitting)?
- ``free_slots(max_num_seqs, waiting, running)``: slots a newcomer could take at the next step (what the
  service's queue bound counts);
- ``hold(output)`` / ``release(waiting, running)``: keep a finished sequence's last output back, and hand back the
  held outputs once they may go.

Which waiting sequence comes first, and who is preempted, is the scheduling policy's (``scheduler.ordering``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from kvserve.scheduler.contract import RequestOutput
from kvserve.scheduler.ordering import SchedulingPolicy
from kvserve.scheduler.sequence import Sequence


class Policy(enum.Enum):
    """``--scheduler``: the batching policy."""

    CONTINUOUS = "continuous"  # token-level slots: a slot freed at step k is refilled at step k+1
    STATIC = "static"          # the naive baseline: a group runs until its last member finishes


class Continuous:
    """Continuous batching (Orca, Yu et al. 2022): a sequence starts as soon as a slot is free, and each
    sequence's outputs go out as they happen."""

    def admissible(self, seq: Sequence, waiting: Iterable[Sequence], running: list[Sequence]) -> bool:
        return True

    def free_slots(self, max_num_seqs: int, waiting: Iterable[Sequence], running: list[Sequence]) -> int:
        return max(0, max_num_seqs - len(running))

    def hold(self, output: RequestOutput) -> bool:
        return False

    def release(self, waiting: Iterable[Sequence], running: list[Sequence]) -> list[RequestOutput]:
        return []


class Static:
    """Static batching, the baseline continuous batching is measured against: a group of up to
    ``group_size`` waiting sequences is admitted only when the previous group has entirely finished, and
    every member's final output is held until the last member finishes (a client of a static server sees
    its answer when the whole batch is done).

    Args:
        group_size: sequences per group (the slots).
    """

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self.group: set[int] = set()                      # ids of the current group
        self.held: list[RequestOutput] = []               # final outputs waiting for the group

    def _active(self, waiting: Iterable[Sequence], running: list[Sequence]) -> bool:
        """Some member of the current group is still running or waiting (preempted)."""
        return any(s.seq_id in self.group for s in running) or any(s.seq_id in self.group for s in waiting)

    def admissible(self, seq: Sequence, waiting: Iterable[Sequence], running: list[Sequence]) -> bool:
        if not self._active(waiting, running) and not self.held:
            self.group = {s.seq_id for s in list(waiting)[:self.group_size]}
        return seq.seq_id in self.group

    def free_slots(self, max_num_seqs: int, waiting: Iterable[Sequence], running: list[Sequence]) -> int:
        """None while the current group is active; the next group starts when it has finished."""
        if self._active(waiting, running):
            return 0
        return max(0, max_num_seqs - len(running))

    def hold(self, output: RequestOutput) -> bool:
        self.held.append(output)
        return True

    def release(self, waiting: Iterable[Sequence], running: list[Sequence]) -> list[RequestOutput]:
        """The held final outputs, once no member of the group is left running or waiting."""
        if not self.held or self._active(waiting, running):
            return []
        released, self.held = self.held, []
        return released


def check_policies(policy: Policy, scheduling: SchedulingPolicy) -> None:
    """Refuse a batching policy with a scheduling policy it cannot follow.

    Raises:
        ValueError: static batching with any order but first come, first served (its groups are formed in arrival
            order, and another order's next sequence may never be in the group).
    """
    if policy is Policy.STATIC and scheduling is not SchedulingPolicy.FCFS:
        raise ValueError("--scheduler static is the first-come-first-served baseline: it takes no other "
                         "--scheduling-policy")


def make_policy(policy: Policy, max_num_seqs: int) -> Continuous | Static:
    """The policy object for ``policy``."""
    return Static(max_num_seqs) if policy is Policy.STATIC else Continuous()
