"""Service outages under load (invariant 1): a NATS server restart and a Postgres outage.

Neither touches the session's shared servers, so both run against external ones
(NATS_URL / DATABASE_URL) too: the NATS restart is of a nats-server of the test's own
(the restart itself, with what the server keeps on disk, is the point), and Postgres
goes away by cutting a `CuttableProxy` between the store and the shared server.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Iterator

import pytest

from buffered_store.dev.proxy import CuttableProxy
from buffered_store.dev.services import NatsServer
from buffered_store.engine.threadlog import ThreadLog
from buffered_store.errors import CommitUnknownError, StoreError, WalUnavailableError
from buffered_store.nats import NatsWal
from buffered_store.testing import InnerStore, make_messages, make_run
from buffered_store.threadrun.entry import FORMAT
from buffered_store.threadrun.store import BufferedThreadRunStore
from tests.plugins.stores import PostgresFactory, StoreFactory

WRITERS = 6
OUTAGE_S = 3.0


def tid(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


async def assert_wal_holds(
    store: BufferedThreadRunStore, thread_id: str, acked: dict[int, int]
) -> None:
    """Every acknowledged checkpoint (seq -> message count) is in the WAL, gap-free."""
    log = ThreadLog(store.wal, store.config, FORMAT)
    hot = await log.hot(thread_id)
    assert hot is not None
    entries = {
        e.seq: e for e in await log.entries_between(thread_id, 0, hot.record.seq, hot.record)
    }
    assert sorted(entries) == list(range(1, hot.record.seq + 1))
    for seq, count in acked.items():
        entry = entries[seq]
        assert entry.message_count == count, (thread_id, seq)
        assert entry.run is not None
        assert entry.run.steps == count


def bounce(server: NatsServer, how: str) -> None:
    """Restart a nats-server: gracefully, or SIGKILL then start."""
    if how == "restart":
        server.restart()
    else:
        server.kill()
        server.start()


@pytest.fixture
def own_nats() -> Iterator[NatsServer]:
    """A nats-server of this test alone (it restarts it), on the same port after restarts."""
    server = NatsServer()
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.mark.parametrize("how", ["restart", "kill"])
async def test_nats_restart_under_load(
    own_nats: NatsServer, open_store: StoreFactory, inner: InnerStore, how: str
) -> None:
    """Writers on 6 threads keep checkpointing while nats-server restarts (SIGTERM, or
    SIGKILL: a process crash, not an OS crash, so nothing acknowledged may be lost). Calls hit by
    the outage may fail with WalUnavailableError or CommitUnknownError, or succeed; the
    same store instance then keeps working without any reconnect by hand, and after
    force_flush_all every acknowledged checkpoint is in the WAL with a unique seq, and
    the inner store holds each thread's last acknowledged snapshot."""
    nats = own_nats
    store = await open_store(
        inner, nats_url=nats.url, drain_on_close=False, checkpoint_timeout_s=5.0
    )
    threads = [tid() for _ in range(WRITERS)]
    acked: dict[str, dict[int, int]] = {t: {} for t in threads}
    errors: Counter[str] = Counter()
    loaded, restarted = asyncio.Event(), asyncio.Event()

    async def write(thread: str) -> None:
        run = make_run(thread)
        n = after_restart = 0
        deadline = time.monotonic() + 40
        while after_restart < 5:
            assert time.monotonic() < deadline, f"{thread} made no progress after the restart"
            n += 1
            try:
                receipt = await store.checkpoint(thread, make_messages(n), run.replace(steps=n))
            except (WalUnavailableError, CommitUnknownError) as exc:
                errors[type(exc).__name__] += 1
                continue
            assert receipt.thread_seq not in acked[thread], "seq acknowledged twice"
            acked[thread][receipt.thread_seq] = n
            if sum(map(len, acked.values())) >= 10 * WRITERS:
                loaded.set()
            if restarted.is_set():
                after_restart += 1

    writers = asyncio.gather(*(write(t) for t in threads))
    try:
        async with asyncio.timeout(20):
            await loaded.wait()
        pid_before = getattr(nats, "pid", None)
        await asyncio.to_thread(bounce, nats, how)
        assert getattr(nats, "pid", None) != pid_before
        restarted.set()
        await writers
        assert isinstance(store.wal, NatsWal)
        assert store.wal.reconnects >= 1, "the store never saw the restart"
    finally:
        restarted.set()
        if not writers.done():
            writers.cancel()

    assert await store.force_flush_all(timeout=30) == WRITERS
    for thread in threads:
        await assert_wal_holds(store, thread, acked[thread])
        last_seq = max(acked[thread])
        count = acked[thread][last_seq]
        assert (await inner.flushed_seqs([thread]))[thread] == last_seq
        assert await inner.load_messages(thread) == make_messages(count)
        latest = await inner.latest_run(thread)
        assert latest is not None
        assert latest.steps == count


async def test_postgres_down_checkpoints_keep_succeeding(
    open_store: StoreFactory,
    open_postgres: PostgresFactory,
    postgres_link: CuttableProxy,
    database_url: str,
) -> None:
    """Postgres unreachable for several seconds under load: every checkpoint succeeds,
    force_flush fails fast with a StoreError instead of hanging, and after Postgres is
    back, force_flush_all brings it to exactly the acknowledged state."""
    pg_inner = await open_postgres(url=postgres_link.via(database_url))
    store = await open_store(pg_inner, drain_on_close=False)
    # A second process over the same database: its status reads find Postgres down too.
    other = await open_store(pg_inner, drain_on_close=False)
    threads = [tid() for _ in range(4)]
    counts = dict.fromkeys(threads, 0)
    runs = {t: make_run(t) for t in threads}

    async def step(thread: str) -> None:
        counts[thread] += 1
        n = counts[thread]
        receipt = await store.checkpoint(thread, make_messages(n), runs[thread].replace(steps=n))
        assert receipt.thread_seq == n

    for thread in threads:
        await step(thread)
    assert await store.force_flush_all() == len(threads)

    postgres_link.cut()
    try:
        during = 0
        until = time.monotonic() + OUTAGE_S
        while time.monotonic() < until:
            await asyncio.gather(*(step(t) for t in threads))
            during += len(threads)
        started = time.monotonic()
        with pytest.raises(StoreError):
            await store.force_flush(threads[0], timeout=3)
        assert time.monotonic() - started < 5
        status = await other.flush_status(threads[0])
        assert status.pending == counts[threads[0]] - 1
    finally:
        postgres_link.restore()
    assert during >= 20

    assert await store.force_flush_all(timeout=30) == len(threads)
    for thread in threads:
        n = counts[thread]
        assert (await pg_inner.flushed_seqs([thread]))[thread] == n
        assert await pg_inner.load_messages(thread) == make_messages(n)
        assert await pg_inner.latest_run(thread) == runs[thread].replace(steps=n)
        assert (await store.flush_status(thread)).pending == 0
