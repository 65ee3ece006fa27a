"""`union.plan_union`: the messages of a pinned-snapshot read as scan rows minus cuts plus
tail rows, against `planning.fold` (the store's own rule). Pure: no Spark, no services.

The union is right only because the watermarks come from the snapshot the scan reads:
each case below builds that snapshot from the entries at or below a watermark and checks
that the union gives the fold of every entry.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pyarrow as pa
import pytest

from buffered_store.engine.keys import wal_subject
from buffered_store.engine.ports import StoredMsg
from buffered_store.spark.datasource import ENTRY_ARROW, entry_batch
from buffered_store.spark.tail import message_entries
from buffered_store.spark.union import (
    MESSAGE_ROWS_ARROW,
    Mark,
    TailMismatchError,
    UnionPlan,
    entries_above,
    plan_union,
)
from buffered_store.threadrun.entry import EntryKind, WalEntry, decode_entry_roles, encode_entry
from buffered_store.threadrun.messages import encode_messages
from buffered_store.threadrun.planning import fold

from .test_condense import AT, history, stored_view


def table(entries: list[WalEntry]) -> pa.Table:
    """The entries as the driver's tail table, in the given (stream) order."""
    items = [decode_entry_roles(encode_entry(e), stream_seq=e.stream_seq) for e in entries]
    return pa.Table.from_batches([entry_batch(items)], schema=ENTRY_ARROW)


def checkpoint(thread_id: str, seq: int, keep: int, texts: list[str], count: int) -> WalEntry:
    """A checkpoint entry keeping `keep` messages and appending `texts`."""
    new = encode_messages([{"role": "user", "content": t} for t in texts])
    assert count == keep + len(new)
    return WalEntry(
        thread_id=thread_id,
        seq=seq,
        kind=EntryKind.CHECKPOINT,
        at=AT,
        keep=keep,
        messages=new,
        message_count=count,
        stream_seq=1000 + seq,
    )


def union_rows(plan: UnionPlan, stored: dict[str, list[bytes]]) -> dict[str, list[bytes]]:
    """What the Spark union returns, per thread (positions in order): the stored rows
    not cut, plus the plan's rows."""
    out: dict[str, dict[int, bytes]] = {}
    for thread_id, messages in stored.items():
        cut = plan.cuts.get(thread_id, len(messages))
        out[thread_id] = {p: m for p, m in enumerate(messages) if p < cut}
    rows = plan.rows
    assert rows.schema == MESSAGE_ROWS_ARROW
    for row in rows.to_pylist():
        cells = out.setdefault(row["thread_id"], {})
        assert row["position"] not in cells, "a tail row duplicates a scanned row"
        cells[row["position"]] = row["message"].encode()
    return {t: [cells[p] for p in sorted(cells)] for t, cells in out.items() if cells}


def test_entries_at_or_below_the_watermark_are_dropped() -> None:
    entries = [checkpoint("a", s, s - 1, [f"a{s}"], s) for s in (1, 2, 3)]
    entries += [checkpoint("b", 1, 0, ["b1"], 1)]
    above = entries_above(table(entries), {"a": Mark(2, 2)})
    # "b" has no mark: a thread the snapshot does not hold, every entry is newer.
    pairs = zip(above["thread_id"].to_pylist(), above["seq"].to_pylist(), strict=True)
    assert list(pairs) == [
        ("a", 3),
        ("b", 1),
    ]


def test_append_only_threads_are_a_union_with_no_cut() -> None:
    entries = [checkpoint("a", 3, 2, ["a3"], 3), checkpoint("a", 4, 3, ["a4"], 4)]
    plan = plan_union(table(entries), {"a": Mark(2, 2)})
    assert plan.cuts == {}
    assert plan.appending == 1
    rows = plan.rows.to_pylist()
    assert [(r["position"], r["thread_seq"]) for r in rows] == [(2, 3), (3, 4)]


def test_a_rewrite_cuts_the_scan_at_the_lowest_position_it_writes() -> None:
    # Stored: 4 messages at seq 4. Seq 5 keeps 1 and writes 2 (a truncation + rewrite),
    # seq 6 appends one.
    entries = [checkpoint("a", 5, 1, ["x", "y"], 3), checkpoint("a", 6, 3, ["z"], 4)]
    plan = plan_union(table(entries), {"a": Mark(4, 4)})
    assert plan.cuts == {"a": 1}
    assert plan.appending == 0
    assert [r["position"] for r in plan.rows.to_pylist()] == [1, 2, 3]


def test_a_snapshot_entry_cuts_every_stored_row() -> None:
    entries = [checkpoint("a", 3, 0, ["p", "q", "r"], 3)]
    plan = plan_union(table(entries), {"a": Mark(2, 2)})
    assert plan.cuts == {"a": 0}


