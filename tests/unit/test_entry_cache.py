"""`EntryCache`: the entries a process appended, kept for its own reads, bounded in bytes
and per thread."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from buffered_store.engine.threadlog import EntryCache


@dataclass(frozen=True)
class E:
    """The engine's entry header, nothing more."""

    thread_id: str
    seq: int
    at: datetime = datetime(2026, 1, 1, tzinfo=UTC)
    writer: str = ""
    jump: bool = False
    deletes: bool = False
    stream_seq: int = 0


def test_found_returns_the_range_asked() -> None:
    cache: EntryCache[E] = EntryCache(max_bytes=1000)
    for seq in range(1, 6):
        cache.put("t", E("t", seq), 10)
    assert sorted(cache.found("t", 2, 4)) == [3, 4]
    assert cache.found("other", 0, 9) == {}
    assert cache.bytes == 50


def test_each_thread_keeps_its_newest_entries_only() -> None:
    cache: EntryCache[E] = EntryCache(max_bytes=10_000, per_thread=3)
    for seq in range(1, 8):
        cache.put("t", E("t", seq), 10)
    assert sorted(cache.found("t", 0, 99)) == [5, 6, 7]
    assert cache.bytes == 30


def test_bytes_are_bounded_by_dropping_the_least_recently_written_threads() -> None:
    cache: EntryCache[E] = EntryCache(max_bytes=100)
    cache.put("old", E("old", 1), 40)
    cache.put("new", E("new", 1), 40)
    cache.put("old", E("old", 2), 10)  # "old" written again: now the newest
    cache.put("third", E("third", 1), 40)
    assert cache.found("new", 0, 9) == {}
    assert sorted(cache.found("old", 0, 9)) == [1, 2]
    assert cache.bytes == 90
    cache.put("huge", E("huge", 1), 101)  # larger than the whole cache: not kept
    assert cache.found("huge", 0, 9) == {}
    cache.drop("old")
    assert cache.bytes == 40


def test_a_zero_budget_keeps_nothing() -> None:
    cache: EntryCache[E] = EntryCache(max_bytes=0)
    cache.put("t", E("t", 1), 1)
    assert cache.found("t", 0, 9) == {}
