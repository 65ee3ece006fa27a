"""The one back-off policy of the package: waits that double from `initial_s` up to
`max_s`, optionally within a time budget. Pure: nothing here reads a clock or sleeps;
callers pass ``now`` (a monotonic time in seconds) and do the waiting themselves, so the
policy tests in microseconds and every retry loop in the package waits the same way.

Two uses:

- a stateful retry loop: ``backoff = Backoff(0.05, 1.0)`` then, after each failed
  attempt, ``await asyncio.sleep(backoff.next_delay())`` (no budget: the caller's own
  timeout bounds the loop), or ``wait = backoff.next_wait(now)`` which answers None once
  the wait would end at or past the budget's deadline (give up);
- a stateless delay for attempt *n* (redelivery delays, restarts counted elsewhere):
  ``backoff.delay(n)`` or `backoff_s`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field


def backoff_s(attempt: int, *, initial_s: float, max_s: float) -> float:
    """The wait after failed attempt `attempt`: `initial_s` for attempt 1 (and below),
    doubling per attempt, capped at `max_s`."""
    exponent = max(0, min(attempt, 64) - 1)
    return float(min(max_s, initial_s * (2**exponent)))


@dataclass(slots=True)
class Backoff:
    """Waits between attempts: `initial_s`, doubling, capped at `max_s`; with `budget_s`
    all of them within a deadline set by the first call of `left` or `next_wait`."""

    initial_s: float
    max_s: float
    budget_s: float | None = None
    jitter_s: float = 0.0
    """Up to this much is added at random to each wait of `next_delay`/`next_wait`, so
    that many clients failing together do not retry together."""
    rng: random.Random | None = field(default=None, repr=False)
    """Where the jitter comes from (default: the `random` module's shared generator; a
    generator of its own per policy would cost a seeding from the OS per retry loop)."""
    attempts: int = 0
    """Failed attempts counted so far by `next_wait` / `next_delay`."""
    _deadline: float | None = field(default=None, repr=False)

    def delay(self, attempt: int) -> float:
        """The wait after failed attempt `attempt` (stateless)."""
        return backoff_s(attempt, initial_s=self.initial_s, max_s=self.max_s)

    def next_delay(self) -> float:
        """Count one more failed attempt and return the wait before the next one."""
        self.attempts += 1
        wait = self.delay(self.attempts)
        if self.jitter_s <= 0:
            return wait
        return wait + (self.rng or random).uniform(0.0, self.jitter_s)

    def left(self, now: float) -> float:
        """Seconds left of the budget (never negative; infinite without a budget)."""
        if self.budget_s is None:
            return math.inf
        if self._deadline is None:
            self._deadline = now + self.budget_s
        return max(0.0, self._deadline - now)

    def next_wait(self, now: float) -> float | None:
        """After a failed attempt: the wait before the next one, or None to give up (the
        wait would end at or past the budget's deadline)."""
        left = self.left(now)
        wait = self.next_delay()
        return None if wait >= left else wait

    def reset(self) -> None:
        """An attempt succeeded: the next failure waits `initial_s` again (the budget's
        deadline, once set, stays)."""
        self.attempts = 0
