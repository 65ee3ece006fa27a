"""Regressions of issue 9: acknowledged checkpoints that were lost, deletes that did not
delete, a retried publish that reverted another writer, list reads that walked the whole
stream, and run ids that moved between threads. Each test failed before its fix.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from buffered_store.engine.appender import Writer
from buffered_store.engine.keys import hot_key, wal_subject
from buffered_store.engine.pending import FLOOR_KEY, decode_floor
from buffered_store.engine.threadlog import ThreadLog
from buffered_store.errors import (
    CommitUnknownError,
    DatabaseUnavailableError,
    RunOwnershipError,
    WalUnavailableError,
)
from buffered_store.model.records import CheckpointReceipt, RunRecord
from buffered_store.model.target import StoredThread
from buffered_store.stores.memory import InMemoryThreadRunStore
from buffered_store.testing import FaultyFlushTarget, InnerStore, make_messages, make_run
from buffered_store.threadrun.entry import FORMAT
from buffered_store.threadrun.store import BufferedThreadRunStore
from tests.plugins.stores import InnerPair, StoreFactory, SubjectCounter


def tid(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def fail_next_hot_update(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make the next `Writer.advance_hot` (the KV update after the publish) fail once."""
    real = Writer.advance_hot
    failures: list[int] = []

    async def advance_hot(
        self: Writer[Any, Any, Any], thread_id: str, record: Any, revision: Any
    ) -> int:
        if not failures:
            failures.append(record.seq)
            raise WalUnavailableError("KV unreachable (injected)")
        return await real(self, thread_id, record, revision)

    monkeypatch.setattr(Writer, "advance_hot", advance_hot)
    return failures


async def wal_seqs(store: BufferedThreadRunStore, thread_id: str) -> list[int]:
    """Thread seqs of every decodable entry on the thread's subject, in stream order."""
    log = ThreadLog(store.wal, store.config, FORMAT)
    subject = wal_subject(store.config.stream_name, thread_id)
    seqs: list[int] = []
    msg = await store.wal.next_on(subject, 1)
    while msg is not None:
        entry = log.decode(thread_id, msg)
        if entry is not None:
            seqs.append(entry.seq)
        msg = await store.wal.next_on(subject, msg.seq + 1)
    return seqs


# -- finding 1: legacy threads -------------------------------------------------------------


