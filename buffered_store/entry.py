"""WAL entries and the KV records around them, and their wire codec. Pure: no I/O.

A WAL entry is one checkpoint (or delete) of one thread at one `seq`. Its messages are a
delta against the thread's previous entry: keep the first `keep` messages, then append
`messages`. An append-only step therefore carries only the new messages. The entry also
carries the full thread summary at its seq, so readers and flushers never derive it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

import orjson

from buffered_store.errors import CorruptEntryError
from buffered_store.messages import decode_message
from buffered_store.records import Message, RunRecord, Thread, _parse_dt

WIRE_VERSION = 1


class EntryKind(StrEnum):
    """What an entry does to its thread."""

    CHECKPOINT = "cp"
    DELETE = "del"


@dataclass(frozen=True, kw_only=True, slots=True)
class WalEntry:
    """One checkpoint or delete of one thread, as stored on the WAL."""

    thread_id: str
    seq: int
    kind: EntryKind
    at: datetime
    """Time of the checkpoint: the thread's `updated_at`."""
    keep: int = 0
    messages: Sequence[bytes] = ()
    """Canonical JSON bytes of the messages appended after `keep`."""
    message_count: int = 0
    run: RunRecord | None = None
    created_at: datetime | None = None
    parent_thread_id: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    writer: str = ""
    """Nonce of the writing call, to tell our own deduplicated publish from another's."""
    stream_seq: int = 0
    """Where the entry sits in the stream, when read back from it (not encoded)."""

    @property
    def thread(self) -> Thread | None:
        """The thread summary at this seq (None for a delete)."""
        if self.kind is EntryKind.DELETE:
            return None
        return Thread(
            thread_id=self.thread_id,
            parent_thread_id=self.parent_thread_id,
            metadata=self.metadata,
            created_at=self.created_at or self.at,
            updated_at=self.at,
            latest_run_id=self.run.run_id if self.run else None,
            message_count=self.message_count,
        )


def encode_entry(entry: WalEntry) -> bytes:
    """Wire bytes of an entry; message bytes are spliced in without re-encoding."""
    head: dict[str, Any] = {
        "v": WIRE_VERSION,
        "t": entry.thread_id,
        "s": entry.seq,
        "k": entry.kind.value,
        "at": entry.at.isoformat(),
        "w": entry.writer,
    }
    if entry.kind is EntryKind.CHECKPOINT:
        head.update(
            keep=entry.keep,
            n=entry.message_count,
            run=entry.run.to_json() if entry.run else None,
            c=(entry.created_at or entry.at).isoformat(),
            p=entry.parent_thread_id,
            md=dict(entry.metadata),
        )
    prefix = orjson.dumps(head)
    return prefix[:-1] + b',"m":[' + b",".join(entry.messages) + b"]}"


def decode_entry(payload: bytes, *, stream_seq: int = 0) -> WalEntry:
    """Entry from wire bytes; anything malformed raises `CorruptEntryError`."""
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise CorruptEntryError(f"payload is not JSON: {exc}") from exc
    if not isinstance(data, dict) or data.get("v") != WIRE_VERSION:
        raise CorruptEntryError("payload is not a WAL entry of a known version")
    try:
        kind = EntryKind(data["k"])
        thread_id = data["t"]
        seq = data["s"]
        if not isinstance(thread_id, str) or not thread_id:
            raise CorruptEntryError("entry has no thread id")
        if not isinstance(seq, int) or seq < 1:
            raise CorruptEntryError(f"entry has an invalid seq {seq!r}")
        at = _parse_dt(data["at"])
        if kind is EntryKind.DELETE:
            return WalEntry(
                thread_id=thread_id,
                seq=seq,
                kind=kind,
                at=at,
                writer=data.get("w", ""),
                stream_seq=stream_seq,
            )
        raw_messages = data["m"]
        if not isinstance(raw_messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in raw_messages
        ):
            raise CorruptEntryError("entry messages are not JSON objects with a role")
        messages = tuple(orjson.dumps(m, option=orjson.OPT_SORT_KEYS) for m in raw_messages)
        keep, count = data["keep"], data["n"]
        if not isinstance(keep, int) or keep < 0 or count != keep + len(messages):
            raise CorruptEntryError("entry message counts are inconsistent")
        run = RunRecord.from_json(data["run"]) if data.get("run") else None
        if run is not None and run.thread_id != thread_id:
            raise CorruptEntryError("entry run belongs to another thread")
        return WalEntry(
            thread_id=thread_id,
            seq=seq,
            kind=kind,
            at=at,
            keep=keep,
            messages=messages,
            message_count=count,
            run=run,
            created_at=_parse_dt(data["c"]),
            parent_thread_id=data.get("p"),
            metadata=data.get("md") or {},
            writer=data.get("w", ""),
            stream_seq=stream_seq,
        )
    except CorruptEntryError:
        raise
    except Exception as exc:
        raise CorruptEntryError(f"malformed entry: {exc!r}") from exc


