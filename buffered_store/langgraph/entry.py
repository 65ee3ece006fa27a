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

Decoding checks every field's type and every key's size (`CorruptEntryError`), so an
entry that cannot be applied is quarantined when fetched instead of failing its flush.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from types import MappingProxyType
from typing import Any, TypeAlias

import orjson

from buffered_store.engine.entries import Header, advance_head, frame, header_json, parse_framed
from buffered_store.engine.frontend import LANGGRAPH
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


# -- decoding ----------------------------------------------------------------------------


_HEADER_KEYS = frozenset(("v", "t", "s", "k", "at", "w", "j"))


def decode_entry(payload: bytes, *, stream_seq: int = 0) -> LgEntry:
    """The entry of wire bytes of either format; `CorruptEntryError` for anything that
    is not an entry this front-end can apply."""
    header, data, attached = parse_framed(payload)
    kind = header.kind
    if kind not in KINDS:
        raise CorruptEntryError(f"unknown LangGraph entry kind {kind!r}")
    _key("thread_id", header.thread_id)
    try:
        if kind == OPS_KIND:
            ops = _decode_ops(data.get("o"), attached)
        else:
            if attached:
                raise CorruptEntryError(f"a {kind!r} entry carries no attachments")
            ops = (_decode_v1(kind, data),)
    except CorruptEntryError:
        raise
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise CorruptEntryError(f"malformed {kind!r} entry: {exc!r}") from exc
    return LgEntry(
        thread_id=header.thread_id,
        seq=header.seq,
        kind=kind,
        at=header.at,
        ops=ops,
        writer=header.writer,
        jump=header.jump,
        stream_seq=stream_seq,
    )


class _Reader:
    """Hands out the attachments in order, checking their lengths."""

    def __init__(self, attached: memoryview) -> None:
        self._data = attached
        self._at = 0

    def take(self, length: Any) -> bytes | None:
        if length == -1:
            return None
        if not isinstance(length, int) or isinstance(length, bool) or length < 0:
            raise CorruptEntryError(f"invalid attachment length {length!r}")
        end = self._at + length
        if end > len(self._data):
            raise CorruptEntryError("an attachment runs past the end of the entry")
        out = bytes(self._data[self._at : end])
        self._at = end
        return out

    def json(self, length: Any, what: str) -> bytes:
        out = self.take(length)
        if out is None:
            raise CorruptEntryError(f"{what} is missing")
        return out

    def done(self) -> None:
        if self._at != len(self._data):
            raise CorruptEntryError("the entry has bytes no operation names")


def _decode_ops(raw: Any, attached: memoryview) -> tuple[Op, ...]:
    if not isinstance(raw, list) or not raw:
        raise CorruptEntryError("an 'o' entry needs a non-empty list of operations")
    reader = _Reader(attached)
    ops: list[Op] = []
    for item in raw:
        if not isinstance(item, list) or not item:
            raise CorruptEntryError(f"invalid operation {item!r}")
        tag = item[0]
        if tag == "p":
            _, ns, cid, pid, cp_len, md_len, blobs = item
            put = Put(
                ns=_key("checkpoint_ns", ns),
                checkpoint_id=_key("checkpoint_id", cid),
                parent_id=None if pid is None else _key("checkpoint_id", pid),
                checkpoint=reader.json(cp_len, "the checkpoint"),
                metadata=reader.json(md_len, "the metadata"),
                blobs=tuple(_blob_row(row, reader) for row in _list(blobs, "blobs")),
            )
            ops.append(put)
        elif tag == "w":
            _, ns, cid, task, path, upsert, rows = item
            ops.append(
                Writes(
                    ns=_key("checkpoint_ns", ns),
                    checkpoint_id=_key("checkpoint_id", cid),
                    task_id=_key("task_id", task),
                    task_path=_text(path, "task_path"),
                    upsert=_bool(upsert, "upsert"),
                    rows=tuple(
                        WriteRow(
                            _int(i, "idx"), _key("channel", ch), _text(t, "type"), reader.take(n)
                        )
                        for i, ch, t, n in _list(rows, "rows")
                    ),
                )
            )
        else:
            raise CorruptEntryError(f"unknown operation {tag!r}")
    reader.done()
    return tuple(ops)


