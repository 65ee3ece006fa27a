"""`MemoryLangGraphSink`: the in-memory twin of `LangGraphSink`'s flush side.

It implements the engine's `FlushSink` port for LangGraph entries (`apply`,
`flushed_seqs`) over plain dictionaries holding the rows LangGraph's three tables would
hold (``checkpoints``, ``checkpoint_blobs``, ``checkpoint_writes``) and each thread's
watermark and owner. The same contract tests (tests/contracts/test_langgraph_sink.py)
run against it and against the Postgres sink, so a flusher test can run without
Postgres and still exercise the real decisions: stale, duplicated and reordered
entries, gaps, deletes, delta blobs, and a thread whose data the database would refuse
failing alone.

What it does not model: ``prune(strategy="keep_latest")`` (LangGraph's own statements
decide what a prune keeps; an entry that prunes fails its thread, not retriable, with a
message saying so), and the saver's reads (`LangGraphSink.read` and the rest run SQL),
so it is a sink for flushers, not a backend for `BufferedCheckpointSaver`.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from buffered_store.engine.entries import chain_after
from buffered_store.engine.flushing import ApplyOutcome, ApplyStatus
from buffered_store.langgraph.entry import (
    BlobRow,
    Claim,
    Copy,
    Delete,
    LgEntry,
    Op,
    Prune,
    Put,
    Runs,
    Writes,
    delta_blob,
)

__all__ = ["MemoryLangGraphSink", "ThreadRows"]

CheckpointKey = tuple[str, str]
"""(checkpoint_ns, checkpoint_id)"""
BlobKey = tuple[str, str, str]
"""(checkpoint_ns, channel, version)"""
WriteKey = tuple[str, str, str, int]
"""(checkpoint_ns, checkpoint_id, task_id, idx)"""


class _Refused(Exception):
    """The database would refuse this thread's data (not retriable)."""


@dataclass
class ThreadRows:
    """One thread's rows, as LangGraph's tables hold them (JSON columns parsed)."""

    checkpoints: dict[CheckpointKey, tuple[str | None, Any, Any]] = field(default_factory=dict)
    """(ns, id) -> (parent id, checkpoint, metadata)"""
    blobs: dict[BlobKey, tuple[str, bytes | None]] = field(default_factory=dict)
    """(ns, channel, version) -> (type, blob)"""
    writes: dict[WriteKey, tuple[str, str, str, bytes | None]] = field(default_factory=dict)
    """(ns, id, task, idx) -> (task_path, channel, type, blob)"""


def _json(data: bytes, what: str) -> Any:
    """A JSON column's value; what ``::jsonb`` refuses, refused here too."""
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise _Refused(f"invalid input syntax for type json ({what}): {exc}") from exc
    if b"\\u0000" in data:
        raise _Refused(f"unsupported Unicode escape sequence \\u0000 ({what})")
    return value


class MemoryLangGraphSink:
    """LangGraph's tables and our watermarks in memory, written as `LangGraphSink`
    writes them (see the module docstring for what it leaves out).

    `calls` records every `apply` and `flushed_seqs` as ``(name, thread ids)``, for tests
    to read; `reset()` empties everything.
    """

    def __init__(self) -> None:
        self.threads: dict[str, ThreadRows] = {}
        self.marks: dict[str, int] = {}
        self.owners: dict[str, str] = {}
        self.calls: list[tuple[str, tuple[str, ...]]] = []
        self.closed = False

    def reset(self) -> None:
        """Forget every row, watermark and recorded call."""
        self.threads, self.marks, self.owners, self.calls = {}, {}, {}, []

    def rows(self, thread_id: str) -> ThreadRows:
        """A copy of a thread's rows (empty when it has none)."""
        return copy.deepcopy(self.threads.get(thread_id, ThreadRows()))

    async def close(self) -> None:
        """Nothing to release; later calls still work (as after a reconnect)."""
        self.closed = True

    async def flushed_seqs(self, thread_ids: Sequence[str]) -> dict[str, int]:
        """Watermarks of several threads (0 for unknown ones)."""
        self.calls.append(("flushed_seqs", tuple(thread_ids)))
        return {t: self.marks.get(t, 0) for t in thread_ids}

    async def apply(self, batches: Sequence[Sequence[LgEntry]]) -> list[ApplyOutcome]:
        """Each thread's entries on top of its watermark, all or nothing per thread."""
        self.calls.append(("apply", tuple(b[0].thread_id if b else "" for b in batches)))
        return [self._apply_thread(batch) for batch in batches]

    def _apply_thread(self, batch: Sequence[LgEntry]) -> ApplyOutcome:
        if not batch:
            return ApplyOutcome("", ApplyStatus.FAILED, 0, error="empty batch", retriable=False)
        thread_id = batch[0].thread_id
        mark = self.marks.get(thread_id, 0)
        if not any(e.seq > mark for e in batch):
            return ApplyOutcome(thread_id, ApplyStatus.STALE, mark)
        chain = chain_after(batch, mark)
        if not chain:
            return ApplyOutcome(thread_id, ApplyStatus.GAP, mark, missing_from=mark + 1)
        stored = self.threads.get(thread_id, ThreadRows())
        rows = copy.deepcopy(stored)
        ops = [op for entry in chain for op in entry.ops]
        try:
            for op in _resolve_deltas(ops, stored):
                _apply_op(rows, op)
        except _Refused as exc:
            return ApplyOutcome(
                thread_id, ApplyStatus.FAILED, mark, error=str(exc), retriable=False
            )
        self.threads[thread_id] = rows
        self.marks[thread_id] = chain[-1].seq
        owner = next((op.owner for op in reversed(ops) if isinstance(op, Claim)), None)
        if owner is not None:
            self.owners[thread_id] = owner
        return ApplyOutcome(thread_id, ApplyStatus.APPLIED, chain[-1].seq)


