"""WAL entries of the LangGraph front-end and their hot records. Pure: no I/O.

One engine thread = one LangGraph ``thread_id`` (all its checkpoint namespaces), so
``delete_thread`` and the per-thread compare-and-set cover every namespace.

An entry carries one or more *operations* (`Op`), applied in order: `Put` and `Writes`
(what ``aput`` and ``aput_writes`` store), `Delete`, `Runs` (``delete_for_runs``),
`Prune` (``keep_latest``), `Copy` (``copy_thread``) and `Claim`. Entries are already
serialised: ``aput`` ran ``serde.dumps_typed`` on every blob value and encoded the
checkpoint and its metadata as JSON text, so the flusher needs neither the serializer
nor any decoding of them: it hands the bytes to Postgres as they are.

Wire formats (the engine's header keys plus, per kind ``k``):

- ``o`` (format 2, written by default): ``o`` is a list of operations, each a compact
  array; the checkpoint JSON, the metadata JSON and every blob travel as raw bytes after
  the JSON object (`engine.entries.frame`), in the order the operations name them:
  ``["p", ns, id, parent id, checkpoint length, metadata length, blobs]`` with each
  blob ``[channel, version, type, length]`` (length -1: no blob) or, for a list channel
  whose new value extends an earlier version, ``[channel, version, type, length, base
  version, item count]`` (`BlobRow.base`: the bytes are only the new items);
  ``["w", ns, id, task, path, upsert, rows]`` with each row ``[idx, channel, type,
  length]``.
- ``put``, ``w`` (format 1, still read; written with ``wal_format=1``): one operation,
  body keys as JSON with base64 blobs: ``put``: ``ns``, ``id``, ``pid``, ``cp``, ``md``,
  ``b`` ([channel, version, type, base64]); ``w``: ``ns``, ``id``, ``task``, ``path``,
  ``up``, ``rows`` ([idx, channel, type, base64]).
- ``del``, ``runs`` (``runs``: run ids), ``prune``, ``copy`` (``cps`` [ns, id, pid, cp,
  md], ``bl`` [ns, channel, version, type, base64], ``ws`` [ns, id, task, path, idx,
  channel, type, base64]), ``claim`` (``owner``): one logical operation each, in both
  formats.

Decoding is `langgraph.decoding`'s; the hot records and the format the engine is handed
(`LG_FORMAT`) are `langgraph.format`'s.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeAlias

import orjson

from buffered_store.engine.entries import Header, frame, header_json
from buffered_store.errors import CorruptEntryError

OPS_KIND = "o"
LOGICAL_KINDS = frozenset({"del", "runs", "prune", "copy", "claim"})
KINDS = frozenset({OPS_KIND, "put", "w"}) | LOGICAL_KINDS
SIMPLE_KINDS = frozenset({OPS_KIND, "put", "w", "claim", "del"})
"""Kinds a read can overlay row by row; the others (logical ops on stored rows) make a
read flush the thread first."""

KEY_LIMITS = {
    "thread_id": 512,
    "checkpoint_ns": 1024,
    "checkpoint_id": 256,
    "task_id": 256,
    "channel": 512,
    "version": 256,
}
"""Longest key of each kind, in UTF-8 bytes. They are Postgres btree keys: an index tuple
holds at most about 2,700 bytes, and the widest index (``checkpoint_blobs``: thread, ns,
channel, version) stays under it with every key at its limit, compressed or not."""


def b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


# -- operations --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BlobRow:
    """A ``checkpoint_blobs`` row of a put: the serialised value of a channel version."""

    channel: str
    version: str
    type: str
    data: bytes | None
    base: str | None = None
    """Set for a delta: `data` holds only the encoded items appended to version `base`
    of the same channel (a msgpack list); the row stored is the list of `count` items
    those of `base` and them make (`delta_blob`)."""
    count: int = 0


@dataclass(frozen=True, slots=True)
class Put:
    """``aput``: a ``checkpoints`` row (JSON texts as bytes) and its new blobs."""

    ns: str
    checkpoint_id: str
    parent_id: str | None
    checkpoint: bytes
    metadata: bytes
    blobs: tuple[BlobRow, ...] = ()


@dataclass(frozen=True, slots=True)
class WriteRow:
    """A ``checkpoint_writes`` row of a task."""

    idx: int
    channel: str
    type: str
    data: bytes | None


@dataclass(frozen=True, slots=True)
class Writes:
    """``aput_writes``: a task's writes (`upsert`: every write of the call was special,
    so stored rows are replaced; else rows already stored are kept)."""

    ns: str
    checkpoint_id: str
    task_id: str
    task_path: str
    upsert: bool
    rows: tuple[WriteRow, ...]


@dataclass(frozen=True, slots=True)
class Delete:
    """``delete_thread``: every namespace of the thread."""


@dataclass(frozen=True, slots=True)
class Runs:
    """``delete_for_runs``: the thread's checkpoints whose metadata ``run_id`` is one of
    `run_ids`, with their writes and the blobs no remaining checkpoint refers to."""

    run_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Prune:
    """``prune(strategy="keep_latest")``: keep each namespace's latest checkpoint."""


