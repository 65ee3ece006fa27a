"""The flusher's pipeline and the cost of one apply: the next window is fetched while a
cycle applies, cycles never overlap, and Postgres gates a whole batch with one lock
statement. Entries go onto the WAL through the minimal writer of `test_flusher`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import pytest
from sqlalchemy import event

from buffered_store.engine.flushing import ApplyOutcome, ApplyStatus
from buffered_store.engine.ids import utcnow
from buffered_store.model.changes import (
    WalEntry,
)
from buffered_store.model.checkpointing import build_checkpoint_entry, validate_checkpoint
from buffered_store.nats import NatsWal
from buffered_store.stores.memory import InMemoryThreadRunStore
from buffered_store.stores.postgres_pipeline import PipelineConnection
from buffered_store.testing import FaultyFlushTarget, InnerStore, make_messages, make_run
from flusher import Flusher, FlusherConfig
from tests.integration.test_flusher import (
    FAST,
    Writer,
    consumer_state,
    flushed_to,
    start,
    tid,
)
from tests.plugins.stores import ConfigFactory
from tests.plugins.waiting import eventually


@pytest.fixture
def fconfig(make_config: ConfigFactory) -> FlusherConfig:
    """The fast flusher config of `test_flusher`, on this test's WAL names."""
    return FlusherConfig.from_store_config(make_config(), **FAST)


@pytest.fixture
async def writer(fconfig: FlusherConfig) -> AsyncIterator[Writer]:
    opened = await NatsWal.connect(fconfig, name="test-writer")
    yield Writer(opened)
    await opened.close()


@pytest.fixture
async def flushers() -> AsyncIterator[list[Flusher]]:
    """Flushers to stop (without drain) at the end, whatever the test did."""
    started: list[Flusher] = []
    yield started
    for item in started:
        with contextlib.suppress(Exception):
            await item.stop(drain=False)


class RecordingTarget(FaultyFlushTarget):
    """Records every forwarded apply call (seqs per thread) and how many overlapped."""

    def __init__(self, inner: InnerStore) -> None:
        super().__init__(inner)
        self.applied: list[dict[str, list[int]]] = []
        self.active = 0
        self.most_active = 0

    async def apply(self, batches: Sequence[Sequence[WalEntry]]) -> list[ApplyOutcome]:
        self.active += 1
        self.most_active = max(self.most_active, self.active)
        try:
            outcomes = await super().apply(batches)
        finally:
            self.active -= 1
        self.applied.append({b[0].thread_id: [e.seq for e in b] for b in batches if b})
        return outcomes


async def test_next_window_is_fetched_while_a_cycle_applies(
    writer: Writer, fconfig: FlusherConfig, flushers: list[Flusher]
) -> None:
    inner = InMemoryThreadRunStore()
    target = RecordingTarget(inner)
    target.block_applies()
    service = await start(flushers, target, fconfig)
    a, b = tid("a"), tid("b")
    await writer.checkpoint(a, make_messages(1))
    await asyncio.wait_for(target.wait_for_blocked_apply(), 10)
    # Past the window the cycle's apply started in: only the pipeline still fetches.
    await asyncio.sleep(4 * fconfig.flush_interval_s)
    for step in (2, 3):
        await writer.checkpoint(a, make_messages(step))
    await writer.checkpoint(b, make_messages(1))

    async def all_delivered() -> bool:
        return await consumer_state(writer.wal) == (0, 4)

    async def all_fetched() -> bool:
        # The server counts a message delivered before the fetch call returns it.
        return service.stats()["fetched"] == 4

    await eventually(all_delivered, what="every message delivered during the blocked apply")
    await eventually(all_fetched, what="every delivered message taken by the flusher")
    assert target.forwarded_applies == 0  # nothing committed yet: nothing acked
    target.unblock_applies()
    await flushed_to(inner, {a: 3, b: 1})
    assert target.most_active == 1  # cycles never overlap
    a_seqs = [seq for call in target.applied for seq in call.get(a, [])]
    assert a_seqs == [1, 2, 3]  # in order, across the two cycles
    assert service.stats()["overlapped_cycles"] >= 1

    async def settled() -> bool:
        return await consumer_state(writer.wal) == (0, 0)

    await eventually(settled, what="every message acked")


