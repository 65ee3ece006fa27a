"""`condense_table` (columnar) against `condense_tail` (the reference, the spec).

Random WAL tails: appends, snapshots that rewrite history (`keep` below the count),
deletes and re-creates, jump chains, gaps, duplicated seqs (the first stored wins), run ids
moving between threads and stream-seq ties. Entries at or below a watermark are part of
the tail too: condensing keeps them, the merge compares with the watermark (see
test_condense.py, which checks the reference against `planning.fold`).
No Spark session and no services.
"""

from __future__ import annotations

import random
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from buffered_store.spark.condense import (
    OVERLAY_ARROW,
    RUN_VERSION_ARROW,
    Condensed,
    CondensedTable,
    condense_table,
    condense_tail,
)
from buffered_store.spark.datasource import (
    ENTRY_ARROW,
    entry_batch,
    run_column,
    run_row,
)
from buffered_store.threadrun.entry import decode_entry_roles, encode_entry
from buffered_store.threadrun.planning import fold
from buffered_store.threadrun.records import RunRecord, RunStatus

from .test_condense import as_dict, history, merged, stored_view

T0 = datetime(2026, 1, 2, tzinfo=UTC)
THREADS = ["a", "b", "ü", "a\x00z"]


@st.composite
def runs(draw: st.DrawFn, thread_id: str, seq: int) -> dict[str, Any] | None:
    if not draw(st.booleans()):
        return None
    return {
        "run_id": draw(st.sampled_from(["r1", "r2", "r3"])),
        "thread_id": thread_id,
        "agent_id": "agent",
        "status": draw(st.sampled_from(["running", "done"])),
        "parent_run_id": None,
        "parent_thread_id": None,
        "created_at": T0,
        "updated_at": T0 + timedelta(seconds=seq),
        "finished_at": None,
        "steps": seq,
        "input_tokens": seq * 10,
        "output_tokens": None,
        "error": None,
        "output": draw(st.sampled_from([None, '{"x":1}'])),
        "metadata": "{}",
    }


@st.composite
def entries(draw: st.DrawFn) -> dict[str, Any]:
    thread_id = draw(st.sampled_from(THREADS))
    seq = draw(st.integers(1, 10))
    stream_seq = draw(st.integers(1, 40))  # ties on purpose
    at = T0 + timedelta(seconds=draw(st.integers(0, 100)))
    if draw(st.integers(0, 5)) == 0:
        return {
            "thread_id": thread_id,
            "seq": seq,
            "kind": "del",
            "stream_seq": stream_seq,
            "at": at,
            "keep": 0,
            "jump": draw(st.booleans()),
            "message_count": 0,
            "created_at": None,
            "parent_thread_id": None,
            "metadata": None,
            "latest_run_id": None,
            "run": None,
            "messages": [],
        }
    keep = draw(st.integers(0, 6))
    texts = draw(st.lists(st.sampled_from(["x", "y", "zz"]), max_size=4))
    run = draw(runs(thread_id, seq))
    return {
        "thread_id": thread_id,
        "seq": seq,
        "kind": "cp",
        "stream_seq": stream_seq,
        "at": at,
        "keep": keep,
        "jump": draw(st.sampled_from([False, False, True, None])),
        # A snapshot may also shrink the thread below what earlier entries wrote.
        "message_count": draw(st.sampled_from([keep + len(texts), max(0, keep - 1)])),
        "created_at": T0,
        "parent_thread_id": draw(st.sampled_from([None, "p"])),
        "metadata": '{"k":1}',
        "latest_run_id": run["run_id"] if run else None,
        "run": run,
        "messages": [
            {"role": "user", "message": f'{{"content":"{t}{seq}","role":"user"}}'} for t in texts
        ],
    }


def assert_same(rows: list[dict[str, Any]]) -> None:
    table = pa.Table.from_pylist(rows, schema=ENTRY_ARROW)
    reference = condense_tail(table.to_pylist())
    condensed = condense_table(table)
    assert condensed.threads.schema == OVERLAY_ARROW
    assert condensed.runs.schema == RUN_VERSION_ARROW
    assert condensed.threads.to_pylist() == reference.threads
    assert condensed.runs.to_pylist() == reference.runs
    assert condensed.counts() == reference.counts()
    assert condensed.runs_by_thread() == reference.runs_by_thread()


@settings(max_examples=400, deadline=None)
@given(st.lists(entries(), max_size=30))
def test_columnar_condensing_equals_the_reference(rows: list[dict[str, Any]]) -> None:
    assert_same(rows)


@settings(max_examples=100, deadline=None)
@given(st.lists(entries(), min_size=1, max_size=30), st.integers(1, 5))
def test_chunking_of_the_table_changes_nothing(rows: list[dict[str, Any]], size: int) -> None:
    batches = [
        pa.RecordBatch.from_pylist(rows[i : i + size], schema=ENTRY_ARROW)
        for i in range(0, len(rows), size)
    ]
    chunked = condense_table(pa.Table.from_batches(batches, schema=ENTRY_ARROW))
    whole = condense_table(pa.Table.from_pylist(rows, schema=ENTRY_ARROW))
    assert chunked == whole