@dataclass(frozen=True, slots=True)
class Copy:
    """``copy_thread``: literal rows of another thread (same keys are replaced)."""

    checkpoints: tuple[tuple[str, str, str | None, bytes, bytes], ...]
    """(ns, id, parent id, checkpoint JSON, metadata JSON)"""
    blobs: tuple[tuple[str, str, str, str, bytes | None], ...]
    """(ns, channel, version, type, blob)"""
    writes: tuple[tuple[str, str, str, str, int, str, str, bytes | None], ...]
    """(ns, id, task, path, idx, channel, type, blob)"""


@dataclass(frozen=True, slots=True)
class Claim:
    """From this entry on only `owner` may put on the thread."""

    owner: str


Op: TypeAlias = Put | Writes | Delete | Runs | Prune | Copy | Claim
_LOGICAL_KIND = {Delete: "del", Runs: "runs", Prune: "prune", Copy: "copy", Claim: "claim"}


@dataclass(frozen=True, kw_only=True, slots=True)
class LgEntry:
    """A WAL entry: the engine's header and the operations it applies, in order."""

    thread_id: str
    seq: int
    kind: str
    at: datetime
    ops: tuple[Op, ...] = ()
    writer: str = ""
    jump: bool = False
    stream_seq: int = 0

    @property
    def deletes(self) -> bool:
        return self.kind == "del"

    @property
    def simple(self) -> bool:
        """Whether a read can fold it row by row (see `SIMPLE_KINDS`)."""
        return self.kind in SIMPLE_KINDS


def kind_of(ops: Sequence[Op]) -> str:
    """The wire kind of an entry holding `ops` (format 2)."""
    if len(ops) == 1 and type(ops[0]) in _LOGICAL_KIND:
        return _LOGICAL_KIND[type(ops[0])]
    if not ops or any(not isinstance(op, Put | Writes) for op in ops):
        raise ValueError("an entry holds puts and writes, or one logical operation")
    return OPS_KIND


def delta_blob(base: bytes, count: int, tail: bytes) -> bytes:
    """The msgpack list of `count` items: the items of the list `base` holds, then the
    items whose encodings `tail` concatenates."""
    start = msgpack_list_start(base)
    return msgpack_list_header(count) + base[start:] + tail


def msgpack_list_header(count: int) -> bytes:
    """The msgpack header of an array of `count` items."""
    if count < 16:
        return bytes((0x90 | count,))
    if count < 1 << 16:
        return b"\xdc" + count.to_bytes(2, "big")
    return b"\xdd" + count.to_bytes(4, "big")


def msgpack_list_start(data: bytes) -> int:
    """Where the first item of the msgpack array `data` starts (after its header)."""
    if not data:
        raise CorruptEntryError("a delta's base is not a msgpack array")
    first = data[0]
    if first & 0xF0 == 0x90:
        return 1
    if first == 0xDC:
        return 3
    if first == 0xDD:
        return 5
    raise CorruptEntryError("a delta's base is not a msgpack array")


