"""The write path of `BufferedThreadRunStore` against a real nats-server.

Round trips per checkpoint, no global lock, no synchronous inner-store work, idempotent
publishes, "commit unknown", garbage on a thread subject, hostile thread ids and
conflicting server objects (DESIGN.md section 5, invariants 1-5 and "bad input").
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from buffered_store.engine.appender import Writer
from buffered_store.engine.ids import utcnow
from buffered_store.engine.keys import hot_key, msg_id, wal_subject
from buffered_store.engine.threadlog import ThreadLog
from buffered_store.errors import (
    CommitUnknownError,
    ConfigError,
    ConflictError,
    ValidationError,
    WalUnavailableError,
)
from buffered_store.model.changes import (
    EntryKind,
    WalEntry,
)
from buffered_store.stores.memory import InMemoryThreadRunStore
from buffered_store.testing import FaultyFlushTarget, InnerStore, make_messages, make_run
from buffered_store.threadrun.entry import (
    FORMAT,
    encode_entry,
)
from buffered_store.threadrun.store import BufferedThreadRunStore
from tests.plugins.stores import ConfigFactory, StoreFactory, SubjectCounter, jetstream


def tid(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


async def stored_seqs(store: BufferedThreadRunStore, thread_id: str, upto: int) -> list[int]:
    """Thread seqs of the WAL entries 1..upto of a thread, read back from the stream."""
    hot = await ThreadLog(store.wal, store.config, FORMAT).hot(thread_id)
    entries = await ThreadLog(store.wal, store.config, FORMAT).entries_between(
        thread_id, 0, upto, hot.record if hot else None
    )
    return [e.seq for e in entries]


# -- cost ------------------------------------------------------------------------------


async def test_steady_state_checkpoint_costs_at_most_two_nats_requests(
    open_store: StoreFactory,
) -> None:
    """Invariant 5: a single writer's steady-state checkpoint is <= 2 NATS round trips."""
    store = await open_store(InMemoryThreadRunStore(), drain_on_close=False)
    thread = tid()
    run = make_run(thread)
    await store.checkpoint(thread, make_messages(1), run)  # warm-up: cursor and run index
    before = store.stats()["nats_requests"]
    for n in range(2, 22):
        receipt = await store.checkpoint(thread, make_messages(n), run.replace(steps=n))
        assert receipt.thread_seq == n
    spent = store.stats()["nats_requests"] - before
    assert spent <= 2 * 20, f"20 steady-state checkpoints cost {spent} NATS requests"


# -- no global lock --------------------------------------------------------------------


@pytest.mark.parametrize("stall_at", ["publish", "hot_update"])
async def test_checkpoints_on_other_threads_do_not_wait_for_a_stalled_writer(
    open_store: StoreFactory, monkeypatch: pytest.MonkeyPatch, stall_at: str
) -> None:
    """Invariant 4: thread A's writer is stuck inside its NATS request (its publish, or its
    hot-record update after the publish); checkpoints of other threads, on the same
    instance and on another instance, still complete. Any lock or lease held across a
    checkpoint (per process or cluster-wide) would make them wait for A."""
    stalled = await open_store(InMemoryThreadRunStore(), drain_on_close=False)
    other = await open_store(InMemoryThreadRunStore(), drain_on_close=False)
    a, b, c = tid("a"), tid("b"), tid("c")
    runs = {t: make_run(t) for t in (a, b, c)}
    await stalled.checkpoint(a, make_messages(1), runs[a])
    await stalled.checkpoint(b, make_messages(1), runs[b])
    await other.checkpoint(c, make_messages(1), runs[c])

    parked, release = asyncio.Event(), asyncio.Event()
    wal = stalled.wal
    if stall_at == "publish":
        real_publish = wal.publish
        subject = wal_subject(stalled.config.stream_name, a)

        async def publish(subj: str, payload: bytes, **kwargs: Any) -> tuple[int, bool]:
            if subj == subject:
                parked.set()
                await release.wait()
            return await real_publish(subj, payload, **kwargs)

        monkeypatch.setattr(wal, "publish", publish)
    else:
        real_swap = wal.kv_swap
        key = hot_key(a)

        async def kv_swap(k: str, value: bytes, *, revision: int | None) -> int:
            if k == key:
                parked.set()
                await release.wait()
            return await real_swap(k, value, revision=revision)

        monkeypatch.setattr(wal, "kv_swap", kv_swap)

    stuck = asyncio.create_task(stalled.checkpoint(a, make_messages(2), runs[a]))
    try:
        async with asyncio.timeout(5):
            await parked.wait()
        async with asyncio.timeout(5):
            for n in (2, 3, 4):
                assert (await stalled.checkpoint(b, make_messages(n), runs[b])).thread_seq == n
                assert (await other.checkpoint(c, make_messages(n), runs[c])).thread_seq == n
        assert not stuck.done(), "thread A's checkpoint was not stalled at all"
    finally:
        release.set()
    receipt = await asyncio.wait_for(stuck, 10)
    assert receipt.thread_seq == 2
    assert await other.load_messages(a) == make_messages(2)


