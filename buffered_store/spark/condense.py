"""Condensing the WAL tail into the overlay: one row per pending thread and per run. Pure.

`condense_tail` is the reference, kept as the spec: a Python loop over rows. `condense_table`
computes exactly what it computes, but on an Arrow table of ``threadlog`` rows: sorts, group
boundaries and scatter/gather over index arrays instead of a Python loop per entry and per
message. A tail whose first entries rewrite whole histories (a snapshot after a writer
restart) holds about as many messages as the flushed table; here that costs a few array
passes, and the result goes to Spark as Arrow, never as Python rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from buffered_store.spark.datasource import ENTRY_ARROW, RUN_STRUCT

OVERLAY_SCHEMA = (
    "thread_id string, ov_seq bigint, ov_first_seq bigint, ov_del_seq bigint, "
    "ov_deleted boolean, ov_count int, ov_parent_thread_id string, ov_metadata string, "
    "ov_created_at timestamp, ov_updated_at timestamp, ov_latest_run_id string, "
    "ov_message_count int, ov_base int, "
    "ov_messages array<struct<thread_seq:bigint, role:string, message:string>>"
)
"""One row per pending thread, condensed from its entries by `condense_tail`.

`ov_messages[i]` is position ``ov_base + i``: the newest entry that wrote it, for every
position from `ov_base` (the lowest one the entries wrote) up to `ov_count`."""
RUN_VERSION_SCHEMA = f"run_id string, ov_owner string, ov_run_seq bigint, ov_run {RUN_STRUCT}"
"""Per run id in the tail: its newest version, the thread holding it and its seq."""

Ints = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]


_TIME = ENTRY_ARROW.field("at").type
OVERLAY_ARROW = pa.schema(
    [
        ("thread_id", pa.string()),
        ("ov_seq", pa.int64()),
        ("ov_first_seq", pa.int64()),
        ("ov_del_seq", pa.int64()),
        ("ov_deleted", pa.bool_()),
        ("ov_count", pa.int32()),
        ("ov_parent_thread_id", pa.string()),
        ("ov_metadata", pa.string()),
        ("ov_created_at", _TIME),
        ("ov_updated_at", _TIME),
        ("ov_latest_run_id", pa.string()),
        ("ov_message_count", pa.int32()),
        ("ov_base", pa.int32()),
        (
            "ov_messages",
            pa.list_(
                pa.struct(
                    [("thread_seq", pa.int64()), ("role", pa.string()), ("message", pa.string())]
                )
            ),
        ),
    ]
)
"""`OVERLAY_SCHEMA` as Arrow (the Spark tests check they agree)."""
RUN_VERSION_ARROW = pa.schema(
    [
        ("run_id", pa.string()),
        ("ov_owner", pa.string()),
        ("ov_run_seq", pa.int64()),
        ("ov_run", ENTRY_ARROW.field("run").type),
    ]
)
"""`RUN_VERSION_SCHEMA` as Arrow."""


@dataclass(frozen=True, slots=True)
class CondensedTable:
    """The overlay of a WAL tail as Arrow tables (`OVERLAY_ARROW`, `RUN_VERSION_ARROW`).

    ``threads.to_pylist()`` and ``runs.to_pylist()`` are the rows `condense_tail` gives.
    """

    threads: pa.Table
    runs: pa.Table

    @property
    def thread_ids(self) -> list[str]:
        """Pending threads, in order."""
        ids: list[str] = self.threads.column("thread_id").to_pylist()
        return ids

    def counts(self) -> dict[str, int]:
        """Newest message count per pending thread (0 when deleted)."""
        counts = self.threads.column("ov_count").to_pylist()
        return dict(zip(self.thread_ids, counts, strict=True))

    def replaced(self) -> dict[str, tuple[int, int]]:
        """Per pending thread, ``(position, seq)``: when the watermark a JDBC partition
        reads is below ``seq``, the merge replaces or hides every stored message row at
        ``position`` and beyond (see `overlay_messages_sql`).

        A deleted thread hides all its rows above its newest seq. Otherwise the rows from
        `ov_base` on are replaced when every cell there is written by an entry above the
        watermark, i.e. below the oldest such entry; a hole (never for well-formed entries)
        leaves only the rows past the count, hidden above the newest seq.
        """
        messages = self.threads.column("ov_messages").combine_chunks()
        flat = messages.flatten()
        parents = _np(pc.list_parent_indices(messages)).astype(np.int64)
        written = _np(flat.is_valid(), False).astype(bool)
        cell_seq = _np(pc.struct_field(flat, "thread_seq"), 0).astype(np.int64)
        rows = self.threads.num_rows
        holes = np.zeros(rows, dtype=np.int64)
        np.add.at(holes, parents, ~written)
        oldest = _np(self.threads.column("ov_seq")).astype(np.int64).copy()
        np.minimum.at(oldest, parents[written], cell_seq[written])
        seq = _np(self.threads.column("ov_seq")).astype(np.int64)
        base = _np(self.threads.column("ov_base")).astype(np.int64)
        count = _np(self.threads.column("ov_count")).astype(np.int64)
        deleted = _np(self.threads.column("ov_deleted"), False).astype(bool)
        position = np.where(deleted, 0, np.where(holes > 0, count, base))
        below = np.where(deleted | (holes > 0), seq, oldest)
        return {
            thread_id: (int(p), int(w))
            for thread_id, p, w in zip(self.thread_ids, position, below, strict=True)
        }

    def runs_by_thread(self) -> dict[str, list[str]]:
        """Per pending thread, the run ids whose newest version it holds."""
        out: dict[str, list[str]] = {thread_id: [] for thread_id in self.thread_ids}
        owners = self.runs.column("ov_owner").to_pylist()
        for run_id, owner in zip(self.runs.column("run_id").to_pylist(), owners, strict=True):
            out[owner].append(run_id)
        return out


def _np(array: pa.Array | pa.ChunkedArray, fill: Any = 0) -> Any:
    """A column as NumPy, nulls replaced by `fill`."""
    return pc.fill_null(array, fill).to_numpy(zero_copy_only=False)


def _group_starts(new_group: Bools) -> Ints:
    """Indexes where groups start, given a flag per row of a sorted column."""
    return np.flatnonzero(new_group).astype(np.int64)


def _changes(column: pa.Array) -> Bools:
    """Per row of a sorted column: does it differ from the row before (row 0: yes)?"""
    flags = np.ones(len(column), dtype=bool)
    if len(column) > 1:
        flags[1:] = _np(pc.not_equal(column[1:], column[:-1]), True)
    return flags


def _last_flagged(flags: Bools) -> Ints:
    """Per row, the index of the last row at or before it whose flag is set (-1: none)."""
    marks = np.where(flags, np.arange(len(flags), dtype=np.int64), -1)
    return np.maximum.accumulate(marks) if len(marks) else marks


def condense_table(table: pa.Table) -> CondensedTable:
    """`condense_tail` over an Arrow table of ``threadlog`` rows in stream order. Pure.

    Only index arrays are sorted and filtered; the messages are gathered once, into the
    overlay rows.
    """
    table = table.select(ENTRY_ARROW.names).combine_chunks()
    if not table.num_rows:
        return CondensedTable(OVERLAY_ARROW.empty_table(), RUN_VERSION_ARROW.empty_table())
    keys = table.select(["thread_id", "seq"])
    # Per thread in seq order; the stable sort keeps stream order among equal seqs, and
    # the first stored entry of a seq wins, as in `plan_entries`.
    order = pc.sort_indices(keys, [("thread_id", "ascending"), ("seq", "ascending")])
    sorted_keys = keys.take(order)
    first_of_seq = _changes(sorted_keys.column("thread_id").combine_chunks()) | _changes(
        sorted_keys.column("seq").combine_chunks()
    )
    rows = _np(order).astype(np.int64)[first_of_seq]
    entries = table.drop_columns(["messages"]).take(pa.array(rows))
    messages = table.column("messages").combine_chunks()
    return CondensedTable(_thread_rows(entries, messages, rows), _run_versions(entries))


def _thread_rows(entries: pa.Table, messages: pa.ListArray, rows: Ints) -> pa.Table:
    """One `OVERLAY_ARROW` row per thread of `entries` (sorted, one entry per seq; entry
    ``i`` has the messages ``messages[rows[i]]``)."""
    n = entries.num_rows
    new_thread = _changes(entries.column("thread_id").combine_chunks())
    starts = _group_starts(new_thread)
    ends = np.append(starts[1:], n) - 1  # last entry of each thread
    group = np.cumsum(new_thread) - 1  # thread index of each entry
    seq = _np(entries.column("seq")).astype(np.int64)
    jump = _np(entries.column("jump"), False).astype(bool)
    deleted = _np(pc.equal(entries.column("kind"), "del"), False).astype(bool)

    # The contiguous run of seqs ending at the newest one; a jump entry starts a chain.
    chain_start = jump.copy()
    chain_start[starts] = True
    if n > 1:
        chain_start[1:] |= seq[1:] != seq[:-1] + 1
    first_index = _last_flagged(chain_start)[ends]
    first_seq = np.where(jump[first_index], 1, seq[first_index])

    del_seq = np.maximum.reduceat(np.where(deleted, seq, 0), starts)
    last_deleted = deleted[ends]
    count = np.where(last_deleted, 0, _np(entries.column("message_count"))[ends]).astype(np.int64)

    keep = _np(entries.column("keep")).astype(np.int64)
    base, cells = _message_cells(messages, rows, keep, group, seq, del_seq, count)
    last = entries.take(pa.array(ends))
    columns = {
        "thread_id": last.column("thread_id"),
        "ov_seq": pa.array(seq[ends], pa.int64()),
        "ov_first_seq": pa.array(first_seq, pa.int64()),
        "ov_del_seq": pa.array(del_seq, pa.int64()),
        "ov_deleted": pa.array(last_deleted, pa.bool_()),
        "ov_count": pa.array(count, pa.int32()),
        "ov_parent_thread_id": last.column("parent_thread_id"),
        "ov_metadata": last.column("metadata"),
        "ov_created_at": last.column("created_at"),
        "ov_updated_at": last.column("at"),
        "ov_latest_run_id": last.column("latest_run_id"),
        "ov_message_count": pa.array(count, pa.int32()),
        "ov_base": pa.array(base, pa.int32()),
        "ov_messages": cells,
    }
    return pa.Table.from_arrays(
        [pc.cast(columns[f.name], f.type) for f in OVERLAY_ARROW], schema=OVERLAY_ARROW
    )


def _message_cells(
    messages: pa.ListArray,
    rows: Ints,
    keep: Ints,
    group: Ints,
    seq: Ints,
    del_seq: Ints,
    count: Ints,
) -> tuple[Ints, pa.ListArray]:
    """Per thread: the lowest position written below its count (`ov_base`), and for each
    position from there to the count the newest entry's message (null: not written)."""
    flat = messages.flatten()
    offsets_all = np.asarray(messages.offsets, dtype=np.int64)
    first_item = offsets_all[rows] - offsets_all[0]
    lengths = _np(pc.list_value_length(messages)).astype(np.int64)[rows]
    owner = np.repeat(np.arange(len(rows), dtype=np.int64), lengths)
    starts = np.cumsum(lengths) - lengths
    within = np.arange(len(owner), dtype=np.int64) - np.repeat(starts, lengths)
    item = first_item[owner] + within  # index into `flat`
    position = keep[owner] + within
    thread = group[owner]
    # A delete drops what came before it; positions past the newest count are not shown.
    live = (seq[owner] > del_seq[thread]) & (position < count[thread])
    cells = np.flatnonzero(live)
    # Newest write per (thread, position): the last of each group, entries being in seq order.
    cells = cells[np.lexsort((owner[cells], position[cells], thread[cells]))]
    if len(cells) > 1:
        same = (thread[cells][1:] == thread[cells][:-1]) & (
            position[cells][1:] == position[cells][:-1]
        )
        cells = cells[np.append(~same, True)]
    base = count.copy()
    np.minimum.at(base, thread[cells], position[cells])
    sizes = count - base
    offsets = np.concatenate(([0], np.cumsum(sizes)))
    slot_of_cell = offsets[thread[cells]] + position[cells] - base[thread[cells]]
    pick = np.full(int(offsets[-1]), -1, dtype=np.int64)
    pick[slot_of_cell] = cells
    hole = pick < 0
    picked = np.where(hole, 0, pick)
    taken = pa.array(item[picked] if len(item) else picked, pa.int64(), mask=hole)
    slots = pa.StructArray.from_arrays(
        [
            pa.array(seq[owner[picked]] if len(owner) else picked, pa.int64()),
            flat.field("role").take(taken),
            flat.field("message").take(taken),
        ],
        names=["thread_seq", "role", "message"],
        mask=pa.array(hole),
    )
    message_type = OVERLAY_ARROW.field("ov_messages").type
    return base, pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), slots, type=message_type)