def _blob_row(row: Any, reader: _Reader) -> BlobRow:
    if not isinstance(row, list) or len(row) not in (4, 6):
        raise CorruptEntryError(f"invalid blob {row!r}")
    channel, version, type_, length = row[:4]
    data = reader.take(length)
    if len(row) == 4:
        return BlobRow(
            _key("channel", channel), _key("version", version), _text(type_, "type"), data
        )
    base, count = row[4:]
    if data is None or _int(count, "item count") < 0:
        raise CorruptEntryError("a delta blob needs its bytes and an item count")
    return BlobRow(
        _key("channel", channel),
        _key("version", version),
        _text(type_, "type"),
        data,
        _key("version", base),
        count,
    )


def _decode_v1(kind: str, data: dict[str, Any]) -> Op:
    if kind == "put":
        return Put(
            ns=_key("checkpoint_ns", data["ns"]),
            checkpoint_id=_key("checkpoint_id", data["id"]),
            parent_id=None if data["pid"] is None else _key("checkpoint_id", data["pid"]),
            checkpoint=_json_object(data["cp"], "cp"),
            metadata=_json_object(data["md"], "md"),
            blobs=tuple(
                BlobRow(_key("channel", ch), _key("version", ver), _text(t, "type"), _unb64(b))
                for ch, ver, t, b in _list(data["b"], "b")
            ),
        )
    if kind == "w":
        return Writes(
            ns=_key("checkpoint_ns", data["ns"]),
            checkpoint_id=_key("checkpoint_id", data["id"]),
            task_id=_key("task_id", data["task"]),
            task_path=_text(data["path"], "task_path"),
            upsert=_bool(data["up"], "up"),
            rows=tuple(
                WriteRow(_int(i, "idx"), _key("channel", ch), _text(t, "type"), _unb64(b))
                for i, ch, t, b in _list(data["rows"], "rows")
            ),
        )
    if kind == "del":
        return Delete()
    if kind == "prune":
        return Prune()
    if kind == "claim":
        return Claim(_text(data["owner"], "owner"))
    if kind == "runs":
        return Runs(tuple(_text(r, "run id") for r in _list(data["runs"], "runs")))
    if kind == "copy":
        return Copy(
            checkpoints=tuple(
                (
                    _key("checkpoint_ns", ns),
                    _key("checkpoint_id", cid),
                    None if pid is None else _key("checkpoint_id", pid),
                    _json_object(cp, "cp"),
                    _json_object(md, "md"),
                )
                for ns, cid, pid, cp, md in _list(data["cps"], "cps")
            ),
            blobs=tuple(
                (
                    _key("checkpoint_ns", ns),
                    _key("channel", ch),
                    _key("version", ver),
                    _text(t, "type"),
                    _unb64(b),
                )
                for ns, ch, ver, t, b in _list(data["bl"], "bl")
            ),
            writes=tuple(
                (
                    _key("checkpoint_ns", ns),
                    _key("checkpoint_id", cid),
                    _key("task_id", task),
                    _text(path, "task_path"),
                    _int(idx, "idx"),
                    _key("channel", ch),
                    _text(t, "type"),
                    _unb64(b),
                )
                for ns, cid, task, path, idx, ch, t, b in _list(data["ws"], "ws")
            ),
        )
    raise CorruptEntryError(f"unknown LangGraph entry kind {kind!r}")


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise CorruptEntryError(f"{what} must be a list")
    return value


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or "\x00" in value:
        raise CorruptEntryError(f"{what} must be a string without NUL")
    return value


def _key(what: str, value: Any) -> str:
    text = _text(value, what)
    limit = KEY_LIMITS[what]
    if len(text) > limit or len(text.encode("utf-8", "surrogatepass")) > limit:
        raise CorruptEntryError(f"{what} is longer than {limit} bytes")
    return text


def _int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise CorruptEntryError(f"{what} must be an integer")
    return value


