"""What a writer remembers of the threads it writes: a cursor per thread (its WAL
position, hot record and the front-end's state), the bounded cache of cursors, and
per-thread locks serialising one instance's writes to a thread.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from buffered_store.engine.entries import H

S = TypeVar("S")
"""What a front-end remembers of a thread at a cursor's seq (e.g. its message snapshot)."""


@dataclass(frozen=True, slots=True)
class Seeded(Generic[H, S]):
    """Where a thread the WAL has never seen stands in the store behind the buffer."""

    seq: int
    """Its stored seq (0: the store does not hold it either)."""
    hot: H | None
    """The hot record to continue from (None when `seq` is 0)."""
    state: S | None
    """The front-end's state of the thread at `seq`."""


@dataclass(slots=True)
class Cursor(Generic[H, S]):
    """What this instance knows of a thread's WAL position."""

    seq: int
    """Highest thread seq known to be in the stream."""
    stream_seq: int
    """Stream seq of the last message on the thread's subject (the CAS expectation)."""
    hot: H | None
    """Hot record at `seq` (what the KV holds, or will once our update lands)."""
    revision: int | None
    """KV revision of the hot key (None: the key does not exist)."""
    state: S | None
    """The front-end's state of the thread at `seq`, when known (None: unknown)."""
    claims: set[str] = field(default_factory=set)
    """Ids the front-end claimed for this thread in KV through this instance (run ids,
    for the thread-run front-end); dropped when the thread is deleted."""
    jump: bool = False
    """The thread's stored seq could not be read: the next entry jumps (see `jump_seq`)."""
    hot_behind: bool = False
    """The KV hot record (at `revision`) is older than `hot`: entries past it were found
    on the subject (a writer's KV update was lost). Readers do not see them yet."""
    state_bytes: int | None = None
    """What `state` weighs (`WriteFormat.state_bytes`; None: not weighed yet)."""
    expires_at: float = 0.0
    """With `max_age_s` set: Unix time from which the thread's oldest entry that may be
    unflushed can expire (0: unknown); the writer checks the thread's entries are all
    still there before writing past it (`Writer.check_retained`)."""


CURSOR_OVERHEAD_BYTES = 1024
"""What a cursor weighs besides its state (hot record, seqs, claims): an estimate."""


class CursorCache(Generic[H, S]):
    """LRU of cursors, one per recently written thread, bounded in threads and in bytes.

    A thread's cursor holds its last snapshot (the state), which can be large: past
    `max_bytes` the least recently used cursors are evicted, and their threads' next
    write loads the cursor again (the slow path: two reads, and a full snapshot instead
    of a delta for `checkpoint`). A cursor whose state alone exceeds the budget is kept
    without its state.
    """

    def __init__(
        self,
        capacity: int,
        *,
        max_bytes: int | None = None,
        weigh: Callable[[S], int] | None = None,
    ) -> None:
        self._items: OrderedDict[str, Cursor[H, S]] = OrderedDict()
        self._capacity = capacity
        self._max_bytes = max_bytes
        self._weigh = weigh
        self._weights: dict[str, int] = {}
        self._pinned: dict[str, int] = {}
        self.held_bytes = 0
        """What the cached cursors weigh now (states plus `CURSOR_OVERHEAD_BYTES` each)."""

    def __len__(self) -> int:
        return len(self._items)

    def get(self, thread_id: str) -> Cursor[H, S] | None:
        """The cursor, marked as recently used."""
        cursor = self._items.get(thread_id)
        if cursor is not None:
            self._items.move_to_end(thread_id)
        return cursor

    def put(self, thread_id: str, cursor: Cursor[H, S]) -> None:
        """Store a cursor, evicting the least recently used ones past the bounds."""
        self.drop(thread_id)
        weight = CURSOR_OVERHEAD_BYTES + self._state_weight(cursor)
        if self._max_bytes is not None and weight > self._max_bytes:
            # Alone above the budget: keep where the thread stands, not what it holds.
            cursor.state = None
            cursor.state_bytes = 0
            weight = CURSOR_OVERHEAD_BYTES
        self._items[thread_id] = cursor
        self._weights[thread_id] = weight
        self.held_bytes += weight
        while len(self._items) > self._capacity or (
            self._max_bytes is not None and self.held_bytes > self._max_bytes
        ):
            victim = next(
                (t for t in self._items if t != thread_id and t not in self._pinned), None
            )
            if victim is None:
                break  # the rest is being written: over the bounds until it is done
            self.drop(victim)

    @contextmanager
    def pinned(self, thread_id: str) -> Iterator[None]:
        """Keep the thread's cursor from eviction while a write to it runs (what the
        write learns on the way, its run claims and a snapshot read back, lives in the
        cursor: evicted between two awaits, the write would start over cold, and under a
        budget many large threads exceed, again and again). `drop` still forgets it.
        Pins nest; `pin` and `unpin` are the same without a context manager."""
        self.pin(thread_id)
        try:
            yield
        finally:
            self.unpin(thread_id)

    def pin(self, thread_id: str) -> None:
        """Start a `pinned` stretch (each `pin` needs its `unpin`)."""
        self._pinned[thread_id] = self._pinned.get(thread_id, 0) + 1

    def unpin(self, thread_id: str) -> None:
        """End a `pinned` stretch."""
        left = self._pinned[thread_id] - 1
        if left:
            self._pinned[thread_id] = left
        else:
            del self._pinned[thread_id]

    def _state_weight(self, cursor: Cursor[H, S]) -> int:
        if self._weigh is None or cursor.state is None:
            return 0
        if cursor.state_bytes is None:
            cursor.state_bytes = self._weigh(cursor.state)
        return cursor.state_bytes

    def drop(self, thread_id: str) -> None:
        """Forget a thread (its next write reloads it from the WAL)."""
        if self._items.pop(thread_id, None) is not None:
            self.held_bytes -= self._weights.pop(thread_id)

    def threads(self) -> list[str]:
        """Threads with a cursor."""
        return list(self._items)

    def behind(self) -> dict[str, Cursor[H, S]]:
        """The cursors whose entry the KV hot record does not show yet (its update queued,
        in flight or failed), by thread; the LRU order is left as it is."""
        return {t: c for t, c in self._items.items() if c.hot_behind}


class ThreadLocks:
    """One lock per thread id, created on demand and dropped when nobody holds it.

    Serialises this instance's own writes to one thread (they would only conflict with
    each other); different threads never wait for each other.
    """

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    async def run(self, thread_id: str, work: Callable[[], Any]) -> Any:
        """Run `work()` (a coroutine factory) holding the thread's lock."""
        lock = self.hold(thread_id)
        try:
            async with lock:
                return await work()
        finally:
            self.release(thread_id)

    def hold(self, thread_id: str) -> asyncio.Lock:
        """The thread's lock, kept until the matching `release` (``async with`` it in
        between): `run` without a coroutine around the work, for the write path."""
        held = self._locks.get(thread_id)
        lock, users = held if held is not None else (asyncio.Lock(), 0)
        self._locks[thread_id] = (lock, users + 1)
        return lock

    def release(self, thread_id: str) -> None:
        """End a `hold`; the lock is dropped when nobody holds it."""
        lock, users = self._locks[thread_id]
        if users == 1:
            del self._locks[thread_id]
        else:
            self._locks[thread_id] = (lock, users - 1)
