"""`ThreadLog.entries_between` walking a thread's subject when the hot record's window
does not reach the watermark (a flusher far behind, a gap after a node kill): the walk
starts at the flusher consumer's ack floor, so it costs the thread's unflushed entries
(a few direct gets, then one scan), not its whole history. In memory: requests counted
as `NatsWal` sends them."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

from buffered_store.config import BufferedStoreConfig
from buffered_store.engine.keys import wal_subject
from buffered_store.engine.threadlog import WALK_DIRECT_GETS, ThreadLog
from buffered_store.model.changes import WalEntry
from buffered_store.testing import MemoryJetStream, MemoryWal, make_entries
from buffered_store.threadrun.entry import FORMAT, HotRecord, encode_entry

T0 = datetime(2026, 1, 1, tzinfo=UTC)
CONFIG = BufferedStoreConfig(stream_name="WALK")
FLUSHED = 300
"""Entries of the thread already flushed, and acknowledged, before the gap."""
PENDING = 6
"""Entries above the watermark, never acknowledged."""


async def stream_with_a_flushed_history(
    *, settle_pending: bool
) -> tuple[MemoryWal, ThreadLog[WalEntry, HotRecord], list[WalEntry]]:
    """One thread's entries in the stream among another thread's; the consumer has
    settled the first `FLUSHED` of them (and the pending ones too with `settle_pending`,
    as terminating a quarantined thread's messages does)."""
    wal = MemoryWal(CONFIG, MemoryJetStream())
    entries = make_entries("t", FLUSHED + PENDING, now=T0)
    noise = make_entries("other", FLUSHED + PENDING, now=T0)
    stored: list[WalEntry] = []
    for i, (entry, other) in enumerate(zip(entries, noise, strict=True)):
        for e in (other, entry):
            seq, _ = await wal.publish(
                wal_subject(CONFIG.stream_name, e.thread_id),
                encode_entry(e),
                msg_id=f"{e.thread_id}-{e.seq}",
                expected_last_subject_seq=0 if i == 0 else (i - 1) * 2 + 1 + (e is entry),
            )
            if e is entry:
                stored.append(dataclasses.replace(entry, stream_seq=seq))
    delivery = await wal.subscribe()
    settle_upto = stored[-1 if settle_pending else FLUSHED - 1].stream_seq
    for msg in await delivery.fetch(10 * (FLUSHED + PENDING), 0):
        if msg.stream_seq <= settle_upto:
            await msg.ack()
    return wal, ThreadLog(wal, CONFIG, FORMAT), stored


async def test_a_gap_far_behind_the_hot_window_walks_from_the_ack_floor() -> None:
    wal, log, stored = await stream_with_a_flushed_history(settle_pending=False)
    wal.requests = 0
    found = await log.entries_between("t", FLUSHED, FLUSHED + PENDING, None)
    assert [e.seq for e in found] == list(range(FLUSHED + 1, FLUSHED + PENDING + 1))
    assert [e.stream_seq for e in found] == [e.stream_seq for e in stored[FLUSHED:]]
    # The consumer's state (two requests), then the walk from the ack floor: its first
    # entries one direct get each, the rest in one scan (a consumer made and deleted).
    # Not the whole history (300 more entries), as a walk from the stream's start.
    assert PENDING > WALK_DIRECT_GETS
    assert wal.requests == 2 + WALK_DIRECT_GETS + 2


async def test_entries_settled_without_a_flush_are_still_found_from_the_start() -> None:
    wal, log, stored = await stream_with_a_flushed_history(settle_pending=True)
    wal.requests = 0
    found = await log.entries_between("t", FLUSHED, FLUSHED + PENDING, None)
    assert [e.seq for e in found] == list(range(FLUSHED + 1, FLUSHED + PENDING + 1))
    assert [e.stream_seq for e in found] == [e.stream_seq for e in stored[FLUSHED:]]
    # Nothing above the floor continues it (one get finds nothing there), so the whole
    # subject decides: its first entries one get each, then all the rest in one scan,
    # where a get per entry took over 300 requests.
    assert wal.requests == 2 + 1 + WALK_DIRECT_GETS + 2


async def test_without_a_flusher_consumer_the_walk_starts_at_the_stream_start() -> None:
    wal, log, stored = await stream_with_a_flushed_history(settle_pending=False)
    assert wal.delete_consumer()
    found = await log.entries_between("t", FLUSHED, FLUSHED + PENDING, None)
    assert [e.stream_seq for e in found] == [e.stream_seq for e in stored[FLUSHED:]]
