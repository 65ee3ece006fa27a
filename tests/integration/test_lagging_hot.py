"""`BufferedThreadRunStore` with `hot_linger_s`: hot records advanced in the background.

Instance A lingers 10 s before it advances a thread's hot record (the longest linger the
configuration takes), so every read below runs while the KV record lags A's acknowledged
checkpoints: the interleaving is driven, not hoped for. Reads of one thread on any
instance must still see them (invariant 12), writers on other instances must continue
the thread's seqs, and a delete must show in its hot record before it returns (run
claims judge deletes by it).
"""

from __future__ import annotations

import uuid

from buffered_store.engine.threadlog import ThreadLog
from buffered_store.model.records import RunStatus
from buffered_store.testing import make_messages, make_run
from buffered_store.threadrun.entry import FORMAT, HotRecord
from buffered_store.threadrun.store import BufferedThreadRunStore
from tests.plugins.stores import InnerPair, StoreFactory

LINGER_S = 10.0


def tid(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


async def hot_record(store: BufferedThreadRunStore, thread_id: str) -> HotRecord | None:
    """The thread's hot record as the KV holds it now."""
    hot = await ThreadLog(store.wal, store.config, FORMAT).hot(thread_id)
    return hot.record if hot is not None else None


async def test_reads_on_any_instance_see_checkpoints_whose_hot_record_lags(
    open_store: StoreFactory, inner_pair: InnerPair
) -> None:
    """B reads A's checkpoints while A's hot records have not been written at all."""
    inner_a, inner_b = inner_pair
    a = await open_store(inner_a, drain_on_close=False, hot_linger_s=LINGER_S)
    b = await open_store(inner_b, drain_on_close=False)
    thread = tid()
    first = make_run(thread, status=RunStatus.DONE)
    await a.checkpoint(thread, make_messages(2), first, metadata={"topic": "x"})
    second = make_run(thread, steps=4)
    receipt = await a.checkpoint(thread, make_messages(5), second)
    assert receipt.thread_seq == 2
    assert await hot_record(a, thread) is None, "the hot record should still be lingering"

    assert await b.load_messages(thread) == make_messages(5)
    loaded = await b.load_thread(thread)
    assert loaded is not None
    assert (loaded.message_count, loaded.latest_run_id) == (5, second.run_id)
    assert dict(loaded.metadata) == {"topic": "x"}
    assert await b.load_run(first.run_id) == first
    assert await b.load_run(second.run_id) == second
    assert await b.latest_run(thread) == second
    assert {r.run_id for r in await b.list_runs(thread)} == {first.run_id, second.run_id}
    assert [r.run_id for r in await b.list_runs(thread, status=RunStatus.DONE)] == [first.run_id]
    status = await b.flush_status(thread)
    assert (status.latest_seq, status.flushed_seq) == (2, 0)
    assert await hot_record(a, thread) is None, "B's reads should not have needed it"

    # A's own list reads let its records land first.
    assert thread in {t.thread_id for t in await a.list_threads()}
    landed = await hot_record(a, thread)
    assert landed is not None
    assert landed.seq == 2

    assert await b.force_flush(thread) == 2
    assert await inner_b.load_messages(thread) == make_messages(5)


async def test_another_writer_continues_after_a_lagging_hot_record(
    open_store: StoreFactory, inner_pair: InnerPair
) -> None:
    """B writes on top of A's entries whose hot record lags: B's seqs follow A's (the
    stream, not the KV, is the truth), and A's late update never moves the record back."""
    inner_a, inner_b = inner_pair
    a = await open_store(inner_a, drain_on_close=False, hot_linger_s=LINGER_S)
    b = await open_store(inner_b, drain_on_close=False)
    thread = tid()
    run = make_run(thread)
    await a.checkpoint(thread, make_messages(2), run)
    await a.checkpoint(thread, make_messages(3), run.replace(steps=3))
    receipt = await b.checkpoint(thread, make_messages(4), run.replace(steps=4))
    assert receipt.thread_seq == 3
    await a.close()  # lets A's lingering update land (a stale one: seq 2)
    record = await hot_record(b, thread)
    assert record is not None
    assert record.seq == 3
    assert await b.load_messages(thread) == make_messages(4)


async def test_a_delete_shows_in_its_hot_record_before_it_returns(
    open_store: StoreFactory, inner_pair: InnerPair
) -> None:
    """With hot records lingering, `delete_thread` still advances its own: B may take the
    deleted thread's run over at once (the claim check reads the owner's hot record)."""
    inner_a, inner_b = inner_pair
    a = await open_store(inner_a, drain_on_close=False, hot_linger_s=LINGER_S)
    b = await open_store(inner_b, drain_on_close=False)
    owner, taker = tid("owner"), tid("taker")
    run_id = f"run-{uuid.uuid4().hex}"
    await a.checkpoint(owner, make_messages(1), make_run(owner, run_id))
    await a.delete_thread(owner)
    record = await hot_record(a, owner)
    assert record is not None
    assert (record.seq, record.thread) == (2, None)
    assert await b.load_thread(owner) is None
    await b.checkpoint(taker, make_messages(1), make_run(taker, run_id))
    taken = await a.load_run(run_id)
    assert taken is not None
    assert taken.thread_id == taker


async def test_checkpoints_within_a_linger_share_one_hot_record_update(
    open_store: StoreFactory, inner_pair: InnerPair
) -> None:
    """Three checkpoints of a thread within the linger: one KV update (the newest record)
    once A lets its records land, and `stats()` tells how many were saved."""
    a = await open_store(inner_pair[0], drain_on_close=False, hot_linger_s=LINGER_S)
    thread = tid()
    run = make_run(thread)
    before = a.stats()
    for steps in (1, 2, 3):
        await a.checkpoint(thread, make_messages(steps), run.replace(steps=steps))
    assert await hot_record(a, thread) is None
    await a.force_flush_all()  # lets this instance's lingering records land first
    record = await hot_record(a, thread)
    assert record is not None
    assert record.seq == 3
    after = a.stats()
    assert after["hot_updates"] - before["hot_updates"] == 1
    assert after["hot_updates_coalesced"] - before["hot_updates_coalesced"] == 2
