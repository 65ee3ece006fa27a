"""Reads of the LangGraph front-end: the unflushed tail of a thread folded on the rows
Postgres holds, giving the rows AsyncPostgresSaver's own query would return after a
flush. Pure: the saver fetches, this module decides.

Rows are dicts shaped as ``langgraph.checkpoint.postgres.base.SELECT_SQL`` returns them
(``channel_values`` and ``pending_writes`` as lists of byte-string tuples), so the
saver turns merged rows into `CheckpointTuple` with LangGraph's own loaders.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from buffered_store.langgraph.entry import Delete, LgEntry, Put, Writes, delta_blob

Row = dict[str, Any]
BlobKey = tuple[str, str, str]
"""(checkpoint_ns, channel, version)"""
WriteKey = tuple[str, str]
"""(checkpoint_ns, checkpoint_id)"""
StoredWrite = tuple[str, int, str, str, bytes | None, str]
"""(task_id, idx, channel, type, blob, task_path) as checkpoint_writes holds it."""
ParentWrite = tuple[str, str, str, int, str, str, bytes | None, str]
"""(checkpoint_ns, checkpoint_id, task_id, idx, channel, type, blob, task_path)."""


@dataclass(frozen=True, slots=True)
class TailWrite:
    ns: str
    checkpoint_id: str
    task_id: str
    idx: int
    channel: str
    type: str
    blob: bytes | None
    task_path: str
    upsert: bool


@dataclass(frozen=True, slots=True)
class Delta:
    """A blob of the tail that only holds the items appended to a stored base."""

    type: str
    base: BlobKey
    count: int
    tail: bytes


@dataclass(slots=True)
class Tail:
    """A thread's unflushed entries, row by row, as the flush would write them."""

    deleted: bool = False
    """The tail deletes the thread: stored rows no longer count."""
    checkpoints: dict[WriteKey, Put] = field(default_factory=dict)
    """(ns, checkpoint id) -> its ``put``."""
    blobs: dict[BlobKey, tuple[str, bytes | None]] = field(default_factory=dict)
    deltas: dict[BlobKey, Delta] = field(default_factory=dict)
    """Blobs whose base is stored, not in the tail (completed with the stored base)."""
    writes: list[TailWrite] = field(default_factory=list)


def fold(entries: Sequence[LgEntry]) -> Tail:
    """The tail of `entries` (simple kinds only: puts, writes, claims, deletes) after the
    last delete."""
    ops = [op for entry in entries for op in entry.ops]
    cut = max((i for i, op in enumerate(ops) if isinstance(op, Delete)), default=-1)
    tail = Tail(deleted=cut >= 0)
    for op in ops[cut + 1 :]:
        if isinstance(op, Put):
            earlier = tail.checkpoints.get((op.ns, op.checkpoint_id))
            # A checkpoint put again keeps its first parent (the upsert only replaces
            # the checkpoint and its metadata).
            tail.checkpoints[(op.ns, op.checkpoint_id)] = (
                op if earlier is None else replace(op, parent_id=earlier.parent_id)
            )
            for blob in op.blobs:
                key = (op.ns, blob.channel, blob.version)
                if key in tail.blobs or key in tail.deltas:
                    continue  # the first version written stays (as in Postgres)
                if blob.base is None:
                    tail.blobs[key] = (blob.type, blob.data)
                    continue
                assert blob.data is not None
                base_key = (op.ns, blob.channel, blob.base)
                base = tail.blobs.get(base_key)
                if base is not None and base[1] is not None:
                    tail.blobs[key] = (blob.type, delta_blob(base[1], blob.count, blob.data))
                elif base_key in tail.deltas:
                    # Based on a delta itself: chain onto its (stored) base.
                    under = tail.deltas[base_key]
                    tail.deltas[key] = Delta(
                        blob.type,
                        under.base,
                        blob.count,
                        under.tail + blob.data,
                    )
                else:
                    tail.deltas[key] = Delta(blob.type, base_key, blob.count, blob.data)
        elif isinstance(op, Writes):
            for row in op.rows:
                tail.writes.append(
                    TailWrite(
                        op.ns,
                        op.checkpoint_id,
                        op.task_id,
                        row.idx,
                        row.channel,
                        row.type,
                        row.data,
                        op.task_path,
                        op.upsert,
                    )
                )
    return tail


@dataclass(frozen=True, slots=True)
class Order:
    """How the database orders text (checkpoint ids, task paths): its collation. Without
    `ranks`, by code point (collations ``C``, ``POSIX``, ``C.UTF-8``, the builtin
    provider's); with them, by each text's position among the texts Postgres sorted for
    this read (`LangGraphSink.collation_ranks`)."""

    ranks: Mapping[str, int] | None = None

    def key(self, text: str) -> Any:
        return text if self.ranks is None else self.ranks[text]


CODE_POINT = Order()


def metadata_of(put: Put) -> Any:
    """The decoded metadata of a tail checkpoint."""
    return orjson.loads(put.metadata)