async def test_stop_without_drain_gives_the_collected_window_back(
    writer: Writer, fconfig: FlusherConfig, flushers: list[Flusher]
) -> None:
    inner = InMemoryThreadRunStore()
    target = RecordingTarget(inner)
    target.block_applies()
    service = await start(flushers, target, fconfig)
    thread = tid()
    await writer.checkpoint(thread, make_messages(1))
    await asyncio.wait_for(target.wait_for_blocked_apply(), 10)
    await writer.checkpoint(thread, make_messages(2))

    async def both_held() -> bool:
        return await consumer_state(writer.wal) == (0, 2)

    await eventually(both_held, what="the second entry collected for the next cycle")
    await asyncio.wait_for(service.stop(drain=False), 5)
    target.unblock_applies()
    # Both given back at once (ack_wait is 5 s): a new flusher takes them promptly.
    await start(flushers, inner, fconfig)
    await flushed_to(inner, {thread: 2}, timeout_s=3)


async def test_stop_with_drain_flushes_the_collected_window_too(
    writer: Writer, fconfig: FlusherConfig, flushers: list[Flusher]
) -> None:
    inner = InMemoryThreadRunStore()
    target = RecordingTarget(inner)
    target.block_applies()
    service = await start(flushers, target, fconfig)
    thread = tid()
    await writer.checkpoint(thread, make_messages(1))
    await asyncio.wait_for(target.wait_for_blocked_apply(), 10)
    await writer.checkpoint(thread, make_messages(2))

    async def both_held() -> bool:
        return await consumer_state(writer.wal) == (0, 2)

    await eventually(both_held, what="the second entry collected for the next cycle")
    stopping = asyncio.create_task(service.stop(drain=True))
    target.unblock_applies()
    await asyncio.wait_for(stopping, 10)
    assert (await inner.flushed_seqs([thread]))[thread] == 2
    assert await consumer_state(writer.wal) == (0, 0)


# -- one gate statement per apply ---------------------------------------------------------


def _chain(thread_id: str, steps: int) -> list[WalEntry]:
    entries: list[WalEntry] = []
    previous, previous_messages = None, None
    run = make_run(thread_id)
    for seq in range(1, steps + 1):
        call = validate_checkpoint(thread_id, make_messages(seq), run.replace(steps=seq), None)
        entry = build_checkpoint_entry(
            call,
            previous=previous,
            previous_messages=previous_messages,
            seq=seq,
            now=utcnow(),
        )
        entries.append(entry)
        previous, previous_messages = entry.thread, call.encoded
    return entries


@pytest.fixture
def statements(pg_inner: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The SQL text of every statement the store executes from now on: through
    SQLAlchemy, and in the psycopg pipelines of `apply()`."""
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    real_send = PipelineConnection.send

    async def send(self: PipelineConnection, steps: Sequence[Any]) -> Any:
        seen.extend(step.sql.decode() for step in steps)
        return await real_send(self, steps)

    monkeypatch.setattr(PipelineConnection, "send", send)
    engine = pg_inner._engine.sync_engine
    event.listen(engine, "before_cursor_execute", record)
    yield seen
    event.remove(engine, "before_cursor_execute", record)


async def test_apply_gates_every_thread_with_one_lock_statement(
    pg_inner: Any, statements: list[str]
) -> None:
    chains = {t: _chain(t, 3) for t in (tid(f"g{i}") for i in range(6))}
    first = await pg_inner.apply([c[:1] for c in chains.values()])
    assert {o.status for o in first} == {ApplyStatus.APPLIED}
    statements.clear()
    round_trips = pg_inner.stats()["round_trips"]
    outcomes = await pg_inner.apply([c[1:] for c in chains.values()])
    assert [(o.status, o.flushed_seq) for o in outcomes] == [(ApplyStatus.APPLIED, 3)] * 6
    assert pg_inner.stats()["round_trips"] - round_trips == 2
    locks = [s for s in statements if "FOR UPDATE" in s and "WITH" not in s]
    assert len(locks) == 1
    assert "ANY" in locks[0]
    # Besides the lock: one statement writes all six threads (no per-thread lock, read
    # or write).
    writes = [s for s in statements if s.lstrip().upper().startswith(("WITH", "UPDATE"))]
    assert len(writes) == 1
    assert "unnest" in writes[0]


async def test_a_thread_given_twice_in_one_apply_is_read_again(pg_inner: Any) -> None:
    thread = tid("twice")
    entries = _chain(thread, 3)
    outcomes = await pg_inner.apply([entries[:1], entries[1:]])
    assert [(o.status, o.flushed_seq) for o in outcomes] == [
        (ApplyStatus.APPLIED, 1),
        (ApplyStatus.APPLIED, 3),
    ]
    assert (await pg_inner.flushed_seqs([thread]))[thread] == 3
