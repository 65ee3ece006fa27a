"""Decoding the LangGraph front-end's WAL entries (both wire formats, see
`langgraph.entry`). Pure: no I/O.

Every field's type and every key's size is checked (`CorruptEntryError`), so an entry
that cannot be applied is quarantined when fetched instead of failing its flush.
"""

from __future__ import annotations

import base64
from typing import Any

import orjson

from buffered_store.engine.entries import parse_framed
from buffered_store.errors import CorruptEntryError
from buffered_store.langgraph.entry import (
    KEY_LIMITS,
    KINDS,
    OPS_KIND,
    BlobRow,
    Claim,
    Copy,
    Delete,
    LgEntry,
    Op,
    Prune,
    Put,
    Runs,
    WriteRow,
    Writes,
)

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
