"""The LangGraph sink's flush plan: which statements one transaction runs for a batch of
threads, and each thread's outcome. Pure, so every branch is checked without Postgres
(tests/langgraph checks the rows against AsyncPostgresSaver's)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from buffered_store.engine.flushing import ApplyStatus
from buffered_store.langgraph import flushplan
from buffered_store.langgraph.entry import (
    BlobRow,
    Claim,
    Delete,
    LgEntry,
    Op,
    Prune,
    Put,
    WriteRow,
    Writes,
    delta_blob,
    kind_of,
    msgpack_list_header,
)
from buffered_store.langgraph.flushplan import (
    INSERT_BLOBS,
    INSERT_CHECKPOINTS,
    INSERT_WRITES,
    RAISE_WATERMARKS,
    UPSERT_WRITES,
)
from buffered_store.stores.pipelining import CHUNK_BYTES, fits_pipeline, payload_bytes

T = datetime(2026, 1, 1, tzinfo=UTC)


def e(thread: str, seq: int, *ops: Op, jump: bool = False) -> LgEntry:
    return LgEntry(thread_id=thread, seq=seq, kind=kind_of(ops), at=T, ops=ops, jump=jump)


def put(cid: str, *blobs: BlobRow, ns: str = "") -> Put:
    return Put(ns, cid, None, b'{"id": "%s"}' % cid.encode(), b"{}", blobs)


def writes(cid: str, *idx: int, upsert: bool = False) -> Writes:
    rows = tuple(WriteRow(i, "ch", "json", b"1") for i in idx)
    return Writes("", cid, "task", "", upsert, rows)


def plan(
    batches: Sequence[Sequence[LgEntry]],
    marks: dict[str, int] | None = None,
    bases: dict[tuple[str, str, str, str], bytes | None] | None = None,
    *,
    isolated: bool = False,
) -> flushplan.Plan:
    return flushplan.plan(batches, range(len(batches)), marks or {}, bases or {}, isolated=isolated)


def columns(statement: flushplan.Statement) -> list[list[object]]:
    assert isinstance(statement.params, list)
    return statement.params


def shape(result: flushplan.Plan) -> list[tuple[str, tuple[int, ...]]]:
    names = {
        INSERT_BLOBS: "blobs",
        INSERT_CHECKPOINTS: "checkpoints",
        INSERT_WRITES: "writes",
        UPSERT_WRITES: "upserts",
        RAISE_WATERMARKS: "watermarks",
    }
    return [(names.get(s.sql, s.sql.split()[0]), s.batches) for s in result.statements]


def test_threads_that_only_put_and_write_share_one_statement_per_table() -> None:
    blob = BlobRow("m", "1", "msgpack", b"\x90")
    batches = [
        [e("a", 1, put("c1", blob), writes("c1", 0, 1)), e("a", 2, writes("c1", -1, upsert=True))],
        [e("b", 5, put("c9"))],
    ]
    result = plan(batches, {"b": 4})
    assert shape(result) == [
        ("blobs", (0,)),
        ("checkpoints", (0, 1)),
        ("writes", (0,)),
        ("upserts", (0,)),
        ("watermarks", (0, 1)),
    ]
    assert {i: o.status for i, o in result.outcomes.items()} == {
        0: ApplyStatus.APPLIED,
        1: ApplyStatus.APPLIED,
    }
    assert result.outcomes[0].flushed_seq == 2
    assert result.entries == {0: 2, 1: 1}
    checkpoints = columns(result.statements[1])
    assert checkpoints[0] == ["a", "b"]
    assert checkpoints[4] == ['{"id": "c1"}', '{"id": "c9"}']
    assert result.statements[-1].params == [["a", "b"], [2, 5], [False, False], [None, None]]


def test_a_key_written_twice_or_a_delete_gets_the_thread_statements_of_its_own() -> None:
    batches = [
        [e("a", 1, put("c1")), e("a", 2, put("c1"))],  # the same checkpoint twice
        [e("b", 1, writes("c1", 0)), e("b", 2, writes("c1", 0))],  # the same write key
        [e("c", 1, Delete()), e("c", 2, put("c2"))],
        [e("d", 1, put("c3"))],
    ]
    assert shape(plan(batches)) == [
        ("checkpoints", (3,)),  # merged: d alone
        ("checkpoints", (0,)),
        ("checkpoints", (0,)),
        ("writes", (1,)),
        ("writes", (1,)),
        ("DELETE", (2,)),
        ("DELETE", (2,)),
        ("DELETE", (2,)),
        ("checkpoints", (2,)),
        ("watermarks", (0, 1, 2, 3)),
    ]


def test_isolated_every_thread_has_its_statements_and_watermark_apart() -> None:
    batches = [[e("a", 1, put("c1"))], [e("b", 1, put("c2")), e("b", 2, Claim("me"))]]
    result = plan(batches, isolated=True)
    assert shape(result) == [
        ("checkpoints", (0,)),
        ("watermarks", (0,)),
        ("checkpoints", (1,)),
        ("watermarks", (1,)),
    ]
    assert result.statements[-1].params == [["b"], [2], [True], ["me"]]


def test_stale_and_gapped_threads_write_nothing() -> None:
    batches = [[e("a", 3, put("c1"))], [e("b", 5, put("c2"))], [e("c", 9, put("c3"), jump=True)]]
    result = plan(batches, {"a": 3, "b": 3, "c": 2})
    assert result.outcomes[0].status is ApplyStatus.STALE
    assert result.outcomes[1].status is ApplyStatus.GAP
    assert result.outcomes[1].missing_from == 4
    assert result.outcomes[2].status is ApplyStatus.APPLIED  # a jump follows any lower seq
    assert shape(result) == [("checkpoints", (2,)), ("watermarks", (2,))]


def test_deltas_are_made_whole_from_the_chain_or_the_stored_base() -> None:
    stored = msgpack_list_header(2) + b"\x01\x02"
    batches = [
        [
            e("a", 1, put("c1", BlobRow("m", "2", "msgpack", b"\x03", base="1", count=3))),
            e("a", 2, put("c2", BlobRow("m", "3", "msgpack", b"\x04", base="2", count=4))),
        ]
    ]
    assert flushplan.wanted_bases(batches) == [("a", "", "m", "1")]
    result = plan(batches, bases={("a", "", "m", "1"): stored})
    blobs = columns(result.statements[0])
    assert blobs[3] == ["2", "3"]
    assert blobs[5] == [
        msgpack_list_header(3) + b"\x01\x02\x03",
        msgpack_list_header(4) + b"\x01\x02\x03\x04",
    ]
    whole = blobs[5][0]
    assert isinstance(whole, bytes)
    assert blobs[5][1] == delta_blob(whole, 4, b"\x04")


def test_a_delta_whose_base_is_not_stored_fails_its_thread_alone() -> None:
    batches = [
        [e("a", 1, put("c1", BlobRow("m", "2", "msgpack", b"\x03", base="1", count=3)))],
        [e("b", 1, put("c2"))],
    ]
    result = plan(batches)
    failed = result.outcomes[0]
    assert failed.status is ApplyStatus.FAILED
    assert not failed.retriable
    assert "not stored" in (failed.error or "")
    assert result.outcomes[1].status is ApplyStatus.APPLIED
    assert shape(result) == [("checkpoints", (1,)), ("watermarks", (1,))]


def test_pruning_threads_run_after_the_pipeline() -> None:
    batches = [[e("a", 1, put("c1")), e("a", 2, Prune())], [e("b", 1, put("c2"))]]
    result = plan(batches)
    assert [(w.batch, w.thread_id, len(w.ops)) for w in result.pruning] == [(0, "a", 2)]
    assert shape(result) == [("checkpoints", (1,)), ("watermarks", (0, 1))]


def test_large_blob_columns_are_split_into_statements_psycopg_can_pipeline() -> None:
    """Each chunk stays under `pipelining.CHUNK_BYTES` (a row alone may not), the chunks
    hold every row once in order, and each names the threads of its own rows."""
    big = CHUNK_BYTES // 3
    batches = [
        [
            e(t, seq, put(f"{t}{seq}", BlobRow("m", str(seq), "msgpack", bytes([i]) * big)))
            for seq in (1, 2)
        ]
        for i, t in enumerate("abcd")
    ]
    batches.append([e("e", 1, put("e1", BlobRow("m", "1", "msgpack", b"y" * (3 * CHUNK_BYTES))))])
    result = plan(batches)
    blobs = [s for s in result.statements if s.sql == INSERT_BLOBS]
    assert len(blobs) == 5
    # Two rows of a third of a chunk each, with their keys: a thread's pair per chunk.
    assert [s.batches for s in blobs] == [(0,), (1,), (2,), (3,), (4,)]
    rows = [row for s in blobs for row in zip(*columns(s), strict=True)]
    assert [(r[0], r[3]) for r in rows] == [(t, v) for t in "abcd" for v in "12"] + [("e", "1")]
    for statement in blobs[:-1]:
        assert payload_bytes(statement.params) <= CHUNK_BYTES
    assert fits_pipeline(s.params for s in blobs[:-1])
    assert not fits_pipeline([blobs[-1].params])  # 6 MiB alone: sent outside a pipeline
    # The other tables' statements are unchanged: one each.
    assert [s.sql for s in result.statements].count(INSERT_CHECKPOINTS) == 1