# -- encoding ----------------------------------------------------------------------------


def encode_entry(entry: LgEntry, *, wal_format: int = 2) -> bytes:
    """The entry's wire bytes (format 1 only for entries of one put or one writes op:
    every process reads format 2 from this version on)."""
    head = header_json(
        Header(entry.thread_id, entry.seq, entry.kind, entry.at, entry.writer, entry.jump)
    )
    if entry.kind == OPS_KIND:
        if wal_format == 1:
            return _encode_v1(head, entry)
        ops, attachments = _ops_body(entry.ops)
        head["o"] = ops
        return frame(orjson.dumps(head), attachments)
    [op] = entry.ops
    head.update(_logical_body(op))
    return orjson.dumps(head)


def _ops_body(ops: Sequence[Op]) -> tuple[list[list[Any]], list[bytes]]:
    body: list[list[Any]] = []
    attachments: list[bytes] = []
    for op in ops:
        if isinstance(op, Put):
            attachments += (op.checkpoint, op.metadata)
            blobs: list[list[Any]] = []
            for b in op.blobs:
                row: list[Any] = [b.channel, b.version, b.type, _attach(attachments, b.data)]
                if b.base is not None:
                    row += (b.base, b.count)
                blobs.append(row)
            body.append(
                [
                    "p",
                    op.ns,
                    op.checkpoint_id,
                    op.parent_id,
                    len(op.checkpoint),
                    len(op.metadata),
                    blobs,
                ]
            )
        elif isinstance(op, Writes):
            rows = [[r.idx, r.channel, r.type, _attach(attachments, r.data)] for r in op.rows]
            body.append(["w", op.ns, op.checkpoint_id, op.task_id, op.task_path, op.upsert, rows])
        else:
            raise ValueError(f"{type(op).__name__} cannot share an entry")
    return body, attachments


def _attach(attachments: list[bytes], data: bytes | None) -> int:
    if data is None:
        return -1
    attachments.append(data)
    return len(data)


def _encode_v1(head: dict[str, Any], entry: LgEntry) -> bytes:
    if len(entry.ops) != 1:
        raise ValueError("format 1 holds one operation per entry")
    [op] = entry.ops
    if isinstance(op, Put):
        if any(b.base is not None for b in op.blobs):
            raise ValueError("format 1 has no delta blobs")
        head["k"] = "put"
        head.update(
            ns=op.ns,
            id=op.checkpoint_id,
            pid=op.parent_id,
            cp=orjson.Fragment(op.checkpoint),
            md=orjson.Fragment(op.metadata),
            b=[[b.channel, b.version, b.type, b64(b.data)] for b in op.blobs],
        )
    elif isinstance(op, Writes):
        head["k"] = "w"
        head.update(
            ns=op.ns,
            id=op.checkpoint_id,
            task=op.task_id,
            path=op.task_path,
            up=op.upsert,
            rows=[[r.idx, r.channel, r.type, b64(r.data)] for r in op.rows],
        )
    else:
        raise ValueError(f"{type(op).__name__} is not a put or a writes")
    return orjson.dumps(head)


def _logical_body(op: Op) -> dict[str, Any]:
    if isinstance(op, Runs):
        return {"runs": list(op.run_ids)}
    if isinstance(op, Claim):
        return {"owner": op.owner}
    if isinstance(op, Copy):
        return {
            "cps": [
                [ns, cid, pid, orjson.Fragment(cp), orjson.Fragment(md)]
                for ns, cid, pid, cp, md in op.checkpoints
            ],
            "bl": [[ns, ch, ver, typ, b64(b)] for ns, ch, ver, typ, b in op.blobs],
            "ws": [
                [ns, cid, task, path, idx, ch, typ, b64(b)]
                for ns, cid, task, path, idx, ch, typ, b in op.writes
            ],
        }
    if isinstance(op, Delete | Prune):
        return {}
    raise ValueError(f"{type(op).__name__} is not a logical operation")
