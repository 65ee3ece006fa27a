"""Pure parts of the write path: cursor cache, per-thread locks, snapshot bookkeeping."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

from buffered_store.engine.cursors import Cursor, CursorCache, ThreadLocks
from buffered_store.engine.entries import RecentSeqs
from buffered_store.engine.hotupdates import merged_recent
from buffered_store.model.changes import (
    EntryKind,
    WalEntry,
)
from buffered_store.model.records import Thread
from buffered_store.threadrun.entry import (
    FORMAT,
    HotRecord,
)

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def cursor(seq: int, snapshot: list[bytes] | None) -> Cursor[HotRecord, list[bytes]]:
    return Cursor(seq=seq, stream_seq=seq, hot=None, revision=None, state=snapshot)


def test_cursor_cache_evicts_least_recently_used() -> None:
    cache: CursorCache[HotRecord, list[bytes]] = CursorCache(2)
    cache.put("a", cursor(1, []))
    cache.put("b", cursor(1, []))
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("c", cursor(1, []))
    assert cache.get("b") is None
    assert sorted(cache.threads()) == ["a", "c"]
    cache.drop("a")
    assert cache.threads() == ["c"]


async def test_thread_locks_serialise_one_thread_but_not_others() -> None:
    locks = ThreadLocks()
    order: list[str] = []
    release = asyncio.Event()

    async def slow() -> None:
        order.append("a1-start")
        await release.wait()
        order.append("a1-end")

    async def fast_same() -> None:
        order.append("a2")

    async def other_thread() -> None:
        order.append("b")

    first = asyncio.create_task(locks.run("a", slow))
    await asyncio.sleep(0)
    second = asyncio.create_task(locks.run("a", fast_same))
    await locks.run("b", other_thread)  # must not wait for thread a
    assert order == ["a1-start", "b"]
    release.set()
    await asyncio.gather(first, second)
    assert order == ["a1-start", "b", "a1-end", "a2"]
    assert locks._locks == {}  # released locks are dropped


async def test_thread_locks_held_without_run_share_one_lock_until_the_last_release() -> None:
    """The write path holds a thread's lock inline (`hold`/`release`, no coroutine of
    its own): holders of one thread share a lock, which is dropped with the last
    release, also when the holder's work failed."""
    locks = ThreadLocks()
    first = locks.hold("a")
    second = locks.hold("a")
    assert first is second
    assert locks.hold("b") is not first
    locks.release("b")

    async def fails() -> None:
        raise RuntimeError("the work failed")

    async with first:
        waiting = asyncio.create_task(locks.run("a", fails))  # a third holder
        await asyncio.sleep(0)
        assert not waiting.done()  # it waits for the lock held above
    locks.release("a")
    with pytest.raises(RuntimeError, match="the work failed"):
        await waiting
    assert "a" in locks._locks  # `second` still holds it
    locks.release("a")
    assert locks._locks == {}


def test_known_snapshot_rules() -> None:
    assert FORMAT.known_state(None, None) == []  # new thread: empty snapshot
    deleted = HotRecord(seq=4, stream_seq=9, thread=None)
    assert FORMAT.known_state(deleted, None) == []
    summary = Thread(
        thread_id="t",
        parent_thread_id=None,
        metadata={},
        created_at=NOW,
        updated_at=NOW,
        latest_run_id=None,
        message_count=1,
    )
    live = HotRecord(seq=4, stream_seq=9, thread=summary)
    assert FORMAT.known_state(live, [b"x"]) == [b"x"]  # a cursor at that seq knows it
    assert FORMAT.known_state(live, None) is None  # nobody does


def test_advance_snapshot_follows_deltas_and_gives_up_when_unknown() -> None:
    base = WalEntry(thread_id="t", seq=2, kind=EntryKind.CHECKPOINT, at=NOW)
    append = WalEntry(
        thread_id="t", seq=2, kind=EntryKind.CHECKPOINT, at=NOW, keep=1, messages=[b"b"]
    )
    assert FORMAT.state_after([b"a"], append, owned=False) == [b"a", b"b"]
    assert FORMAT.state_after(None, append, owned=False) is None
    assert FORMAT.state_after([], append, owned=False) is None  # keep beyond what we know
    full = WalEntry(thread_id="t", seq=2, kind=EntryKind.CHECKPOINT, at=NOW, messages=[b"z"])
    assert FORMAT.state_after(None, full, owned=False) == [b"z"]
    delete = WalEntry(thread_id="t", seq=3, kind=EntryKind.DELETE, at=NOW)
    assert FORMAT.state_after([b"a"], delete, owned=False) == []
    assert FORMAT.state_after([b"a"], base, owned=False) == []


def test_merge_recent_keeps_newest_window() -> None:
    ours = HotRecord(seq=5, stream_seq=50, thread=None, recent=RecentSeqs(((4, 40), (5, 50))))
    stored = HotRecord(seq=3, stream_seq=30, thread=None, recent=RecentSeqs(((2, 20), (3, 30))))
    merged = FORMAT.with_recent(ours, merged_recent(ours.recent, stored.recent, window=3))
    assert merged.recent == ((3, 30), (4, 40), (5, 50))
    assert merged.seq == 5


def test_an_owned_snapshot_is_extended_in_place_and_a_shared_one_copied() -> None:
    append = WalEntry(
        thread_id="t", seq=2, kind=EntryKind.CHECKPOINT, at=NOW, keep=1, messages=[b"b"]
    )
    shared = [b"a"]
    assert FORMAT.state_after(shared, append, owned=False) == [b"a", b"b"]
    assert shared == [b"a"]
    owned = [b"a"]
    assert FORMAT.state_after(owned, append, owned=True) is owned
    assert owned == [b"a", b"b"]
