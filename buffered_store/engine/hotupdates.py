"""Hot records advanced in the background (`HotUpdates`), off the writer's path, and
the merge of two hot records' recent (seq, stream seq) lists."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Generic

from buffered_store.engine.cursors import Cursor, S
from buffered_store.engine.entries import H

if TYPE_CHECKING:
    from buffered_store.engine.appender import Writer

log = logging.getLogger("buffered_store.engine.appender")


class LingerQueue:
    """Threads whose hot-record update waits for its linger to end, in the order they
    started waiting (one linger for all: also the order their lingers end). No I/O and no
    clock: times come in as numbers.

    `take` hands out the threads whose linger ends within `slack_s` of now, so one timer
    serves every update due around the same moment: on an otherwise idle process each
    timer that fires is a wake-up, which costs a virtual machine's core about as much CPU
    as the update it starts.
    """

    def __init__(self, linger_s: float, slack_s: float) -> None:
        self.linger_s = linger_s
        self.slack_s = slack_s
        self._ends: OrderedDict[str, float] = OrderedDict()

    def add(self, thread_id: str, now: float) -> None:
        """The thread's linger starts at `now` (unless it is already waiting)."""
        self._ends.setdefault(thread_id, now + self.linger_s)

    def take(self, now: float) -> list[str]:
        """The threads whose linger ends by `now + slack_s`, taken out of the queue."""
        cutoff = now + self.slack_s
        taken: list[str] = []
        ends = self._ends
        while ends and next(iter(ends.values())) <= cutoff:
            taken.append(ends.popitem(last=False)[0])
        return taken

    def take_all(self) -> list[str]:
        """Every waiting thread, taken out of the queue."""
        taken = list(self._ends)
        self._ends.clear()
        return taken

    def next_end(self) -> float | None:
        """When the first waiting thread's linger ends (None: nobody waits)."""
        return next(iter(self._ends.values()), None)

    def __contains__(self, thread_id: object) -> bool:
        return thread_id in self._ends

    def __len__(self) -> int:
        return len(self._ends)


class HotUpdates(Generic[H, S]):
    """Hot records advanced in the background, one update in flight per thread.

    The entry is durable and its seq taken once the publish is acknowledged; the hot
    record only helps readers find the tail. Readers do not rely on it being current:
    they read the subject's last message beside it (`ThreadLog.latest`) and walk what
    it does not cover. A write's update that finds another in flight for its thread
    waits for it and then writes the newest record only (writes outrunning the updates
    cost fewer of them). An update is retried while the WAL is unreachable
    (`Writer.advance_hot`) until it lands or the writer closes; one that fails otherwise
    is dropped, and the thread's next write queues a newer record. `settled` waits for
    what is queued or in flight.

    With `linger_s`, an update waits that long before it is written, so that the writes
    of the thread made meanwhile share it (and its round trip runs while the caller is
    busy elsewhere rather than right after its write). One timer serves every thread
    (`LingerQueue`): when it fires it also starts the updates due within the next half
    linger, so an update goes out between half a linger and a linger after the write
    that queued it. `settled` and `close` cut every linger short.
    """

    def __init__(self, writer: Writer[Any, H, S], *, linger_s: float = 0.0) -> None:
        self._writer = writer
        self._lingering = LingerQueue(linger_s, linger_s / 2)
        self._timer: asyncio.TimerHandle | None = None
        self._hurrying = 0
        self._closed = False
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
            self._schedule(thread_id)

    def pending(self, thread_id: str) -> bool:
        """Whether an update of the thread's hot record is queued or in flight."""
        return thread_id in self._running or thread_id in self._lingering

    async def settled(self) -> None:
        """Return once every update submitted so far is written (or has failed for good:
        the writer was closed), lingering no more."""
        self._hurrying += 1
        try:
            while self._running or self._lingering:
                for thread_id in self._lingering.take_all():
                    self._start(thread_id)
                await asyncio.gather(*list(self._running.values()), return_exceptions=True)
        finally:
            self._hurrying -= 1

    async def close(self, timeout_s: float) -> None:
        """Let the updates in flight finish for up to `timeout_s`, then cancel the rest
        (their entries are durable; readers find them on the stream)."""
        try:
            async with asyncio.timeout(timeout_s):
                await self.settled()
        except TimeoutError:
            log.warning(
                "hot records of %d threads were not updated before closing",
                len(self._running) + len(self._lingering),
                extra={"action": "hot_updates_abandoned"},
            )
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._lingering.take_all()
        for task in list(self._running.values()):
            task.cancel()
        await asyncio.gather(*list(self._running.values()), return_exceptions=True)

    def _schedule(self, thread_id: str) -> None:
        """Start the thread's update now, or when its linger ends."""
        if self._closed:
            return
        if self._lingering.linger_s <= 0 or self._hurrying:
            self._start(thread_id)
            return
        loop = asyncio.get_running_loop()
        self._lingering.add(thread_id, loop.time())
        self._arm(loop)

    def _tick(self) -> None:
        """The first linger is over: start its update and those due soon after it."""
        self._timer = None
        loop = asyncio.get_running_loop()
        for thread_id in self._lingering.take(loop.time()):
            self._start(thread_id)
        self._arm(loop)

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        """Set the timer for the first linger's end, unless it is set or nobody waits."""
        end = self._lingering.next_end()
        if self._timer is None and end is not None:
            self._timer = loop.call_at(end, self._tick)

    def _start(self, thread_id: str) -> None:
        self._running[thread_id] = asyncio.create_task(self._run(thread_id))

    async def _run(self, thread_id: str) -> None:
        try:
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
            else:
                self._schedule(thread_id)  # written meanwhile: a linger of its own


def merged_recent(
    ours: Sequence[tuple[int, int]], stored: Sequence[tuple[int, int]], window: int
) -> tuple[tuple[int, int], ...]:
    """The newest `window` (seq, stream seq) pairs of both lists, ours winning a tie."""
    merged = dict(stored)
    merged.update(ours)
    return tuple(sorted(merged.items()))[-window:]
