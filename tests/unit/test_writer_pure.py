"""Pure parts of the write path: cursor cache, per-thread locks, snapshot bookkeeping."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

from buffered_store.engine.appender import (
    Cursor,
    CursorCache,
    ThreadLocks,
    _advance_snapshot,
    _known_snapshot,
    _merge_recent,
)
from buffered_store.threadrun.entry import EntryKind, HotRecord, WalEntry
from buffered_store.threadrun.records import Thread

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def cursor(seq: int, snapshot: list[bytes] | None) -> Cursor:
    return Cursor(seq=seq, stream_seq=seq, hot=None, revision=None, snapshot=snapshot)


def test_cursor_cache_evicts_least_recently_used() -> None:
    cache = CursorCache(2)
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


def test_known_snapshot_rules() -> None:
    assert _known_snapshot(None, None) == []  # new thread: empty snapshot
    deleted = HotRecord(seq=4, stream_seq=9, thread=None)
    assert _known_snapshot(deleted, None) == []
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
    assert _known_snapshot(live, cursor(4, [b"x"])) == [b"x"]  # our cursor is at that seq
    assert _known_snapshot(live, cursor(3, [b"x"])) is None  # someone wrote since: unknown
    assert _known_snapshot(live, None) is None


def test_advance_snapshot_follows_deltas_and_gives_up_when_unknown() -> None:
    base = WalEntry(thread_id="t", seq=2, kind=EntryKind.CHECKPOINT, at=NOW)
    append = WalEntry(
        thread_id="t", seq=2, kind=EntryKind.CHECKPOINT, at=NOW, keep=1, messages=[b"b"]
    )
    assert _advance_snapshot([b"a"], append) == [b"a", b"b"]
    assert _advance_snapshot(None, append) is None
    assert _advance_snapshot([], append) is None  # keep beyond what we know
    full = WalEntry(thread_id="t", seq=2, kind=EntryKind.CHECKPOINT, at=NOW, messages=[b"z"])
    assert _advance_snapshot(None, full) == [b"z"]
    delete = WalEntry(thread_id="t", seq=3, kind=EntryKind.DELETE, at=NOW)
    assert _advance_snapshot([b"a"], delete) == []
    assert _advance_snapshot([b"a"], base) == []


def test_merge_recent_keeps_newest_window() -> None:
    ours = HotRecord(seq=5, stream_seq=50, thread=None, recent=((4, 40), (5, 50)))
    stored = HotRecord(seq=3, stream_seq=30, thread=None, recent=((2, 20), (3, 30)))
    merged = _merge_recent(ours, stored, window=3)
    assert merged.recent == ((3, 30), (4, 40), (5, 50))
    assert merged.seq == 5