@dataclass(frozen=True, kw_only=True, slots=True)
class HotRecord:
    """The thread's hot metadata in KV (`h.<thread>`), advanced by writers with CAS.

    `recent` maps the latest few seqs to their stream seqs, so a reader fetches the
    unflushed tail with direct gets instead of walking the subject.
    """

    seq: int
    stream_seq: int
    thread: Thread | None
    """Summary at `seq`; None when the entry at `seq` deleted the thread."""
    recent: tuple[tuple[int, int], ...] = ()

    def stream_seq_of(self, seq: int) -> int | None:
        """Stream sequence of the entry with this thread seq, if still in `recent`."""
        for thread_seq, stream_seq in self.recent:
            if thread_seq == seq:
                return stream_seq
        return None


def advance_hot(
    previous: HotRecord | None, entry: WalEntry, stream_seq: int, *, window: int
) -> HotRecord:
    """The hot record after `entry` was stored at `stream_seq`."""
    recent = (previous.recent if previous else ()) + ((entry.seq, stream_seq),)
    return HotRecord(
        seq=entry.seq, stream_seq=stream_seq, thread=entry.thread, recent=recent[-window:]
    )


def encode_hot(record: HotRecord) -> bytes:
    """KV bytes of a hot record."""
    return orjson.dumps(
        {
            "s": record.seq,
            "ss": record.stream_seq,
            "th": record.thread.to_json() if record.thread else None,
            "r": record.recent,
        }
    )


def decode_hot(data: bytes) -> HotRecord:
    """Hot record from KV bytes."""
    try:
        raw = orjson.loads(data)
        thread = Thread.from_json(raw["th"]) if raw.get("th") else None
        return HotRecord(
            seq=int(raw["s"]),
            stream_seq=int(raw["ss"]),
            thread=thread,
            recent=tuple((int(a), int(b)) for a, b in raw.get("r", ())),
        )
    except Exception as exc:
        raise CorruptEntryError(f"malformed hot record: {exc!r}") from exc


@dataclass(frozen=True, slots=True)
class FlushedMark:
    """The thread's flushed watermark in KV (`f.<thread>`), raised after each commit."""

    seq: int
    stream_seq: int


def encode_flushed(mark: FlushedMark) -> bytes:
    """KV bytes of a flushed watermark."""
    return orjson.dumps({"s": mark.seq, "ss": mark.stream_seq})


def decode_flushed(data: bytes) -> FlushedMark:
    """Flushed watermark from KV bytes."""
    try:
        raw = orjson.loads(data)
        return FlushedMark(int(raw["s"]), int(raw["ss"]))
    except Exception as exc:
        raise CorruptEntryError(f"malformed flushed watermark: {exc!r}") from exc


def messages_of(data: Sequence[bytes]) -> list[Message]:
    """Decode canonical message bytes to dicts."""
    return [decode_message(item) for item in data]
