"""Many deadlines on one event-loop timer. Pure asyncio: no I/O.

Waiters that all take the same timeout (a request's, a checkpoint's) get deadlines in
the order they arrive, so each new one comes after those already waiting: noting it in
a dict costs less than a timer handle per waiter (scheduled, cancelled, and left in the
loop's heap). One timer, set for the nearest deadline, expires the waiters whose time is
up and is set again for the nearest of the others.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

EXPIRY_SLACK_S = 0.001
"""The timer expires deadlines at most this far ahead (a loop runs a timer up to its
clock resolution early)."""


class SharedTimer(Generic[K]):
    """Deadlines (loop time) by key; `expire(key)` is called, once, for each key whose
    deadline passes while it is still `add`ed (`discard` takes a key back)."""

    def __init__(self, expire: Callable[[K], None]) -> None:
        self._expire_key = expire
        self._waiting: dict[K, float] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def add(self, key: K, when: float) -> None:
        """Expire `key` at `when` (in the running loop's time)."""
        self._waiting[key] = when
        if when < self._timer_at:
            self._arm(asyncio.get_running_loop(), when)

    def discard(self, key: K) -> None:
        """Forget `key`'s deadline (nothing if it has none)."""
        self._waiting.pop(key, None)

    def _arm(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = loop.call_at(at, self._expire, loop)

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer, self._timer_at = None, math.inf
        now = loop.time() + EXPIRY_SLACK_S
        nearest = math.inf
        for key, when in list(self._waiting.items()):
            if when <= now:
                del self._waiting[key]
                self._expire_key(key)
            elif when < nearest:
                nearest = when
        if nearest < math.inf:
            self._arm(loop, nearest)