def _resolve_deltas(ops: Sequence[Op], stored: ThreadRows) -> list[Op]:
    """Every delta blob made whole: from a blob an earlier operation of the chain wrote,
    else from the stored rows as they were before the chain (what the Postgres sink
    reads while it locks the watermark)."""
    known: dict[BlobKey, bytes | None] = {}
    out: list[Op] = []
    for op in ops:
        if isinstance(op, Delete):
            known.clear()
        if not isinstance(op, Put):
            out.append(op)
            continue
        blobs: list[BlobRow] = []
        for blob in op.blobs:
            if blob.base is not None:
                key = (op.ns, blob.channel, blob.base)
                base = known[key] if key in known else stored.blobs.get(key, ("", None))[1]
                if base is None or blob.data is None:
                    raise _Refused(
                        f"the base {blob.base!r} of channel {blob.channel!r} in namespace "
                        f"{op.ns!r} is not stored: the delta cannot be applied"
                    )
                blob = BlobRow(
                    blob.channel, blob.version, blob.type, delta_blob(base, blob.count, blob.data)
                )
            known.setdefault((op.ns, blob.channel, blob.version), blob.data)
            blobs.append(blob)
        out.append(
            Put(op.ns, op.checkpoint_id, op.parent_id, op.checkpoint, op.metadata, tuple(blobs))
        )
    return out


def _apply_op(rows: ThreadRows, op: Op) -> None:
    """One operation, as the Postgres sink's statements for it change the tables."""
    if isinstance(op, Put):
        for blob in op.blobs:
            rows.blobs.setdefault((op.ns, blob.channel, blob.version), (blob.type, blob.data))
        _put_checkpoint(rows, op.ns, op.checkpoint_id, op.parent_id, op.checkpoint, op.metadata)
    elif isinstance(op, Writes):
        for row in op.rows:
            key = (op.ns, op.checkpoint_id, op.task_id, row.idx)
            if key in rows.writes:
                if not op.upsert:
                    continue
                path = rows.writes[key][0]  # the upsert leaves task_path as it was
                rows.writes[key] = (path, row.channel, row.type, row.data)
            else:
                rows.writes[key] = (op.task_path, row.channel, row.type, row.data)
    elif isinstance(op, Delete):
        rows.checkpoints.clear()
        rows.blobs.clear()
        rows.writes.clear()
    elif isinstance(op, Runs):
        _delete_runs(rows, set(op.run_ids))
    elif isinstance(op, Copy):
        for ns, channel, version, kind, data in op.blobs:
            rows.blobs.setdefault((ns, channel, version), (kind, data))
        for ns, cid, pid, checkpoint, metadata in op.checkpoints:
            _put_checkpoint(rows, ns, cid, pid, checkpoint, metadata)
        for ns, cid, task, path, idx, channel, kind, data in op.writes:
            old = rows.writes.get((ns, cid, task, idx))
            rows.writes[(ns, cid, task, idx)] = (
                old[0] if old else path,
                channel,
                kind,
                data,
            )
    elif isinstance(op, Prune):
        raise _Refused("prune is not modelled by MemoryLangGraphSink (use Postgres)")
    # A Claim changes the watermark row only (see `_apply_thread`).


def _put_checkpoint(
    rows: ThreadRows, ns: str, cid: str, pid: str | None, checkpoint: bytes, metadata: bytes
) -> None:
    values = (_json(checkpoint, "checkpoint"), _json(metadata, "metadata"))
    old = rows.checkpoints.get((ns, cid))
    # ON CONFLICT DO UPDATE sets checkpoint and metadata; the parent stays.
    rows.checkpoints[(ns, cid)] = (old[0] if old else pid, *values)


def _delete_runs(rows: ThreadRows, run_ids: set[str]) -> None:
    """The checkpoints of the runs, their writes, and in the namespaces that lost one the
    blobs no remaining checkpoint refers to (by its ``channel_versions``)."""
    gone = {
        key
        for key, (_, _, metadata) in rows.checkpoints.items()
        if isinstance(metadata, dict) and _as_text(metadata.get("run_id")) in run_ids
    }
    if not gone:
        return
    for key in gone:
        del rows.checkpoints[key]
    rows.writes = {k: v for k, v in rows.writes.items() if (k[0], k[1]) not in gone}
    namespaces = {ns for ns, _ in gone}
    referenced: set[BlobKey] = set()
    for (ns, _), (_, checkpoint, _) in rows.checkpoints.items():
        versions = checkpoint.get("channel_versions") if isinstance(checkpoint, dict) else None
        if ns in namespaces and isinstance(versions, dict):
            for channel, version in versions.items():
                text = _as_text(version)
                if text is not None:
                    referenced.add((ns, channel, text))
    rows.blobs = {k: v for k, v in rows.blobs.items() if k[0] not in namespaces or k in referenced}


def _as_text(value: Any) -> str | None:
    """A JSON value as ``->>`` turns it into text."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    return orjson.dumps(value).decode()
