"""Waiting in tests for something asynchronous by design (a flush, a trim, a lingering
update) without assuming how long it takes."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable


async def eventually(
    check: Callable[[], bool | Awaitable[bool]],
    *,
    timeout_s: float = 15.0,
    what: str = "condition",
    every_s: float = 0.02,
) -> float:
    """Wait until `check()` holds (awaited when it returns an awaitable), asking every
    `every_s`; returns the seconds it took. After `timeout_s`: AssertionError naming
    `what`."""
    started = time.monotonic()
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(every_s)