def needs_more_rows(rows: Sequence[Row], tail: Tail, limit: int | None) -> bool:
    """True when a limited read returned a full page some of whose rows the tail
    replaces: the page must be read again, longer, to fill the limit."""
    return (
        limit is not None
        and len(rows) == limit
        and any((r["checkpoint_ns"], r["checkpoint_id"]) in tail.checkpoints for r in rows)
    )


def merge(
    rows: Sequence[Row],
    tail: Tail,
    thread_id: str,
    *,
    ns: str | None,
    checkpoint_id: str | None,
    before_id: str | None,
    metadata_filter: Mapping[str, Any] | None,
    limit: int | None,
    order: Order = CODE_POINT,
) -> list[Row]:
    """Stored rows and the tail's checkpoints matching the query, newest first in the
    database's `order`. Rows from the tail are marked ``_pending`` (their blobs and
    writes are completed by `complete`)."""
    merged: dict[WriteKey, Row] = {}
    if not tail.deleted:
        for row in rows:
            key = (row["checkpoint_ns"], row["checkpoint_id"])
            if key not in tail.checkpoints:
                merged[key] = row
    for key in candidates(tail, ns=ns, checkpoint_id=checkpoint_id):
        put = tail.checkpoints[key]
        if before_id is not None and not order.key(key[1]) < order.key(before_id):
            continue
        metadata = metadata_of(put)
        if metadata_filter and not contains(metadata, metadata_filter):
            continue
        merged[key] = {
            "thread_id": thread_id,
            "checkpoint_ns": key[0],
            "checkpoint_id": key[1],
            "parent_checkpoint_id": put.parent_id,
            "checkpoint": orjson.loads(put.checkpoint),
            "metadata": metadata,
            "channel_values": None,
            "pending_writes": None,
            "_pending": True,
        }
    chosen = sorted(merged.values(), key=lambda r: order.key(r["checkpoint_id"]), reverse=True)
    return chosen if limit is None else chosen[:limit]


def candidates(tail: Tail, *, ns: str | None, checkpoint_id: str | None) -> list[WriteKey]:
    """The tail's checkpoints in the read's namespace and id (before ``before`` and
    the metadata filter)."""
    return [
        key
        for key in tail.checkpoints
        if (ns is None or key[0] == ns) and (checkpoint_id is None or key[1] == checkpoint_id)
    ]


def keep_stored_parents(chosen: Sequence[Row], parents: Mapping[WriteKey, str | None]) -> None:
    """Pending rows put again over a stored checkpoint keep the stored row's parent, as
    the flush's upsert does (`parents`: the stored parents of pending rows' keys)."""
    for row in chosen:
        key = (row["checkpoint_ns"], row["checkpoint_id"])
        if row.get("_pending") and key in parents:
            row["parent_checkpoint_id"] = parents[key]


def wanted(chosen: Sequence[Row], tail: Tail) -> tuple[list[BlobKey], list[WriteKey]]:
    """What the pending rows need from Postgres: blobs the tail does not carry (a
    checkpoint refers to every channel's current version, most written earlier) and the
    stored writes of their checkpoints."""
    blobs: set[BlobKey] = set()
    writes: list[WriteKey] = []
    for row in chosen:
        if row.get("_pending"):
            ns = row["checkpoint_ns"]
            for channel, version in row["checkpoint"].get("channel_versions", {}).items():
                key = (ns, channel, str(version))
                if key in tail.deltas:
                    blobs.add(tail.deltas[key].base)
                elif key not in tail.blobs:
                    blobs.add(key)
            writes.append((ns, row["checkpoint_id"]))
    return sorted(blobs), writes


def needs_stored_bases(chosen: Sequence[Row], tail: Tail) -> bool:
    """Whether a pending row refers to a delta whose base only Postgres holds."""
    return any(
        (row["checkpoint_ns"], channel, str(version)) in tail.deltas
        for row in chosen
        if row.get("_pending")
        for channel, version in row["checkpoint"].get("channel_versions", {}).items()
    )


def complete(
    row: Row,
    tail: Tail,
    stored_blobs: Mapping[BlobKey, tuple[str, bytes | None]],
    stored_writes: Mapping[WriteKey, Sequence[StoredWrite]],
) -> Row:
    """The row with its blobs and pending writes, tail writes applied as the flush would
    (insert-or-ignore per (task, idx); an upsert of special writes keeps the path)."""
    key = (row["checkpoint_ns"], row["checkpoint_id"])
    state: dict[tuple[str, int], tuple[str, str, bytes | None, str]] = {}
    if row.get("_pending"):
        values = []
        for channel, version in row["checkpoint"].get("channel_versions", {}).items():
            bkey = (key[0], channel, str(version))
            got = stored_blobs.get(bkey) or tail.blobs.get(bkey)
            if got is None and bkey in tail.deltas:
                delta = tail.deltas[bkey]
                base = stored_blobs.get(delta.base)
                if base is not None and base[1] is not None:
                    got = (delta.type, delta_blob(base[1], delta.count, delta.tail))
            if got is not None:
                values.append([channel.encode(), got[0].encode(), got[1]])
        row["channel_values"] = values
        for task, idx, channel, type_, blob, path in stored_writes.get(key, ()):
            state[(task, idx)] = (channel, type_, blob, path)
    else:
        for w in row["pending_writes"] or ():
            state[(w[0].decode(), int(w[5]))] = (w[1].decode(), w[2].decode(), w[3], w[4].decode())
    apply_writes(state, tail, key)
    row["pending_writes"] = [
        [task.encode(), channel.encode(), type_.encode(), blob, path.encode(), str(idx).encode()]
        for (task, idx), (channel, type_, blob, path) in state.items()
    ]
    return row