def _run_versions(entries: pa.Table) -> pa.Table:
    """Per run id: its newest version, latest in the stream; the earlier thread in
    (thread, seq) order wins a tie, as in the reference."""
    has_run = pc.is_valid(entries.column("run"))
    runs = entries.filter(has_run)
    runs = runs.append_column("run_id", pc.struct_field(runs.column("run"), "run_id"))
    runs = runs.append_column("order", pa.array(np.arange(runs.num_rows, dtype=np.int64)))
    runs = runs.take(
        pc.sort_indices(
            runs,
            [("run_id", "ascending"), ("stream_seq", "descending"), ("order", "ascending")],
        )
    )
    runs = runs.filter(pa.array(_changes(runs.column("run_id").combine_chunks())))
    columns = {
        "run_id": runs.column("run_id"),
        "ov_owner": runs.column("thread_id"),
        "ov_run_seq": runs.column("seq"),
        "ov_run": runs.column("run"),
    }
    return pa.Table.from_arrays(
        [pc.cast(columns[f.name], f.type) for f in RUN_VERSION_ARROW], schema=RUN_VERSION_ARROW
    )


# -- the reference -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Condensed:
    """The overlay of a WAL tail: rows of `OVERLAY_SCHEMA` and `RUN_VERSION_SCHEMA`."""

    threads: list[dict[str, Any]]
    runs: list[dict[str, Any]]

    def counts(self) -> dict[str, int]:
        """Newest message count per pending thread (0 when deleted)."""
        return {row["thread_id"]: row["ov_count"] for row in self.threads}

    def runs_by_thread(self) -> dict[str, list[str]]:
        """Per pending thread, the run ids whose newest version it holds."""
        out: dict[str, list[str]] = {row["thread_id"]: [] for row in self.threads}
        for run in self.runs:
            out[run["ov_owner"]].append(run["run_id"])
        return out