def test_entries_the_snapshot_holds_already_change_nothing() -> None:
    # Flushed between the tail read and the pin: the watermark passed every entry.
    entries = [checkpoint("a", 3, 0, ["p"], 1)]
    plan = plan_union(table(entries), {"a": Mark(3, 1)})
    assert plan.cuts == {}
    assert plan.rows.num_rows == 0


def test_a_delete_cuts_every_row_and_hides_the_thread() -> None:
    delete = WalEntry(thread_id="a", seq=3, kind=EntryKind.DELETE, at=AT, stream_seq=1003)
    plan = plan_union(table([delete]), {"a": Mark(2, 5)})
    assert plan.cuts == {"a": 0}
    assert plan.rows.num_rows == 0


def test_a_gap_above_the_watermark_fails_naming_the_thread() -> None:
    entries = [checkpoint("a", 4, 2, ["a4"], 3)]
    with pytest.raises(TailMismatchError, match="thread a: entries after seq 2"):
        plan_union(table(entries), {"a": Mark(2, 2)})


def test_entries_keeping_more_than_is_stored_fail() -> None:
    entries = [checkpoint("a", 3, 5, ["a3"], 6)]
    with pytest.raises(TailMismatchError, match="keep 5 messages but only 2"):
        plan_union(table(entries), {"a": Mark(2, 2)})


@pytest.mark.parametrize("seed", range(60))
def test_union_at_any_watermark_equals_the_fold(seed: int) -> None:
    """Random histories (appends, rewrites, snapshots, deletes), a random watermark and a
    tail starting anywhere at or below it: the union is the fold of every entry."""
    rng = random.Random(seed)
    entries = history(rng, rng.randint(1, 12))
    for watermark in range(len(entries) + 1):
        start = rng.randint(0, watermark)
        tail = entries[start:]
        stored = stored_view(entries, watermark)
        expected = fold(stored, tail)
        live = stored.thread is not None
        mark = Mark(watermark, len(stored.messages) if live else 0)
        plan = plan_union(table(tail), {"t": mark})
        got = union_rows(plan, {"t": list(stored.messages) if live else []})
        want = {"t": expected.messages} if expected.thread is not None and expected.messages else {}
        assert got == want, (seed, watermark, start)
        # Every tail row is newer than the snapshot: it never shadows a flushed row.
        assert all(r["thread_seq"] > watermark for r in plan.rows.to_pylist())


def test_the_light_decode_gives_the_full_decode_s_message_columns() -> None:
    rng = random.Random(7)
    entries = history(rng, 30)
    subject = wal_subject("S", "t")
    stored = [StoredMsg(i + 1, subject, encode_entry(e)) for i, e in enumerate(entries)]
    light = message_entries("S", stored)
    full = table([replace(e, stream_seq=i + 1) for i, e in enumerate(entries)])
    columns = ["thread_id", "seq", "kind", "keep", "jump", "message_count", "messages"]
    assert light.select(columns).to_pylist() == full.select(columns).to_pylist()


def test_the_light_decode_skips_what_the_full_decode_skips() -> None:
    good = checkpoint("t", 1, 0, ["a"], 1)
    other = checkpoint("u", 2, 0, ["b"], 1)  # published on another thread's subject
    subject = wal_subject("S", "t")
    rows = message_entries(
        "S",
        [
            StoredMsg(1, subject, encode_entry(good)),
            StoredMsg(2, subject, b"not json"),
            StoredMsg(3, subject, encode_entry(other)),
            StoredMsg(4, subject, encode_entry(good).replace(b'"n":1', b'"n":7')),
            StoredMsg(5, "S.other.x", encode_entry(good)),
        ],
    )
    assert rows["stream_seq"].to_pylist() == [1]


def test_a_snapshot_equal_to_the_stored_rows_still_cuts_them() -> None:
    """The cut is decided on positions, never on content: a snapshot entry's rows come
    from the tail even when they equal the stored ones (equality is not known cheaply)."""
    entries = [checkpoint("a", 2, 0, ["same"], 1)]
    plan = plan_union(table(entries), {"a": Mark(1, 1)})
    assert plan.cuts == {"a": 0}
    assert [r["thread_seq"] for r in plan.rows.to_pylist()] == [2]


def test_the_light_decode_cuts_messages_whose_text_holds_the_separator() -> None:
    entries = [
        checkpoint("t", 1, 0, ["a},{b", "}", "{"], 3),
        checkpoint("t", 2, 3, ['x"},{"y'], 4),
        checkpoint("t", 3, 4, [], 4),
    ]
    subject = wal_subject("S", "t")
    stored = [StoredMsg(e.stream_seq, subject, encode_entry(e)) for e in entries]
    light = message_entries("S", stored)
    assert light.column("messages").to_pylist() == table(entries).column("messages").to_pylist()
