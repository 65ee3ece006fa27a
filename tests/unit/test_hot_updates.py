"""Hot records advanced in the background (`HotUpdates`) and the one timer their lingers
share (`LingerQueue`): updates due around the same moment start together, a write made
while its thread's update is in flight gets an update of its own, and `settled` cuts
every linger short."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from buffered_store.engine.appender import Writer
from buffered_store.engine.cursors import Cursor
from buffered_store.engine.hotupdates import HotUpdates, LingerQueue
from tests.plugins.waiting import eventually


def test_a_linger_queue_hands_out_the_threads_due_within_the_slack_in_order() -> None:
    queue = LingerQueue(1.0, 0.5)
    queue.add("a", 10.0)
    queue.add("b", 10.2)
    queue.add("a", 10.3)  # already waiting: its linger still ends at 11.0
    queue.add("c", 10.6)
    assert queue.next_end() == 11.0
    assert queue.take(10.4) == []  # nobody's linger ends by 10.9
    assert queue.take(11.0) == ["a", "b"]  # a's is over, b's ends at 11.2: one timer
    assert "c" in queue  # ends at 11.6, past 11.5
    assert "a" not in queue
    assert queue.next_end() == 11.6
    queue.add("a", 11.1)
    assert queue.take_all() == ["c", "a"]
    assert len(queue) == 0
    assert queue.next_end() is None
    assert queue.take(99.0) == []


class FakeWriter:
    """What `HotUpdates` uses of a `Writer`: `advance_hot` (here recording each record's
    seq and the timer tick it was started in) and the cursor cache."""

    def __init__(self) -> None:
        self.written: list[tuple[str, int]] = []
        self.gate: asyncio.Event | None = None
        self.cursors: dict[str, Cursor[Any, Any]] = {}

    async def advance_hot(self, thread_id: str, record: Any, revision: int | None) -> int:
        if self.gate is not None:
            await self.gate.wait()
        self.written.append((thread_id, record))
        return len(self.written)


def cursor(seq: int) -> Cursor[Any, Any]:
    return Cursor(seq=seq, stream_seq=seq, hot=seq, revision=None, state=None)


def hot_updates(writer: FakeWriter, linger_s: float) -> HotUpdates[Any, Any]:
    return HotUpdates(cast(Writer[Any, Any, Any], writer), linger_s=linger_s)


async def test_updates_due_within_half_a_linger_start_on_one_timer() -> None:
    writer = FakeWriter()
    updates = hot_updates(writer, 1.0)
    ticks = 0
    tick = updates._tick

    def counted() -> None:
        nonlocal ticks
        ticks += 1
        tick()

    updates._tick = counted  # type: ignore[method-assign]
    updates.submit("a", cursor(1))
    await asyncio.sleep(0.05)
    updates.submit("b", cursor(1))  # its own linger would end 0.05 s after a's
    assert updates.pending("a")
    assert updates.pending("b")
    assert writer.written == []
    await eventually(lambda: len(writer.written) == 2)
    assert ticks == 1
    assert sorted(writer.written) == [("a", 1), ("b", 1)]
    assert not updates.pending("a")
    assert not updates.pending("b")
    await updates.close(5)


async def test_a_write_made_while_its_update_is_in_flight_gets_an_update_of_its_own() -> None:
    writer = FakeWriter()
    writer.gate = asyncio.Event()
    updates = hot_updates(writer, 0.05)
    updates.submit("a", cursor(1))
    await eventually(lambda: "a" in updates._running)  # the first update is in flight
    updates.submit("a", cursor(2))
    updates.submit("a", cursor(3))  # shares the next update with seq 2
    writer.gate.set()
    await eventually(lambda: len(writer.written) == 2)
    assert writer.written == [("a", 1), ("a", 3)]
    assert updates.updates == 2
    assert updates.coalesced == 1
    await eventually(lambda: not updates.pending("a"))
    await updates.close(5)


async def test_settled_starts_every_lingering_update_at_once() -> None:
    writer = FakeWriter()
    updates = hot_updates(writer, 30.0)
    for thread in ("a", "b", "c"):
        updates.submit(thread, cursor(7))
    await asyncio.sleep(0.02)
    assert writer.written == []
    await asyncio.wait_for(updates.settled(), 5)  # a 30 s linger would outlast this
    assert sorted(writer.written) == [("a", 7), ("b", 7), ("c", 7)]
    updates.submit("a", cursor(8))
    await asyncio.wait_for(updates.close(5), 5)  # closing cuts it short too
    assert writer.written[-1] == ("a", 8)
    updates.submit("b", cursor(9))  # closed: nothing more is written
    await asyncio.sleep(0.02)
    assert len(writer.written) == 4
    assert not updates.pending("b")