def condense_tail(entries: Iterable[Mapping[str, Any]]) -> Condensed:
    """Fold the tail's entries (rows of `ENTRY_SCHEMA` as dicts) per thread. Pure.

    Per thread: the newest seq ``b``; the first seq of the contiguous run of seqs ending
    at ``b`` (an entry missing below it is a gap; 1 when the run starts with a jump entry,
    which follows any watermark); the last delete; the summary at ``b``;
    for each message position below the count at ``b`` that an entry wrote, the newest
    such entry and its message. Those positions are contiguous, from the lowest `keep`
    after the last delete: every later entry keeps at most what exists, so the newest
    entry whose `keep` does not cover a position also wrote it. Per run id: its newest
    version, latest in the stream (a run id reused by another thread moves there, and
    the later write is the one a flush leaves in place).

    Whether an entry applies depends on the watermark each JDBC partition reads, so
    nothing is dropped here: the Spark side compares these seqs with it.
    """
    groups: dict[str, dict[int, Mapping[str, Any]]] = {}
    for entry in entries:
        # The first stored entry of a seq wins, as in `plan_entries`.
        groups.setdefault(entry["thread_id"], {}).setdefault(entry["seq"], entry)
    newest_runs: dict[str, tuple[int, int, str, Mapping[str, Any]]] = {}
    rows: list[dict[str, Any]] = []
    for thread_id in sorted(groups):
        by_seq = groups[thread_id]
        seqs = sorted(by_seq)
        first = seqs[-1]
        while first - 1 in by_seq and not by_seq[first].get("jump"):
            first -= 1
        if by_seq[first].get("jump"):
            first = 1  # a chain started by a jump applies on top of any lower watermark
        cells: dict[int, dict[str, Any]] = {}
        deleted_at = 0
        for seq in seqs:
            entry = by_seq[seq]
            if entry["kind"] == "del":
                cells, deleted_at = {}, seq
                continue
            for index, message in enumerate(entry["messages"] or ()):
                cells[entry["keep"] + index] = {
                    "thread_seq": seq,
                    "role": message["role"],
                    "message": message["message"],
                }
            run = entry["run"]
            if run is not None:
                known = newest_runs.get(run["run_id"])
                if known is None or known[0] < entry["stream_seq"]:
                    newest_runs[run["run_id"]] = (entry["stream_seq"], seq, thread_id, run)
        last = by_seq[seqs[-1]]
        deleted = last["kind"] == "del"
        count = 0 if deleted else last["message_count"]
        base = min((p for p in cells if p < count), default=count)
        rows.append(
            {
                "thread_id": thread_id,
                "ov_seq": seqs[-1],
                "ov_first_seq": first,
                "ov_del_seq": deleted_at,
                "ov_deleted": deleted,
                "ov_count": count,
                "ov_parent_thread_id": last["parent_thread_id"],
                "ov_metadata": last["metadata"],
                "ov_created_at": last["created_at"],
                "ov_updated_at": last["at"],
                "ov_latest_run_id": last["latest_run_id"],
                "ov_message_count": count,
                "ov_base": base,
                # A hole (impossible for well-formed entries) reads as "not written".
                "ov_messages": [cells.get(p) for p in range(base, count)],
            }
        )
    runs = [
        {"run_id": run_id, "ov_owner": thread_id, "ov_run_seq": seq, "ov_run": run}
        for run_id, (_, seq, thread_id, run) in sorted(newest_runs.items())
    ]
    return Condensed(rows, runs)
