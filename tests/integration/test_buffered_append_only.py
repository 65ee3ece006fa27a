"""Append-only deltas (invariant 6): WAL bytes and Postgres rows per checkpoint are
O(new messages), and a thread larger than the NATS max_payload keeps growing by appending,
also from a cold instance that never saw its snapshot."""

from __future__ import annotations

import uuid

import pytest

from buffered_store.engine.keys import wal_subject
from buffered_store.errors import PayloadTooLargeError
from buffered_store.testing import make_messages, make_run
from tests.plugins.stores import InnerPair, RowsReader, StoreFactory, SubjectCounter

MESSAGE_SIZE = 1000
"""Content length of each message: about 1 KiB on the wire."""
TOTAL = 2000
MAX_DELTA_BYTES = 4096
"""Upper bound of a WAL entry appending 1-2 such messages (entry header and run included)."""


def tid(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


async def test_append_only_thread_grows_past_one_mib_with_small_entries(
    open_store: StoreFactory,
    inner_pair: InnerPair,
    message_rows: RowsReader,
    request: pytest.FixtureRequest,
) -> None:
    """2,000 messages of ~1 KiB, appended 1-2 per checkpoint:

    - every checkpoint after the first costs under 4 KiB of WAL, late ones as little as
      early ones (no growth with history), and the whole history fits although it is
      twice the 1 MiB max_payload;
    - a flush halfway writes the first half; the final flush writes only new rows: rows
      of the first half are not rewritten (same xmin, same thread_seq) over Postgres;
    - a cold instance (new store object, new connections) appends to the >1 MiB thread
      with a small delta, and the original writer continues after it.
    """
    inner, other_inner = inner_pair
    over_postgres = "postgres" in request.node.callspec.id
    rows = message_rows if over_postgres else None
    store = await open_store(inner, drain_on_close=False)
    thread = tid()
    run = make_run(thread)
    history = make_messages(TOTAL, size=MESSAGE_SIZE)

    count, step, costs = 0, 0, []
    half_rows: list[tuple[int, int, str]] = []
    half_seq = 0
    while count < TOTAL - 4:
        step += 1
        count = min(count + 1 + step % 2, TOTAL - 4)
        before = store.stats()["wal_bytes"]
        receipt = await store.checkpoint(thread, history[:count], run)
        costs.append(store.stats()["wal_bytes"] - before)
        if not half_seq and count >= TOTAL // 2:
            half_seq = await store.force_flush(thread)
            assert half_seq == receipt.thread_seq
            if rows is not None:
                half_rows = await rows(thread)
                assert len(half_rows) == count
    assert receipt.thread_seq == step
    assert max(costs[1:]) <= MAX_DELTA_BYTES, max(costs[1:])
    early, late = sum(costs[10:30]), sum(costs[-20:])
    assert late <= early * 1.1, (early, late)
    # Quadratic growth would be ~1000x this: each message is sent about once.
    assert sum(costs) < TOTAL * (MESSAGE_SIZE + 50) + len(costs) * 1024

    cold = await open_store(other_inner, drain_on_close=False)
    cold_receipt = await cold.checkpoint(thread, history[: TOTAL - 2], run.replace(steps=1))
    assert cold_receipt.thread_seq == step + 1
    assert 0 < cold.stats()["wal_bytes"] <= MAX_DELTA_BYTES
    before = store.stats()["wal_bytes"]
    final = await store.checkpoint(thread, history, run.replace(steps=2))
    assert final.thread_seq == step + 2
    assert store.stats()["wal_bytes"] - before <= MAX_DELTA_BYTES
    assert await cold.load_messages(thread) == history

    assert await cold.force_flush(thread) == step + 2
    assert await other_inner.load_messages(thread) == history
    loaded = await other_inner.load_thread(thread)
    assert loaded is not None
    assert loaded.message_count == TOTAL
    if rows is not None:
        after = await rows(thread)
        assert len(after) == TOTAL
        assert after[: len(half_rows)] == half_rows, "the final flush rewrote old rows"
        assert all(seq > half_seq for _, seq, _ in after[len(half_rows) :])


async def test_a_snapshot_too_large_for_one_wal_entry_is_refused_and_nothing_written(
    open_store: StoreFactory, inner_pair: InnerPair, subject_counts: SubjectCounter
) -> None:
    """A checkpoint whose own new content exceeds the server's max_payload fails with
    PayloadTooLargeError, on a new thread and on an existing one: the WAL, the hot record
    and the seqs are untouched, and the thread keeps working."""
    inner, _ = inner_pair
    store = await open_store(inner, drain_on_close=False)
    huge = {"role": "user", "content": "x" * (1536 * 1024)}

    fresh = tid("fresh")
    with pytest.raises(PayloadTooLargeError):
        await store.checkpoint(fresh, [huge], make_run(fresh))
    assert await store.load_thread(fresh) is None
    assert (await store.flush_status(fresh)).latest_seq == 0

    thread = tid()
    run = make_run(thread)
    await store.checkpoint(thread, make_messages(2), run)
    bytes_before = store.stats()["wal_bytes"]
    with pytest.raises(PayloadTooLargeError):
        await store.checkpoint(thread, [*make_messages(2), huge], run)
    assert store.stats()["wal_bytes"] == bytes_before
    assert await store.load_messages(thread) == make_messages(2)
    counts = await subject_counts(store)
    assert wal_subject(store.config.stream_name, fresh) not in counts
    assert counts[wal_subject(store.config.stream_name, thread)] == 1
    assert (await store.checkpoint(thread, make_messages(3), run)).thread_seq == 2
    assert await store.force_flush(thread) == 2
    assert await inner.load_messages(thread) == make_messages(3)


async def test_appends_from_two_instances_send_only_new_messages(
    open_store: StoreFactory, inner_pair: InnerPair
) -> None:
    """`append` entries carry only the new messages, whatever the history and whichever
    instance writes: a cold instance appends on top of the other's latest entry (learnt
    from the hot record, without the snapshot), and the warm one continues after it
    through the per-thread compare-and-set."""
    inner, other_inner = inner_pair
    store = await open_store(inner, drain_on_close=False)
    thread = tid()
    run = make_run(thread)
    history = make_messages(600, size=MESSAGE_SIZE)
    await store.checkpoint(thread, history[:400], run)
    costs = []
    for index in range(400, 598):
        before = store.stats()["wal_bytes"]
        await store.append(thread, history[index : index + 1], run)
        costs.append(store.stats()["wal_bytes"] - before)
    assert max(costs) <= MAX_DELTA_BYTES
    assert costs[-1] <= costs[0] + 16  # seq digits aside, no growth with the history

    cold = await open_store(other_inner, drain_on_close=False)
    receipt = await cold.append(thread, history[598:599], run.replace(steps=1))
    assert receipt.thread_seq == 200
    assert 0 < cold.stats()["wal_bytes"] <= MAX_DELTA_BYTES
    # The warm instance's cursor is stale now: its append conflicts, reloads and lands after.
    final = await store.append(thread, history[599:], run.replace(steps=2))
    assert final.thread_seq == 201
    assert await cold.load_messages(thread) == history
    assert await store.force_flush(thread) == 201
    assert await inner.load_messages(thread) == history


async def test_restarted_writers_prove_the_stored_snapshot_and_send_deltas(
    open_store: StoreFactory, inner_pair: InnerPair
) -> None:
    """A writer that never saw a thread (a restarted process, another instance) and is
    handed the full snapshot proves, by the hot record's digest, that it extends the
    stored one and sends only the new messages; a snapshot that edits the stored history
    is sent whole, and the writers after it prove their snapshots against that one."""
    inner, other_inner = inner_pair
    store = await open_store(inner, drain_on_close=False)
    thread = tid()
    run = make_run(thread)
    history = make_messages(300, size=MESSAGE_SIZE)
    for count in range(10, 291, 20):
        await store.checkpoint(thread, history[:count], run)

    restarted = await open_store(other_inner, drain_on_close=False)
    await restarted.checkpoint(thread, history[:292], run.replace(steps=1))
    assert 0 < restarted.stats()["wal_bytes"] <= MAX_DELTA_BYTES
    assert await store.load_messages(thread) == history[:292]

    edited = history[:294]
    edited[5] = {"role": "user", "content": "edited"}
    another = await open_store(other_inner, drain_on_close=False)
    await another.checkpoint(thread, edited, run.replace(steps=2))
    assert another.stats()["wal_bytes"] > 290 * MESSAGE_SIZE  # not proven: the whole snapshot
    assert await restarted.load_messages(thread) == edited

    # The first writer's cursor is stale: its write conflicts, reloads the hot record
    # and proves its snapshot against the edited one.
    before = store.stats()["wal_bytes"]
    final = await store.checkpoint(thread, [*edited, history[294]], run.replace(steps=3))
    assert final.thread_seq == 18
    assert 0 < store.stats()["wal_bytes"] - before <= MAX_DELTA_BYTES
    assert await store.force_flush(thread) == 18
    assert await inner.load_messages(thread) == [*edited, history[294]]
