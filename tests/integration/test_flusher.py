"""The flusher service against real NATS, with the in-memory and the Postgres inner store.

Entries are published straight onto the WAL by a minimal writer (`Writer` below: the same
entries, msg ids, per-subject compare-and-set and hot records as the buffered store), so
these tests exercise the flusher alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import pytest

from buffered_store.config import EngineConfig
from buffered_store.dev.services import NatsServer
from buffered_store.engine import ids
from buffered_store.engine.flushing import ApplyOutcome, ApplyStatus, FlushSink
from buffered_store.engine.ids import MAX_ID_BYTES, utcnow
from buffered_store.engine.keys import hot_key, msg_id, wal_subject
from buffered_store.engine.threadlog import ThreadLog
from buffered_store.errors import WalUnavailableError
from buffered_store.model.changes import (
    WalEntry,
)
from buffered_store.model.checkpointing import build_checkpoint_entry, validate_checkpoint
from buffered_store.model.protocol import ThreadRunStore
from buffered_store.model.records import Message, RunRecord, Thread
from buffered_store.model.target import FlushTarget
from buffered_store.nats import NatsWal
from buffered_store.nats import scan as nats_scan
from buffered_store.nats.delivery import NatsDelivered
from buffered_store.stores.memory import InMemoryThreadRunStore
from buffered_store.testing import FaultyFlushTarget, InnerStore, make_messages, make_run
from buffered_store.threadrun.entry import (
    FORMAT,
    HotRecord,
    advance_hot,
    encode_entry,
    encode_hot,
)
from flusher import Flusher, FlusherConfig
from flusher.quarantine import QuarantineKind, list_quarantine, replay
from tests.plugins.stores import ConfigFactory, PostgresFactory, jetstream
from tests.plugins.waiting import eventually

FAST: dict[str, Any] = {
    "flush_interval_s": 0.05,
    "fetch_timeout_s": 0.2,
    "ack_wait_s": 5.0,
    "nak_delay_initial_s": 0.05,
    "nak_delay_max_s": 0.5,
    "requeue_delay_s": 0.02,
    "db_retry_initial_s": 0.02,
    "db_retry_max_s": 0.2,
    "nats_retry_initial_s": 0.05,
    "nats_retry_max_s": 0.5,
    "poison_attempts": 3,
    "drain_timeout_s": 10.0,
}


# -- a minimal WAL writer -------------------------------------------------------------------


@dataclass
class _Cursor:
    seq: int = 0
    subject_seq: int = 0
    hot: HotRecord | None = None
    revision: int | None = None
    thread: Thread | None = None
    messages: list[bytes] | None = None


@dataclass
class Writer:
    """Publishes checkpoint entries the way the buffered store does (CAS on the subject,
    dedup id, hot record), plus arbitrary payloads."""

    wal: Any
    cursors: dict[str, _Cursor] = field(default_factory=dict)

    async def checkpoint(
        self, thread_id: str, messages: Sequence[Message], run: RunRecord | None = None
    ) -> WalEntry:
        cursor = self.cursors.setdefault(thread_id, _Cursor())
        call = validate_checkpoint(thread_id, messages, run or make_run(thread_id), None)
        entry = build_checkpoint_entry(
            call,
            previous=cursor.thread,
            previous_messages=cursor.messages,
            seq=cursor.seq + 1,
            now=utcnow(),
        )
        stream_seq = await self._publish(
            thread_id, encode_entry(entry), msg_id(thread_id, entry.seq)
        )
        cursor.hot = advance_hot(cursor.hot, entry, stream_seq, window=64)
        cursor.revision = await self.wal.kv_swap(
            hot_key(thread_id), encode_hot(cursor.hot), revision=cursor.revision
        )
        cursor.seq, cursor.thread, cursor.messages = entry.seq, entry.thread, call.encoded
        return replace(entry, stream_seq=stream_seq)

    async def raw(self, thread_id: str, payload: bytes) -> int:
        """Publish any payload on the thread's subject; returns its stream seq."""
        return await self._publish(thread_id, payload, f"raw-{uuid.uuid4().hex}")

    async def _publish(self, thread_id: str, payload: bytes, dedup_id: str) -> int:
        cursor = self.cursors.setdefault(thread_id, _Cursor())
        subject = wal_subject(self.wal.config.stream_name, thread_id)
        stream_seq, _ = await self.wal.publish(
            subject, payload, msg_id=dedup_id, expected_last_subject_seq=cursor.subject_seq
        )
        cursor.subject_seq = stream_seq
        return int(stream_seq)


# -- fixtures and helpers -------------------------------------------------------------------


@pytest.fixture
def fconfig(make_config: ConfigFactory) -> FlusherConfig:
    """A fast flusher config on this test's unique WAL names."""
    return FlusherConfig.from_store_config(make_config(), **FAST)


