"""The LangGraph flush sink's contract, over `MemoryLangGraphSink` and `LangGraphSink`
(Postgres, marked ``integration``): the same entries leave the same rows in LangGraph's
three tables and the same watermarks, and get the same outcomes.

Postgres-only behaviour (two round trips per flush, SQLSTATE classification, isolating
the culprit statement) is in tests/langgraph/test_sink.py.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from buffered_store.engine.flushing import ApplyOutcome, ApplyStatus
from buffered_store.langgraph.entry import (
    BlobRow,
    Claim,
    Copy,
    Delete,
    LgEntry,
    Op,
    Put,
    Runs,
    WriteRow,
    Writes,
)
from buffered_store.langgraph.memory_sink import MemoryLangGraphSink, ThreadRows
from buffered_store.langgraph.sink import LangGraphSink
from buffered_store.stores.urls import to_libpq_url

T = datetime(2026, 1, 1, tzinfo=UTC)


class SinkHarness:
    """A sink under test, and a way to read a thread's rows back from what it wrote."""

    sink: Any

    async def apply(self, *batches: Sequence[LgEntry]) -> list[ApplyOutcome]:
        outcomes: list[ApplyOutcome] = await self.sink.apply(list(batches))
        return outcomes

    async def rows(self, thread_id: str) -> ThreadRows:
        raise NotImplementedError


class MemoryHarness(SinkHarness):
    def __init__(self) -> None:
        self.sink = MemoryLangGraphSink()

    async def rows(self, thread_id: str) -> ThreadRows:
        rows: ThreadRows = self.sink.rows(thread_id)
        return rows


class PostgresHarness(SinkHarness):
    def __init__(self, sink: LangGraphSink, dsn: str) -> None:
        self.sink = sink
        self.dsn = dsn

    async def rows(self, thread_id: str) -> ThreadRows:
        found = ThreadRows()
        async with await psycopg.AsyncConnection.connect(self.dsn, row_factory=dict_row) as conn:
            cur = await conn.execute(
                "SELECT checkpoint_ns, checkpoint_id, parent_checkpoint_id, checkpoint, metadata "
                "FROM checkpoints WHERE thread_id = %s",
                (thread_id,),
            )
            for r in await cur.fetchall():
                found.checkpoints[(r["checkpoint_ns"], r["checkpoint_id"])] = (
                    r["parent_checkpoint_id"],
                    r["checkpoint"],
                    r["metadata"],
                )
            cur = await conn.execute(
                "SELECT checkpoint_ns, channel, version, type, blob FROM checkpoint_blobs "
                "WHERE thread_id = %s",
                (thread_id,),
            )
            for r in await cur.fetchall():
                found.blobs[(r["checkpoint_ns"], r["channel"], r["version"])] = (
                    r["type"],
                    None if r["blob"] is None else bytes(r["blob"]),
                )
            cur = await conn.execute(
                "SELECT checkpoint_ns, checkpoint_id, task_id, idx, task_path, channel, type, "
                "blob FROM checkpoint_writes WHERE thread_id = %s",
                (thread_id,),
            )
            for r in await cur.fetchall():
                key = (r["checkpoint_ns"], r["checkpoint_id"], r["task_id"], r["idx"])
                found.writes[key] = (
                    r["task_path"],
                    r["channel"],
                    r["type"],
                    None if r["blob"] is None else bytes(r["blob"]),
                )
        return found


async def _set_up_tables(dsn: str) -> None:
    sink = await LangGraphSink.open(dsn)
    try:
        await sink.setup()
    finally:
        await sink.close()


@pytest.fixture(scope="session")
def lg_sink_dsn(database_url: str) -> str:
    """LangGraph's tables and our watermarks in the test database, created once. A plain
    fixture (on a loop of its own, in a thread), so `harness` can ask for it lazily: only
    the Postgres variant needs the services."""
    dsn = to_libpq_url(database_url)
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, _set_up_tables(dsn)).result()
    return dsn


@pytest.fixture(params=["memory", pytest.param("postgres", marks=pytest.mark.integration)])
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[SinkHarness]:
    if request.param == "memory":
        yield MemoryHarness()
        return
    dsn: str = request.getfixturevalue("lg_sink_dsn")
    sink = await LangGraphSink.open(dsn)
    try:
        yield PostgresHarness(sink, dsn)
    finally:
        await sink.close()


# -- building entries --------------------------------------------------------------------------


def thread() -> str:
    return f"sc-{uuid.uuid4().hex[:12]}"


def entry(thread_id: str, seq: int, *ops: Op) -> LgEntry:
    return LgEntry(thread_id=thread_id, seq=seq, kind="o", at=T, ops=ops)


def put(
    cid: str,
    *blobs: BlobRow,
    ns: str = "",
    parent: str | None = None,
    checkpoint: bytes | None = None,
    run_id: str = "run-1",
) -> Put:
    versions = {b.channel: b.version for b in blobs}
    body = checkpoint or b'{"v": 4, "id": "%s", "channel_versions": %s}' % (
        cid.encode(),
        str(versions).replace("'", '"').encode(),
    )
    metadata = b'{"step": 1, "run_id": "%s"}' % run_id.encode()
    return Put(ns, cid, parent, body, metadata, blobs)


