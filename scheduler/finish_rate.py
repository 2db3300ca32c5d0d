"""How fast the scheduler finishes sequences while it has work: what a 429's Retry-After is computed from.

Time is counted on a busy clock that stops while nothing waits or runs, so an idle hour between two bursts
does not make the next burst's rate look tiny (and its Retry-After huge).
"""

from __future__ import annotations

import time
from collections import deque

WINDOW = 64  # recent finishes the rate is measured over


class FinishRate:
    """Finishes per second of busy time over the last ``WINDOW`` finishes."""

    def __init__(self) -> None:
        self.finish_times: deque[float] = deque(maxlen=WINDOW)  # busy_clock() at recent finishes
        self._busy_s = 0.0                     # seconds with work, up to _busy_since
        self._busy_since: float | None = None  # perf_counter() when work last appeared; None while idle

    def work_arrived(self) -> None:
        """Work appeared (a sequence was added): the busy clock runs, if it was stopped."""
        if self._busy_since is None:
            self._busy_since = time.perf_counter()

    def finished(self, still_busy: bool) -> None:
        """A sequence finished; ``still_busy``: others wait or run (else the busy clock stops now)."""
        self.finish_times.append(self.busy_clock())
        if not still_busy and self._busy_since is not None:
            self._busy_s = self.busy_clock()
            self._busy_since = None

    def busy_clock(self) -> float:
        """Seconds during which the scheduler has had work (waiting or running sequences)."""
        since = self._busy_since
        return self._busy_s + (time.perf_counter() - since if since is not None else 0.0)

    def rate(self) -> float | None:
        """Finishes per second of busy time over the recent finishes, or None before two finishes."""
        if len(self.finish_times) < 2:
            return None
        span = self.finish_times[-1] - self.finish_times[0]
        return (len(self.finish_times) - 1) / span if span > 0 else None
