"""`langgraph.search`, the pure parts of ``list(None, ...)``: how the statement's rows
are split by thread, how many stored rows a pending thread needs, and how the pending
threads' tails merge with every thread's rows (newest first, filter, before, limit)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import orjson

from buffered_store.langgraph import search
from buffered_store.langgraph.entry import Delete, LgEntry, Op, Put, kind_of


def row(thread_id: str, checkpoint_id: str, **metadata: Any) -> dict[str, Any]:
    return {
        "thread_id": thread_id,
        "checkpoint_ns": "",
        "checkpoint_id": checkpoint_id,
        "parent_checkpoint_id": None,
        "checkpoint": {"id": checkpoint_id, "channel_versions": {}},
        "metadata": {"step": 0, **metadata},
        "channel_values": None,
        "pending_writes": None,
    }


def put(checkpoint_id: str, **metadata: Any) -> Put:
    checkpoint = orjson.dumps({"id": checkpoint_id, "channel_versions": {}})
    return Put("", checkpoint_id, None, checkpoint, orjson.dumps({"step": 1, **metadata}))


def entry(thread_id: str, seq: int, *ops: Op) -> LgEntry:
    return LgEntry(
        thread_id=thread_id,
        seq=seq,
        kind=kind_of(ops),
        at=datetime(2026, 1, 1, tzinfo=UTC),
        ops=ops,
    )


def ids(chosen: list[search.Chosen]) -> list[tuple[str, str]]:
    return [(c.thread_id, c.row["checkpoint_id"]) for c in chosen]


def test_split_keeps_each_pending_threads_watermark_even_without_rows() -> None:
    rows = [
        {"_pending": "p1", "_flushed_seq": 3, **row("p1", "05")},
        {"_pending": "p2", "_flushed_seq": 0, **row("p2", "x") | {"checkpoint_id": None}},
        {"_pending": None, "_flushed_seq": None, **row("o", "04")},
    ]
    found = search.split(rows)
    assert found.flushed == {"p1": 3, "p2": 0}
    assert [r["checkpoint_id"] for r in found.pending_rows["p1"]] == ["05"]
    assert found.pending_rows["p2"] == []
    assert [r["thread_id"] for r in found.other_rows] == ["o"]
    assert all("_pending" not in r for r in found.other_rows + found.pending_rows["p1"])


def test_a_pending_thread_reads_the_page_plus_one_row_per_checkpoint_it_puts() -> None:
    chain = [entry("p", 1, put("01"), put("02")), entry("p", 2, Delete())]
    assert search.own_limit(chain, 5) == 7
    assert search.own_limit(chain, None) is None


def test_tails_merge_with_every_threads_rows_newest_first() -> None:
    found = search.Found(
        flushed={"p": 1, "gone": 1},
        pending_rows={
            "p": [row("p", "06", tag="old"), row("p", "02")],
            "gone": [row("gone", "09")],
        },
        other_rows=[row("o", "08"), row("o", "03")],
    )
    chains = {
        # seq 1 is flushed already (the snapshot's watermark): only seq 2 and 3 count.
        "p": [
            entry("p", 1, put("99")),
            entry("p", 2, put("07")),
            entry("p", 3, put("06", tag="new")),
        ],
        "gone": [entry("gone", 2, Delete())],
    }
    chosen = search.merge(found, chains, before_id=None, metadata_filter=None, limit=None)
    assert ids(chosen) == [("o", "08"), ("p", "07"), ("p", "06"), ("o", "03"), ("p", "02")]
    replaced = chosen[2].row
    assert replaced["metadata"]["tag"] == "new"
    assert replaced["_pending"] is True
    assert chosen[0].tail is None
    assert chosen[1].tail is not None

    limited = search.merge(found, chains, before_id=None, metadata_filter=None, limit=2)
    assert ids(limited) == [("o", "08"), ("p", "07")]
    # `before` filters the tails here; the statement filtered the stored rows already.
    found.other_rows = [r for r in found.other_rows if r["checkpoint_id"] < "07"]
    before = search.merge(found, chains, before_id="07", metadata_filter=None, limit=None)
    assert ids(before) == [("p", "06"), ("o", "03"), ("p", "02")]
    # So does the metadata filter (no stored row has the tag).
    none_stored = search.Found(flushed=found.flushed, pending_rows={}, other_rows=[])
    tagged = search.merge(
        none_stored, chains, before_id=None, metadata_filter={"tag": "new"}, limit=5
    )
    assert ids(tagged) == [("p", "06")]


def test_wanted_asks_for_the_pending_rows_of_live_threads_only() -> None:
    tail_put = put("07")
    found = search.Found(flushed={"p": 0}, pending_rows={"p": []}, other_rows=[row("o", "08")])
    chosen = search.merge(
        found, {"p": [entry("p", 1, tail_put)]}, before_id=None, metadata_filter=None, limit=None
    )
    blobs, writes = search.wanted(chosen)
    assert blobs == []
    assert writes == [("p", "", "07")]


def test_the_query_binds_the_filter_twice_and_the_pending_ids_for_both_parts() -> None:
    query, args = search.rows_query("WHERE metadata @> %s ", ["{}"], {"a": 3, "b": None}, 2)
    assert query.count("%s") == len(args) == 6
    assert args == [["a", "b"], [3, None], "{}", "{}", ["a", "b"], 2]
    assert "checkpoints.thread_id = p.thread_id" in query
    empty, _ = search.rows_query("", [], {}, None)
    assert "WHERE checkpoints.thread_id = p.thread_id" in empty
    assert "WHERE NOT (thread_id = ANY(%s))" in empty