# -- no synchronous inner-store work ---------------------------------------------------


async def test_checkpoint_does_not_touch_the_inner_store(
    open_store: StoreFactory, inner: InnerStore
) -> None:
    """Checkpoints only append to the WAL: with no flusher, the inner store is never
    written and holds nothing. The one call a thread costs is a read on its very first
    checkpoint (the WAL has never seen it: the inner store may hold older seqs); later
    checkpoints make no call at all."""
    spy = FaultyFlushTarget(inner)
    store = await open_store(spy, drain_on_close=False)
    threads = [tid() for _ in range(3)]
    for thread in threads:
        run = make_run(thread)
        for n in range(1, 4):
            await store.checkpoint(thread, make_messages(n), run)
    assert dict(spy.calls) == {"read_thread": len(threads)}, dict(spy.calls)
    for thread in threads:
        assert await inner.load_thread(thread) is None
        assert await inner.load_messages(thread) is None
        assert await store.load_messages(thread) == make_messages(3)
    assert await inner.list_threads() == []
    assert await inner.list_runs() == []


async def test_wrapping_a_store_that_already_holds_the_thread_continues_its_seqs(
    open_store: StoreFactory, inner: InnerStore
) -> None:
    """A thread written straight to the inner store before the buffer was put in front of
    it: the first buffered checkpoint continues its seqs with an append-only delta, and
    the flush applies it (it must not be judged stale and dropped)."""
    thread = tid()
    run = make_run(thread)
    for n in range(1, 4):
        await inner.checkpoint(thread, make_messages(n), run)
    store = await open_store(inner, drain_on_close=False)
    receipt = await store.checkpoint(thread, make_messages(5), run)
    assert receipt.thread_seq == 4
    assert await store.load_messages(thread) == make_messages(5)
    assert store.stats()["wal_bytes"] < len(encode_entry_of_messages(thread, 5)), (
        "the first buffered entry should be a delta of 2 messages, not the snapshot"
    )
    assert await store.force_flush(thread) == 4
    assert await inner.load_messages(thread) == make_messages(5)


def encode_entry_of_messages(thread: str, count: int) -> bytes:
    """Wire size reference: an entry carrying `count` whole messages."""
    from buffered_store.model.checkpointing import build_checkpoint_entry, validate_checkpoint

    call = validate_checkpoint(thread, make_messages(count), make_run(thread), None)
    entry = build_checkpoint_entry(call, previous=None, previous_messages=None, seq=1, now=utcnow())
    return encode_entry(entry)


# -- idempotent publish ----------------------------------------------------------------