def blob(channel: str, version: str, data: bytes, **delta: Any) -> BlobRow:
    return BlobRow(channel, version, "msgpack", data, **delta)


def writes(cid: str, task: str, *rows: tuple[int, bytes], upsert: bool = False) -> Writes:
    return Writes(
        "", cid, task, "path", upsert, tuple(WriteRow(i, "ch", "json", d) for i, d in rows)
    )


# -- the contract ------------------------------------------------------------------------------


async def test_puts_and_writes_land_with_the_watermark(harness: SinkHarness) -> None:
    t = thread()
    [outcome] = await harness.apply(
        [
            entry(t, 1, put("c1", blob("m", "1", b"\x91\x01")), writes("c1", "a", (0, b"1"))),
            entry(t, 2, put("c2", blob("m", "2", b"\x92\x01\x02"), parent="c1")),
        ]
    )
    assert (outcome.thread_id, outcome.status, outcome.flushed_seq) == (t, ApplyStatus.APPLIED, 2)
    assert await harness.sink.flushed_seqs([t, "unknown"]) == {t: 2, "unknown": 0}
    rows = await harness.rows(t)
    assert sorted(rows.checkpoints) == [("", "c1"), ("", "c2")]
    parent, checkpoint, metadata = rows.checkpoints[("", "c2")]
    assert parent == "c1"
    assert checkpoint["channel_versions"] == {"m": "2"}
    assert metadata == {"step": 1, "run_id": "run-1"}
    assert rows.blobs == {
        ("", "m", "1"): ("msgpack", b"\x91\x01"),
        ("", "m", "2"): ("msgpack", b"\x92\x01\x02"),
    }
    assert rows.writes == {("", "c1", "a", 0): ("path", "ch", "json", b"1")}


async def test_a_stale_batch_changes_nothing(harness: SinkHarness) -> None:
    t = thread()
    e1, e2 = entry(t, 1, put("c1")), entry(t, 2, put("c2"))
    await harness.apply([e1, e2])
    [outcome] = await harness.apply([entry(t, 1, put("c9"))])
    assert (outcome.status, outcome.flushed_seq) == (ApplyStatus.STALE, 2)
    assert sorted((await harness.rows(t)).checkpoints) == [("", "c1"), ("", "c2")]


async def test_a_gap_writes_nothing_and_names_the_missing_seq(harness: SinkHarness) -> None:
    t = thread()
    [outcome] = await harness.apply([entry(t, 2, put("c2"))])
    assert (outcome.status, outcome.flushed_seq, outcome.missing_from) == (ApplyStatus.GAP, 0, 1)
    assert (await harness.rows(t)).checkpoints == {}
    outcomes = await harness.apply([entry(t, 1, put("c1")), entry(t, 2, put("c2"))])
    assert (outcomes[0].status, outcomes[0].flushed_seq) == (ApplyStatus.APPLIED, 2)


async def test_duplicated_and_reordered_entries_apply_once(harness: SinkHarness) -> None:
    t = thread()
    e1 = entry(t, 1, writes("c1", "a", (0, b"1")))
    e2 = entry(t, 2, writes("c1", "a", (0, b"2"), upsert=True))
    e3 = entry(t, 3, put("c1"))
    [outcome] = await harness.apply([e3, e1, e2, e1, e3])
    assert (outcome.status, outcome.flushed_seq) == (ApplyStatus.APPLIED, 3)
    rows = await harness.rows(t)
    assert rows.writes == {("", "c1", "a", 0): ("path", "ch", "json", b"2")}


async def test_an_insert_keeps_the_first_write_and_an_upsert_replaces_it(
    harness: SinkHarness,
) -> None:
    t = thread()
    await harness.apply([entry(t, 1, writes("c1", "a", (0, b"first"), (1, b"x")))])
    await harness.apply([entry(t, 2, writes("c1", "a", (0, b"second")))])
    assert (await harness.rows(t)).writes[("", "c1", "a", 0)][3] == b"first"
    await harness.apply([entry(t, 3, writes("c1", "a", (0, b"third"), upsert=True))])
    rows = await harness.rows(t)
    assert rows.writes[("", "c1", "a", 0)][3] == b"third"
    assert rows.writes[("", "c1", "a", 1)][3] == b"x"


async def test_a_deleted_thread_never_comes_back_from_a_late_entry(harness: SinkHarness) -> None:
    t = thread()
    e1 = entry(t, 1, put("c1", blob("m", "1", b"\x90")), writes("c1", "a", (0, b"1")))
    await harness.apply([e1, entry(t, 2, Delete())])
    assert await harness.rows(t) == ThreadRows()
    [outcome] = await harness.apply([e1])
    assert (outcome.status, outcome.flushed_seq) == (ApplyStatus.STALE, 2)
    assert await harness.rows(t) == ThreadRows()
    [outcome] = await harness.apply([entry(t, 3, put("c5"))])
    assert outcome.flushed_seq == 3
    assert sorted((await harness.rows(t)).checkpoints) == [("", "c5")]