WriteState = dict[tuple[str, int], tuple[str, str, bytes | None, str]]
"""(task_id, idx) -> (channel, type, blob, task_path) of one checkpoint's writes."""


def apply_writes(state: WriteState, tail: Tail, key: WriteKey) -> None:
    """The tail's writes of one checkpoint applied on its stored writes, as the flush
    applies them (insert-or-ignore per (task, idx); an upsert of special writes keeps
    the stored path)."""
    for w in tail.writes:
        if (w.ns, w.checkpoint_id) != key:
            continue
        old = state.get((w.task_id, w.idx))
        if old is None:
            state[(w.task_id, w.idx)] = (w.channel, w.type, w.blob, w.task_path)
        elif w.upsert:
            state[(w.task_id, w.idx)] = (w.channel, w.type, w.blob, old[3])


# -- pending sends of checkpoints before format 4 ------------------------------------------


def migrates_sends(row: Row) -> bool:
    """Whether AsyncPostgresSaver moves the row's parent's ``__pregel_tasks`` writes
    into its channel values: a checkpoint before format 4 that has a parent."""
    version = row["checkpoint"].get("v")
    return (
        isinstance(version, int | float)
        and not isinstance(version, bool)
        and version < 4
        and bool(row["parent_checkpoint_id"])
    )


def sends_to_assemble(chosen: Sequence[Row], tail: Tail) -> list[str]:
    """Parents whose sends the saver assembles from stored and tail writes: those of
    pending rows, and of stored rows whose parent has tail writes (the sends Postgres
    returned with a stored row are then incomplete). The others came with their row."""
    written = {w.checkpoint_id for w in tail.writes}
    return sorted(
        {
            row["parent_checkpoint_id"]
            for row in chosen
            if migrates_sends(row)
            and (row.get("_pending") or tail.deleted or row["parent_checkpoint_id"] in written)
        }
    )


def tail_write_keys(tail: Tail, parents: Sequence[str]) -> list[tuple[str, str, str, int]]:
    """(ns, checkpoint id, task, idx) of the tail's writes at `parents`: the stored writes
    they may meet, whatever their channel."""
    wanted = set(parents)
    return sorted(
        {
            (w.ns, w.checkpoint_id, w.task_id, w.idx)
            for w in tail.writes
            if w.checkpoint_id in wanted
        }
    )


def sends(
    parent: str,
    tail: Tail,
    stored: Sequence[ParentWrite],
    channel: str,
) -> list[tuple[str, str, int, str, bytes | None]]:
    """The `channel` (``__pregel_tasks``) writes at checkpoint id `parent`, in every
    namespace (AsyncPostgresSaver's lookup ignores it), after the tail's writes are
    applied on the stored ones: (task_path, task_id, idx, type, blob), unsorted.
    `stored` holds (ns, checkpoint id, task, idx, channel, type, blob, path) rows."""
    by_ns: dict[str, WriteState] = {}
    if not tail.deleted:
        for ns, cid, task, idx, ch, type_, blob, path in stored:
            if cid == parent:
                by_ns.setdefault(ns, {})[(task, idx)] = (ch, type_, blob, path)
    for w in tail.writes:
        if w.checkpoint_id == parent:
            by_ns.setdefault(w.ns, {})
    out: list[tuple[str, str, int, str, bytes | None]] = []
    for ns, state in by_ns.items():
        apply_writes(state, tail, (ns, parent))
        out.extend(
            (path, task, idx, type_, blob)
            for (task, idx), (ch, type_, blob, path) in state.items()
            if ch == channel
        )
    return out


# -- jsonb containment (the metadata filter, ``metadata @> filter``) ----------------------


def _scalar_eq(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    return type(a) is type(b) and bool(a == b)


def contains(doc: Any, flt: Any) -> bool:
    """jsonb ``doc @> flt``, for the tail's metadata (Postgres answers it for stored rows)."""
    if isinstance(flt, dict):
        return isinstance(doc, dict) and all(
            k in doc and contains(doc[k], v) for k, v in flt.items()
        )
    if isinstance(flt, list | tuple):
        return isinstance(doc, list | tuple) and all(any(contains(d, f) for d in doc) for f in flt)
    if isinstance(doc, dict | list | tuple):
        return False
    return _scalar_eq(doc, flt)
