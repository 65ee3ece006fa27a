"""WAL entries of the LangGraph front-end and their hot records. Pure: no I/O.

One engine thread = one LangGraph ``thread_id`` (all its checkpoint namespaces), so
``delete_thread`` and the per-thread compare-and-set cover every namespace.

Entries are already serialised: `aput` ran ``serde.dumps_typed`` on every blob value, so
the flusher needs neither the serializer nor any key. Blobs travel base64 in the JSON.

Body keys, per kind (``k``):

- ``put``: ``ns``, ``id`` (checkpoint id), ``pid`` (parent id or null), ``cp`` (the
  checkpoint JSON with blob values taken out, as AsyncPostgresSaver stores it), ``md``
  (metadata JSON), ``b`` ([channel, version, type, base64 blob or null] per new blob).
- ``w``: ``ns``, ``id``, ``task``, ``path``, ``up`` (true: upsert, every write of the call
  was special; false: insert-or-ignore), ``rows`` ([idx, channel, type, base64 blob]).
- ``del``: the thread is deleted (every namespace).
- ``runs``: ``runs`` (run ids): delete the thread's checkpoints whose metadata run_id is
  one of them, with their writes (`delete_for_runs`, one entry per affected thread).
- ``prune``: keep only the latest checkpoint per namespace (strategy keep_latest;
  strategy delete is a ``del``).
- ``copy``: literal rows copied from another thread: ``cps`` ([ns, id, pid, cp, md]),
  ``bl`` ([ns, channel, version, type, b64]), ``ws`` ([ns, id, task, path, idx, channel,
  type, b64]).
- ``claim``: ``owner``: from this seq on only `owner` may put on the thread.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

import orjson

from buffered_store.engine.entries import Header, advance_head, header_json, parse_entry
from buffered_store.errors import CorruptEntryError

KINDS = frozenset({"put", "w", "del", "runs", "prune", "copy", "claim"})
SIMPLE_KINDS = frozenset({"put", "w", "claim", "del"})
"""Kinds a read can overlay row by row; the others (logical ops on stored rows) make a
read flush the thread first."""


def b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


@dataclass(frozen=True, kw_only=True, slots=True)
class LgEntry:
    thread_id: str
    seq: int
    kind: str
    at: datetime
    body: dict[str, Any] = field(default_factory=dict)
    writer: str = ""
    jump: bool = False
    stream_seq: int = 0

    @property
    def deletes(self) -> bool:
        return self.kind == "del"


def encode_entry(entry: LgEntry) -> bytes:
    head = header_json(
        Header(entry.thread_id, entry.seq, entry.kind, entry.at, entry.writer, entry.jump)
    )
    for key in entry.body:
        if key in head:
            raise ValueError(f"body key {key!r} clashes with a header key")
    head.update(entry.body)
    return orjson.dumps(head)


_HEADER_KEYS = ("v", "t", "s", "k", "at", "w", "j")


def decode_entry(payload: bytes, *, stream_seq: int = 0) -> LgEntry:
    header, data = parse_entry(payload)
    if header.kind not in KINDS:
        raise CorruptEntryError(f"unknown LangGraph entry kind {header.kind!r}")
    body = {k: v for k, v in data.items() if k not in _HEADER_KEYS}
    return LgEntry(
        thread_id=header.thread_id,
        seq=header.seq,
        kind=header.kind,
        at=header.at,
        body=body,
        writer=header.writer,
        jump=header.jump,
        stream_seq=stream_seq,
    )


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
    if entry.kind == "claim":
        owner = entry.body.get("owner")
    if entry.kind not in SIMPLE_KINDS:
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


class LangGraphFormat:
    """`engine.appender.WriteFormat` of the LangGraph front-end. Entries are
    self-contained, so the writer's cursor state is a constant (no deltas)."""

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

    def known_state(self, hot: LgHot | None, same_seq: bool | None) -> bool:
        return True

    def state_after(self, state: bool | None, entry: LgEntry, *, owned: bool) -> bool:
        return True

    def state_bytes(self, state: bool) -> int:
        return 0  # a constant: nothing held per thread

    def added_bytes(self, entry: LgEntry) -> int:
        return 0


LG_FORMAT = LangGraphFormat()
