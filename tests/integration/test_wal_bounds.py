"""The WAL as a bounded buffer (issue 25 items 1-3), on real NATS and Postgres.

- flushed entries leave the stream once `retain_flushed_s` has passed since their flush
  (one purge per trim run), and reads and writes on the trimmed threads go on;
- unflushed entries never expire by default; with `max_age_s` set and entries expired
  anyway, the next write on the thread is refused instead of acknowledged;
- at `wal_max_bytes` writes raise `WalFullError` (retriable), nothing acknowledged is
  lost, and writes succeed again once a flusher has drained;
- a flusher stopped for longer than `retain_flushed_s` and restarted loses nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from buffered_store.engine.keys import encode_token
from buffered_store.errors import WalEntriesExpiredError, WalFullError
from buffered_store.model.records import Message
from buffered_store.nats import NatsWal
from buffered_store.testing import InnerStore, make_run
from buffered_store.threadrun.store import BufferedThreadRunStore
from flusher import Flusher, FlusherConfig
from tests.plugins.stores import StoreFactory, jetstream
from tests.plugins.waiting import eventually


def tid(label: str = "t") -> str:
    return f"{label}-{uuid.uuid4().hex[:10]}"


def msg(thread_id: str, n: int, size: int = 40) -> Message:
    return {"role": "user", "content": f"{thread_id}:{n}:" + "x" * size}


async def stream_messages(store: BufferedThreadRunStore) -> int:
    async with jetstream(store.config) as js:
        info = await js.stream_info(store.config.stream_name)
    return int(info.state.messages)


@pytest.fixture
async def flushers() -> AsyncIterator[list[Flusher]]:
    started: list[Flusher] = []
    yield started
    for item in started:
        with contextlib.suppress(Exception):
            await item.stop(drain=False)


async def start_flusher(
    flushers: list[Flusher], inner: Any, store: BufferedThreadRunStore, **overrides: Any
) -> Flusher:
    settings: dict[str, Any] = {"flush_interval_s": 0.05, "trim_interval_s": 0.2, **overrides}
    service = Flusher(inner, FlusherConfig.from_store_config(store.config, **settings))
    await service.start()
    flushers.append(service)
    return service


class Model:
    """What every acknowledged checkpoint says each thread holds."""

    def __init__(self) -> None:
        self.messages: dict[str, list[Message]] = {}
        self.seqs: dict[str, int] = {}

    async def checkpoint(self, store: BufferedThreadRunStore, thread_id: str) -> int:
        history = [*self.messages.get(thread_id, []), msg(thread_id, len(self.seqs))]
        receipt = await store.checkpoint(thread_id, history, make_run(thread_id))
        self.messages[thread_id] = history
        self.seqs[thread_id] = receipt.thread_seq
        return receipt.thread_seq

    async def check(self, inner: InnerStore) -> None:
        """The inner store (Postgres) holds exactly what was acknowledged."""
        threads = list(self.messages)
        assert await inner.flushed_seqs(threads) == self.seqs
        for thread_id, messages in self.messages.items():
            assert await inner.load_messages(thread_id) == messages


async def test_flushed_entries_leave_the_stream_after_the_retention_window(
    open_store: StoreFactory, pg_inner: InnerStore, flushers: list[Flusher]
) -> None:
    """Item 1: with a flusher, the stream empties once `retain_flushed_s` has passed
    since the flush; the trimmed threads read back whole and take new checkpoints (from
    the instance that wrote them and from a fresh one), their seqs continuing."""
    store = await open_store(pg_inner, retain_flushed_s=1.0, drain_on_close=False)
    model = Model()
    threads = [tid() for _ in range(3)]
    for _ in range(10):
        for thread_id in threads:
            await model.checkpoint(store, thread_id)
    flusher = await start_flusher(flushers, pg_inner, store)
    await flusher.wait_idle(10)
    assert await stream_messages(store) == 30  # still inside the window

    async def trimmed() -> bool:
        return await stream_messages(store) == 0

    await eventually(trimmed, what="the flushed entries to be trimmed")
    stats = flusher.stats()
    assert stats["trims"] >= 1
    assert stats["trimmed_messages"] >= 30
    for thread_id in threads:
        assert await store.load_messages(thread_id) == model.messages[thread_id]
    # Writes on trimmed threads: a cached cursor (its expected stream seq was purged) and
    # a cold one (hot record pointing at a purged entry, empty subject).
    assert await model.checkpoint(store, threads[0]) == 11
    other = await open_store(pg_inner, retain_flushed_s=1.0, drain_on_close=False)
    assert await model.checkpoint(other, threads[1]) == 11
    assert await other.load_messages(threads[2]) == model.messages[threads[2]]
    await flusher.wait_idle(10)
    await model.check(pg_inner)


async def test_unflushed_entries_never_expire_by_default(
    open_store: StoreFactory, pg_inner: InnerStore
) -> None:
    """Item 2: the stream is created without an age limit, and with a byte limit only when
    one is configured (then discarding new entries, never old ones)."""
    store = await open_store(pg_inner, drain_on_close=False)
    async with jetstream(store.config) as js:
        config = (await js.stream_info(store.config.stream_name)).config
    assert not config.max_age
    assert config.max_bytes in (None, -1)


async def test_a_write_after_unflushed_entries_expired_is_refused(
    open_store: StoreFactory, pg_inner: InnerStore
) -> None:
    """Item 2: with `max_age_s` opted in and a thread's unflushed entries expired, the
    next write refuses (`WalEntriesExpiredError`) instead of acknowledging an entry that
    could never be applied; from another instance too. Before: seq 3 was acknowledged,
    and `force_flush` then failed on the missing entries."""
    settings: dict[str, Any] = {
        "max_age_s": 1.5,
        "duplicate_window_s": 1.0,
        "drain_on_close": False,
    }
    store = await open_store(pg_inner, **settings)
    thread_id, other_thread = tid(), tid()
    model = Model()
    await model.checkpoint(store, thread_id)
    await model.checkpoint(store, thread_id)
    await asyncio.sleep(0.8)
    await model.checkpoint(store, other_thread)

    async def expired() -> bool:
        return await stream_messages(store) <= 1

    await eventually(expired, timeout_s=10, what="the first entries to expire")
    with pytest.raises(WalEntriesExpiredError) as refused:
        await store.checkpoint(thread_id, [msg(thread_id, 9)], make_run(thread_id))
    assert refused.value.latest_seq == 2
    assert refused.value.flushed_seq == 0
    assert not refused.value.retriable
    fresh = await open_store(pg_inner, **settings)
    with pytest.raises(WalEntriesExpiredError):
        await fresh.checkpoint(thread_id, [msg(thread_id, 9)], make_run(thread_id))

    # Partly expired: the thread's first entry is gone, its second still there.
    async def other_expired() -> bool:
        return await stream_messages(store) == 0

    await model.checkpoint(store, other_thread)  # seq 2: its seq 1 is still there
    await eventually(other_expired, timeout_s=10, what="the other thread's entries to expire")
    with pytest.raises(WalEntriesExpiredError):
        await store.checkpoint(other_thread, [msg(other_thread, 9)], make_run(other_thread))
    assert await stream_messages(store) == 0  # nothing was written


async def test_a_full_wal_refuses_writes_until_a_flusher_drained_it(
    open_store: StoreFactory, pg_inner: InnerStore, flushers: list[Flusher]
) -> None:
    """Item 3: at `wal_max_bytes` checkpoints raise the retriable `WalFullError` with
    nothing written; once a flusher drains (trimming at once under pressure, not after
    `retain_flushed_s`), they succeed again, and Postgres holds every acknowledged one."""
    store = await open_store(pg_inner, wal_max_bytes=16_384, drain_on_close=False)
    model = Model()
    threads = [tid() for _ in range(4)]
    refused: WalFullError | None = None
    for n in range(400):
        thread_id = threads[n % len(threads)]
        try:
            await model.checkpoint(store, thread_id)
        except WalFullError as exc:
            refused = exc
            break
    assert refused is not None, "the WAL never filled"
    assert refused.retriable
    assert store.stats()["checkpoints_wal_full"] == 1
    before = await stream_messages(store)
    with pytest.raises(WalFullError):
        await model.checkpoint(store, threads[0])
    assert await stream_messages(store) == before
    flusher = await start_flusher(flushers, pg_inner, store)

    async def accepted() -> bool:
        try:
            await model.checkpoint(store, threads[0])
        except WalFullError:
            return False
        return True

    await eventually(accepted, what="writes to be accepted again")
    assert flusher.stats()["wal_max_bytes"] == 16_384
    await flusher.wait_idle(10)
    await model.check(pg_inner)


async def test_a_flusher_stopped_longer_than_the_retention_window_loses_nothing(
    open_store: StoreFactory, pg_inner: InnerStore, flushers: list[Flusher]
) -> None:
    """Fault test: writes go on while the flusher is stopped for three times
    `retain_flushed_s` (the default config has no `max_age_s`); restarted, it flushes
    everything, Postgres equals the model, and the stream is trimmed afterwards."""
    store = await open_store(pg_inner, retain_flushed_s=0.5, drain_on_close=False)
    model = Model()
    threads = [tid() for _ in range(4)]
    flusher = await start_flusher(flushers, pg_inner, store)
    for _ in range(3):
        for thread_id in threads:
            await model.checkpoint(store, thread_id)
    await flusher.wait_idle(10)
    await flusher.stop(drain=True)
    stopped_at = time.monotonic()
    while time.monotonic() - stopped_at < 1.5:
        for thread_id in threads:
            await model.checkpoint(store, thread_id)
        await asyncio.sleep(0.1)
    for thread_id in threads:  # reads overlay what waits in the WAL
        assert await store.load_messages(thread_id) == model.messages[thread_id]
    restarted = await start_flusher(flushers, pg_inner, store)
    await restarted.wait_idle(15)
    await model.check(pg_inner)

    async def trimmed() -> bool:
        return await stream_messages(store) == 0

    await eventually(trimmed, what="the stream to be trimmed after the catch-up")
    wal = store.wal
    assert isinstance(wal, NatsWal)
    await model.check(pg_inner)


async def test_hot_records_of_idle_flushed_threads_are_removed(
    open_store: StoreFactory, pg_inner: InnerStore, flushers: list[Flusher]
) -> None:
    """Item 4: the hot bucket keeps the threads in use. The hot records of threads idle
    for `hot_idle_s`, flushed and trimmed (a deleted one too) go, delete markers
    included; the threads read back from Postgres, and their next writes (a cached
    cursor, a fresh instance, a re-created deleted thread) continue their seqs."""
    store = await open_store(pg_inner, retain_flushed_s=0.3, drain_on_close=False)
    model = Model()
    idle, deleted, busy = tid("idle"), tid("deleted"), tid("busy")
    for thread_id in (idle, deleted, busy):
        for _ in range(3):
            await model.checkpoint(store, thread_id)
    await store.delete_thread(deleted)
    del model.messages[deleted], model.seqs[deleted]
    flusher = await start_flusher(flushers, pg_inner, store, hot_idle_s=1.5)
    bucket = store.config.hot_bucket

    async def hot_subjects() -> set[str]:
        async with jetstream(store.config) as js:
            info = await js.stream_info(f"KV_{bucket}", subjects_filter=f"$KV.{bucket}.h.>")
        return set(info.state.subjects or {})

    async def only_busy_left() -> bool:
        await model.checkpoint(store, busy)  # keeps one thread in use
        await asyncio.sleep(0.2)
        return len(await hot_subjects()) == 1

    await eventually(only_busy_left, timeout_s=20, what="idle hot records to be removed")
    assert flusher.stats()["hot_records_forgotten"] == 2
    assert await store.wal.kv_get(f"h.{encode_token(idle)}") is None
    assert await store.load_messages(idle) == model.messages[idle]
    assert await store.load_thread(deleted) is None
    assert await model.checkpoint(store, idle) == 4  # a cached cursor
    fresh = await open_store(pg_inner, retain_flushed_s=0.3, drain_on_close=False)
    assert await fresh.checkpoint(deleted, [msg(deleted, 0)], make_run(deleted)) is not None
    model.messages[deleted] = [msg(deleted, 0)]
    model.seqs[deleted] = 5  # after its three checkpoints and its delete
    assert (await fresh.flush_status(deleted)).latest_seq == 5
    await flusher.wait_idle(10)
    await model.check(pg_inner)
