"""Group commit per thread: one publish at a time per thread, and the writes that arrive
meanwhile go out together in the next one.

A thread's writes are serialised anyway (each is a compare-and-set on the thread's
subject), so a write that arrives while another one of its thread is in flight would
only wait for it and then pay a round trip of its own. Here it joins the next publish
instead: one entry, one round trip, for every write queued behind the one in flight.

A write may also *linger*: wait up to `linger_s` for a write that follows it before it
goes out. LangGraph saves a task's writes in the background and then, a moment later,
the step's checkpoint, which the step waits for: the writes linger, the checkpoint comes
and takes them along, and the step pays one round trip instead of two. A write that
does not linger (``urgent``) starts the publish at once, taking whatever is queued.

Writes of different threads never wait for each other. `max_inflight` bounds the
publishes in flight in the whole process (the others queue in arrival order), so a
burst of threads shares the connection fairly instead of all at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

R = TypeVar("R")
"""What a caller asks to write (a front-end's operation)."""
T = TypeVar("T")
"""What a publish returns to each of its callers (the entry written)."""


@dataclass(eq=False, slots=True)
class _Request(Generic[R, T]):
    item: R
    joins: bool
    future: asyncio.Future[T]


@dataclass(eq=False, slots=True)
class _Queue(Generic[R, T]):
    waiting: list[_Request[R, T]] = field(default_factory=list)
    urgent: bool = False
    wake: asyncio.Future[None] | None = None
    """Set while the drainer lingers: resolved by an urgent write or the linger's end."""
    drainer: asyncio.Task[None] | None = None

    def hurry(self) -> None:
        """Mark the queue urgent and end a linger in progress."""
        self.urgent = True
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)


class GroupCommit(Generic[R, T]):
    """Per-thread queues of writes, each drained by one task that publishes them.

    `publish(thread_id, items)` writes the items as one entry and returns what each
    caller gets; items that may share an entry are those submitted with ``joins``; an
    item without it always goes alone, in its place in the order.
    """

    def __init__(
        self,
        publish: Callable[[str, Sequence[R]], Awaitable[T]],
        *,
        linger_s: float = 0.0,
        max_inflight: int = 0,
    ) -> None:
        self._publish = publish
        self._linger_s = linger_s
        self._queues: dict[str, _Queue[R, T]] = {}
        self._slots = asyncio.Semaphore(max_inflight) if max_inflight > 0 else None
        self.publishes = 0
        """Publishes made (each one entry, one round trip)."""
        self.joined = 0
        """Writes that went out in another write's entry."""

    async def submit(self, thread_id: str, item: R, *, joins: bool, urgent: bool) -> T:
        """Queue `item` behind the thread's earlier writes; returns once it is written.

        With ``urgent`` the thread's queue goes out as soon as the publish in flight (if
        any) returns; without, it may wait `linger_s` for a write that follows.
        """
        queue = self._queues.get(thread_id)
        if queue is None:
            queue = self._queues[thread_id] = _Queue()
        request: _Request[R, T] = _Request(item, joins, asyncio.get_running_loop().create_future())
        # A caller cancelled while it waits cancels only its future, not its write (the
        # drainer writes it all the same and skips resolving it); an outcome nobody
        # reads is consumed.
        request.future.add_done_callback(_consume)
        queue.waiting.append(request)
        if urgent or not joins or self._linger_s <= 0:
            queue.hurry()
        if queue.drainer is None:
            queue.drainer = asyncio.create_task(self._drain(thread_id, queue))
        # Awaited as it is, not through `asyncio.shield`: a shield's outer future is
        # resolved by a callback of the inner one, one more turn of the loop per write.
        return await request.future

    async def settled(self) -> None:
        """Return once every write submitted so far is written (or failed)."""
        drainers = [q.drainer for q in self._queues.values() if q.drainer is not None]
        if drainers:
            await asyncio.gather(*drainers, return_exceptions=True)

    async def _drain(self, thread_id: str, queue: _Queue[R, T]) -> None:
        try:
            while queue.waiting:
                if not queue.urgent:
                    await self._linger(queue)
                batch = _take(queue.waiting)
                if not queue.waiting:
                    queue.urgent = False
                await self._send(thread_id, batch)
        except BaseException as exc:
            # Cancelled (the process shuts down): what is still queued was not written.
            for request in queue.waiting:
                if not request.future.done():
                    request.future.set_exception(exc)
            queue.waiting.clear()
            raise
        finally:
            queue.drainer = None
            if not queue.waiting and self._queues.get(thread_id) is queue:
                del self._queues[thread_id]

    async def _linger(self, queue: _Queue[R, T]) -> None:
        """Wait until an urgent write comes (`_Queue.hurry`) or `linger_s` is over.

        A bare future and a timer: the urgent write wakes the drainer in the next turn
        of the loop (`asyncio.wait_for` on an event takes three, and a task of its own).
        """
        loop = asyncio.get_running_loop()
        wake = queue.wake = loop.create_future()
        timer = loop.call_later(self._linger_s, _wake, wake)
        try:
            await wake
        finally:
            timer.cancel()
            queue.wake = None

    async def _send(self, thread_id: str, batch: list[_Request[R, T]]) -> None:
        try:
            if self._slots is None:
                result = await self._publish(thread_id, [r.item for r in batch])
            else:
                async with self._slots:
                    result = await self._publish(thread_id, [r.item for r in batch])
        except BaseException as exc:
            for request in batch:
                if not request.future.done():
                    request.future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        self.publishes += 1
        self.joined += len(batch) - 1
        for request in batch:
            if not request.future.done():
                request.future.set_result(result)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _consume(future: asyncio.Future[T]) -> None:
    if not future.cancelled():
        future.exception()


def _take(waiting: list[_Request[R, T]]) -> list[_Request[R, T]]:
    """The next publish's requests: the first one, and those after it that join, as
    long as it joins too."""
    first = waiting.pop(0)
    batch = [first]
    if first.joins:
        while waiting and waiting[0].joins:
            batch.append(waiting.pop(0))
    return batch