async def test_same_msg_id_published_twice_is_stored_once(
    open_store: StoreFactory, subject_counts: SubjectCounter
) -> None:
    """Invariant 3 at the adapter: the second publish of (thread, seq) is recognised
    (reported as a duplicate, or refused by the per-subject CAS) and not stored again."""
    store = await open_store(InMemoryThreadRunStore(), drain_on_close=False)
    thread = tid()
    subject = wal_subject(store.config.stream_name, thread)
    entry = WalEntry(
        thread_id=thread,
        seq=1,
        kind=EntryKind.CHECKPOINT,
        at=utcnow(),
        messages=(b'{"content":"hi","role":"user"}',),
        message_count=1,
        run=make_run(thread),
        writer="w1",
    )
    payload = encode_entry(entry)
    first, duplicate = await store.wal.publish(
        subject, payload, msg_id=msg_id(thread, 1), expected_last_subject_seq=0
    )
    assert not duplicate
    try:
        again, duplicate = await store.wal.publish(
            subject, payload, msg_id=msg_id(thread, 1), expected_last_subject_seq=0
        )
    except ConflictError:
        pass
    else:
        assert (again, duplicate) == (first, True)
    assert (await subject_counts(store)).get(subject) == 1


async def test_publish_retried_after_a_lost_ack_creates_one_entry(
    open_store: StoreFactory, monkeypatch: pytest.MonkeyPatch, subject_counts: SubjectCounter
) -> None:
    """Invariant 3 end to end: the server stored the entry but its ack was lost; the
    writer's retry must not append a second entry, and the checkpoint keeps its seq."""
    store = await open_store(InMemoryThreadRunStore(), drain_on_close=False)
    thread = tid()
    run = make_run(thread)
    await store.checkpoint(thread, make_messages(1), run)
    real_publish = store.wal.publish
    lost = 0

    async def publish_losing_first_ack(subj: str, payload: bytes, **kw: Any) -> tuple[int, bool]:
        nonlocal lost
        result = await real_publish(subj, payload, **kw)
        if lost == 0:
            lost += 1
            raise WalUnavailableError("ack lost (injected)")
        return result

    monkeypatch.setattr(store.wal, "publish", publish_losing_first_ack)
    receipt = await store.checkpoint(thread, make_messages(2), run)
    monkeypatch.undo()
    assert lost == 1
    assert receipt.thread_seq == 2
    subject = wal_subject(store.config.stream_name, thread)
    assert (await subject_counts(store)).get(subject) == 2
    assert (await store.checkpoint(thread, make_messages(3), run)).thread_seq == 3
    assert await stored_seqs(store, thread, 3) == [1, 2, 3]
    await store.force_flush(thread)
    assert await store.inner.load_messages(thread) == make_messages(3)


# -- commit unknown ----------------------------------------------------------------------


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


@pytest.mark.parametrize("earlier", [0, 2], ids=["first-checkpoint", "third-checkpoint"])
async def test_commit_unknown_checkpoint_is_flushed_by_force_flush(
    open_store: StoreFactory, inner: InnerStore, monkeypatch: pytest.MonkeyPatch, earlier: int
) -> None:
    """A checkpoint whose publish landed but whose hot-record update failed raises
    CommitUnknownError naming its seq; the entry is durable, so a later force_flush (the
    next call on the thread, no checkpoint in between) lands it in the inner store."""
    store = await open_store(inner, drain_on_close=False)
    thread = tid()
    run = make_run(thread)
    for n in range(1, earlier + 1):
        await store.checkpoint(thread, make_messages(n), run)
    failures = fail_next_hot_update(monkeypatch)
    with pytest.raises(CommitUnknownError) as caught:
        await store.checkpoint(thread, make_messages(earlier + 1), run.replace(steps=99))
    assert failures == [earlier + 1]
    assert caught.value.thread_id == thread
    assert caught.value.thread_seq == earlier + 1
    monkeypatch.undo()

    assert await store.force_flush(thread) == earlier + 1
    assert await inner.load_messages(thread) == make_messages(earlier + 1)
    latest = await inner.latest_run(thread)
    assert latest is not None
    assert latest.steps == 99


