"""Flushing WAL entries into the inner store: watermarks, redelivery, deletes, force_flush.

Runs against the in-memory store and Postgres alike (the `inner` fixture). Entries are
read back from the real stream and handed to `FlushTarget.apply` the way a flusher that
got them redelivered or out of order would (invariants 7, 9, 11, 14).
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from buffered_store.engine.flushing import ApplyStatus
from buffered_store.engine.threadlog import ThreadLog
from buffered_store.errors import DatabaseUnavailableError, FlushTimeoutError, StoreError
from buffered_store.model.changes import (
    WalEntry,
)
from buffered_store.model.records import Message, RunRecord
from buffered_store.stores.memory import InMemoryThreadRunStore
from buffered_store.testing import FaultyFlushTarget, InnerStore, make_messages, make_run
from buffered_store.threadrun.entry import (
    FORMAT,
)
from buffered_store.threadrun.store import BufferedThreadRunStore
from tests.plugins.stores import StoreFactory


def tid(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


async def wal_entries(store: BufferedThreadRunStore, thread_id: str, upto: int) -> list[WalEntry]:
    """Entries 1..upto of a thread, read back from the stream."""
    log = ThreadLog(store.wal, store.config, FORMAT)
    hot = await log.hot(thread_id)
    return await log.entries_between(thread_id, 0, upto, hot.record if hot else None)


async def assert_state(
    inner: InnerStore,
    thread_id: str,
    *,
    seq: int,
    messages: list[Message] | None,
    latest: RunRecord | None,
) -> None:
    """The inner store holds exactly this state of the thread at watermark `seq`."""
    assert (await inner.flushed_seqs([thread_id]))[thread_id] == seq
    assert await inner.load_messages(thread_id) == messages
    assert await inner.latest_run(thread_id) == latest


# -- stale, duplicated and reordered entries ---------------------------------------------


async def test_redelivered_and_reordered_entries_never_move_a_thread_backwards(
    store: BufferedThreadRunStore, inner: InnerStore
) -> None:
    """Invariant 7: entries above the watermark apply in seq order whatever order they come
    in; a batch starting after a hole writes nothing (GAP); entries at or below the
    watermark (redelivered, duplicated, late) change nothing: not the messages, not the
    run versions, not the watermark."""
    thread = tid()
    run = make_run(thread)
    newer = make_run(thread)
    await store.checkpoint(thread, make_messages(2), run)
    await store.checkpoint(thread, make_messages(6), run.replace(steps=2))
    await store.checkpoint(thread, make_messages(3, start=40), newer)
    e1, e2, e3 = await wal_entries(store, thread, 3)

    [gap] = await inner.apply([[e3]])
    assert gap.status is ApplyStatus.GAP
    assert gap.missing_from == 1
    assert await inner.load_thread(thread) is None

    [applied] = await inner.apply([[e3, e1, e2]])
    assert (applied.status, applied.flushed_seq) == (ApplyStatus.APPLIED, 3)
    for late in ([e2], [e1], [e2, e1], [e1, e2, e3], [e3]):
        [outcome] = await inner.apply([late])
        assert (outcome.status, outcome.flushed_seq) == (ApplyStatus.STALE, 3), late
    await assert_state(inner, thread, seq=3, messages=make_messages(3, start=40), latest=newer)
    assert await inner.load_run(run.run_id) == run.replace(steps=2)
    assert await store.load_messages(thread) == make_messages(3, start=40)


async def test_late_entries_of_an_earlier_flush_are_skipped(
    store: BufferedThreadRunStore, inner: InnerStore
) -> None:
    """Seq 3 flushed first (by force_flush), then seqs 2 and 1 are redelivered one by one:
    each is acknowledged as stale and the thread stays at seq 3."""
    thread = tid()
    run = make_run(thread)
    for n in (1, 2, 3):
        await store.checkpoint(thread, make_messages(n), run.replace(steps=n))
    assert await store.force_flush(thread) == 3
    e1, e2, _ = await wal_entries(store, thread, 3)
    for late in (e2, e1):
        [outcome] = await inner.apply([[late]])
        assert outcome.status is ApplyStatus.STALE
    await assert_state(inner, thread, seq=3, messages=make_messages(3), latest=run.replace(steps=3))


async def test_concurrent_applies_of_overlapping_batches_end_at_the_newest(
    store: BufferedThreadRunStore, inner: InnerStore
) -> None:
    """Two flushers applying overlapping batches of one thread at the same time: whatever
    the interleaving, the thread ends at the highest seq, written once."""
    threads = [tid() for _ in range(8)]
    batches: list[tuple[list[WalEntry], list[WalEntry]]] = []
    for thread in threads:
        run = make_run(thread)
        for n in (1, 2, 3):
            await store.checkpoint(thread, make_messages(n * 2), run.replace(steps=n))
        e1, e2, e3 = await wal_entries(store, thread, 3)
        batches.append(([e1, e2, e3], [e1, e2]))
    results = await asyncio.gather(
        *(inner.apply([full]) for full, _ in batches),
        *(inner.apply([part]) for _, part in batches),
    )
    assert all(o.status is not ApplyStatus.FAILED for [o] in results)
    for thread in threads:
        await store.force_flush(thread)
        latest = await inner.latest_run(thread)
        assert latest is not None
        assert latest.steps == 3
        assert await inner.load_messages(thread) == make_messages(6)
        assert (await inner.flushed_seqs([thread]))[thread] == 3


# -- deletes -------------------------------------------------------------------------------


async def test_delete_then_recreate_continues_seqs_and_old_entries_stay_dead(
    store: BufferedThreadRunStore, inner: InnerStore
) -> None:
    """Invariant 11: a thread deleted and recreated continues its seqs after the delete;
    redelivering the pre-delete entries (or the delete) changes nothing."""
    thread = tid()
    old_run, new_run = make_run(thread), make_run(thread)
    await store.checkpoint(thread, make_messages(2), old_run)
    await store.checkpoint(thread, make_messages(4), old_run)
    assert await store.force_flush(thread) == 2
    await store.delete_thread(thread)
    receipt = await store.checkpoint(thread, make_messages(1, start=70), new_run)
    assert receipt.thread_seq == 4

    assert await store.load_messages(thread) == make_messages(1, start=70)
    assert await store.load_run(old_run.run_id) is None
    assert await store.force_flush(thread) == 4
    await assert_state(inner, thread, seq=4, messages=make_messages(1, start=70), latest=new_run)

    e1, e2, delete, _ = await wal_entries(store, thread, 4)
    for late in ([e1], [e2], [e1, e2], [delete], [e1, e2, delete]):
        [outcome] = await inner.apply([late])
        assert outcome.status is ApplyStatus.STALE
    await assert_state(inner, thread, seq=4, messages=make_messages(1, start=70), latest=new_run)
    assert await inner.load_run(old_run.run_id) is None
    assert [r.run_id for r in await inner.list_runs(thread)] == [new_run.run_id]


@pytest.mark.parametrize("flushed_before_delete", [True, False])
async def test_redelivered_entries_do_not_resurrect_a_deleted_thread(
    store: BufferedThreadRunStore, inner: InnerStore, flushed_before_delete: bool
) -> None:
    """A deleted thread stays deleted (tombstone keeps the watermark) when its old entries
    come again, whether or not they had been flushed before the delete."""
    thread = tid()
    run = make_run(thread)
    await store.checkpoint(thread, make_messages(2), run)
    await store.checkpoint(thread, make_messages(3), run)
    if flushed_before_delete:
        await store.force_flush(thread)
    await store.delete_thread(thread)
    assert await store.load_thread(thread) is None
    assert await store.force_flush(thread) == 3
    e1, e2, _ = await wal_entries(store, thread, 3)
    for late in ([e1], [e2], [e1, e2]):
        [outcome] = await inner.apply([late])
        assert outcome.status is ApplyStatus.STALE
    assert (await inner.flushed_seqs([thread]))[thread] == 3
    assert await inner.load_thread(thread) is None
    assert await inner.load_messages(thread) is None
    assert await inner.load_run(run.run_id) is None
    assert await inner.list_threads() == []
    assert await store.load_thread(thread) is None
    assert (await store.checkpoint(thread, make_messages(1), run)).thread_seq == 4


# -- force_flush and flush_status -------------------------------------------------------------


async def test_force_flush_without_any_flusher_and_flush_status(
    open_store: StoreFactory, inner: InnerStore
) -> None:
    """force_flush applies every acknowledged checkpoint itself (coalesced into one
    application), returns the flushed seq, and flush_status counts what is pending, on
    the writing instance and on another one."""
    spy = FaultyFlushTarget(inner)
    store = await open_store(spy, drain_on_close=False)
    other = await open_store(inner, drain_on_close=False)  # another process, same database
    thread = tid()
    run = make_run(thread)
    for n in range(1, 11):
        await store.checkpoint(thread, make_messages(n), run.replace(steps=n))
    for instance in (store, other):
        status = await instance.flush_status(thread)
        assert (status.latest_seq, status.flushed_seq, status.pending) == (10, 0, 10)

    assert await store.force_flush(thread) == 10
    assert spy.forwarded_applies == 1
    await assert_state(
        inner, thread, seq=10, messages=make_messages(10), latest=run.replace(steps=10)
    )
    status = await store.flush_status(thread)
    assert (status.latest_seq, status.flushed_seq, status.pending) == (10, 10, 0)

    await store.checkpoint(thread, make_messages(11), run)
    assert (await other.flush_status(thread)).pending == 1
    assert await store.force_flush(thread) == 11
    assert await store.force_flush(thread) == 11
    assert spy.forwarded_applies == 2
    assert await store.force_flush(tid("unknown")) == 0
    unknown = await store.flush_status(tid("unknown"))
    assert (unknown.latest_seq, unknown.flushed_seq, unknown.pending) == (0, 0, 0)


async def test_force_flush_all_flushes_every_pending_thread(
    open_store: StoreFactory, inner: InnerStore
) -> None:
    """8 threads x 5 checkpoints: one force_flush_all leaves each with its latest run and
    snapshot, with fewer applications than checkpoints."""
    spy = FaultyFlushTarget(inner)
    store = await open_store(spy, drain_on_close=False)
    runs = {thread: make_run(thread) for thread in [tid() for _ in range(8)]}
    for n in range(1, 6):
        for thread, run in runs.items():
            await store.checkpoint(thread, make_messages(n), run.replace(steps=n))
    assert await store.force_flush_all() == 8
    assert spy.forwarded_applies < 40
    for thread, run in runs.items():
        await assert_state(
            inner, thread, seq=5, messages=make_messages(5), latest=run.replace(steps=5)
        )
        assert (await store.flush_status(thread)).pending == 0


async def test_force_flush_times_out_naming_the_thread(
    open_store: StoreFactory, inner: InnerStore
) -> None:
    """An inner store that never returns: force_flush raises FlushTimeoutError naming the
    thread after its timeout (not before, not much later), and works once it answers."""
    faulty = FaultyFlushTarget(inner)
    store = await open_store(faulty, drain_on_close=False)
    thread = tid()
    await store.checkpoint(thread, make_messages(2), make_run(thread))
    faulty.block_applies()
    started = time.monotonic()
    with pytest.raises(FlushTimeoutError) as caught:
        await store.force_flush(thread, timeout=0.5)
    elapsed = time.monotonic() - started
    assert 0.5 <= elapsed < 2.5, elapsed
    assert caught.value.thread_id == thread
    assert thread in str(caught.value)
    assert caught.value.retriable
    assert faulty.blocked_applies == 0, "the timed-out apply is still parked"
    assert await inner.load_messages(thread) is None
    assert (await store.flush_status(thread)).pending == 1

    faulty.unblock_applies()
    assert await store.force_flush(thread, timeout=5) == 1
    assert await inner.load_messages(thread) == make_messages(2)


async def test_force_flush_reports_an_unreachable_database_and_lands_later(
    open_store: StoreFactory, inner: InnerStore
) -> None:
    """The inner store raises DatabaseUnavailableError: force_flush fails with a retriable
    StoreError, nothing is marked flushed, and the next force_flush lands everything."""
    faulty = FaultyFlushTarget(inner)
    store = await open_store(faulty, drain_on_close=False)
    thread = tid()
    run = make_run(thread)
    await store.checkpoint(thread, make_messages(2), run)
    faulty.fail_next_applies(1)
    with pytest.raises(StoreError) as caught:
        await store.force_flush(thread)
    assert isinstance(caught.value, DatabaseUnavailableError) or caught.value.retriable
    assert (await store.flush_status(thread)).flushed_seq == 0
    await store.checkpoint(thread, make_messages(3), run)
    assert await store.force_flush(thread) == 2
    await assert_state(inner, thread, seq=2, messages=make_messages(3), latest=run)


async def test_twenty_concurrent_checkpoints_flush_to_the_highest_seq(
    open_store: StoreFactory, inner: InnerStore
) -> None:
    """20 concurrent checkpoints on one thread from two instances: seqs are 1..20, and
    the flushed state is the snapshot and run of the entry with seq 20 (no mixing)."""
    one = await open_store(inner, drain_on_close=False)
    two = await open_store(InMemoryThreadRunStore(), drain_on_close=False)
    thread = tid()
    snapshots = {i: make_messages(1 + i % 7, start=100 * i) for i in range(20)}
    runs = {i: make_run(thread, run_id=f"run-{i}-{uuid.uuid4().hex[:6]}") for i in range(20)}
    receipts = await asyncio.gather(
        *((one if i % 2 else two).checkpoint(thread, snapshots[i], runs[i]) for i in range(20))
    )
    by_seq = {r.thread_seq: i for i, r in enumerate(receipts)}
    assert sorted(by_seq) == list(range(1, 21))
    last = by_seq[20]
    assert await two.load_messages(thread) == snapshots[last]
    assert await one.force_flush(thread) == 20
    await assert_state(inner, thread, seq=20, messages=snapshots[last], latest=runs[last])
