"""`BufferedThreadRunStore` over the in-memory WAL (`MemoryWal`): the `ThreadRunStore`
conformance suite without any service, and the flusher draining a `MemoryWal`.

The suite runs in the three read-consistency modes, as
tests/integration/test_buffered_conformance.py runs them over NATS: EVENTUAL through
`FlushedWrites` (each write returns once its thread is flushed, see that module); and
READ_YOUR_WRITES once more with hot records advanced in the background after a linger
(`hot_linger_s`), so that its reads run while the hot records lag the entries.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest

from buffered_store import (
    BufferedStoreConfig,
    CommitUnknownError,
    DatabaseUnavailableError,
    InMemoryThreadRunStore,
    ReadConsistency,
    ThreadRunStore,
    ValidationError,
    WalUnavailableError,
)
from buffered_store.engine.keys import flushed_key, wal_subject
from buffered_store.testing import (
    MemoryJetStream,
    MemoryWal,
    make_messages,
    make_run,
    open_memory_store,
)
from buffered_store.testing.conformance import FlushedWrites, fresh_id
from buffered_store.testing.conformance.pytest_suite import ThreadRunStoreSuite
from flusher import Flusher

MODES = list(ReadConsistency)
LAGGING_HOT_S = 0.05
"""`hot_linger_s` of the suite's run with hot records advanced in the background: longer
than most of its tests' reads take after their writes."""
Mode = tuple[ReadConsistency, float | None]
"""A read consistency, and the store's `hot_linger_s`."""


@pytest.fixture(
    scope="class",
    params=[(mode, None) for mode in MODES] + [(ReadConsistency.READ_YOUR_WRITES, LAGGING_HOT_S)],
    ids=lambda mode: mode[0].value + ("" if mode[1] is None else "-lagging-hot"),
)
def mode(request: pytest.FixtureRequest) -> Mode:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="class")
async def shared_store(mode: Mode) -> AsyncIterator[ThreadRunStore]:
    store = _in_mode(mode)
    yield store
    await store.close()


class TestBufferedOverMemoryWal(ThreadRunStoreSuite):
    """The whole suite, in each mode; no flusher (reads overlay the WAL or flush first)."""

    @pytest.fixture
    def store(self, shared_store: ThreadRunStore) -> ThreadRunStore:
        return shared_store

    @pytest.fixture
    async def empty_store(self, mode: Mode) -> AsyncIterator[ThreadRunStore]:
        store = _in_mode(mode)
        yield store
        with contextlib.suppress(Exception):
            await store.close()


def _in_mode(mode: Mode) -> ThreadRunStore:
    consistency, linger = mode
    config = BufferedStoreConfig(
        read_consistency=consistency, drain_on_close=False, hot_linger_s=linger
    )
    store = open_memory_store(InMemoryThreadRunStore(), config)
    return FlushedWrites(store) if consistency is ReadConsistency.EVENTUAL else store


# -- the flusher over a MemoryWal -------------------------------------------------------------


def _acked_upto(server: MemoryJetStream, config: BufferedStoreConfig, seq: int) -> bool:
    consumer = server.consumer(config.stream_name, config.consumer_name)
    return consumer is not None and consumer.ack_floor >= seq and not consumer.unacked


async def test_flusher_drains_a_memory_wal_and_acks() -> None:
    server = MemoryJetStream()
    inner = InMemoryThreadRunStore()
    config = BufferedStoreConfig(flush_interval_s=0.05, drain_on_close=False)
    store = open_memory_store(inner, config, server=server)
    flusher_wal = MemoryWal(config, server)
    flusher = Flusher(inner, config, wal=flusher_wal, backlog_poll_s=0)
    tid = fresh_id()
    run = make_run(tid)
    try:
        for n in (1, 2, 3):
            await store.checkpoint(tid, make_messages(n), run.replace(steps=n))
        assert await inner.load_messages(tid) is None  # nothing flushed yet
        await flusher.start()
        await server.wait_for(lambda: _acked_upto(server, config, 3))
        assert await inner.load_messages(tid) == make_messages(3)
        assert await inner.load_run(run.run_id) == run.replace(steps=3)
        state = await flusher_wal.consumer_state()
        assert (state.num_pending, state.num_redelivered, state.last_seq) == (0, 0, 3)
        assert await flusher_wal.tail_bounds() == (4, 3)
        assert (await store.flush_status(tid)).pending == 0
        # The watermark is the inner store's, committed with the data: no KV flushed
        # mark is raised per thread and cycle.
        assert await flusher_wal.kv_get(flushed_key(tid)) is None
        assert flusher.stats()["acked"] == 3
    finally:
        await flusher.stop()
        await store.close()


async def test_two_stores_and_a_flusher_share_one_server() -> None:
    """A second store instance reads the first one's writes through the shared WAL, and
    writes on top of them; the flusher applies both instances' entries in order."""
    server = MemoryJetStream()
    inner = InMemoryThreadRunStore()
    config = BufferedStoreConfig(flush_interval_s=0.05, drain_on_close=False)
    first = open_memory_store(inner, config, server=server)
    second = open_memory_store(inner, config, server=server)
    flusher_wal = MemoryWal(config, server)
    tid = fresh_id()
    run = make_run(tid)
    try:
        await first.checkpoint(tid, make_messages(2), run)
        assert await second.load_messages(tid) == make_messages(2)
        receipt = await second.checkpoint(tid, make_messages(4), run)
        assert receipt.thread_seq == 2
        async with Flusher(inner, config, wal=flusher_wal, backlog_poll_s=0):
            await server.wait_for(lambda: _acked_upto(server, config, 2))
        assert await inner.load_messages(tid) == make_messages(4)
    finally:
        await first.close()
        await second.close()


