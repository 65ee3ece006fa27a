"""Deadlines of many writes on one timer.

`asyncio.timeout_at` schedules a timer for each scope and cancels it on the way out: a
timer handle, a push on the loop's heap and a cancelled handle left in it, for every
write (about 20 µs of CPU a scope on a 2-core machine, 6 µs here). Writes all take
the same timeout (``checkpoint_timeout_s``), so each new
deadline comes after those already waiting: here a scope only notes its deadline, and
one timer, set for the nearest one, cancels the tasks whose time is up, as
`asyncio.timeout_at` would (the reply inbox does the same for its requests).
"""

from __future__ import annotations

import asyncio
import math
from types import TracebackType

EXPIRY_SLACK_S = 0.001
"""The timer expires deadlines at most this far ahead (a loop runs a timer up to its
clock resolution early)."""


class Deadlines:
    """The deadlines of the scopes (`at`) entered and not yet left, on one timer."""

    def __init__(self) -> None:
        self._waiting: dict[Deadline, float] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    def at(self, when: float) -> Deadline:
        """``async with deadlines.at(when):`` as ``async with asyncio.timeout_at(when):``
        (`when` in loop time): the task is cancelled at `when`, and the scope raises
        `TimeoutError` in place of that cancellation."""
        return Deadline(self, when)

    def _add(self, scope: Deadline) -> None:
        self._waiting[scope] = scope.when
        if scope.when < self._timer_at:
            self._arm(asyncio.get_running_loop(), scope.when)

    def _arm(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = loop.call_at(at, self._expire, loop)

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        """Cancel the tasks whose deadline has passed; set the timer for the nearest of
        the others."""
        self._timer, self._timer_at = None, math.inf
        now = loop.time() + EXPIRY_SLACK_S
        nearest = math.inf
        for scope, when in list(self._waiting.items()):
            if when <= now:
                del self._waiting[scope]
                scope.expire()
            elif when < nearest:
                nearest = when
        if nearest < math.inf:
            self._arm(loop, nearest)


class Deadline:
    """One scope of `Deadlines.at`."""

    __slots__ = ("_cancelling", "_deadlines", "_task", "expired", "when")

    def __init__(self, deadlines: Deadlines, when: float) -> None:
        self._deadlines = deadlines
        self.when = when
        self.expired = False
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0

    async def __aenter__(self) -> Deadline:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a deadline is kept inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._deadlines._add(self)
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._deadlines._waiting.pop(self, None)
        # As asyncio.Timeout: the cancellation is ours to turn into TimeoutError only
        # when nobody else asked for one meanwhile.
        if (
            self.expired
            and self._task is not None
            and self._task.uncancel() <= self._cancelling
            and et is asyncio.CancelledError
        ):
            raise TimeoutError from e

    def expire(self) -> None:
        """The deadline has passed: cancel the task (once)."""
        if not self.expired and self._task is not None:
            self.expired = True
            self._task.cancel()
