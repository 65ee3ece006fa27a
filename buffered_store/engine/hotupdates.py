"""Hot records advanced in the background (`HotUpdates`), off the writer's path, and
the merge of two hot records' recent (seq, stream seq) lists."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any, Generic

from buffered_store.engine.cursors import Cursor, S
from buffered_store.engine.entries import H

if TYPE_CHECKING:
    from buffered_store.engine.appender import Writer

log = logging.getLogger("buffered_store.engine.appender")


class HotUpdates(Generic[H, S]):
    """Hot records advanced in the background, one update in flight per thread.

    The entry is durable and its seq taken once the publish is acknowledged; the hot
    record only helps readers find the tail. Readers do not rely on it being current:
    they read the subject's last message beside it (`ThreadLog.latest`) and walk what
    it does not cover. A write's update that finds another in flight for its thread
    waits for it and then writes the newest record only (writes outrunning the updates
    cost fewer of them). Failures are retried until they succeed or the writer closes;
    `settled` waits for what is in flight.

    With `linger_s`, an update waits that long before it is written, so that the writes
    of the thread made meanwhile share it (and its round trip runs while the caller is
    busy elsewhere rather than right after its write); `settled` and `close` cut every
    linger short.
    """

    def __init__(self, writer: Writer[Any, H, S], *, linger_s: float = 0.0) -> None:
        self._writer = writer
        self._linger_s = linger_s
        self._hurry = asyncio.Event()
        self._hurrying = 0
        self._latest: dict[str, Cursor[H, S]] = {}
        self._running: dict[str, asyncio.Task[None]] = {}
        self._revisions: dict[str, int | None] = {}
        self.updates = 0
        """Hot-record updates written."""
        self.coalesced = 0
        """Writes whose hot record was superseded before it was written."""

    def submit(self, thread_id: str, cursor: Cursor[H, S]) -> None:
        """Advance the thread's hot record to `cursor`'s (latest submission wins)."""
        if thread_id in self._latest:
            self.coalesced += 1
        self._latest[thread_id] = cursor
        if thread_id not in self._revisions:
            self._revisions[thread_id] = cursor.revision
        if thread_id not in self._running:
            self._running[thread_id] = asyncio.create_task(self._run(thread_id))

    def pending(self, thread_id: str) -> bool:
        """Whether an update of the thread's hot record is queued or in flight."""
        return thread_id in self._running

    async def settled(self) -> None:
        """Return once every update submitted so far is written (or has failed for good:
        the writer was closed), lingering no more."""
        self._hurrying += 1
        self._hurry.set()
        try:
            while self._running:
                await asyncio.gather(*list(self._running.values()), return_exceptions=True)
        finally:
            self._hurrying -= 1
            if not self._hurrying:
                self._hurry.clear()

    async def close(self, timeout_s: float) -> None:
        """Let the updates in flight finish for up to `timeout_s`, then cancel the rest
        (their entries are durable; readers find them on the stream)."""
        try:
            async with asyncio.timeout(timeout_s):
                await self.settled()
        except TimeoutError:
            log.warning(
                "hot records of %d threads were not updated before closing",
                len(self._running),
                extra={"action": "hot_updates_abandoned"},
            )
        for task in list(self._running.values()):
            task.cancel()
        await asyncio.gather(*list(self._running.values()), return_exceptions=True)

    async def _linger(self) -> None:
        if self._linger_s > 0 and not self._hurry.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._linger_s):
                    await self._hurry.wait()

    async def _run(self, thread_id: str) -> None:
        try:
            while thread_id in self._latest:
                await self._linger()
                cursor = self._latest.pop(thread_id)
                assert cursor.hot is not None
                revision = await self._writer.advance_hot(
                    thread_id, cursor.hot, self._revisions.get(thread_id)
                )
                self.updates += 1
                self._revisions[thread_id] = revision
                current = self._writer.cursors.get(thread_id)
                if current is not None:
                    current.revision = revision
                    if current is cursor:
                        current.hot_behind = False
        finally:
            del self._running[thread_id]
            if thread_id not in self._latest:
                self._revisions.pop(thread_id, None)


def merged_recent(
    ours: tuple[tuple[int, int], ...], stored: tuple[tuple[int, int], ...], window: int
) -> tuple[tuple[int, int], ...]:
    """The newest `window` (seq, stream seq) pairs of both lists, ours winning a tie."""
    merged = dict(stored)
    merged.update(ours)
    return tuple(sorted(merged.items()))[-window:]