async def test_checkpoints_fail_while_the_server_is_down_and_resume_after() -> None:
    """A publish that got no answer may have landed: the caller hears "commit unknown"."""
    server = MemoryJetStream()
    config = BufferedStoreConfig(drain_on_close=False, checkpoint_timeout_s=0.2)
    store = open_memory_store(InMemoryThreadRunStore(), config, server=server)
    tid = fresh_id()
    run = make_run(tid)
    try:
        await store.checkpoint(tid, make_messages(1), run)
        server.available = False
        with pytest.raises(CommitUnknownError) as failed:
            await store.checkpoint(tid, make_messages(2), run)
        assert isinstance(failed.value.__cause__, WalUnavailableError | TimeoutError)
        server.available = True
        receipt = await store.checkpoint(tid, make_messages(3), run)
        assert receipt.thread_seq == 2  # the failed call left no gap
        assert await store.load_messages(tid) == make_messages(3)
    finally:
        await store.close()


async def test_a_lost_publish_reply_is_commit_unknown_and_the_entry_is_kept() -> None:
    """The publish landed but its reply was lost: the store must not reuse its seq."""
    server = MemoryJetStream()
    store = open_memory_store(
        InMemoryThreadRunStore(), BufferedStoreConfig(drain_on_close=False), server=server
    )
    assert isinstance(store.wal, MemoryWal)
    tid = fresh_id()
    run = make_run(tid)
    try:
        await store.checkpoint(tid, make_messages(1), run)
        store.wal.lose_publish_replies(1)
        with contextlib.suppress(Exception):
            await store.checkpoint(tid, make_messages(2), run)
        receipt = await store.checkpoint(tid, make_messages(3), run)
        subject = wal_subject(store.config.stream_name, tid)
        seqs = [m.seq for m in await store.wal.read_range(1, await store.wal.last_seq())]
        assert [m.subject for m in await store.wal.get_many(seqs)] == [subject] * len(seqs)
        assert receipt.thread_seq == len(seqs)  # every entry holds its own seq, no gap
        assert await store.load_messages(tid) == make_messages(3)
    finally:
        await store.close()


async def test_checkpoint_check_snapshots_names_a_message_changed_in_place() -> None:
    """`check_snapshots` turns the O(new) contract of `checkpoint()` into an error; without
    it the writer reuses the encoding of the objects it has seen (documented)."""
    for check in (True, False):
        config = BufferedStoreConfig(drain_on_close=False, check_snapshots=check)
        store = open_memory_store(InMemoryThreadRunStore(), config)
        tid = fresh_id()
        run = make_run(tid)
        try:
            messages = make_messages(6)
            await store.checkpoint(tid, messages, run)
            messages[1]["content"] = "changed in place"
            messages.append(make_messages(1, start=6)[0])
            if check:
                with pytest.raises(ValidationError, match=r"messages\[1\] was changed in place"):
                    await store.checkpoint(tid, messages, run)
                assert await store.load_messages(tid) == make_messages(6)
                continue
            await store.checkpoint(tid, messages, run)
            assert await store.load_messages(tid) == make_messages(7)  # not seen
            messages[1] = {**messages[1], "content": "edited"}  # a new object: seen
            await store.checkpoint(tid, messages, run)
            assert await store.load_messages(tid) == messages
        finally:
            await store.close()


class _WatermarksDown:
    """An inner store whose watermark reads fail once `down` is set (Postgres gone)."""

    def __init__(self, inner: InMemoryThreadRunStore) -> None:
        self.inner = inner
        self.down = False

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    async def flushed_seqs(self, thread_ids: list[str]) -> dict[str, int]:
        if self.down:
            raise DatabaseUnavailableError("watermarks unreachable (test)")
        return await self.inner.flushed_seqs(thread_ids)


async def test_flush_status_while_the_inner_store_is_down_follows_the_flushers_acks() -> None:
    """The flusher raises no KV marks: with the watermark unreadable, `flush_status`
    bounds it by the consumer's ack floor (acks follow commits)."""
    server = MemoryJetStream()
    inner = _WatermarksDown(InMemoryThreadRunStore())
    config = BufferedStoreConfig(flush_interval_s=0.05, drain_on_close=False)
    store = open_memory_store(inner, config, server=server)  # type: ignore[arg-type]
    flusher = Flusher(inner, config, wal=MemoryWal(config, server), backlog_poll_s=0)  # type: ignore[arg-type]
    tid = fresh_id()
    run = make_run(tid)
    try:
        for n in (1, 2, 3):
            await store.checkpoint(tid, make_messages(n), run.replace(steps=n))
        await flusher.start()
        await server.wait_for(lambda: _acked_upto(server, config, 3))
        await flusher.stop()
        for n in (4, 5):
            await store.checkpoint(tid, make_messages(n), run.replace(steps=n))
        inner.down = True
        status = await store.flush_status(tid)
        assert (status.latest_seq, status.flushed_seq, status.pending) == (5, 3, 2)
    finally:
        await flusher.stop()
        await store.close()