@pytest.fixture
async def wal(fconfig: FlusherConfig) -> AsyncIterator[Any]:
    from buffered_store.nats import NatsWal

    opened = await NatsWal.connect(fconfig, name="test-writer")
    yield opened
    await opened.close()


@pytest.fixture
def writer(wal: Any) -> Writer:
    return Writer(wal)


@pytest.fixture
async def flushers() -> AsyncIterator[list[Flusher]]:
    """Flushers to stop (without drain) at the end, whatever the test did."""
    started: list[Flusher] = []
    yield started
    for item in started:
        with contextlib.suppress(Exception):
            await item.stop(drain=False)


async def start(flushers: list[Flusher], inner: Any, config: FlusherConfig) -> Flusher:
    service = Flusher(inner, config)
    await service.start()
    flushers.append(service)
    return service


def tid(label: str = "t") -> str:
    return f"{label}-{uuid.uuid4().hex[:10]}"


async def flushed_to(
    target: FlushSink[Any], expected: dict[str, int], timeout_s: float = 10.0
) -> None:
    async def check() -> bool:
        return await target.flushed_seqs(list(expected)) == expected

    await eventually(check, timeout_s=timeout_s, what=f"watermarks {expected}")


def counters(inner: Any) -> dict[str, int]:
    return cast(dict[str, int], inner.stats())


async def consumer_state(wal: Any) -> tuple[int, int]:
    info = await wal.consumer_state()
    return int(info.num_pending), int(info.num_ack_pending)


# -- coalescing -----------------------------------------------------------------------------


async def test_coalesces_ten_entries_of_one_thread(
    inner: InnerStore, writer: Writer, fconfig: FlusherConfig, flushers: list[Flusher]
) -> None:
    thread = tid()
    run = make_run(thread)
    for step in range(1, 11):
        await writer.checkpoint(thread, make_messages(step), run.replace(steps=step))
    service = await start(flushers, inner, fconfig)
    await flushed_to(inner, {thread: 10})
    await service.wait_idle()
    assert counters(inner)["thread_applications"] < 10
    assert counters(inner)["applied_entries"] == 10
    assert await inner.load_messages(thread) == make_messages(10)
    latest = await inner.latest_run(thread)
    assert latest is not None
    assert latest.steps == 10
    stats = service.stats()
    assert stats["entries_applied"] == 10
    assert stats["coalesced_entries"] >= 1
    assert stats["acked"] == 10


async def test_eight_threads_each_end_with_their_own_latest_run(
    inner: InnerStore, writer: Writer, fconfig: FlusherConfig, flushers: list[Flusher]
) -> None:
    threads = [tid(f"t{i}") for i in range(8)]
    latest: dict[str, str] = {}
    for step in range(1, 6):
        for thread in threads:
            run = make_run(thread)
            latest[thread] = run.run_id
            await writer.checkpoint(thread, make_messages(step), run)
    service = await start(flushers, inner, fconfig)
    await flushed_to(inner, dict.fromkeys(threads, 5))
    for thread in threads:
        found = await inner.latest_run(thread)
        assert found is not None
        assert found.run_id == latest[thread]
        assert len(await inner.list_runs(thread)) == 5  # every distinct run survived
        assert await inner.load_messages(thread) == make_messages(5)
    assert counters(inner)["thread_applications"] < 40
    assert service.stats()["transactions"] < 40


# -- ack after the watermark ----------------------------------------------------------------


