"""A writer never appends after entries that left the WAL unflushed (issue 25 item 2),
and keeps writing after entries that left it once flushed (trimming), over `MemoryWal`
with a clock of the test's own: no server, no sleep."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from buffered_store import BufferedStoreConfig, InMemoryThreadRunStore
from buffered_store.errors import WalEntriesExpiredError
from buffered_store.testing import MemoryJetStream, make_run, open_memory_store


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 11, 26, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


def chat(n: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"m{i}"} for i in range(n)]


async def test_a_partly_removed_unflushed_thread_refuses_once_its_oldest_entry_may_expire() -> None:
    """With `max_age_s`, a cached cursor checks the thread's entries are still there once
    the oldest unflushed one nears its age limit; gone, the write is refused."""
    clock = Clock()
    server = MemoryJetStream()
    config = BufferedStoreConfig(max_age_s=600.0, duplicate_window_s=60.0, drain_on_close=False)
    store = open_memory_store(InMemoryThreadRunStore(), config, server=server, clock=clock)
    run = make_run("a")
    receipts = [await store.checkpoint("a", chat(n), run) for n in (1, 2, 3)]
    # An operator (or expiry) removes the first two entries, never flushed.
    third = receipts[2].stream_seq
    assert third is not None
    await store.wal.purge_below(third)
    clock.now += timedelta(seconds=30)
    await store.checkpoint("a", chat(4), run)  # far from the age limit: not looked at
    clock.now += timedelta(seconds=600)
    with pytest.raises(WalEntriesExpiredError) as refused:
        await store.checkpoint("a", chat(5), run)
    assert (refused.value.flushed_seq, refused.value.latest_seq) == (0, 4)
    await store.close()


async def test_a_flushed_and_trimmed_thread_takes_new_checkpoints() -> None:
    """Entries that left the stream after their flush are no loss: the writer asks the
    inner store once and continues the thread's seqs, from a cold cursor too."""
    clock = Clock()
    server = MemoryJetStream()
    inner = InMemoryThreadRunStore()
    config = BufferedStoreConfig(max_age_s=600.0, duplicate_window_s=60.0, drain_on_close=False)
    store = open_memory_store(inner, config, server=server, clock=clock)
    run = make_run("b")
    for n in (1, 2, 3):
        await store.checkpoint("b", chat(n), run)
    await store.force_flush("b")
    last = (await store.wal.consumer_state()).last_seq
    await store.wal.purge_below(last + 1)
    clock.now += timedelta(seconds=900)
    assert (await store.checkpoint("b", chat(4), run)).thread_seq == 4
    other = open_memory_store(inner, config, server=server, clock=clock)
    await store.force_flush("b")
    await store.wal.purge_below((await store.wal.consumer_state()).last_seq + 1)
    assert (await other.checkpoint("b", chat(5), run)).thread_seq == 5
    assert await other.load_messages("b") == chat(5)
    await store.close()
    await other.close()
