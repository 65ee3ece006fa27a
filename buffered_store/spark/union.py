"""The messages of a read-your-writes read as a union, not a join. Pure: no I/O.

When every JDBC partition reads one pinned Postgres snapshot (`jdbc.pin_snapshot`), the
driver knows each pending thread's watermark ``W`` and stored message count in that
snapshot before any row is scanned. Then nothing about a row depends on the partition
that reads it, and the merge is decided per thread, once, here:

1. Entries at or below ``W`` are in the snapshot already: dropped (`entries_above`).
   What is left is strictly newer than every row the scan returns.
2. Those entries are condensed (`condense.condense_table`): per thread the newest writer
   of each position from ``base``, the lowest position any of them writes, to the newest
   count. Every position from ``base`` on is written by one of them (each entry keeps at
   most what exists), so rows from ``base`` on come from the tail, rows below it from the
   scan: no row of the scan is ever replaced, only cut off.
3. A thread whose entries only append (``base`` at or past its stored count, no delete:
   almost every pending thread) needs nothing from the scan but its rows as they are;
   only the others (*cut* threads: a rewrite, a truncation, a snapshot entry, a delete)
   need the scan to drop their rows at ``base`` and beyond (`UnionPlan.cuts`).

So the messages read is ``scan UNION ALL tail rows``: no join, no per-row watermark, and
the scan fetches only the columns the query needs. Newest seq wins per key because the
tail rows are exactly the entries above the snapshot's watermark, and the snapshot is
the one the scan reads: a flush committing after it is not seen by the scan, while its
entries are in the tail (read before the snapshot was taken, see `overlay`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from buffered_store.errors import StoreError
from buffered_store.spark.condense import OVERLAY_ARROW, condense_table

MESSAGE_ROWS_ARROW = pa.schema(
    [
        ("thread_id", pa.string()),
        ("position", pa.int32()),
        ("role", pa.string()),
        ("message", pa.string()),
        ("thread_seq", pa.int64()),
    ]
)
"""Rows the tail adds to a messages read (`jdbc.MESSAGE_COLUMNS` as Arrow)."""


class TailMismatchError(StoreError):
    """The WAL tail does not continue a thread's state in the pinned snapshot."""


@dataclass(frozen=True, slots=True)
class Mark:
    """A pending thread in the pinned snapshot: its watermark and stored message count
    (0 for a thread the table does not hold or holds as a tombstone)."""

    watermark: int
    stored: int


TAIL_CELLS_ARROW = pa.schema(
    [
        ("thread_id", pa.string()),
        ("ov_base", pa.int32()),
        ("ov_messages", OVERLAY_ARROW.field("ov_messages").type),
    ]
)
"""The tail's rows per thread: ``ov_messages[i]`` is position ``ov_base + i``."""


@dataclass(frozen=True, slots=True)
class UnionPlan:
    """How the messages read merges the tail: scan rows minus `cuts`, plus the rows of
    `cells`."""

    cells: pa.Table
    """Per thread, the rows the tail adds or replaces (`TAIL_CELLS_ARROW`), every one
    newer than the snapshot: one row per thread, exploded by Spark (a million rows of a
    tail of snapshots cost Arrow and Spark far more as rows than as 2,000 lists)."""
    cuts: dict[str, int]
    """Per thread whose scan rows the tail rewrites: the first position dropped from the
    scan (0: every row of the thread)."""
    appending: int
    """Pending threads whose entries only append: their scan rows stay as they are."""

    @property
    def rows(self) -> pa.Table:
        """`cells` as message rows (`MESSAGE_ROWS_ARROW`)."""
        return message_rows(self.cells)


def entries_above(entries: pa.Table, marks: Mapping[str, Mark]) -> pa.Table:
    """The entries whose seq is above their thread's watermark (0 for a thread not in
    `marks`), in their order."""
    if not entries.num_rows:
        return entries
    ids = pa.array(list(marks), pa.string())
    marks_w = np.fromiter((m.watermark for m in marks.values()), np.int64, len(marks))
    index = pc.index_in(entries.column("thread_id"), value_set=ids)
    found = pc.fill_null(index, -1).to_numpy(zero_copy_only=False).astype(np.int64)
    watermark = np.where(found >= 0, marks_w[np.maximum(found, 0)] if len(marks) else 0, 0)
    seq = entries.column("seq").to_numpy().astype(np.int64)
    return entries.filter(pa.array(seq > watermark))


def plan_union(entries: pa.Table, marks: Mapping[str, Mark]) -> UnionPlan:
    """The union for `entries` (rows of ``threadlog``, in stream order) on top of the
    snapshot described by `marks` (every thread with entries should have one). Pure.

    Raises `TailMismatchError` when a thread's entries above its watermark do not start
    right after it (an entry neither flushed nor in the tail) or do not fit its stored
    state, as the store's own reads fail for it.
    """
    condensed = condense_table(entries_above(entries, marks)).threads
    if not condensed.num_rows:
        return UnionPlan(TAIL_CELLS_ARROW.empty_table(), {}, 0)
    ids: list[str] = condensed.column("thread_id").to_pylist()
    first = condensed.column("ov_first_seq").to_pylist()
    base = condensed.column("ov_base").to_pylist()
    deleted_at = condensed.column("ov_del_seq").to_pylist()
    cuts: dict[str, int] = {}
    for thread_id, first_seq, lowest, del_seq in zip(ids, first, base, deleted_at, strict=True):
        mark = marks.get(thread_id, Mark(0, 0))
        if first_seq > mark.watermark + 1:
            raise TailMismatchError(
                f"thread {thread_id}: entries after seq {mark.watermark} are neither "
                "flushed nor in the WAL tail"
            )
        # A delete in the chain drops every stored row; after it, entries start empty.
        cut = 0 if del_seq else lowest
        if cut > mark.stored:
            raise TailMismatchError(
                f"thread {thread_id}: entries after seq {mark.watermark} keep {cut} "
                f"messages but only {mark.stored} are stored"
            )
        if cut < mark.stored:
            cuts[thread_id] = cut
    cells = condensed.select(TAIL_CELLS_ARROW.names)
    if pc.list_flatten(cells.column("ov_messages")).null_count:
        raise TailMismatchError("a position between entries is written by none of them")
    return UnionPlan(cells, cuts, len(ids) - len(cuts))


def message_rows(condensed: pa.Table) -> pa.Table:
    """Per-thread cells (`TAIL_CELLS_ARROW`) as message rows (`MESSAGE_ROWS_ARROW`)."""
    cells = condensed.column("ov_messages").combine_chunks()
    flat = cells.flatten()
    parents = pc.list_parent_indices(cells).to_numpy().astype(np.int64)
    offsets = np.asarray(cells.offsets, dtype=np.int64)
    base = condensed.column("ov_base").to_numpy().astype(np.int64)
    within = np.arange(len(parents), dtype=np.int64) - (offsets[parents] - offsets[0])
    columns = [
        condensed.column("thread_id").combine_chunks().take(pa.array(parents)),
        pa.array(base[parents] + within, pa.int32()),
        flat.field("role"),
        flat.field("message"),
        flat.field("thread_seq"),
    ]
    return pa.Table.from_arrays(columns, schema=MESSAGE_ROWS_ARROW)