async def test_messages_are_acked_only_after_their_commit(
    inner: InnerStore,
    writer: Writer,
    fconfig: FlusherConfig,
    flushers: list[Flusher],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events: list[tuple[str, int]] = []
    original_apply = type(inner).apply
    original_ack = NatsDelivered.ack

    async def apply(self: Any, batches: Any) -> Any:
        outcomes = await original_apply(self, batches)
        events.extend(("commit", o.flushed_seq) for o in outcomes)
        return outcomes

    async def ack(self: NatsDelivered) -> None:
        events.append(("ack", self.stream_seq))
        await original_ack(self)

    monkeypatch.setattr(type(inner), "apply", apply)
    monkeypatch.setattr(NatsDelivered, "ack", ack)
    thread = tid()
    written = [await writer.checkpoint(thread, make_messages(i)) for i in range(1, 4)]
    service = await start(flushers, inner, fconfig)
    await flushed_to(inner, {thread: 3})
    await service.wait_idle()
    acks = {value: i for i, (kind, value) in enumerate(events) if kind == "ack"}
    assert sorted(acks) == [e.stream_seq for e in written]
    for entry in written:
        committed = next(
            i for i, (kind, seq) in enumerate(events) if kind == "commit" and seq >= entry.seq
        )
        assert acks[entry.stream_seq] > committed
    # The watermark is the inner store's: no KV mark is raised per thread and cycle.
    assert await ThreadLog(service.wal, fconfig, FORMAT).mark(thread) is None


async def test_stale_duplicate_is_acked_and_never_moves_back(
    inner: InnerStore, writer: Writer, fconfig: FlusherConfig, flushers: list[Flusher]
) -> None:
    thread = tid()
    old = await writer.checkpoint(thread, make_messages(1))
    await writer.checkpoint(thread, make_messages(2))
    await writer.checkpoint(thread, make_messages(3))
    service = await start(flushers, inner, fconfig)
    await flushed_to(inner, {thread: 3})
    # A late copy of entry 1 (an old writer's retry outside the dedup id) shows up.
    await writer.raw(thread, encode_entry(old))
    await eventually(
        lambda: _stat_at_least(service, "stale_entries", 1), what="the stale entry to be acked"
    )
    await service.wait_idle()
    assert (await inner.flushed_seqs([thread]))[thread] == 3
    assert await inner.load_messages(thread) == make_messages(3)
    assert await consumer_state(service.wal) == (0, 0)


async def _stat_at_least(service: Flusher, name: str, value: float) -> bool:
    return service.stats()[name] >= value


# -- gaps -----------------------------------------------------------------------------------


async def test_missing_earlier_entries_are_fetched_from_the_stream(
    inner: InnerStore, writer: Writer, wal: Any, fconfig: FlusherConfig, flushers: list[Flusher]
) -> None:
    thread = tid()
    for step in range(1, 5):
        await writer.checkpoint(thread, make_messages(step))
    # Another consumer of the durable takes entries 1-2 and sits on them.
    thief = await wal.subscribe()
    stolen = await thief.fetch(2, 2)
    assert [m.stream_seq for m in stolen] == [1, 2]
    service = await start(flushers, inner, fconfig)
    await flushed_to(inner, {thread: 4})
    assert await inner.load_messages(thread) == make_messages(4)
    stats = service.stats()
    assert stats["gaps"] >= 1
    assert stats["entries_fetched"] >= 2
    for msg in stolen:  # handed back: they come in stale and are acked
        await msg.nak()
    await service.wait_idle()
    assert service.stats()["stale_entries"] >= 2
    await thief.close()


# -- failures ---------------------------------------------------------------------------------


async def test_database_errors_are_retried_until_the_data_arrives(
    inner: InnerStore,
    writer: Writer,
    fconfig: FlusherConfig,
    flushers: list[Flusher],
    caplog: pytest.LogCaptureFixture,
) -> None:
    faulty = FaultyFlushTarget(inner)
    faulty.fail_next_applies(3)
    thread = tid()
    await writer.checkpoint(thread, make_messages(2))
    caplog.set_level(logging.INFO, logger="flusher")
    service = await start(flushers, faulty, fconfig)
    await flushed_to(inner, {thread: 1})
    assert faulty.failed_applies == 3
    assert await inner.load_messages(thread) == make_messages(2)
    stats = service.stats()
    assert stats["db_retries"] == 3
    assert stats["db_retry_episodes"] == 1
    actions = [getattr(r, "action", None) for r in caplog.records]
    assert actions.count("db_unavailable") == 1
    assert actions.count("db_recovered") == 1


async def test_database_outage_holds_messages_and_flushes_once_back(
    make_config: ConfigFactory, flushers: list[Flusher]
) -> None:

    config = FlusherConfig.from_store_config(make_config(), **{**FAST, "ack_wait_s": 1.0})
    inner = InMemoryThreadRunStore()
    faulty = FaultyFlushTarget(inner)
    faulty.fail_next_applies(10**6)  # down until further notice
    thread = tid()
    service = await start(flushers, faulty, config)
    writer = Writer(service.wal)
    for step in range(1, 4):
        await writer.checkpoint(thread, make_messages(step))
    await eventually(lambda: _stat_at_least(service, "db_retries", 5), what="retries")
    await asyncio.sleep(1.5)  # longer than ack_wait: in-progress acks keep the messages
    assert service.stats()["redeliveries"] == 0
    faulty.fail_next_applies(0)
    await flushed_to(inner, {thread: 3})
    await service.wait_idle()
    assert service.stats()["db_retry_episodes"] == 1
    assert isinstance(service.wal, NatsWal)


# -- poison -----------------------------------------------------------------------------------


async def test_garbage_payload_is_quarantined_once_and_others_keep_flowing(
    inner: InnerStore, writer: Writer, fconfig: FlusherConfig, flushers: list[Flusher]
) -> None:
    bad_thread, good_thread = tid("bad"), tid("good")
    garbage_seq = await writer.raw(bad_thread, b"not-json")
    await writer.checkpoint(good_thread, make_messages(1))
    service = await start(flushers, inner, fconfig)
    await flushed_to(inner, {good_thread: 1})
    await service.wait_idle()
    records = await list_quarantine(service.wal)
    assert len(records) == 1
    [record] = records
    assert record.kind is QuarantineKind.MESSAGE
    assert record.stream_seq == garbage_seq
    assert record.subject == wal_subject(fconfig.stream_name, bad_thread)
    assert record.thread_id == bad_thread
    assert record.payload_bytes == len(b"not-json")
    assert record.preview_hex == b"not-json".hex()
    assert "JSON" in record.reason
    assert not record.replayable
    assert await inner.load_thread(bad_thread) is None
    await writer.checkpoint(good_thread, make_messages(2))  # still flowing afterwards
    await flushed_to(inner, {good_thread: 2})
    await service.wait_idle()
    stats = service.stats()
    assert stats["quarantined_messages"] == 1
    assert stats["redeliveries"] == 0
    assert len(await list_quarantine(service.wal)) == 1


async def test_two_identical_garbage_payloads_give_two_records(
    writer: Writer, fconfig: FlusherConfig, flushers: list[Flusher]
) -> None:
    thread = tid()
    first = await writer.raw(thread, b"\x00\x01garbage")
    second = await writer.raw(thread, b"\x00\x01garbage")
    service = await start(flushers, InMemoryThreadRunStore(), fconfig)
    await eventually(lambda: _stat_at_least(service, "quarantined_messages", 2), what="records")
    await service.wait_idle()
    records = await list_quarantine(service.wal)
    assert sorted(r.stream_seq or 0 for r in records) == [first, second]


async def test_garbage_is_dropped_after_bounded_deliveries_without_a_bucket(
    writer: Writer, wal: Any, fconfig: FlusherConfig, flushers: list[Flusher]
) -> None:
    config = fconfig.replace(poison_attempts=2)
    service = await start(flushers, InMemoryThreadRunStore(), config)
    async with jetstream(fconfig) as js:  # after start re-created it
        await js.delete_key_value(fconfig.quarantine_bucket)
    thread = tid()
    await writer.raw(thread, b"not-json")
    await eventually(
        lambda: _stat_at_least(service, "dropped_unrecorded", 1), what="the drop", timeout_s=15
    )
    await service.wait_idle()
    stats = service.stats()
    assert stats["messages"] == 4  # 2 x poison_attempts deliveries, then terminated
    assert stats["quarantined_messages"] == 0
    assert await consumer_state(service.wal) == (0, 0)


class PoisonTarget:
    """Delegates to an inner store, but fails (not retriable) every batch of `thread_id`
    that holds the entry with seq `bad_seq`, until healed."""

    def __init__(self, inner: InnerStore, thread_id: str, bad_seq: int) -> None:
        self.inner = inner
        self.thread_id = thread_id
        self.bad_seq = bad_seq
        self.healed = False

    async def apply(self, batches: Sequence[Sequence[WalEntry]]) -> list[ApplyOutcome]:
        if self.healed:
            return await self.inner.apply(batches)
        good = [b for b in batches if not self._poisoned(b)]
        outcomes = iter(await self.inner.apply(good) if good else [])
        watermark = (await self.inner.flushed_seqs([self.thread_id]))[self.thread_id]
        return [
            ApplyOutcome(
                self.thread_id, ApplyStatus.FAILED, watermark, error="rejected", retriable=False
            )
            if self._poisoned(b)
            else next(outcomes)
            for b in batches
        ]

    def _poisoned(self, batch: Sequence[WalEntry]) -> bool:
        return any(e.thread_id == self.thread_id and e.seq == self.bad_seq for e in batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_entry_that_never_applies_quarantines_its_thread_and_replays(
    inner: InnerStore, writer: Writer, fconfig: FlusherConfig, flushers: list[Flusher]
) -> None:
    sick, healthy = tid("sick"), tid("healthy")
    for step in range(1, 5):
        await writer.checkpoint(sick, make_messages(step))
    await writer.checkpoint(healthy, make_messages(1))
    target = PoisonTarget(inner, sick, bad_seq=3)
    service = await start(flushers, target, fconfig)
    await eventually(
        lambda: _stat_at_least(service, "quarantined_threads", 1), what="quarantine", timeout_s=15
    )
    await service.wait_idle()
    # Entries before the culprit were applied; the culprit and what follows are held.
    assert await inner.flushed_seqs([sick, healthy]) == {sick: 2, healthy: 1}
    records = {r.kind: r for r in await list_quarantine(service.wal)}
    assert records[QuarantineKind.THREAD].thread_id == sick
    assert records[QuarantineKind.THREAD].seq == 3
    assert len(records[QuarantineKind.THREAD].stream_seqs) == 2
    assert records[QuarantineKind.MESSAGE].seq == 3
    # A later entry of the quarantined thread joins the quarantine; others keep flowing.
    await writer.checkpoint(sick, make_messages(5))
    await writer.checkpoint(healthy, make_messages(2))
    await flushed_to(inner, {healthy: 2})
    await service.wait_idle()
    thread_record = next(r for r in await list_quarantine(service.wal) if r.thread_id == sick)
    assert len(thread_record.stream_seqs) == 3
    # Fixed: replay flushes the thread from its watermark and clears its records.
    target.healed = True
    result = await replay(ThreadLog(service.wal, fconfig, FORMAT), target, thread_id=sick)
    assert result.flushed_seq == 5
    assert await inner.load_messages(sick) == make_messages(5)
    assert await list_quarantine(service.wal) == []


# -- several flushers -------------------------------------------------------------------------


async def test_two_flushers_apply_each_entry_once(
    writer: Writer, fconfig: FlusherConfig, flushers: list[Flusher]
) -> None:
    inner = InMemoryThreadRunStore()
    one = await start(flushers, inner, fconfig)
    two = await start(flushers, inner, fconfig)
    threads = [tid(f"t{i}") for i in range(4)]
    for step in range(1, 6):
        for thread in threads:
            await writer.checkpoint(thread, make_messages(step))
    await flushed_to(inner, dict.fromkeys(threads, 5))
    await one.wait_idle()
    await two.wait_idle()
    assert counters(inner)["applied_entries"] == 20
    for thread in threads:
        assert await inner.load_messages(thread) == make_messages(5)


async def test_shared_consumer_over_postgres_never_moves_backwards(
    writer: Writer, fconfig: FlusherConfig, flushers: list[Flusher], open_postgres: PostgresFactory
) -> None:
    first, second = await open_postgres(), await open_postgres()
    await start(flushers, first, fconfig)
    await start(flushers, second, fconfig)
    thread = tid()
    for step in range(1, 21):
        await writer.checkpoint(thread, make_messages(step))
    await flushed_to(first, {thread: 20})
    assert await second.load_messages(thread) == make_messages(20)
    total = counters(first)["applied_entries"] + counters(second)["applied_entries"]
    assert total == 20


# -- stop and restart -------------------------------------------------------------------------


async def test_stop_with_drain_flushes_what_it_holds(
    writer: Writer, fconfig: FlusherConfig, flushers: list[Flusher]
) -> None:
    inner = InMemoryThreadRunStore()
    faulty = FaultyFlushTarget(inner)
    faulty.block_applies()
    service = await start(flushers, faulty, fconfig)
    thread = tid()
    for step in range(1, 4):
        await writer.checkpoint(thread, make_messages(step))
    await asyncio.wait_for(faulty.wait_for_blocked_apply(), 10)
    stopping = asyncio.create_task(service.stop(drain=True))
    await asyncio.sleep(0.1)
    assert not stopping.done()  # the drain waits for the held batch
    faulty.unblock_applies()
    await asyncio.wait_for(stopping, 10)
    assert (await inner.flushed_seqs([thread]))[thread] == 3
    assert await consumer_state(writer.wal) == (0, 0)


async def test_stop_without_drain_gives_messages_back(
    writer: Writer, fconfig: FlusherConfig, flushers: list[Flusher]
) -> None:
    inner = InMemoryThreadRunStore()
    faulty = FaultyFlushTarget(inner)
    faulty.block_applies()
    service = await start(flushers, faulty, fconfig)
    thread = tid()
    await writer.checkpoint(thread, make_messages(1))
    await asyncio.wait_for(faulty.wait_for_blocked_apply(), 10)
    await asyncio.wait_for(service.stop(drain=False), 5)
    faulty.unblock_applies()
    # Given back at once (not after ack_wait): a new flusher takes it promptly.
    await start(flushers, inner, fconfig)
    await flushed_to(inner, {thread: 1}, timeout_s=3)


async def test_generic_target_over_a_plain_store(
    writer: Writer, fconfig: FlusherConfig, flushers: list[Flusher]
) -> None:
    class PlainStore:
        """Only the ThreadRunStore protocol: no FlushTarget methods."""

        def __init__(self) -> None:
            self._inner = InMemoryThreadRunStore()

        def __getattr__(self, name: str) -> Any:
            if name in {"apply", "read_thread", "read_run", "read_runs", "flushed_seqs"}:
                raise AttributeError(name)
            return getattr(self._inner, name)

    plain = PlainStore()
    assert not isinstance(plain, FlushTarget)
    thread = tid()
    runs = [make_run(thread) for _ in range(2)]
    for step in range(1, 5):
        await writer.checkpoint(thread, make_messages(step), runs[step % 2])
    service = await start(flushers, cast(ThreadRunStore, plain), fconfig)
    await flushed_to(service.target, {thread: 4})
    store = cast(ThreadRunStore, plain)
    assert await store.load_messages(thread) == make_messages(4)
    latest = await store.latest_run(thread)
    assert latest is not None
    assert latest.run_id == runs[0].run_id
    assert len(await store.list_runs(thread)) == 2
    mark = await ThreadLog(service.wal, fconfig, FORMAT).mark(thread)
    assert mark is not None
    assert mark.seq == 4


async def test_recovers_from_a_nats_server_restart(flushers: list[Flusher]) -> None:
    from buffered_store.nats import NatsWal

    server = NatsServer()
    await asyncio.to_thread(server.start)
    try:
        token = uuid.uuid4().hex[:8]
        config = FlusherConfig(
            nats_url=server.url,
            stream_name=f"R{token}",
            hot_bucket=f"hot{token}",
            quarantine_bucket=f"q{token}",
            consumer_name=f"c{token}",
            **FAST,
        )
        wal = await NatsWal.connect(config, name="test-writer")
        writer = Writer(wal)
        inner = InMemoryThreadRunStore()
        service = await start(flushers, inner, config)
        thread = tid()
        for step in range(1, 4):
            await writer.checkpoint(thread, make_messages(step))
        await flushed_to(inner, {thread: 3})
        await asyncio.to_thread(server.restart)
        for step in range(4, 7):
            await _retry_wal(functools.partial(writer.checkpoint, thread, make_messages(step)))
        await flushed_to(inner, {thread: 6}, timeout_s=20)
        assert await inner.load_messages(thread) == make_messages(6)
        # The pull subscription is re-created once the flusher notices the reconnect; that
        # can land after the entries above were flushed, so wait for it (bounded).
        deadline = asyncio.get_running_loop().time() + 10
        while service.stats()["resubscribes"] < 1:
            assert asyncio.get_running_loop().time() < deadline, "never resubscribed"
            await asyncio.sleep(0.05)
        await service.stop()
        await wal.close()
    finally:
        await asyncio.to_thread(server.close)


async def _retry_wal(call: Callable[[], Awaitable[Any]], timeout_s: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await call()
        except WalUnavailableError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def test_config_of_a_store_is_accepted(
    make_config: ConfigFactory, flushers: list[Flusher]
) -> None:
    store_config: EngineConfig = make_config(flush_interval_s=0.05)
    service = Flusher(InMemoryThreadRunStore(), store_config)
    assert isinstance(service.config, FlusherConfig)
    assert service.config.stream_name == store_config.stream_name
    await service.start()
    flushers.append(service)
    await service.stop()
    assert not service.running


# -- command line -----------------------------------------------------------------------------


def cli_env(config: FlusherConfig) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUFSTORE_")}
    env.update(
        BUFSTORE_NATS_URL=config.nats_url,
        BUFSTORE_STREAM_NAME=config.stream_name,
        BUFSTORE_HOT_BUCKET=config.hot_bucket,
        BUFSTORE_QUARANTINE_BUCKET=config.quarantine_bucket,
        BUFSTORE_CONSUMER_NAME=config.consumer_name,
        BUFSTORE_ACK_WAIT_S=str(config.ack_wait_s),
        BUFSTORE_FLUSH_INTERVAL_S="0.05",
    )
    return env


async def run_cli(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    bufstore = Path(sys.executable).with_name("bufstore")
    proc = await asyncio.create_subprocess_exec(
        str(bufstore),
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return int(proc.returncode or 0), out.decode(), err.decode()


async def test_quarantine_commands(
    writer: Writer,
    fconfig: FlusherConfig,
    flushers: list[Flusher],
    database_url: str,
    open_postgres: PostgresFactory,
    schema_name: str,
) -> None:
    await open_postgres()  # migrates the schema the replay command opens
    garbage = await writer.raw(tid(), b"not-json")
    service = await start(flushers, InMemoryThreadRunStore(), fconfig)
    await eventually(lambda: _stat_at_least(service, "quarantined_messages", 1), what="record")
    env = cli_env(fconfig)
    code, out, _ = await run_cli(env, "quarantine", "list", "--json")
    assert code == 0
    [line] = out.splitlines()
    assert json.loads(line)["stream_seq"] == garbage
    code, out, err = await run_cli(
        env,
        "quarantine",
        "replay",
        "--stream-seq",
        str(garbage),
        "--database-url",
        database_url,
        "--schema",
        schema_name,
    )
    assert code == 1
    assert "cannot be replayed" in err
    code, out, _ = await run_cli(env, "quarantine", "drop", "--stream-seq", str(garbage))
    assert code == 0
    assert "dropped 1 record(s)" in out
    assert await list_quarantine(service.wal) == []


async def test_flusher_process_drains_into_postgres_until_sigterm(
    writer: Writer,
    fconfig: FlusherConfig,
    database_url: str,
    open_postgres: PostgresFactory,
    schema_name: str,
) -> None:
    pg = await open_postgres()
    thread = tid()
    for step in range(1, 4):
        await writer.checkpoint(thread, make_messages(step))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "flusher",
        "--database-url",
        database_url,
        "--schema",
        schema_name,
        "--stats-interval",
        "0",
        env=cli_env(fconfig),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        await flushed_to(pg, {thread: 3}, timeout_s=30)
        await writer.checkpoint(thread, make_messages(4))
        await flushed_to(pg, {thread: 4})
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    assert "stopping" in err.decode()
    assert await pg.load_messages(thread) == make_messages(4)


# -- data the database rejects (issue 9, finding 2) -------------------------------------------


def _cjk(count: int, start: int) -> str:
    """`count` distinct CJK ideographs (3 UTF-8 bytes each): nothing for Postgres to
    compress, so 512 of them in a thread id and a run id overflow the btree of
    ``runs_thread_created_idx`` (about 3,000 bytes > 2,704)."""
    return "".join(chr(start + i) for i in range(count))


@pytest.fixture
def older_id_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Accept ids as long as a version that counted characters did, so entries the
    database rejects can reach the WAL and `apply()`, as they did before the fix."""
    monkeypatch.setattr(ids, "MAX_ID_BYTES", 4 * MAX_ID_BYTES)


@pytest.mark.usefixtures("older_id_limit")
async def test_rejected_data_fails_only_its_thread_in_apply(pg_inner: InnerStore) -> None:
    sick = _cjk(512, 0x4E00)
    healthy = tid("healthy")

    def entry(thread_id: str, run_id: str | None = None) -> object:
        call = validate_checkpoint(
            thread_id, make_messages(1), make_run(thread_id, run_id=run_id), None
        )
        return build_checkpoint_entry(
            call, previous=None, previous_messages=None, seq=1, now=utcnow()
        )

    outcomes = await pg_inner.apply([[entry(sick, _cjk(512, 0x6000))], [entry(healthy)]])  # type: ignore[list-item]
    assert [o.status for o in outcomes] == [ApplyStatus.FAILED, ApplyStatus.APPLIED]
    assert not outcomes[0].retriable
    assert "ProgramLimitExceeded" in (outcomes[0].error or "")
    assert await pg_inner.flushed_seqs([sick, healthy]) == {sick: 0, healthy: 1}
    assert await pg_inner.load_thread(sick) is None


@pytest.mark.usefixtures("older_id_limit")
async def test_rejected_data_is_quarantined_and_other_threads_keep_flushing(
    pg_inner: InnerStore, writer: Writer, fconfig: FlusherConfig, flushers: list[Flusher]
) -> None:
    sick = _cjk(512, 0x4E00)
    healthy = tid("healthy")
    await writer.checkpoint(sick, make_messages(1), make_run(sick, run_id=_cjk(512, 0x6000)))
    await writer.checkpoint(healthy, make_messages(1))
    service = await start(flushers, pg_inner, fconfig)
    # Before the fix the rejection read as "database unavailable": retried forever, and
    # no thread flushed any more.
    await eventually(
        lambda: _stat_at_least(service, "quarantined_threads", 1), what="quarantine", timeout_s=15
    )
    await writer.checkpoint(healthy, make_messages(2))
    await flushed_to(pg_inner, {healthy: 2})
    quarantined = {r.kind: r for r in await list_quarantine(service.wal)}
    assert quarantined[QuarantineKind.THREAD].thread_id == sick
    assert "ProgramLimitExceeded" in quarantined[QuarantineKind.THREAD].reason
    assert service.stats()["db_retry_episodes"] == 0


# -- a deleted durable consumer (issue 9, finding 7) ------------------------------------------


async def test_deleted_consumer_is_created_again_and_flushing_resumes(
    inner: InnerStore,
    wal: Any,
    writer: Writer,
    fconfig: FlusherConfig,
    flushers: list[Flusher],
    caplog: pytest.LogCaptureFixture,
) -> None:
    first, second = tid("first"), tid("second")
    await writer.checkpoint(first, make_messages(1))
    service = await start(flushers, inner, fconfig)
    await flushed_to(inner, {first: 1})
    with caplog.at_level(logging.WARNING, logger="flusher.intake"):
        # An operator (or a stream reset script) deletes the consumer under the flusher:
        # nats-py then fails every fetch with "no responders", also after re-binding.
        async with jetstream(fconfig) as js:
            await js.delete_consumer(fconfig.stream_name, fconfig.consumer_name)
        await writer.checkpoint(first, make_messages(2))
        await writer.checkpoint(second, make_messages(1))
        await flushed_to(inner, {first: 2, second: 1})
    assert service.stats()["consumers_recreated"] == 1
    assert [r for r in caplog.records if getattr(r, "action", None) == "consumer_recreated"]
    async with jetstream(fconfig) as js:
        info = await js.consumer_info(fconfig.stream_name, fconfig.consumer_name)
    assert info.config.ack_wait == fconfig.ack_wait_s
    await service.wait_idle()


async def test_a_scan_cut_short_by_the_server_raises_instead_of_returning_less(
    wal: Any, writer: Writer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A status other than "no more messages" (a 409 when the consumer goes away) ends a
    consumer scan with `WalUnavailableError`, never with a silently shorter list."""
    monkeypatch.setattr(nats_scan, "SCAN_BATCH", 2)
    seqs = [await writer.raw("t0", f"p{i}".encode()) for i in range(6)]
    client = wal._nc  # the test speaks to the scan's inbox directly
    inboxes: list[str] = []
    new_inbox = client.new_inbox

    def recording_inbox() -> str:
        inboxes.append(new_inbox())
        return inboxes[-1]

    original_publish = client.publish

    async def publish(subject: str, payload: bytes = b"", **kwargs: Any) -> None:
        await original_publish(subject, payload, **kwargs)
        if ".CONSUMER.MSG.NEXT." in subject and inboxes:  # after the first pull request
            await original_publish(inboxes[-1], b"", headers={"Status": "409"})

    monkeypatch.setattr(client, "new_inbox", recording_inbox)
    monkeypatch.setattr(client, "publish", publish)
    with pytest.raises(WalUnavailableError, match="interrupted: 409"):
        await wal.read_range(seqs[0], seqs[-1])
    monkeypatch.undo()
    assert [m.seq for m in await wal.read_range(seqs[0], seqs[-1])] == seqs


async def test_read_range_returns_a_slice_of_the_stream_in_order(
    wal: Any, writer: Writer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`Wal.read_range` (the Spark overlay's tail read) over more than two pull requests,
    the last one cut short by the range's end."""
    monkeypatch.setattr(nats_scan, "SCAN_BATCH", 256)
    seqs = [await writer.raw(f"t{i % 3}", f"p{i}".encode()) for i in range(1200)]
    got = await wal.read_range(seqs[5], seqs[1100])
    assert [m.seq for m in got] == seqs[5:1101]
    assert [m.data for m in got] == [f"p{i}".encode() for i in range(5, 1101)]
    assert {m.subject for m in got} == {
        wal_subject(wal.config.stream_name, f"t{i}") for i in range(3)
    }
    assert await wal.read_range(seqs[-1] + 1, seqs[-1] + 10) == []
    assert await wal.read_range(seqs[3], seqs[2]) == []


# -- a stalled apply transaction --------------------------------------------------------------


async def test_a_stalled_apply_transaction_is_abandoned_and_releases_its_locks(
    pg_inner: InnerStore,
    writer: Writer,
    fconfig: FlusherConfig,
    flushers: list[Flusher],
    database_url: str,
    schema_name: str,
) -> None:
    """A cycle's transaction that does not finish (here: its message insert waits on a
    table lock another session holds) is abandoned after `apply_timeout_s`: the locks it
    took are released (a third session, say a migration, gets the threads table), it is
    retried like after a lost database, and the cycle completes once the stall ends.
    Before the bound, the transaction waited for ever, and a migration behind it."""
    import psycopg

    config = replace(fconfig, flusher=replace(fconfig.flusher, apply_timeout_s=1.0))
    thread = tid()
    await writer.checkpoint(thread, make_messages(1))
    service = await start(flushers, pg_inner, config)
    await flushed_to(pg_inner, {thread: 1})

    url = database_url.replace("postgresql+psycopg://", "postgresql://")
    async with (
        await psycopg.AsyncConnection.connect(url) as blocker,
        await psycopg.AsyncConnection.connect(url) as third,
    ):
        await blocker.execute(f'LOCK TABLE "{schema_name}".messages IN SHARE ROW EXCLUSIVE MODE')
        await writer.checkpoint(thread, make_messages(2))
        await eventually(
            functools.partial(blocked_by, third, blocker.info.backend_pid),
            what="the flush waiting on the table",
            timeout_s=20,
        )
        # What the flush holds (here: its lock on the threads table, which a migration
        # needs) it holds only within one bounded transaction: another session gets it
        # in turn instead of waiting for ever.
        await third.execute("SET lock_timeout = '15s'")
        await third.execute(f'LOCK TABLE "{schema_name}".threads IN ACCESS EXCLUSIVE MODE')
        await third.rollback()
        # (the server let go before the flusher's task has finished being cancelled)
        await eventually(
            lambda: _stat_at_least(service, "apply_timeouts", 1), what="the bound", timeout_s=20
        )
        await blocker.rollback()
    await flushed_to(pg_inner, {thread: 2}, timeout_s=20)
    assert await pg_inner.load_messages(thread) == make_messages(2)
    assert service.stats()["db_retries"] >= service.stats()["apply_timeouts"] >= 1


async def blocked_by(conn: Any, pid: int) -> bool:
    """Whether a session waits on a lock `pid` holds."""
    cur = await conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))", (pid,)
    )
    row = await cur.fetchone()
    return row is not None and row[0] > 0