async def test_commit_unknown_seq_is_neither_reused_nor_skipped(
    open_store: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Invariant 2 after "commit unknown": the next checkpoint (same instance, or a fresh
    one) takes the next seq; the stream holds 1..N, each once."""
    store = await open_store(InMemoryThreadRunStore(), drain_on_close=False)
    thread = tid()
    run = make_run(thread)
    await store.checkpoint(thread, make_messages(1), run)
    fail_next_hot_update(monkeypatch)
    with pytest.raises(CommitUnknownError):
        await store.checkpoint(thread, make_messages(2), run)
    monkeypatch.undo()
    assert (await store.checkpoint(thread, make_messages(3), run)).thread_seq == 3
    fresh = await open_store(InMemoryThreadRunStore(), drain_on_close=False)
    assert (await fresh.checkpoint(thread, make_messages(4), run)).thread_seq == 4
    assert await stored_seqs(store, thread, 4) == [1, 2, 3, 4]
    assert await store.load_messages(thread) == make_messages(4)


async def test_commit_unknown_when_the_hot_bucket_stays_unreachable(
    open_store: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The KV update keeps failing until the checkpoint's budget runs out: the caller gets
    CommitUnknownError (not a silent success, not a plain failure), and the entry is kept."""
    store = await open_store(
        InMemoryThreadRunStore(), drain_on_close=False, checkpoint_timeout_s=0.5
    )
    thread = tid()
    run = make_run(thread)
    await store.checkpoint(thread, make_messages(1), run)
    real_swap = store.wal.kv_swap
    key = hot_key(thread)

    async def kv_swap(k: str, value: bytes, *, revision: int | None) -> int:
        if k == key:
            raise WalUnavailableError("KV down (injected)")
        return await real_swap(k, value, revision=revision)

    monkeypatch.setattr(store.wal, "kv_swap", kv_swap)
    with pytest.raises(CommitUnknownError) as caught:
        await store.checkpoint(thread, make_messages(2), run)
    assert caught.value.thread_id == thread
    monkeypatch.undo()
    assert (await store.checkpoint(thread, make_messages(3), run)).thread_seq == 3
    assert await stored_seqs(store, thread, 3) == [1, 2, 3]


# -- garbage on a thread subject -----------------------------------------------------------


async def test_garbage_on_a_thread_subject_breaks_neither_writers_nor_readers(
    open_store: StoreFactory, inner: InnerStore
) -> None:
    """Raw payloads published on a thread's subject by someone else (not JSON; a valid
    entry of another thread; a well-formed entry claiming a far seq) hold no seq: the next
    checkpoints, from the same and from a cold instance, continue 3, 4; reads ignore them;
    force_flush lands the real entries only."""
    store = await open_store(inner, drain_on_close=False)
    thread = tid()
    run = make_run(thread)
    for n in (1, 2):
        await store.checkpoint(thread, make_messages(n), run)
    subject = wal_subject(store.config.stream_name, thread)
    forged = WalEntry(
        thread_id=thread,
        seq=99,
        kind=EntryKind.CHECKPOINT,
        at=utcnow(),
        messages=(b'{"content":"forged","role":"user"}',),
        message_count=1,
        run=make_run(thread),
    )
    foreign = WalEntry(
        thread_id="someone-else",
        seq=3,
        kind=EntryKind.CHECKPOINT,
        at=utcnow(),
        message_count=0,
    )
    for junk in (b"not-json", encode_entry(foreign), encode_entry(forged), b"{}"):
        await store.wal.append(subject, junk)

    cold = await open_store(InMemoryThreadRunStore(), drain_on_close=False)
    assert await cold.load_messages(thread) == make_messages(2)
    assert await store.load_messages(thread) == make_messages(2)
    assert (await store.checkpoint(thread, make_messages(3), run)).thread_seq == 3
    await store.wal.append(subject, b"not-json")
    assert (await cold.checkpoint(thread, make_messages(4), run)).thread_seq == 4
    assert (await store.checkpoint(thread, make_messages(5), run)).thread_seq == 5
    assert await cold.load_messages(thread) == make_messages(5)
    thread_row = await store.load_thread(thread)
    assert thread_row is not None
    assert thread_row.message_count == 5

    assert await store.force_flush(thread) == 5
    assert await inner.load_messages(thread) == make_messages(5)
    assert await stored_seqs(store, thread, 5) == [1, 2, 3, 4, 5]


# -- hostile thread ids -----------------------------------------------------------------


HOSTILE_IDS = ["a.b.c", "*", ">", "a b\tc", "emoji 🧵🔥", "..", "a.*.>", "$JS.API", "ü.ñ"]


async def test_hostile_thread_ids_are_encoded_into_one_subject_token(
    open_store: StoreFactory, inner: InnerStore, subject_counts: SubjectCounter
) -> None:
    """Bad input: ids with dots, wildcards, spaces and emoji become exactly one subject
    token (stream.t.<token>), never collide, and round-trip through reads and a flush.
    The empty id is rejected and nothing is written."""
    store = await open_store(inner, drain_on_close=False)
    suffix = uuid.uuid4().hex[:6]
    ids = [f"{raw}{suffix}" for raw in HOSTILE_IDS] + [raw for raw in ("*", ">", ".")]
    for n, thread in enumerate(ids, start=1):
        await store.checkpoint(thread, make_messages(n), make_run(thread))
    with pytest.raises(ValidationError):
        await store.checkpoint("", make_messages(1), make_run("x"))

    counts = await subject_counts(store)
    stream = store.config.stream_name
    assert len(counts) == len(ids)
    for subject, count in counts.items():
        tokens = subject.split(".")
        assert tokens[:2] == [stream, "t"], subject
        assert len(tokens) == 3, subject
        assert not set(tokens[2]) & set("*> \t"), subject
        assert count == 1

    other = await open_store(InMemoryThreadRunStore(), drain_on_close=False)
    for n, thread in enumerate(ids, start=1):
        assert await other.load_messages(thread) == make_messages(n), thread
    assert {t.thread_id for t in await other.list_threads(limit=100)} == set(ids)
    assert await store.force_flush_all() == len(ids)
    for n, thread in enumerate(ids, start=1):
        assert await inner.load_messages(thread) == make_messages(n), thread


# -- server objects ---------------------------------------------------------------------


async def test_connect_with_a_conflicting_max_age_is_refused(
    open_store: StoreFactory, make_config: ConfigFactory
) -> None:
    """An existing stream with another max_age is never silently reconfigured or used."""
    await open_store(InMemoryThreadRunStore(), max_age_s=3600.0)
    with pytest.raises(ConfigError) as caught:
        await BufferedThreadRunStore.connect(
            InMemoryThreadRunStore(), make_config(max_age_s=7200.0)
        )
    message = str(caught.value)
    assert "max_age" in message
    assert make_config().stream_name in message


async def test_second_connect_reuses_stream_buckets_and_consumer(
    open_store: StoreFactory, config: Any
) -> None:
    """Reconnecting with the same names reuses the objects (same creation time, data
    still there) instead of failing or recreating them."""
    first = await open_store(InMemoryThreadRunStore(), drain_on_close=False)
    thread = tid()
    await first.checkpoint(thread, make_messages(2), make_run(thread))
    async with jetstream(config) as js:
        stream_before = await js.stream_info(config.stream_name)
        consumer_before = await js.consumer_info(config.stream_name, config.consumer_name)
        hot_before = await js.stream_info(f"KV_{config.hot_bucket}")

        second = await open_store(InMemoryThreadRunStore(), drain_on_close=False)
        assert (await js.stream_info(config.stream_name)).created == stream_before.created
        consumer_after = await js.consumer_info(config.stream_name, config.consumer_name)
        assert consumer_after.created == consumer_before.created
        assert (await js.stream_info(f"KV_{config.hot_bucket}")).created == hot_before.created
    assert await second.load_messages(thread) == make_messages(2)
    assert (await second.checkpoint(thread, make_messages(3), make_run(thread))).thread_seq == 2
