"""Scheduling policies (``--scheduling-policy``): who is admitted first, who is preempted, and how slots and the token
budget are shared.

Each policy is the scheduler's waiting queue plus a few decisions; the scheduler asks and knows nothing else of it:

- ``add(seq)`` / ``requeue(seq)`` / ``remove(seq)``: an arrival, a preempted sequence going back, an abort;
- ``head()``: the waiting sequence to admit next (None: none may now); iterating the queue gives the rest in the
  policy's order (the scheduler admits a short prompt from behind a long head that the prefill limits hold back);
- ``pop(seq)``: ``seq`` was admitted (the head, or such a short prompt);
- ``order(running)``: the order running sequences claim the step's budget and blocks; when the pool runs out, the
  last of this order still running is preempted (it may be the sequence that needed the room);
- ``displace(running, newcomer)``: a running sequence to preempt so that ``newcomer`` can start now, or None;
- ``begin(running, budget)``, ``cap(seq)``, ``charge(seq, tokens)``: per step, the most tokens a sequence may take
  (a tenant's share of the budget under fair sharing; unbounded otherwise), and what it took.

Three policies:

- ``FCFS`` (the default): arrival order, no overtaking (but for a short prompt past a long one that the scheduler's
  prefill limits hold back); a preempted sequence goes back to the head of the queue and the newest running sequence
  is the one preempted.
- ``PRIORITY``: lower ``priority`` first (vLLM's field and meaning), first come first served within a level; a
  waiting sequence that finds no slot or no blocks preempts the newest running sequence of the lowest priority
  below its own.
- ``FAIR``: per tenant. Among the tenants with work, running slots and the step's token budget are shared equally
  (max-min fair: a tenant that needs less than its share leaves the rest to the others); the next slot goes to the
  waiting tenant with the fewest running sequences, and a tenant below its share of the slots takes one from the
  tenant with the most, so one tenant's flood cannot keep another's request waiting for more than a step.
"""

from __future__ import annotations

import enum
import heapq
from collections import Counter, deque
from collections.abc import Iterator

from kvserve.scheduler.sequence import Sequence

_UNBOUNDED = 1 << 62  # a cap no step reaches (tokens)


class SchedulingPolicy(enum.Enum):
    """``--scheduling-policy``: the order of admission and preemption."""

    FCFS = "fcfs"          # first come, first served
    PRIORITY = "priority"  # lower priority value first (vLLM's), FCFS within a level
    FAIR = "fair"          # equal shares of slots and tokens per tenant, FCFS within a tenant


class Fcfs:
    """First come, first served: arrival order, a preempted sequence back at the head, the newest preempted."""

    def __init__(self) -> None:
        self._queue: deque[Sequence] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._queue)

    def add(self, seq: Sequence) -> None:
        self._queue.append(seq)

    def requeue(self, seq: Sequence) -> None:
        self._queue.appendleft(seq)

    def remove(self, seq: Sequence) -> None:
        self._queue.remove(seq)

    def head(self) -> Sequence | None:
        return self._queue[0] if self._queue else None

    def pop(self, seq: Sequence) -> None:
        """Take ``seq`` out: it was admitted (the head, or a short prompt from behind it)."""
        if self._queue[0] is seq:
            self._queue.popleft()
        else:
            self._queue.remove(seq)

    def order(self, running: list[Sequence]) -> list[Sequence]:
        return list(running)

    def displace(self, running: list[Sequence], newcomer: Sequence) -> Sequence | None:
        return None  # nobody overtakes

    def begin(self, running: list[Sequence], budget: int) -> None:
        pass

    def cap(self, seq: Sequence) -> int:
        return _UNBOUNDED

    def charge(self, seq: Sequence, tokens: int, admitted: bool = False) -> None:
        pass