async def test_legacy_thread_after_a_lost_hot_update_continues_its_seqs(
    open_store: StoreFactory, inner_pair: InnerPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread already in the inner store at seq 3; its first buffered checkpoint (seq 4)
    lands but its hot-record update is lost. Another instance must continue at seq 5, not
    restart at 1 (which the flush would judge stale: acknowledged data silently dropped)."""
    first_inner, second_inner = inner_pair
    thread = tid()
    run = make_run(thread)
    for n in range(1, 4):
        await first_inner.checkpoint(thread, make_messages(n), run)
    writer = await open_store(first_inner, drain_on_close=False)
    fail_next_hot_update(monkeypatch)
    with pytest.raises(CommitUnknownError) as caught:
        await writer.checkpoint(thread, make_messages(4), run)
    monkeypatch.undo()
    assert caught.value.thread_seq == 4

    other = await open_store(second_inner, drain_on_close=False)
    receipt = await other.checkpoint(thread, make_messages(6), run.replace(steps=6))
    assert receipt.thread_seq == 5
    assert await other.load_messages(thread) == make_messages(6)
    assert await other.force_flush(thread) == 5
    assert await second_inner.load_messages(thread) == make_messages(6)
    status = await other.flush_status(thread)
    assert (status.latest_seq, status.flushed_seq, status.pending) == (5, 5, 0)
    assert await wal_seqs(other, thread) == [4, 5]


class SeedFailingTarget(FaultyFlushTarget):
    """An inner store whose thread reads fail, as when the database is down."""

    def __init__(self, inner: InnerStore) -> None:
        super().__init__(inner)
        self.down = True

    async def read_thread(self, thread_id: str, *, with_messages: bool) -> StoredThread:
        if self.down:
            raise DatabaseUnavailableError("database down (injected)")
        return await super().read_thread(thread_id, with_messages=with_messages)


async def test_legacy_thread_first_written_while_the_database_is_down(
    open_store: StoreFactory, inner_pair: InnerPair
) -> None:
    """The first buffered checkpoint of a thread the inner store holds at seq 3, while the
    inner store cannot be read: it is accepted (the WAL does not need the database) and
    must neither restart at seq 1 (judged stale by the flush) nor hide behind the stored
    state in reads; the flush lands it over the legacy rows, legacy runs kept."""
    first_inner, second_inner = inner_pair
    thread = tid()
    legacy_run = make_run(thread)
    for n in range(1, 4):
        await first_inner.checkpoint(thread, make_messages(n), legacy_run)
    down = SeedFailingTarget(first_inner)
    writer = await open_store(down, drain_on_close=False)
    run = make_run(thread)
    first = await writer.checkpoint(thread, make_messages(2, start=100), run)
    assert first.thread_seq > 3
    second = await writer.checkpoint(thread, make_messages(3, start=100), run.replace(steps=2))
    assert second.thread_seq == first.thread_seq + 1

    reader = await open_store(second_inner, drain_on_close=False)
    assert await reader.load_messages(thread) == make_messages(3, start=100)
    found = await reader.load_thread(thread)
    assert found is not None
    assert (found.latest_run_id, found.message_count) == (run.run_id, 3)
    assert await reader.force_flush(thread) == second.thread_seq
    assert await second_inner.load_messages(thread) == make_messages(3, start=100)
    assert {r.run_id for r in await second_inner.list_runs(thread)} == {
        legacy_run.run_id,
        run.run_id,
    }
    status = await reader.flush_status(thread)
    assert (status.latest_seq, status.pending) == (second.thread_seq, 0)

    down.down = False  # back up: the thread's later checkpoints follow on as usual
    third = await writer.checkpoint(thread, make_messages(4, start=100), run.replace(steps=3))
    assert third.thread_seq == second.thread_seq + 1
    assert await reader.load_messages(thread) == make_messages(4, start=100)


# -- finding 3: delete ---------------------------------------------------------------------


async def test_delete_sees_a_recreation_by_another_instance(
    open_store: StoreFactory, inner: InnerStore
) -> None:
    """Instance B deleted the thread (its cache says "deleted"); instance A re-creates it
    (unflushed). B's next delete must delete it, not trust its cache and return."""
    a = await open_store(inner, drain_on_close=False)
    b = await open_store(inner, drain_on_close=False)
    thread = tid()
    await b.checkpoint(thread, make_messages(1), make_run(thread))
    await b.delete_thread(thread)
    await a.checkpoint(thread, make_messages(2), make_run(thread))
    assert await b.load_messages(thread) == make_messages(2)

    await b.delete_thread(thread)
    assert await a.load_thread(thread) is None
    assert await b.load_messages(thread) is None
    await a.force_flush(thread)
    assert await inner.load_thread(thread) is None


# -- finding 4: lost publish ack with another writer on top -------------------------------


async def test_retry_after_a_lost_ack_finds_its_entry_under_another_writers(
    open_store: StoreFactory, subject_counts: SubjectCounter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A's publish lands but its ack is lost; before A retries, B appends on top. A's
    retry must recognise its own entry (one message back, not the subject's last) instead
    of publishing the same checkpoint again above B's, which would revert B."""
    inner = InMemoryThreadRunStore()
    a = await open_store(inner, drain_on_close=False)
    b = await open_store(inner, drain_on_close=False)
    thread = tid()
    run = make_run(thread)
    await a.checkpoint(thread, make_messages(1), run)
    real_publish = a.wal.publish
    b_receipts: list[CheckpointReceipt] = []

    async def publish_then_lose_ack(subject: str, payload: bytes, **kw: Any) -> tuple[int, bool]:
        result = await real_publish(subject, payload, **kw)
        if not b_receipts:
            b_receipts.append(await b.checkpoint(thread, make_messages(3, start=50), run))
            raise WalUnavailableError("ack lost (injected)")
        return result

    monkeypatch.setattr(a.wal, "publish", publish_then_lose_ack)
    mine = await a.checkpoint(thread, make_messages(2), run)
    monkeypatch.undo()
    assert (mine.thread_seq, b_receipts[0].thread_seq) == (2, 3)
    assert (await subject_counts(a)).get(wal_subject(a.config.stream_name, thread)) == 3
    assert await wal_seqs(a, thread) == [1, 2, 3]
    assert await a.load_messages(thread) == make_messages(3, start=50)
    await a.force_flush(thread)
    assert await inner.load_messages(thread) == make_messages(3, start=50)


# -- finding 5: list reads bounded by pending threads ------------------------------------


async def test_list_reads_cost_pending_threads_not_pending_entries(
    open_store: StoreFactory, inner: InnerStore
) -> None:
    """One thread with 300 unflushed entries, another with 200 entries flushed by
    force_flush (which does not ack: with no flusher ever running, the consumer's tail is
    the whole stream). Finding the pending threads costs O(pending threads) NATS requests:
    list_threads and list_runs read no entry at all, force_flush_all reads only the
    pending thread's entries (which it must apply)."""
    store = await open_store(inner, drain_on_close=False)
    busy, quiet = tid("busy"), tid("quiet")
    run = make_run(busy)
    quiet_run = make_run(quiet)
    for n in range(1, 201):
        await store.checkpoint(quiet, make_messages(n % 3 + 1), quiet_run.replace(steps=n))
    await store.force_flush(quiet)
    for n in range(1, 301):
        await store.checkpoint(busy, make_messages(n % 5 + 1), run.replace(steps=n))

    def cost() -> int:
        return int(store.stats()["nats_requests"])

    before = cost()
    threads = await store.list_threads()
    assert [t.thread_id for t in threads] == [busy, quiet]
    assert cost() - before <= 12, f"list_threads cost {cost() - before} requests"
    before = cost()
    runs = await store.list_runs()
    assert {r.run_id: r.steps for r in runs}[run.run_id] == 300
    assert cost() - before <= 12, f"list_runs cost {cost() - before} requests"
    before = cost()
    assert await store.force_flush_all() == 1
    assert await inner.load_messages(busy) == make_messages(300 % 5 + 1)
    assert cost() - before <= 300 + 20, f"force_flush_all cost {cost() - before}"
    before = cost()
    assert await store.force_flush_all() == 0
    assert cost() - before <= 8


# -- finding 6: a run id stays on its thread ----------------------------------------------


async def test_run_id_reused_on_another_thread_is_refused(
    open_store: StoreFactory, inner: InnerStore
) -> None:
    """A run checkpointed on thread A cannot be checkpointed on thread B (from any
    instance): RunOwnershipError names A, and nothing is written for B. Once A is
    deleted the run is gone, and B may use the id."""
    a_store = await open_store(inner, drain_on_close=False)
    b_store = await open_store(inner, drain_on_close=False)
    a, b = tid("a"), tid("b")
    await a_store.checkpoint(a, make_messages(1), make_run(a, "shared-run"))
    with pytest.raises(RunOwnershipError) as caught:
        await b_store.checkpoint(b, make_messages(1), make_run(b, "shared-run"))
    assert caught.value.owner_thread_id == a
    assert caught.value.run_id == "shared-run"
    assert await b_store.load_thread(b) is None
    assert (await b_store.flush_status(b)).latest_seq == 0
    found = await b_store.load_run("shared-run")
    assert found is not None
    assert found.thread_id == a

    await a_store.delete_thread(a)
    receipt = await b_store.checkpoint(b, make_messages(1), make_run(b, "shared-run"))
    assert receipt.thread_seq == 1
    moved = await a_store.load_run("shared-run")
    assert moved is not None
    assert moved.thread_id == b


# -- review of the fixes above -------------------------------------------------------------


async def test_append_to_a_legacy_thread_whose_history_cannot_be_read_is_refused(
    open_store: StoreFactory, inner_pair: InnerPair
) -> None:
    """`append()` of a thread the WAL has never seen, while the inner store cannot be read:
    the appended messages extend a history nobody knows, so the call is refused with a
    retriable error and nothing is written (a jump entry holding only the new messages
    would replace the thread's stored history at the flush). Once the database answers,
    the same call extends the legacy history."""
    first_inner, second_inner = inner_pair
    thread = tid()
    run = make_run(thread)
    for n in range(1, 4):
        await first_inner.checkpoint(thread, make_messages(n), run)
    down = SeedFailingTarget(first_inner)
    writer = await open_store(down, drain_on_close=False)
    with pytest.raises(DatabaseUnavailableError) as caught:
        await writer.append(thread, make_messages(1, start=3), run.replace(steps=4))
    assert caught.value.retriable
    assert await wal_seqs(writer, thread) == []

    down.down = False
    receipt = await writer.append(thread, make_messages(1, start=3), run.replace(steps=4))
    assert receipt.thread_seq == 4
    reader = await open_store(second_inner, drain_on_close=False)
    assert await reader.load_messages(thread) == make_messages(4)
    assert await reader.force_flush(thread) == 4
    assert await second_inner.load_messages(thread) == make_messages(4)


def lose_ack_under_another_writer(
    a: BufferedThreadRunStore,
    b: BufferedThreadRunStore,
    thread: str,
    monkeypatch: pytest.MonkeyPatch,
    *,
    lookup_failures: int,
) -> list[CheckpointReceipt]:
    """A's next publish lands, then B checkpoints on top and A's ack is lost; A's next
    `lookup_failures` reads of the subject fail as if NATS were unreachable."""
    real_publish, real_next_on = a.wal.publish, a.wal.next_on
    b_receipts: list[CheckpointReceipt] = []
    failures = [lookup_failures]

    async def publish_then_lose_ack(subject: str, payload: bytes, **kw: Any) -> tuple[int, bool]:
        result = await real_publish(subject, payload, **kw)
        if not b_receipts:
            b_receipts.append(await b.checkpoint(thread, make_messages(3, start=50), b_run))
            raise WalUnavailableError("ack lost (injected)")
        return result

    async def next_on(subject: str, from_seq: int) -> Any:
        if failures[0] > 0:
            failures[0] -= 1
            raise WalUnavailableError("NATS unreachable (injected)")
        return await real_next_on(subject, from_seq)

    b_run = make_run(thread)
    monkeypatch.setattr(a.wal, "publish", publish_then_lose_ack)
    monkeypatch.setattr(a.wal, "next_on", next_on)
    return b_receipts


async def test_lost_ack_whose_lookup_fails_once_still_finds_its_entry(
    open_store: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a lost ack, the retry's conflict sends A to look for its own entry; that read
    failing once must not turn a stored checkpoint into "WAL unavailable" (nothing
    stored): the lookup is retried and A gets its receipt."""
    inner = InMemoryThreadRunStore()
    a = await open_store(inner, drain_on_close=False)
    b = await open_store(inner, drain_on_close=False)
    thread = tid()
    await a.checkpoint(thread, make_messages(1), make_run(thread))
    b_receipts = lose_ack_under_another_writer(a, b, thread, monkeypatch, lookup_failures=1)
    mine = await a.checkpoint(thread, make_messages(2), make_run(thread))
    monkeypatch.undo()
    assert (mine.thread_seq, b_receipts[0].thread_seq) == (2, 3)
    assert await wal_seqs(a, thread) == [1, 2, 3]


async def test_lost_ack_whose_lookup_never_answers_is_commit_unknown(
    open_store: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same, but the lookup never succeeds within the checkpoint's budget: the entry may
    be stored (it is), so the caller must hear CommitUnknownError, never
    WalUnavailableError, which promises that nothing was written."""
    inner = InMemoryThreadRunStore()
    a = await open_store(inner, drain_on_close=False, checkpoint_timeout_s=1.0)
    b = await open_store(inner, drain_on_close=False)
    thread = tid()
    await a.checkpoint(thread, make_messages(1), make_run(thread))
    lose_ack_under_another_writer(a, b, thread, monkeypatch, lookup_failures=10**9)
    with pytest.raises(CommitUnknownError):
        await a.checkpoint(thread, make_messages(2), make_run(thread))
    monkeypatch.undo()
    assert await wal_seqs(a, thread) == [1, 2, 3]


async def test_run_claimed_by_a_checkpoint_in_flight_is_not_taken_over(
    open_store: StoreFactory, inner: InnerStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A's checkpoint has claimed run R and its publish is on its way. B checkpoints
    another thread with R meanwhile: the run is not in A's thread *yet*, but the claim is
    fresh, so B is refused (taking it over would leave R on both threads once A's
    publish lands)."""
    a_store = await open_store(inner, drain_on_close=False)
    b_store = await open_store(inner, drain_on_close=False)
    a, b = tid("a"), tid("b")
    run_id = f"run-{uuid.uuid4().hex}"
    real_publish = a_store.wal.publish
    released = asyncio.Event()
    parked = asyncio.Event()

    async def slow_publish(subject: str, payload: bytes, **kw: Any) -> tuple[int, bool]:
        parked.set()
        await released.wait()
        return await real_publish(subject, payload, **kw)

    monkeypatch.setattr(a_store.wal, "publish", slow_publish)
    a_write = asyncio.create_task(a_store.checkpoint(a, make_messages(1), make_run(a, run_id)))
    await parked.wait()
    with pytest.raises(RunOwnershipError) as caught:
        await b_store.checkpoint(b, make_messages(1), make_run(b, run_id))
    assert caught.value.owner_thread_id == a
    released.set()
    assert (await a_write).thread_seq == 1
    monkeypatch.undo()
    found = await b_store.load_run(run_id)
    assert found is not None
    assert found.thread_id == a
    assert await b_store.load_thread(b) is None


@pytest.mark.parametrize("deleter", ["same", "other"])
async def test_run_of_a_deleted_thread_taken_over_is_not_reused_by_the_old_thread(
    open_store: StoreFactory, inner: InnerStore, deleter: str
) -> None:
    """A's thread held R and was deleted (by A's instance or another one); B took R over.
    A re-creating its thread with R must be refused: A's instance may not trust a claim
    it made before the delete."""
    a_store = await open_store(inner, drain_on_close=False)
    b_store = await open_store(inner, drain_on_close=False)
    other = await open_store(inner, drain_on_close=False)
    a, b = tid("a"), tid("b")
    run_id = f"run-{uuid.uuid4().hex}"
    await a_store.checkpoint(a, make_messages(1), make_run(a, run_id))
    await (a_store if deleter == "same" else other).delete_thread(a)
    await b_store.checkpoint(b, make_messages(1), make_run(b, run_id))
    with pytest.raises(RunOwnershipError) as caught:
        await a_store.checkpoint(a, make_messages(2), make_run(a, run_id))
    assert caught.value.owner_thread_id == b
    assert await a_store.load_thread(a) is None
    await b_store.force_flush_all()
    stored = await inner.load_run(run_id)
    assert stored is not None
    assert stored.thread_id == b


async def test_hot_record_too_large_for_a_kv_value_drops_its_runs(
    open_store: StoreFactory, inner: InnerStore
) -> None:
    """A thread whose metadata nearly fills a NATS message: each entry fits, but the hot
    record (the same metadata plus the last four runs) does not. The checkpoint must
    still succeed (the hot record leaves the runs out; reads take them from the entries)
    instead of failing its KV update as commit unknown."""
    store = await open_store(inner, drain_on_close=False)
    thread = tid()
    metadata = {"blob": "x" * 1_036_000}
    runs = [make_run(thread, output="y" * 3_500) for _ in range(4)]
    for n, run in enumerate(runs, start=1):
        receipt = await store.checkpoint(thread, make_messages(n), run, metadata=metadata)
        assert receipt.thread_seq == n
    assert {r.run_id for r in await store.list_runs(thread)} == {r.run_id for r in runs}
    latest = await store.latest_run(thread)
    assert latest is not None
    assert latest.run_id == runs[-1].run_id
    await store.force_flush(thread)
    assert await inner.load_messages(thread) == make_messages(4)


async def test_unflushed_jump_chain_counts_its_entries_as_pending(
    open_store: StoreFactory, inner_pair: InnerPair
) -> None:
    """Two checkpoints written as a jump chain (database down at the first write) are two
    pending checkpoints, not the distance between the stored seq and the jump seq."""
    first_inner, _ = inner_pair
    thread = tid()
    run = make_run(thread)
    for n in range(1, 4):
        await first_inner.checkpoint(thread, make_messages(n), run)
    down = SeedFailingTarget(first_inner)
    writer = await open_store(down, drain_on_close=False)
    await writer.checkpoint(thread, make_messages(1, start=100), run)
    second = await writer.checkpoint(thread, make_messages(2, start=100), run)
    down.down = False
    status = await writer.flush_status(thread)
    assert (status.latest_seq, status.flushed_seq, status.pending) == (second.thread_seq, 3, 2)


async def test_legacy_thread_whose_subject_holds_only_unreadable_messages_continues(
    open_store: StoreFactory, inner_pair: InnerPair
) -> None:
    """No hot record, and the thread's subject holds a message that is not a readable
    entry: the cursor must still ask the inner store where the thread's seqs stand (a
    restart at seq 1 would be judged stale by the flush)."""
    first_inner, second_inner = inner_pair
    thread = tid()
    run = make_run(thread)
    for n in range(1, 4):
        await first_inner.checkpoint(thread, make_messages(n), run)
    writer = await open_store(first_inner, drain_on_close=False)
    subject = wal_subject(writer.config.stream_name, thread)
    await writer.wal.append(subject, b"not an entry")
    receipt = await writer.checkpoint(thread, make_messages(4), run.replace(steps=4))
    assert receipt.thread_seq == 4
    reader = await open_store(second_inner, drain_on_close=False)
    assert await reader.force_flush(thread) == 4
    assert await second_inner.load_messages(thread) == make_messages(4)


async def test_unreadable_hot_record_keeps_the_pending_floor_below_it(
    open_store: StoreFactory, inner: InnerStore
) -> None:
    """A hot record nobody can decode may belong to a pending thread: list scans skip it
    but must not raise the pending floor past it."""
    store = await open_store(inner, drain_on_close=False)
    await store.checkpoint("before", make_messages(1), make_run("before"))
    bad_revision = await store.wal.kv_put(hot_key("garbled"), b"{not a hot record")
    await store.checkpoint("after", make_messages(1), make_run("after"))
    threads = await store.list_threads()
    assert {t.thread_id for t in threads} == {"before", "after"}
    floor = await store.wal.kv_get(FLOOR_KEY)
    assert floor is None or decode_floor(floor.value).kv_seq <= bad_revision


async def test_pending_scan_of_many_threads_costs_a_few_round_trips(
    open_store: StoreFactory, inner: InnerStore
) -> None:
    """Finding the pending threads among many written since the floor costs a bounded
    number of requests (a few direct gets, then one consumer delivering the rest in
    batches), not one request per thread; threads written twice (their older hot record
    superseded in the bucket's stream) are found once, at their latest state."""
    store = await open_store(inner, drain_on_close=False)
    threads = [tid(f"many{i:03d}") for i in range(120)]
    runs = {t: make_run(t) for t in threads}
    await asyncio.gather(*(store.checkpoint(t, make_messages(1), runs[t]) for t in threads))
    await asyncio.gather(*(store.checkpoint(t, make_messages(2), runs[t]) for t in threads[::3]))
    before = store.stats()["nats_requests"]
    listed = await store.list_threads(limit=200)
    cost = store.stats()["nats_requests"] - before
    assert sorted(t.thread_id for t in listed) == sorted(threads)
    counts = {t.thread_id: t.message_count for t in listed}
    assert all(counts[t] == (2 if i % 3 == 0 else 1) for i, t in enumerate(threads))
    assert cost <= 16, f"list_threads cost {cost} requests for 120 pending threads"
    assert await store.force_flush_all() == 120
    assert await store.force_flush_all() == 0


# -- found by the model test -------------------------------------------------------------


@pytest.mark.parametrize("same_run", [True, False], ids=["updated-run", "new-run"])
async def test_load_run_racing_a_flush_sees_the_newest_version(
    open_store: StoreFactory,
    inner: InnerStore,
    monkeypatch: pytest.MonkeyPatch,
    same_run: bool,
) -> None:
    """`load_run` read the stored row and the flushed watermark concurrently: a flush
    committing after the row was read moved the run's newest version out of the pending
    entries, and the read returned the older stored version (or nothing)."""
    store = await open_store(inner, drain_on_close=False)
    thread = tid()
    first = make_run(thread)
    await store.checkpoint(thread, make_messages(1), first.replace(steps=1))
    await store.force_flush(thread)
    newest = first.replace(steps=2) if same_run else make_run(thread, steps=2)
    await store.checkpoint(thread, make_messages(2), newest)
    real_read_run = store.target.read_run

    async def read_then_flush(run_id: str) -> Any:
        found = await real_read_run(run_id)
        await store.force_flush(thread)  # commits between the row read and the watermark
        return found

    monkeypatch.setattr(store.target, "read_run", read_then_flush)
    assert await store.load_run(newest.run_id) == newest
    assert await store.latest_run(thread) == newest


async def test_load_run_of_a_taken_over_run_racing_a_flush_sees_the_claimants_version(
    open_store: StoreFactory, inner: InnerStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Thread a's run is flushed and a is deleted; thread b takes the run over. A flush
    committing both after `load_run` read a's stored row moved b's version out of the
    pending entries: the read compared a's seq with b's watermark (seqs of different
    threads), skipped the second row read and returned the deleted thread's run (found
    by the model test, flusher running beside the reads)."""
    store = await open_store(inner, drain_on_close=False)
    a, b = tid("a"), tid("b")
    run = make_run(a, steps=1)
    for steps in (1, 2, 3):  # a's seq above b's, as in the model test's example
        await store.checkpoint(a, make_messages(steps), run.replace(steps=steps))
    await store.force_flush(a)
    await store.delete_thread(a)
    taken = run.replace(thread_id=b, steps=9)
    await store.checkpoint(b, make_messages(1), taken)
    # a's delete and b's run commit after the read.
    flush_after_the_first_row_read(store, monkeypatch, a, store.force_flush_all)
    assert await store.load_run(run.run_id) == taken
    assert await store.latest_run(b) == taken


async def test_load_run_of_a_claimed_run_racing_the_old_owners_delete_flush_is_gone(
    open_store: StoreFactory, inner: InnerStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim of a deleted thread's run moved to b, whose checkpoint is not written
    yet. The old owner's delete committing after `load_run` read its stored row hid the
    pending delete from the read, which returned the deleted thread's run."""
    store = await open_store(inner, drain_on_close=False)
    a, b = tid("a"), tid("b")
    run = make_run(a, steps=1)
    await store.checkpoint(a, make_messages(1), run)
    await store.force_flush(a)
    await store.delete_thread(a)
    loop = asyncio.get_running_loop()
    await store._claims.claim(b, run.run_id, loop.time() + 10)  # b's checkpoint to come
    flush_after_the_first_row_read(store, monkeypatch, a, lambda: store.force_flush(a))
    assert await store.load_run(run.run_id) is None


def flush_after_the_first_row_read(
    store: BufferedThreadRunStore,
    monkeypatch: pytest.MonkeyPatch,
    owner: str,
    flush: Callable[[], Awaitable[object]],
) -> None:
    """The store's first read of a run row finds `owner`'s row, then `flush` commits
    before that read returns: a flush landing between the row read and the watermarks."""
    real_read_run = store.target.read_run
    calls = 0

    async def read_then_flush(run_id: str) -> Any:
        nonlocal calls
        calls += 1
        found = await real_read_run(run_id)
        if calls == 1:
            assert found is not None
            assert found.run.thread_id == owner
            await flush()
        return found

    monkeypatch.setattr(store.target, "read_run", read_then_flush)


async def test_delete_repeated_after_its_hot_update_was_lost_is_visible(
    open_store: StoreFactory, inner: InnerStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delete lands in the WAL but its hot-record update is lost (commit unknown). The
    caller deletes again: the thread is deleted already, so nothing is written, but the
    call used to return while every read still showed the thread."""
    a = await open_store(inner, drain_on_close=False)
    b = await open_store(inner, drain_on_close=False)
    thread = tid()
    await a.checkpoint(thread, make_messages(2), make_run(thread))
    fail_next_hot_update(monkeypatch)
    with pytest.raises(CommitUnknownError):
        await a.delete_thread(thread)
    monkeypatch.undo()
    await a.delete_thread(thread)
    for store in (a, b):
        assert await store.load_thread(thread) is None
        assert await store.load_messages(thread) is None
        assert thread not in {t.thread_id for t in await store.list_threads()}


@pytest.mark.parametrize("last", ["checkpoint", "delete"])
async def test_thread_summary_after_flushing_an_entry_whose_hot_update_was_lost(
    open_store: StoreFactory, inner: InnerStore, monkeypatch: pytest.MonkeyPatch, last: str
) -> None:
    """An entry lands but its hot-record update is lost, then a flush applies it. Every
    read must now show it: `load_thread` answered from the stale hot record for good
    (the old summary, or a deleted thread still there) while `load_messages` read the
    database."""
    store = await open_store(inner, drain_on_close=False)
    thread = tid()
    run = make_run(thread)
    await store.checkpoint(thread, make_messages(2), run)
    fail_next_hot_update(monkeypatch)
    lost = (
        store.checkpoint(thread, make_messages(3), run.replace(steps=3))
        if last == "checkpoint"
        else store.delete_thread(thread)
    )
    with pytest.raises(CommitUnknownError):
        await lost
    monkeypatch.undo()
    await store.force_flush(thread)
    summary = await store.load_thread(thread)
    if last == "checkpoint":
        assert summary is not None
        assert summary.message_count == 3
        assert await store.load_messages(thread) == make_messages(3)
        assert await store.latest_run(thread) == run.replace(steps=3)
    else:
        assert summary is None
        assert await store.load_messages(thread) is None


async def test_reader_with_a_cursor_sees_a_flushed_entry_whose_hot_update_was_lost(
    open_store: StoreFactory, inner_pair: InnerPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B wrote the thread last, so its cursor matches the hot record; A's next entry lands
    but its hot-record update is lost, then it is flushed. B's reads took its cached
    snapshot and the hot record's summary (both older than the database) for good."""
    a = await open_store(inner_pair[0], drain_on_close=False)
    b = await open_store(inner_pair[1], drain_on_close=False)
    thread = tid()
    run = make_run(thread)
    await b.checkpoint(thread, make_messages(2), run)
    fail_next_hot_update(monkeypatch)
    with pytest.raises(CommitUnknownError):
        await a.checkpoint(thread, make_messages(3), run.replace(steps=3), metadata={"k": 1})
    monkeypatch.undo()
    await a.force_flush(thread)
    assert await b.load_messages(thread) == make_messages(3)
    summary = await b.load_thread(thread)
    assert summary is not None
    assert (summary.message_count, summary.metadata) == (3, {"k": 1})


async def test_run_of_a_thread_deleted_then_re_created_without_it_is_free(
    open_store: StoreFactory, inner: InnerStore
) -> None:
    """A's thread held R, was deleted, then re-created with another run. R exists nowhere
    any more, so B may use it at once: the claim check only counted the owner as deleted
    while it stayed deleted, and refused R for `run_claim_grace_s` (5 minutes)."""
    a_store = await open_store(inner, drain_on_close=False)
    b_store = await open_store(inner, drain_on_close=False)
    a, b = tid("a"), tid("b")
    run_id = f"run-{uuid.uuid4().hex}"
    await a_store.checkpoint(a, make_messages(1), make_run(a, run_id))
    await a_store.delete_thread(a)
    await a_store.checkpoint(a, make_messages(2), make_run(a))
    await b_store.checkpoint(b, make_messages(1), make_run(b, run_id))
    assert [r.thread_id for r in await b_store.list_runs(b)] == [b]
    await b_store.force_flush_all()
    stored = await inner.load_run(run_id)
    assert stored is not None
    assert stored.thread_id == b
    assert run_id not in {r.run_id for r in await inner.list_runs(a)}


async def test_run_taken_over_reads_as_the_new_threads_before_any_flush(
    open_store: StoreFactory, inner: InnerStore
) -> None:
    """Thread A's run R is flushed at A's seq 3; A is deleted (not flushed) and B takes R
    over at B's seq 1. `load_run(R)` compared the two seqs as if of one thread and
    returned A's stored version."""
    a_store = await open_store(inner, drain_on_close=False)
    b_store = await open_store(inner, drain_on_close=False)
    a, b = tid("a"), tid("b")
    run_id = f"run-{uuid.uuid4().hex}"
    for step in range(1, 4):
        await a_store.checkpoint(a, make_messages(step), make_run(a, run_id, steps=step))
    await a_store.force_flush(a)
    await a_store.delete_thread(a)
    taken = make_run(b, run_id, steps=9)
    await b_store.checkpoint(b, make_messages(1), taken)
    for store in (a_store, b_store):
        assert await store.load_run(run_id) == taken
        assert await store.latest_run(b) == taken
        assert await store.list_runs(b) == [taken]
    await a_store.delete_thread(b)
    assert await b_store.load_run(run_id) is None


@pytest.mark.parametrize("owner_again", [False, True], ids=["owner-gone", "owner-re-created"])
async def test_force_flush_of_a_run_taken_over_flushes_the_owners_delete_first(
    open_store: StoreFactory, inner: InnerStore, owner_again: bool
) -> None:
    """Thread A's run R is flushed; A is deleted (not flushed) and B takes R over. With no
    flusher running, `force_flush(B)` found R still on A in the inner store and raised
    `FlushFailedError` (RunOwnershipError), though the WAL orders A's delete first (found
    by the model test). It now flushes A first and then B."""
    store = await open_store(inner, drain_on_close=False)
    a, b = tid("a"), tid("b")
    run_id = f"run-{uuid.uuid4().hex}"
    await store.checkpoint(a, make_messages(2), make_run(a, run_id, steps=2))
    await store.force_flush(a)
    await store.delete_thread(a)
    taken = make_run(b, run_id, steps=9)
    await store.checkpoint(b, make_messages(1), taken)
    if owner_again:
        await store.checkpoint(a, make_messages(1, start=4), make_run(a, steps=1))
    await store.force_flush(b)
    assert await inner.load_run(run_id) == taken
    assert await inner.list_runs(b) == [taken]
    assert (await inner.load_thread(a) is not None) is owner_again
    assert (await store.flush_status(a)).pending == 0
    assert (await store.flush_status(b)).pending == 0


@pytest.mark.parametrize("claimant_first", [True, False], ids=["claimant-first", "owner-first"])
@pytest.mark.parametrize("claimant_re_created", [False, True], ids=["plain", "re-created"])
@pytest.mark.parametrize("flush", ["force_flush_all", "force_flush"])
async def test_a_run_taken_over_is_flushed_with_its_owner_side_by_side(
    open_store: StoreFactory,
    inner: InnerStore,
    claimant_first: bool,
    claimant_re_created: bool,
    flush: str,
) -> None:
    """Thread A (owning run R, flushed) is deleted and re-created with another run; B
    (new, or flushed and then deleted and re-created too) takes R over; nothing flushed
    since. `force_flush_all` flushes A and B side by side, each in a transaction of its
    own: B's gate found R still on A (A's transaction not committed), and by the time the
    owner was looked up A had let R go, so B failed with a ConflictError ("a run it names
    belonged to another thread") and `force_flush_all` raised `FlushFailedError`. The
    refusal now says the same entries may apply at once (`retry_now`), and they do."""
    store = await open_store(inner, drain_on_close=False)
    suffix = uuid.uuid4().hex[:12]
    a, b = (f"z-{suffix}", f"a-{suffix}") if claimant_first else (f"a-{suffix}", f"z-{suffix}")
    run_id = f"run-{uuid.uuid4().hex}"
    await store.checkpoint(a, make_messages(2), make_run(a, run_id, steps=2))
    if claimant_re_created:
        await store.checkpoint(b, make_messages(1), make_run(b))
    await store.force_flush_all()
    await store.delete_thread(a)
    fresh_a = make_run(a)
    await store.checkpoint(a, make_messages(1, start=7), fresh_a)
    if claimant_re_created:
        await store.delete_thread(b)
    taken = make_run(b, run_id, steps=9)
    await store.checkpoint(b, make_messages(1, start=3), taken)
    if flush == "force_flush":
        await store.force_flush(b)
    else:
        await store.force_flush_all()
    assert await inner.load_run(run_id) == taken
    assert await inner.list_runs(b) == [taken]
    assert await inner.load_messages(b) == make_messages(1, start=3)
    if flush == "force_flush_all":
        assert await inner.list_runs(a) == [fresh_a]
        assert await inner.load_messages(a) == make_messages(1, start=7)
        assert (await store.flush_status(a)).pending == 0
    assert (await store.flush_status(b)).pending == 0


async def swap_runs_of_two_re_created_threads(
    store: BufferedThreadRunStore,
) -> tuple[RunRecord, RunRecord]:
    """A (run RA) and B (run RB) flushed, both deleted, A re-created with RB and B with RA
    (nothing flushed since); returns the runs A and B now hold."""
    a, b = tid("a"), tid("b")
    ra, rb = f"run-{uuid.uuid4().hex}", f"run-{uuid.uuid4().hex}"
    await store.checkpoint(a, make_messages(2), make_run(a, ra))
    await store.checkpoint(b, make_messages(3), make_run(b, rb))
    await store.force_flush_all()
    await store.delete_thread(a)
    await store.delete_thread(b)
    a_takes, b_takes = make_run(a, rb, steps=4), make_run(b, ra, steps=6)
    await store.checkpoint(a, make_messages(1, start=5), a_takes)
    await store.checkpoint(b, make_messages(1, start=8), b_takes)
    return a_takes, b_takes


@pytest.mark.parametrize("flush", ["force_flush_all", "force_flush"])
async def test_two_re_created_threads_that_swapped_their_runs_are_flushed(
    open_store: StoreFactory, inner: InnerStore, flush: str
) -> None:
    """A owns run RA and B owns RB, both flushed; both are deleted, A is re-created with RB
    and B with RA, nothing flushed since. Each claim needs the other thread's delete
    first: the target wrote each thread's reset just before its own write, and
    `flush_thread` flushed the owner alone first, so neither could go first and the
    flush raised `FlushFailedError` (RunOwnershipError). The target now writes every
    reset of a call before its writes, and `flush_thread` applies a thread together with
    the owner it waits for."""
    store = await open_store(inner, drain_on_close=False)
    a_takes, b_takes = await swap_runs_of_two_re_created_threads(store)
    a, b = a_takes.thread_id, b_takes.thread_id
    if flush == "force_flush":
        await store.force_flush(a)
    else:
        await store.force_flush_all()
    assert await inner.list_runs(a) == [a_takes]
    assert await inner.list_runs(b) == [b_takes]
    assert await inner.load_messages(a) == make_messages(1, start=5)
    assert await inner.load_messages(b) == make_messages(1, start=8)
    for thread_id in (a, b):
        assert (await store.flush_status(thread_id)).pending == 0


async def test_a_flusher_applies_two_re_created_threads_that_swapped_their_runs(
    open_store: StoreFactory, inner: InnerStore
) -> None:
    """The swap above, flushed by a running flusher instead of `force_flush`: all four
    entries land in one cycle, and its one apply call must write both resets first."""
    from flusher import Flusher, FlusherConfig

    store = await open_store(inner, drain_on_close=False)
    a_takes, b_takes = await swap_runs_of_two_re_created_threads(store)
    a, b = a_takes.thread_id, b_takes.thread_id
    config = FlusherConfig.from_store_config(
        store.config, flush_interval_s=0.05, fetch_timeout_s=0.2, nak_delay_initial_s=0.05
    )
    flusher = Flusher(inner, config)
    await flusher.start()
    try:
        await flusher.wait_idle(timeout_s=20)
        stats = flusher.stats()
    finally:
        await flusher.stop(drain=False)
    assert await inner.list_runs(a) == [a_takes]
    assert await inner.list_runs(b) == [b_takes]
    assert await inner.flushed_seqs([a, b]) == {a: 3, b: 3}
    assert (stats["apply_failures"], stats["quarantined_threads"]) == (0, 0)
