"""`LangGraphSink.apply` against real Postgres: a flush costs two round trips whatever
the number of threads, a thread whose data Postgres rejects fails alone while the others
of the same call are applied, and a bad entry never stalls the flusher of every thread
(it is quarantined, the other threads flow). DESIGN invariant 10; issue 24, defect 4."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any, cast

import orjson
import psycopg
import pytest
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.conformance.test_utils import generate_checkpoint

from buffered_store.engine.flushing import ApplyStatus
from buffered_store.engine.keys import msg_id, wal_subject
from buffered_store.errors import DatabaseUnavailableError, SchemaError
from buffered_store.langgraph import LG_FORMAT, BufferedCheckpointSaver, LangGraphConfig
from buffered_store.langgraph.entry import (
    BlobRow,
    LgEntry,
    Put,
    WriteRow,
    Writes,
    encode_entry,
)
from buffered_store.langgraph.flushplan import WATERMARKS, Statement
from buffered_store.langgraph.sink import (
    SETUP_LOCK_NAMESPACE,
    LangGraphSink,
    culprit,
    failure_of,
)
from buffered_store.nats import NatsWal
from buffered_store.stores.postgres_errors import DbFailure
from flusher import Flusher, FlusherConfig

T = datetime(2026, 1, 1, tzinfo=UTC)


def thread() -> str:
    return f"s-{uuid.uuid4().hex[:10]}"


def put_entry(thread_id: str, seq: int, cid: str, checkpoint: bytes = b'{"v": 4}') -> LgEntry:
    blob = BlobRow("m", str(seq), "msgpack", b"\x90")
    op = Put("", cid, None, checkpoint, b'{"step": 1}', (blob,))
    writes = Writes("", cid, "task", "", False, (WriteRow(0, "x", "json", b"1"),))
    return LgEntry(thread_id=thread_id, seq=seq, kind="o", at=T, ops=(op, writes))


@pytest.fixture
async def sink(lg_tables: str) -> AsyncIterator[LangGraphSink]:
    opened = await LangGraphSink.open(lg_tables)
    yield opened
    await opened.close()


async def stored_checkpoints(dsn: str, thread_ids: list[str]) -> dict[str, list[str]]:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cur = await conn.execute(
            "SELECT thread_id, checkpoint_id FROM checkpoints WHERE thread_id = ANY(%s) "
            "ORDER BY checkpoint_id",
            (thread_ids,),
        )
        found: dict[str, list[str]] = {t: [] for t in thread_ids}
        for tid, cid in await cur.fetchall():
            found[tid].append(cid)
        return found


@pytest.mark.parametrize("threads", [1, 8, 64])
async def test_a_flush_costs_two_round_trips_whatever_the_number_of_threads(
    sink: LangGraphSink, lg_tables: str, threads: int
) -> None:
    ids = [thread() for _ in range(threads)]
    before = sink.stats["round_trips"]
    outcomes = await sink.apply(
        [[put_entry(t, 1, "c1"), put_entry(t, 2, "c2"), put_entry(t, 3, "c3")] for t in ids]
    )
    assert [o.status for o in outcomes] == [ApplyStatus.APPLIED] * threads
    assert sink.stats["round_trips"] - before == 2
    assert await sink.flushed_seqs(ids) == dict.fromkeys(ids, 3)
    assert await stored_checkpoints(lg_tables, ids) == {t: ["c1", "c2", "c3"] for t in ids}


def blob_entry(thread_id: str, seq: int, data: bytes) -> LgEntry:
    op = Put(
        "", f"c{seq}", None, b'{"v": 4}', b'{"step": 1}', (BlobRow("m", str(seq), "bytes", data),)
    )
    return LgEntry(thread_id=thread_id, seq=seq, kind="o", at=T, ops=(op,))


async def stored_blob_sizes(dsn: str, thread_id: str) -> list[int]:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cur = await conn.execute(
            "SELECT length(blob) FROM checkpoint_blobs WHERE thread_id = %s ORDER BY version",
            (thread_id,),
        )
        return [row[0] for row in await cur.fetchall()]


async def test_large_blobs_are_flushed_without_hanging_the_transaction(
    sink: LangGraphSink, lg_tables: str
) -> None:
    """psycopg may not send a pipelined bytea array (or value) of several MB: the flush
    then sat "idle in transaction", its watermark rows locked, forever (40 MB of blobs
    in one statement hung every time here; 10 MB often). Blob arrays are split into
    chunks that pipeline (two round trips still), and a blob too large for any chunk goes
    in statements of their own, outside pipeline mode."""
    many, huge = thread(), thread()
    chunked = [blob_entry(many, seq, bytes([seq]) * 1_000_000) for seq in range(1, 41)]
    before = dict(sink.stats)
    async with asyncio.timeout(60):  # a hang fails the test instead of the suite
        [outcome] = await sink.apply([chunked])
    assert outcome.status is ApplyStatus.APPLIED
    assert sink.stats["round_trips"] - before["round_trips"] == 2
    assert sink.stats["unpipelined"] == before["unpipelined"]
    assert await stored_blob_sizes(lg_tables, many) == [1_000_000] * 40
    async with asyncio.timeout(60):
        [outcome] = await sink.apply([[blob_entry(huge, 1, b"h" * 9_000_000)]])
    assert outcome.status is ApplyStatus.APPLIED
    assert sink.stats["unpipelined"] == before["unpipelined"] + 1
    assert await stored_blob_sizes(lg_tables, huge) == [9_000_000]


async def test_a_thread_whose_rows_postgres_rejects_fails_alone(
    sink: LangGraphSink, lg_tables: str
) -> None:
    good, bad, other = thread(), thread(), thread()
    outcomes = await sink.apply(
        [
            [put_entry(good, 1, "c1")],
            [put_entry(bad, 1, "c1"), put_entry(bad, 2, "c2", checkpoint=b"{not json")],
            [put_entry(other, 1, "c1")],
        ]
    )
    assert [o.status for o in outcomes] == [
        ApplyStatus.APPLIED,
        ApplyStatus.FAILED,
        ApplyStatus.APPLIED,
    ], [o.error for o in outcomes]
    failed = outcomes[1]
    assert not failed.retriable
    assert "22P02" in (failed.error or "")
    assert failed.flushed_seq == 0
    assert sink.stats["rejected"] == 1
    assert sink.stats["isolated_runs"] == 1
    assert await sink.flushed_seqs([good, bad, other]) == {good: 1, bad: 0, other: 1}
    assert await stored_checkpoints(lg_tables, [good, bad, other]) == {
        good: ["c1"],
        bad: [],
        other: ["c1"],
    }


def test_errors_are_told_apart_by_sqlstate_not_by_class() -> None:
    # Postgres refuses an index row too large with SQLSTATE 54000, which psycopg raises
    # as an OperationalError, the class of a lost connection.
    too_large = psycopg.errors.ProgramLimitExceeded("index row size 5400 exceeds maximum")
    assert isinstance(too_large, psycopg.OperationalError)
    assert failure_of(too_large) is DbFailure.DATA
    assert failure_of(psycopg.OperationalError("connection lost")) is DbFailure.UNAVAILABLE
    assert failure_of(psycopg.errors.DeadlockDetected()) is DbFailure.CONFLICT


async def publish_raw(
    wal: NatsWal, config: LangGraphConfig, thread_id: str, payload: bytes
) -> None:
    await wal.publish(
        wal_subject(config.stream_name, thread_id),
        payload,
        msg_id=msg_id(thread_id, 1),
        expected_last_subject_seq=0,
    )


def v1_put(thread_id: str, *, ns: str = "", drop: str = "") -> bytes:
    body = {
        "v": 1,
        "t": thread_id,
        "s": 1,
        "k": "put",
        "at": T.isoformat(),
        "w": "",
        "ns": ns,
        "id": "c1",
        "pid": None,
        "cp": {"v": 4},
        "md": {"step": 0},
        "b": [],
    }
    body.pop(drop, None)
    return orjson.dumps(body)


async def test_bad_entries_are_quarantined_while_every_other_thread_flows(
    lg_config: LangGraphConfig,
) -> None:
    """Issue 24, defect 4: a 5,300-character namespace (Postgres refuses its index row,
    SQLSTATE 54000) and a body missing a key each stalled every thread's flush; the
    first was retried forever as an outage, the second failed every cycle."""
    config = lg_config.replace(poison_attempts=2, drain_on_close=False)
    long_ns, missing_key, rejected = thread(), thread(), thread()
    good = [thread() for _ in range(4)]
    async with BufferedCheckpointSaver.connect(config) as saver:
        wal = saver.wal
        assert isinstance(wal, NatsWal)
        await publish_raw(wal, config, long_ns, v1_put(long_ns, ns="n" * 5300))
        await publish_raw(wal, config, missing_key, v1_put(missing_key, drop="md"))
        await publish_raw(
            wal, config, rejected, encode_entry(put_entry(rejected, 1, "c1", b"{not json"))
        )
        for t in good:
            head: RunnableConfig = {"configurable": {"thread_id": t, "checkpoint_ns": ""}}
            for step in (1, 2):
                cp = generate_checkpoint(channel_values={"n": step}, channel_versions={"n": step})
                head = await saver.aput(head, cp, {"source": "loop", "step": step}, {"n": step})
        async with Flusher(saver.sink, config, fmt=LG_FORMAT, backlog_poll_s=0):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                flushed = await saver.sink.flushed_seqs(good)
                records = await saver.wal.quarantine.keys()
                if all(v == 2 for v in flushed.values()) and len(records) >= 3:
                    break
                await asyncio.sleep(0.05)
        assert flushed == dict.fromkeys(good, 2)
        values = [await wal.quarantine.get(key) for key in records]
        quarantined = [orjson.loads(v.value) for v in values if v is not None]
        reasons = {q.get("thread_id"): q.get("reason", "") for q in quarantined}
        assert "checkpoint_ns is longer" in reasons[long_ns]
        assert "malformed 'put'" in reasons[missing_key]
        assert "22P02" in reasons[rejected]


class FakeCursor:
    def __init__(self, done: bool) -> None:
        self.pgresult = object() if done else None


def test_the_culprit_is_the_first_statement_without_a_result_whenever_the_error_surfaces() -> None:
    """psycopg reads results while later statements are still being queued, so the
    server's error for one statement can be raised while sending another: that one is
    not to blame (a misattribution failed a good thread in the suite, now and then)."""
    statements = [Statement(f"S{i}", (), (i,)) for i in range(5)]
    done = [FakeCursor(True), FakeCursor(True), FakeCursor(False), FakeCursor(False)]
    server_error = psycopg.errors.InvalidTextRepresentation("invalid input syntax for type json")
    cursors = cast(list[Any], done)
    assert culprit(statements, cursors, statements[4], server_error) is statements[2]
    assert culprit(statements, cursors, None, server_error) is statements[2]
    client_error = psycopg.DataError("PostgreSQL text fields cannot contain NUL (0x00) bytes")
    assert culprit(statements, cursors[:2], statements[2], client_error) is statements[2]


async def test_tables_not_set_up_say_so_and_how_to_fix_it(schemas: tuple[str, str]) -> None:
    """A schema without LangGraph's tables: reads and flushes raise `SchemaError` naming
    `setup()`, not a refusal an operator has to decode (and no thread is quarantined for
    it: the flusher's cycle fails and is tried again)."""
    _, empty = schemas
    sink = await LangGraphSink.open(empty)
    try:
        with pytest.raises(SchemaError, match="setup"):
            await sink.flushed_seqs(["t"])
        with pytest.raises(SchemaError, match="setup"):
            await sink.apply([[put_entry(thread(), 1, "c1")]])
    finally:
        await sink.close()


async def test_processes_setting_up_one_schema_at_once_take_turns(
    schemas: tuple[str, str],
) -> None:
    """Four sinks set up one fresh schema at the same moment (an application and its
    flusher deployed together): all succeed, where LangGraph's migrations run side by side
    fail with a duplicate catalog entry. A turn held elsewhere for longer than
    `turn_timeout_s` fails with a message naming the lock; once released, setup goes on."""
    _, fresh = schemas
    sinks = [await LangGraphSink.open(fresh) for _ in range(4)]
    try:
        await asyncio.gather(*(sink.setup() for sink in sinks))
        assert await sinks[0].flushed_seqs(["t"]) == {"t": 0}
    finally:
        for sink in sinks:
            await sink.close()

    patient = await LangGraphSink.open(fresh)
    try:
        async with await psycopg.AsyncConnection.connect(fresh, autocommit=True) as holder:
            await holder.execute(
                "SELECT pg_advisory_lock(%s, hashtext(current_schema()))",
                (SETUP_LOCK_NAMESPACE,),
            )
            with pytest.raises(DatabaseUnavailableError, match="setting up this schema"):
                await patient.setup(turn_timeout_s=0.3)
        await patient.setup(turn_timeout_s=0.3)
    finally:
        await patient.close()


async def test_a_stalled_flush_transaction_is_abandoned_and_releases_its_locks(
    lg_config: LangGraphConfig, pg_dsn: str
) -> None:
    """The LangGraph sink under the flusher's `apply_timeout_s`: a cycle whose writes wait
    on a table lock another session holds, after the thread's watermark row was locked,
    is abandoned after the bound (a third session then gets the row), retried, and
    completes once the stall ends, with the tables as a flush without the stall leaves
    them."""
    config = lg_config.replace(drain_on_close=False)
    one = thread()
    bounded = FlusherConfig.for_front_end(config, apply_timeout_s=1.0, db_retry_max_s=0.2)
    head: RunnableConfig = {"configurable": {"thread_id": one, "checkpoint_ns": ""}}

    async with BufferedCheckpointSaver.connect(config) as saver:

        async def step(n: int) -> RunnableConfig:
            cp = generate_checkpoint(channel_values={"n": n}, channel_versions={"n": n})
            return await saver.aput(head, cp, {"source": "loop", "step": n}, {"n": n})

        head = await step(1)
        flusher = Flusher(saver.sink, bounded, fmt=LG_FORMAT, backlog_poll_s=0)
        async with flusher:
            await until_flushed(saver, {one: 1})
            async with (
                await psycopg.AsyncConnection.connect(pg_dsn) as blocker,
                await psycopg.AsyncConnection.connect(pg_dsn) as third,
            ):
                await blocker.execute("LOCK TABLE checkpoints IN SHARE ROW EXCLUSIVE MODE")
                head = await step(2)
                deadline = time.monotonic() + 20
                while not await blocked_by(third, blocker.info.backend_pid):
                    assert time.monotonic() < deadline, "the flush never waited on the table"
                    await asyncio.sleep(0.02)
                await third.execute("SET lock_timeout = '15s'")
                await third.execute(
                    f"SELECT 1 FROM {WATERMARKS} WHERE thread_id = %s FOR UPDATE", (one,)
                )
                await third.rollback()
                # (the server let go before the flusher's task has finished being cancelled)
                while flusher.stats()["apply_timeouts"] < 1:
                    assert time.monotonic() < deadline + 20, "the bound was never counted"
                    await asyncio.sleep(0.02)
                await blocker.rollback()
            await until_flushed(saver, {one: 2})
        found = await saver.aget_tuple(head)
        assert found is not None
        assert found.checkpoint["channel_values"] == {"n": 2}


async def until_flushed(saver: BufferedCheckpointSaver, expected: dict[str, int]) -> None:
    deadline = time.monotonic() + 20
    while await saver.sink.flushed_seqs(list(expected)) != expected:
        assert time.monotonic() < deadline, f"not flushed to {expected}"
        await asyncio.sleep(0.05)


async def blocked_by(conn: psycopg.AsyncConnection[Any], pid: int) -> bool:
    """Whether a session waits on a lock `pid` holds."""
    cur = await conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))", (pid,)
    )
    row = await cur.fetchone()
    return row is not None and row[0] > 0
