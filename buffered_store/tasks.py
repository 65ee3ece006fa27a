"""Stopping a task for sure.

`task.cancel()` is a request: the coroutine sees one `CancelledError` and may carry on.
Python 3.11's `asyncio.wait_for` does so by accident (gh-86296): when its inner future
completes in the same loop pass as the cancellation, it returns the result and drops
the cancellation. nats-py connects through ``wait_for(open_connection(...))`` and then
waits for the server's INFO line, so a SIGTERM that lands just as the TCP connection
opens leaves the connect waiting for a server that never speaks, for as long as its
connect timeout (an hour if configured so). A stop that awaits a cancelled task must
therefore cancel again while the task runs on.
"""

from __future__ import annotations

import asyncio
from typing import Any

RECANCEL_S = 0.5
"""How long a cancelled task may run on before it is cancelled again."""


async def cancel_and_wait(task: asyncio.Future[Any], *, again_s: float = RECANCEL_S) -> None:
    """Cancel `task` and return once it is done, cancelling it again every `again_s`
    while it runs on (its cancellation was swallowed). Retrieves nothing: the caller
    reads ``task.cancelled()`` / ``task.result()`` as it needs."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=again_s)