@pytest.mark.parametrize("seed", range(30))
def test_writer_histories_condense_alike(seed: int) -> None:
    """Tails of entries the way the writer builds them, several threads interleaved."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for number in range(rng.randint(1, 4)):
        thread_rows = [as_dict(e) for e in history(rng, rng.randint(1, 10))]
        start = rng.randint(0, len(thread_rows) - 1)
        for row in thread_rows[start:]:
            row["thread_id"] = f"t{number}"
            if row["run"] is not None:
                row["run"]["thread_id"] = f"t{number}"
            row["stream_seq"] = rng.randint(1, 10_000)
            rows.append(row)
    rng.shuffle(rows)
    assert_same(rows)


def test_an_empty_tail_condenses_to_empty_tables() -> None:
    condensed = condense_table(ENTRY_ARROW.empty_table())
    assert condensed == CondensedTable(OVERLAY_ARROW.empty_table(), RUN_VERSION_ARROW.empty_table())
    assert condensed.counts() == {}
    assert condensed.runs_by_thread() == {}


@pytest.mark.parametrize("seed", range(10))
def test_entry_batch_equals_entry_rows(seed: int) -> None:
    """The columnar build of the ``threadlog`` rows gives what `entry_row` gives."""
    entries = history(random.Random(seed), 12)
    items = [decode_entry_roles(encode_entry(e), stream_seq=e.stream_seq) for e in entries]
    batch = entry_batch(items)
    assert batch.schema == ENTRY_ARROW
    assert batch.to_pylist() == [as_dict(entry) for entry, _ in items]


def test_run_column_equals_run_rows_for_every_field() -> None:
    """Every field of the column build, including the three converted ones (status,
    output, metadata) and falsy outputs that are not null, is what `run_row` gives."""
    rng = random.Random(7)
    outputs: list[Any] = [None, 0, "", [], {}, False, {"a": [1, "b"]}, "done", 3.5]
    runs: list[RunRecord | None] = [None]
    for i, output in enumerate(outputs):
        runs.append(
            RunRecord(
                run_id=f"r{i}",
                thread_id=f"t{i % 3}",
                agent_id="agent",
                status=rng.choice(list(RunStatus)),
                parent_run_id=None if i % 2 else f"p{i}",
                parent_thread_id=None if i % 3 else f"pt{i}",
                created_at=T0,
                updated_at=T0 + timedelta(seconds=i),
                finished_at=None if i % 2 else T0 + timedelta(minutes=i),
                steps=i,
                input_tokens=10 * i,
                output_tokens=2**40 + i,
                error=None if i % 4 else f"boom {i}",
                output=output,
                metadata={} if i % 2 else {"k": i, "nested": {"x": [i]}},
            )
        )
        if i % 3 == 0:
            runs.append(None)
    column = run_column(runs)
    assert column.type == ENTRY_ARROW.field("run").type
    assert column.to_pylist() == [None if r is None else run_row(r) for r in runs]
    assert run_column([]).to_pylist() == []


def test_a_stream_seq_tie_keeps_the_earlier_thread_and_seq() -> None:
    """Not seen in a real stream (its seqs are unique), but the reference defines it."""
    rows = []
    for thread_id, seq in (("b", 2), ("a", 3), ("a", 1), ("b", 1)):
        rows.append(
            {
                "thread_id": thread_id,
                "seq": seq,
                "kind": "cp",
                "stream_seq": 7,
                "at": T0,
                "keep": 0,
                "jump": False,
                "message_count": 0,
                "created_at": T0,
                "parent_thread_id": None,
                "metadata": "{}",
                "latest_run_id": "r",
                "run": {"run_id": "r", "thread_id": thread_id, "agent_id": "x", "steps": seq},
                "messages": [],
            }
        )
    assert_same(rows)
    [version] = condense_table(pa.Table.from_pylist(rows, schema=ENTRY_ARROW)).runs.to_pylist()
    assert (version["ov_owner"], version["ov_run_seq"]) == ("a", 1)


@pytest.mark.parametrize("seed", range(40))
def test_rows_declared_replaced_are_never_shown_from_postgres(seed: int) -> None:
    """`replaced()` lets the JDBC read drop the text of rows the merge replaces or hides:
    with those rows' text garbled, the merge (`merged`, the Spark rules in Python) at any
    watermark gives the same messages as the fold."""
    rng = random.Random(seed)
    entries = history(rng, rng.randint(1, 12))
    for watermark in range(len(entries)):
        start = rng.randint(0, watermark)
        table = pa.Table.from_pylist([as_dict(e) for e in entries[start:]], schema=ENTRY_ARROW)
        condensed = condense_table(table)
        as_rows = Condensed(condensed.threads.to_pylist(), condensed.runs.to_pylist())
        stored = stored_view(entries, watermark)
        [(position, below)] = condensed.replaced().values()
        garbled = [
            b"garbled" if p >= position and watermark < below else message
            for p, message in enumerate(stored.messages)
        ]
        expected = fold(stored, entries[start:])
        messages, _ = merged(as_rows, replace(stored, messages=garbled), watermark)
        assert messages == (None if expected.thread is None else expected.messages)