class Priority(Fcfs):
    """Lower ``priority`` first, arrival order within a level (a preempted sequence keeps its arrival serial, so
    it goes back ahead of the later arrivals of its level)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Sequence]] = []  # (priority, serial, seq)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Sequence]:
        return (seq for _, _, seq in sorted(self._heap, key=lambda entry: entry[:2]))

    def add(self, seq: Sequence) -> None:
        heapq.heappush(self._heap, (seq.request.priority, seq.serial, seq))

    requeue = add

    def remove(self, seq: Sequence) -> None:
        self._heap = [entry for entry in self._heap if entry[2] is not seq]
        heapq.heapify(self._heap)

    def head(self) -> Sequence | None:
        return self._heap[0][2] if self._heap else None

    def pop(self, seq: Sequence) -> None:
        if self._heap[0][2] is seq:
            heapq.heappop(self._heap)
        else:
            self.remove(seq)

    def order(self, running: list[Sequence]) -> list[Sequence]:
        return sorted(running, key=lambda seq: seq.request.priority)  # stable: admission order within a level

    def displace(self, running: list[Sequence], newcomer: Sequence) -> Sequence | None:
        if not running:
            return None
        last = self.order(running)[-1]
        return last if last.request.priority > newcomer.request.priority else None


class FairShare(Fcfs):
    """Equal shares per tenant of the running slots and of each step's token budget (see the module docstring).

    Args:
        max_num_seqs: the slots shared.
    """

    def __init__(self, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs
        self._queues: dict[str | None, deque[Sequence]] = {}  # tenant -> its waiting sequences, FCFS
        self._count = 0
        self._running: Counter = Counter()   # tenant -> running sequences (this step)
        self._left: dict[str | None, int] = {}  # tenant -> tokens of its share left in this step

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[Sequence]:
        return iter(sorted((seq for queue in self._queues.values() for seq in queue), key=lambda s: s.serial))

    def _queue(self, seq: Sequence) -> deque[Sequence]:
        return self._queues.setdefault(seq.request.tenant, deque())

    def add(self, seq: Sequence) -> None:
        self._queue(seq).append(seq)
        self._count += 1

    def requeue(self, seq: Sequence) -> None:
        self._queue(seq).appendleft(seq)
        self._count += 1
        self._running[seq.request.tenant] -= 1

    def remove(self, seq: Sequence) -> None:
        queue = self._queue(seq)
        queue.remove(seq)
        self._count -= 1
        if not queue:
            del self._queues[seq.request.tenant]

    def head(self) -> Sequence | None:
        """The head of the waiting tenant with the fewest running sequences (then the earliest arrival) among those
        with tokens of their share left."""
        best = None
        for tenant, queue in self._queues.items():
            if self._left.get(tenant, 1) <= 0:
                continue
            key = (self._running[tenant], queue[0].serial)
            if best is None or key < best[0]:
                best = (key, queue[0])
        return best[1] if best is not None else None

    def pop(self, seq: Sequence) -> None:
        self.remove(seq)  # the head of its tenant's queue, or a short prompt from behind it

    def order(self, running: list[Sequence]) -> list[Sequence]:
        """The tenants with fewer running sequences first; the newest sequence of the tenant with the most is last
        (the one preempted when the pool runs out)."""
        counts = Counter(seq.request.tenant for seq in running)
        return sorted(running, key=lambda seq: counts[seq.request.tenant])  # stable: admission order within

    def displace(self, running: list[Sequence], newcomer: Sequence) -> Sequence | None:
        """The newest sequence of the tenant with the most running ones, when ``newcomer``'s tenant holds less than
        its share of the slots and that tenant holds at least two more than it."""
        counts = Counter(seq.request.tenant for seq in running)
        tenants = set(counts) | set(self._queues)
        mine = counts[newcomer.request.tenant]
        if mine >= max(1, self.max_num_seqs // len(tenants)):
            return None
        biggest, most = max(counts.items(), key=lambda item: item[1], default=(None, 0))
        if most < mine + 2:
            return None
        return next(seq for seq in reversed(running) if seq.request.tenant == biggest)

    def begin(self, running: list[Sequence], budget: int) -> None:
        """Each tenant's share of this step's ``budget``: max-min fair over what each could use (its running
        sequences' tokens still to compute, then its waiting ones'), so a tenant needing less than an equal share
        leaves the rest to the others."""
        self._running = Counter(seq.request.tenant for seq in running)
        demand: Counter = Counter()
        for seq in running:
            demand[seq.request.tenant] += seq.num_uncomputed
        for tenant, queue in self._queues.items():
            for seq in queue:  # enough of the queue to know whether it could use the whole budget
                if demand[tenant] >= budget:
                    break
                demand[tenant] += seq.num_tokens
        self._left = {}
        left = budget
        ranked = sorted(demand.items(), key=lambda item: item[1])
        for index, (tenant, wants) in enumerate(ranked):
            self._left[tenant] = min(wants, left // (len(ranked) - index))
            left -= self._left[tenant]

    def cap(self, seq: Sequence) -> int:
        return self._left.get(seq.request.tenant, 0)

    def charge(self, seq: Sequence, tokens: int, admitted: bool = False) -> None:
        tenant = seq.request.tenant
        self._left[tenant] = self._left.get(tenant, 0) - tokens
        if admitted:
            self._running[tenant] += 1


def make_ordering(policy: SchedulingPolicy, max_num_seqs: int) -> Fcfs:
    """The waiting queue and decisions of ``policy``."""
    if policy is SchedulingPolicy.PRIORITY:
        return Priority()
    if policy is SchedulingPolicy.FAIR:
        return FairShare(max_num_seqs)
    return Fcfs()