def _bool(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise CorruptEntryError(f"{what} must be true or false")
    return value


def _json_object(value: Any, what: str) -> bytes:
    if not isinstance(value, dict):
        raise CorruptEntryError(f"{what} must be a JSON object")
    return orjson.dumps(value)


def _unb64(value: Any) -> bytes | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise CorruptEntryError("a blob must be base64 text or null")
    try:
        return base64.b64decode(value, validate=True)
    except ValueError as exc:
        raise CorruptEntryError(f"a blob is not base64: {exc}") from exc


# -- hot records -------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class LgHot:
    """Hot record (KV ``h.<thread>``): the engine's view plus the write owner."""

    seq: int
    stream_seq: int
    recent: tuple[tuple[int, int], ...] = ()
    deleted_seq: int = 0
    chain_from: int = 0
    owner: str | None = None
    """Who may put (set by the latest claim entry; None: anyone)."""
    logical_seq: int = 0
    """Seq of the latest entry a read cannot overlay row by row (runs/prune/copy): a reader
    whose watermark is below it flushes the thread before reading."""


def advance_hot(previous: LgHot | None, entry: LgEntry, stream_seq: int, *, window: int) -> LgHot:
    head = advance_head(previous, entry, stream_seq, window=window)
    owner = previous.owner if previous else None
    logical = previous.logical_seq if previous else 0
    for op in entry.ops:
        if isinstance(op, Claim):
            owner = op.owner
    if not entry.simple:
        logical = entry.seq
    return LgHot(
        seq=head.seq,
        stream_seq=head.stream_seq,
        recent=head.recent,
        deleted_seq=head.deleted_seq,
        chain_from=head.chain_from,
        owner=owner,
        logical_seq=logical,
    )


def encode_hot(record: LgHot) -> bytes:
    return orjson.dumps(
        {
            "s": record.seq,
            "ss": record.stream_seq,
            "r": record.recent,
            "ds": record.deleted_seq,
            "cf": record.chain_from,
            "o": record.owner,
            "ls": record.logical_seq,
        }
    )


def decode_hot(data: bytes) -> LgHot:
    try:
        raw = orjson.loads(data)
        return LgHot(
            seq=int(raw["s"]),
            stream_seq=int(raw["ss"]),
            recent=tuple((int(a), int(b)) for a, b in raw.get("r", ())),
            deleted_seq=int(raw.get("ds", 0)),
            chain_from=int(raw.get("cf", 0)),
            owner=raw.get("o"),
            logical_seq=int(raw.get("ls", 0)),
        )
    except Exception as exc:
        raise CorruptEntryError(f"malformed LangGraph hot record: {exc!r}") from exc


@dataclass(frozen=True, slots=True)
class ListBase:
    """What a writer put last in a list channel of a namespace: a delta's base."""

    version: str
    items: tuple[Any, ...]
    """The items of the value put (a copy of the list: appending to it later changes
    nothing here). A new value extends it when its first items are these very objects."""
    size: int
    """Bytes of the stored blob."""
    full: bytes | None = None
    """The stored blob itself, kept only to check deltas (``check_deltas``)."""


LgState: TypeAlias = Mapping[tuple[str, str], ListBase]
"""The writer's cursor state of a thread: (namespace, channel) -> the list value it put
last, for the channels whose latest version it knows it wrote."""
NO_BASES: LgState = MappingProxyType({})


class LangGraphFormat:
    """`engine.appender.WriteFormat` of the LangGraph front-end. The cursor state is the
    list values this writer put last (`LgState`), the bases of its delta blobs; it is
    only known for what the writer itself wrote, so an entry read back leaves it unknown
    (None: the next put writes whole blobs)."""

    front_end = LANGGRAPH
    """The name its streams are tagged with (`buffered_store.engine.frontend`)."""

    def decode_entry(self, payload: bytes, *, stream_seq: int = 0) -> LgEntry:
        return decode_entry(payload, stream_seq=stream_seq)

    def decode_hot(self, data: bytes) -> LgHot:
        return decode_hot(data)

    def advance_hot(
        self, previous: LgHot | None, entry: LgEntry, stream_seq: int, *, window: int
    ) -> LgHot:
        return advance_hot(previous, entry, stream_seq, window=window)

    def encode_hot(self, record: LgHot, *, limit: int) -> bytes:
        return encode_hot(record)

    def with_recent(self, record: LgHot, recent: tuple[tuple[int, int], ...]) -> LgHot:
        return replace(record, recent=recent)

    def placed(self, entry: LgEntry, stream_seq: int) -> LgEntry:
        # Operations hold bytes and texts only: the built entry is what a read gets back.
        return replace(entry, stream_seq=stream_seq)

    def known_state(self, hot: LgHot | None, same_seq: LgState | None) -> LgState | None:
        if same_seq is not None:
            return same_seq
        if hot is None or hot.deleted_seq == hot.seq:
            return NO_BASES  # nothing stored: nothing to be the base of a delta
        return None

    def state_after(self, state: LgState | None, entry: LgEntry, *, owned: bool) -> LgState | None:
        return NO_BASES if entry.deletes else None

    def state_bytes(self, state: LgState) -> int:
        # The items a base holds weigh about what their encoding does (they are the
        # graph's own objects, often still alive in its state), plus the blob kept to
        # check deltas and a little per channel.
        return sum(
            base.size + len(base.full or b"") + 8 * len(base.items) + 200 for base in state.values()
        )

    def added_bytes(self, entry: LgEntry) -> int:
        return 0  # the state is never extended in place (`state_after` gives None)


LG_FORMAT = LangGraphFormat()
