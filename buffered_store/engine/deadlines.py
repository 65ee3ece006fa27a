"""Deadlines of many writes on one timer.

`asyncio.timeout_at` schedules a timer for each scope and cancels it on the way out: a
timer handle, a push on the loop's heap and a cancelled handle left in it, for every
write (about 20 µs of CPU a scope on a 2-core machine, 6 µs here). Writes all take
the same timeout (``checkpoint_timeout_s``), so each new
deadline comes after those already waiting: here a scope only notes its deadline, and
one timer (`buffered_store.timers.SharedTimer`, which the reply inbox uses for its
requests too), set for the nearest one, cancels the tasks whose time is up, as
`asyncio.timeout_at` would.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

from buffered_store.timers import SharedTimer


class Deadlines:
    """The deadlines of the scopes (`at`) entered and not yet left, on one timer."""

    def __init__(self) -> None:
        self._timer: SharedTimer[Deadline] = SharedTimer(Deadline.expire)

    def at(self, when: float) -> Deadline:
        """``with deadlines.at(when):`` (inside a task) as ``async with
        asyncio.timeout_at(when):`` (`when` in loop time): the task is cancelled at
        `when`, and the scope raises `TimeoutError` in place of that cancellation. A
        plain context manager: entering and leaving it awaits nothing, so it makes no
        coroutine either."""
        return Deadline(self._timer, when)


class Deadline:
    """One scope of `Deadlines.at`."""

    __slots__ = ("_cancelling", "_deadlines", "_task", "expired", "when")

    def __init__(self, deadlines: SharedTimer[Deadline], when: float) -> None:
        self._deadlines = deadlines
        self.when = when
        self.expired = False
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0

    def __enter__(self) -> Deadline:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a deadline is kept inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._deadlines.add(self, self.when)
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._deadlines.discard(self)
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