async def test_a_delta_blob_is_made_whole_from_the_stored_base_or_the_batch(
    harness: SinkHarness,
) -> None:
    t = thread()
    await harness.apply([entry(t, 1, put("c1", blob("m", "1", b"\x92\x01\x02")))])
    # Version 2 extends the stored version 1 by one item; version 3 extends version 2,
    # which the same batch carries.
    v2 = blob("m", "2", b"\x03", base="1", count=3)
    v3 = blob("m", "3", b"\x04", base="2", count=4)
    [outcome] = await harness.apply([entry(t, 2, put("c2", v2)), entry(t, 3, put("c3", v3))])
    assert outcome.status is ApplyStatus.APPLIED, outcome.error
    rows = await harness.rows(t)
    assert rows.blobs[("", "m", "2")] == ("msgpack", b"\x93\x01\x02\x03")
    assert rows.blobs[("", "m", "3")] == ("msgpack", b"\x94\x01\x02\x03\x04")


async def test_a_thread_whose_data_cannot_be_stored_fails_alone(harness: SinkHarness) -> None:
    good, no_base, bad_json = thread(), thread(), thread()
    outcomes = await harness.apply(
        [entry(good, 1, put("c1"))],
        [entry(no_base, 1, put("c1", blob("m", "2", b"\x03", base="1", count=3)))],
        [entry(bad_json, 1, put("c1")), entry(bad_json, 2, put("c2", checkpoint=b"{not json"))],
    )
    assert [(o.status, o.retriable) for o in outcomes] == [
        (ApplyStatus.APPLIED, True),
        (ApplyStatus.FAILED, False),
        (ApplyStatus.FAILED, False),
    ]
    assert "base" in (outcomes[1].error or "")
    assert [o.flushed_seq for o in outcomes] == [1, 0, 0]
    assert await harness.sink.flushed_seqs([good, no_base, bad_json]) == {
        good: 1,
        no_base: 0,
        bad_json: 0,
    }
    assert (await harness.rows(bad_json)).checkpoints == {}  # not even its first entry
    assert sorted((await harness.rows(good)).checkpoints) == [("", "c1")]


async def test_delete_for_runs_takes_their_checkpoints_writes_and_orphaned_blobs(
    harness: SinkHarness,
) -> None:
    t = thread()
    shared = blob("m", "1", b"\x90")
    await harness.apply(
        [
            entry(t, 1, put("c1", shared, run_id="keep"), writes("c1", "a", (0, b"k"))),
            entry(t, 2, put("c2", blob("n", "1", b"\x90"), run_id="drop")),
            entry(t, 3, writes("c2", "b", (0, b"d"))),
            entry(t, 4, put("c3", shared, run_id="drop")),
        ]
    )
    [outcome] = await harness.apply([entry(t, 5, Runs(("drop",)))])
    assert outcome.status is ApplyStatus.APPLIED
    rows = await harness.rows(t)
    assert sorted(rows.checkpoints) == [("", "c1")]
    assert sorted(rows.writes) == [("", "c1", "a", 0)]
    assert sorted(rows.blobs) == [("", "m", "1")]  # still referenced by c1


async def test_copy_writes_the_rows_it_carries(harness: SinkHarness) -> None:
    t = thread()
    op = Copy(
        checkpoints=(("", "c1", None, b'{"v": 4, "channel_versions": {}}', b'{"step": 0}'),),
        blobs=(("", "m", "1", "msgpack", b"\x90"),),
        writes=(("", "c1", "a", "p", 0, "ch", "json", b"1"),),
    )
    [outcome] = await harness.apply([entry(t, 1, op, Claim("writer-1"))])
    assert outcome.status is ApplyStatus.APPLIED
    rows = await harness.rows(t)
    assert rows.checkpoints == {("", "c1"): (None, {"v": 4, "channel_versions": {}}, {"step": 0})}
    assert rows.blobs == {("", "m", "1"): ("msgpack", b"\x90")}
    assert rows.writes == {("", "c1", "a", 0): ("p", "ch", "json", b"1")}


async def test_an_empty_batch_fails_without_touching_the_others(harness: SinkHarness) -> None:
    t = thread()
    outcomes = await harness.apply([], [entry(t, 1, put("c1"))])
    assert [(o.status, o.retriable) for o in outcomes] == [
        (ApplyStatus.FAILED, False),
        (ApplyStatus.APPLIED, True),
    ]


async def test_the_memory_sink_records_its_calls_and_resets() -> None:
    sink = MemoryLangGraphSink()
    t = thread()
    await sink.apply([[entry(t, 1, put("c1"), Claim("w"))]])
    await sink.flushed_seqs([t])
    assert sink.calls == [("apply", (t,)), ("flushed_seqs", (t,))]
    assert sink.owners == {t: "w"}
    sink.reset()
    assert (sink.calls, sink.threads, sink.marks) == ([], {}, {})
