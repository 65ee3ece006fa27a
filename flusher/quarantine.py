"""Quarantine of WAL messages that cannot be flushed: records, listing, replay and drop.

Records live in the KV bucket `EngineConfig.quarantine_bucket`:

- ``m.<stream_seq>``: one message, terminated on the consumer. Either a payload that is
  not an entry (no seq: it blocks nobody) or the entry of a thread that kept failing to
  apply (its culprit).
- ``t.<token>``: a quarantined thread, with the stream seqs of its terminated entries.
  Entries of a thread after its culprit cannot apply without it, so they are quarantined
  too, while every other thread keeps flowing.

Nothing is lost: the flushers' trimming never purges past the oldest stream seq a record
names (`flusher.trim.quarantined_floor`), so `replay` re-reads a thread's entries from its
watermark and flushes them inline (unless an opt-in `max_age_s` expired them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

import orjson

from buffered_store.engine.flushing import FlushSink
from buffered_store.engine.ids import parse_time
from buffered_store.engine.keys import encode_token
from buffered_store.engine.ports import Wal
from buffered_store.engine.threadlog import ThreadLog, flush_thread
from buffered_store.errors import (
    ConflictError,
    CorruptEntryError,
    FlushFailedError,
    StoreError,
    ValidationError,
    WalEntriesMissingError,
    WalObjectMissingError,
    WalRefusedError,
    WalUnavailableError,
)
from flusher.policy import PREVIEW_BYTES, Undecodable, classify

log = logging.getLogger("flusher.quarantine")

_CAS_ATTEMPTS = 10


class QuarantineError(StoreError):
    """The quarantine operation is not possible."""


THREAD_FAILURES = (
    FlushFailedError,
    WalEntriesMissingError,
    ConflictError,
    CorruptEntryError,
    ValidationError,
    QuarantineError,
)
"""What one thread's replay can meet that is the thread's own: its data refused, its
entries gone, it kept moving, its record unreadable. The database or NATS away (and
anything else) ends a bulk replay instead, since every thread would fail the same way."""

RECORD_FAILURES = (
    WalUnavailableError,
    WalRefusedError,
    WalObjectMissingError,
    ConflictError,
    ValidationError,
    QuarantineError,
)
"""Why a quarantine record may not be read or written: NATS away or refusing, the bucket
missing, other writers racing the record, a record too large or unreadable."""


class QuarantineKind(StrEnum):
    """What a quarantine record stands for."""

    MESSAGE = "message"
    THREAD = "thread"


def message_key(stream_seq: int) -> str:
    """Key of the record of one quarantined message."""
    return f"m.{stream_seq}"


def thread_key(thread_id: str) -> str:
    """Key of the record of a quarantined thread (ids are encoded like WAL subjects)."""
    return f"t.{encode_token(thread_id)}"


@dataclass(frozen=True, kw_only=True, slots=True)
class QuarantineRecord:
    """One quarantine record: a message (``m.``) or a thread (``t.``)."""

    kind: QuarantineKind
    reason: str
    at: datetime
    """When the record was first written."""
    thread_id: str | None = None
    """The thread (for a message: the one its subject names, None if none)."""
    subject: str | None = None
    stream_seq: int | None = None
    """The message's position in the stream (message records)."""
    seq: int | None = None
    """Thread seq of the entry (message records of entries) or of the thread's culprit."""
    payload_bytes: int = 0
    preview_hex: str = ""
    """Hex of the first bytes of an undecodable payload (never of a decodable entry)."""
    stream_seqs: tuple[int, ...] = ()
    """Thread records: stream seqs of the thread's terminated entries."""
    deliveries: int = 0

    @property
    def key(self) -> str:
        """The record's KV key."""
        if self.kind is QuarantineKind.THREAD:
            assert self.thread_id is not None
            return thread_key(self.thread_id)
        assert self.stream_seq is not None
        return message_key(self.stream_seq)

    @property
    def replayable(self) -> bool:
        """False for a payload that is not an entry (unless a newer decoder accepts it)."""
        return self.kind is QuarantineKind.THREAD or self.seq is not None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "kind": self.kind.value,
            "reason": self.reason,
            "at": self.at.isoformat(),
            "thread_id": self.thread_id,
            "subject": self.subject,
            "stream_seq": self.stream_seq,
            "seq": self.seq,
            "payload_bytes": self.payload_bytes,
            "preview_hex": self.preview_hex,
            "stream_seqs": list(self.stream_seqs),
            "deliveries": self.deliveries,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> QuarantineRecord:
        """Inverse of `to_json`."""
        return cls(
            kind=QuarantineKind(data["kind"]),
            reason=str(data.get("reason", "")),
            at=parse_time(data["at"]),
            thread_id=data.get("thread_id"),
            subject=data.get("subject"),
            stream_seq=data.get("stream_seq"),
            seq=data.get("seq"),
            payload_bytes=int(data.get("payload_bytes", 0)),
            preview_hex=str(data.get("preview_hex", "")),
            stream_seqs=tuple(int(s) for s in data.get("stream_seqs", ())),
            deliveries=int(data.get("deliveries", 0)),
        )


def undecodable_record(
    bad: Undecodable,
    *,
    subject: str,
    stream_seq: int,
    data: bytes,
    deliveries: int,
    now: datetime,
) -> QuarantineRecord:
    """The record of a payload that is not an entry (a short hex preview, never more)."""
    return QuarantineRecord(
        kind=QuarantineKind.MESSAGE,
        reason=bad.reason,
        at=now,
        thread_id=bad.thread_id,
        subject=subject,
        stream_seq=stream_seq,
        payload_bytes=len(data),
        preview_hex=data[:PREVIEW_BYTES].hex(),
        deliveries=deliveries,
    )


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """What `replay` did."""

    thread_id: str
    flushed_seq: int
    """The thread's watermark in the target after the replay."""
    removed: tuple[str, ...] = field(default=())
    """Quarantine keys deleted."""


class Quarantine:
    """The quarantine bucket: writes by flushers, reads and deletes by operators."""

    def __init__(self, wal: Wal) -> None:
        self.wal = wal

    async def add_message(self, record: QuarantineRecord) -> bool:
        """Write a message record unless one exists; True when this call wrote it.

        Create-only, so a redelivered message is never quarantined twice.
        """
        try:
            await self.wal.quarantine.create(record.key, orjson.dumps(record.to_json()))
        except ConflictError:
            return False
        return True

    async def add_thread(
        self,
        thread_id: str,
        *,
        reason: str,
        seq: int | None,
        stream_seqs: Iterable[int],
        now: datetime,
    ) -> bool:
        """Create the thread record or add stream seqs to it; True when this call created it."""
        key = thread_key(thread_id)
        new = tuple(stream_seqs)
        for _ in range(_CAS_ATTEMPTS):
            current = await self._get(key)
            if current is None:
                record = QuarantineRecord(
                    kind=QuarantineKind.THREAD,
                    reason=reason,
                    at=now,
                    thread_id=thread_id,
                    seq=seq,
                    stream_seqs=tuple(sorted(set(new))),
                )
                revision = None
            else:
                old, revision = current
                merged = tuple(sorted(set(old.stream_seqs) | set(new)))
                if merged == old.stream_seqs:
                    return False
                record = dataclasses.replace(old, stream_seqs=merged)
            try:
                await self._swap(key, record, revision)
            except ConflictError:
                continue  # another flusher extended it meanwhile: merge again
            return current is None
        raise ConflictError(f"quarantine record of thread {thread_id!r} kept changing")

    async def thread_record(self, thread_id: str) -> QuarantineRecord | None:
        """The thread's record, or None when it is not quarantined."""
        current = await self._get(thread_key(thread_id))
        return current[0] if current else None

    async def message_record(self, stream_seq: int) -> QuarantineRecord | None:
        """A message's record, or None."""
        current = await self._get(message_key(stream_seq))
        return current[0] if current else None

    async def records(self) -> list[QuarantineRecord]:
        """Every record: threads first, then messages by stream seq."""
        keys = await self.wal.quarantine.keys()
        found = await asyncio.gather(*(self._get(key) for key in keys))
        out = [item[0] for item in found if item is not None]
        out.sort(key=lambda r: (r.kind is QuarantineKind.MESSAGE, r.stream_seq or 0, r.key))
        return out

    async def delete(self, key: str) -> None:
        """Delete a record (absent is fine)."""
        await self.wal.quarantine.delete(key)

    async def _get(self, key: str) -> tuple[QuarantineRecord, int] | None:
        entry = await self.wal.quarantine.get(key)
        if entry is None:
            return None
        try:
            return QuarantineRecord.from_json(orjson.loads(entry.value)), entry.revision
        except (ValueError, KeyError, TypeError) as exc:
            raise QuarantineError(f"quarantine record {key} is malformed: {exc!r}") from exc

    async def _swap(self, key: str, record: QuarantineRecord, revision: int | None) -> None:
        value = orjson.dumps(record.to_json())
        await self.wal.quarantine.swap(key, value, revision=revision)


async def list_quarantine(wal: Wal) -> list[QuarantineRecord]:
    """Every quarantine record of the WAL `wal` is connected to."""
    return await Quarantine(wal).records()


async def replay(
    thread_log: ThreadLog[Any, Any],
    target: FlushSink[Any],
    *,
    stream_seq: int | None = None,
    thread_id: str | None = None,
) -> ReplayResult:
    """Flush a quarantined thread inline (re-reading its entries from the stream) and, on
    success, delete its quarantine records.

    Give the thread, or the stream seq of one of its records. A payload that is not an
    entry cannot be replayed (it holds no data to flush): `QuarantineError` says so,
    unless the payload decodes by now (a newer decoder, or the flusher of the right
    front-end), when its thread is flushed. A thread's replay removes every record of
    it: its thread record and its message records (`replay_all` with `thread_id`).
    Raises `FlushFailedError` when the thread still fails (the database or NATS away:
    their own errors); its records then stay. The thread
    log reads the entries of the front-end `target` flushes.
    """
    if (stream_seq is None) == (thread_id is None):
        raise ValidationError("replay needs exactly one of stream_seq or thread_id")
    if thread_id is not None:
        bulk = await replay_all(thread_log, target, thread_id=thread_id)
        if bulk.failed:
            raise FlushFailedError(bulk.failed[0][1], thread_id=thread_id)
        if not bulk.replayed:
            raise QuarantineError(f"thread {thread_id!r} is not quarantined")
        return bulk.replayed[0]
    quarantine = Quarantine(thread_log.wal)
    extra: list[str] = []
    if stream_seq is not None:
        record = await quarantine.message_record(stream_seq)
        if record is None:
            raise QuarantineError(f"no quarantine record for stream seq {stream_seq}")
        extra.append(record.key)
        if record.seq is not None and record.thread_id is not None:
            thread_id = record.thread_id
        else:
            thread_id = await _thread_of_payload(thread_log, stream_seq, record)
    assert thread_id is not None
    return await _replay_thread(thread_log, target, quarantine, thread_id, extra)


@dataclass(frozen=True, slots=True)
class BulkReplay:
    """What `replay_all` did."""

    replayed: tuple[ReplayResult, ...] = ()
    """Threads flushed, with the records each removed."""
    failed: tuple[tuple[str, str], ...] = ()
    """(thread, error) of threads that still fail: their records stay."""
    skipped: tuple[tuple[str, str], ...] = ()
    """(record key, why) of records that hold nothing to flush here: a payload that is
    no entry of this front-end, a message no longer in the stream, another stream's."""


async def replay_all(
    thread_log: ThreadLog[Any, Any], target: FlushSink[Any], *, thread_id: str | None = None
) -> BulkReplay:
    """Replay every quarantined thread (or only `thread_id`) in one go, each flushed
    once from its watermark, whatever number of records it has.

    A record belongs to a thread by its thread record, by its entry, or, for a payload
    that was not an entry when it was quarantined, by that payload decoding now with this
    front-end's format: after a flusher of another front-end quarantined every entry of
    a stream ("'put' is not a valid EntryKind"), the right front-end's replay flushes
    them all. A thread that still fails keeps its records and the others go on.
    """
    quarantine = Quarantine(thread_log.wal)
    threads: dict[str, list[str]] = {}
    skipped: list[tuple[str, str]] = []
    for record in await quarantine.records():
        if thread_id is not None and record.thread_id not in (thread_id, None):
            continue  # a message record's thread is its subject's: never another one
        owner, why = await _owner(thread_log, record)
        if owner is None:
            skipped.append((record.key, why))
        elif thread_id is None or owner == thread_id:
            threads.setdefault(owner, []).append(record.key)
    replayed: list[ReplayResult] = []
    failed: list[tuple[str, str]] = []
    for owner, keys in threads.items():
        extra = [key for key in keys if key != thread_key(owner)]
        try:
            replayed.append(await _replay_thread(thread_log, target, quarantine, owner, extra))
        except THREAD_FAILURES as exc:
            failed.append((owner, f"{type(exc).__name__}: {exc}"))
    return BulkReplay(tuple(replayed), tuple(failed), tuple(skipped))


async def _owner(
    thread_log: ThreadLog[Any, Any], record: QuarantineRecord
) -> tuple[str | None, str]:
    """The thread whose flush a record waits for, or None and why it waits for none."""
    if record.kind is QuarantineKind.THREAD or (
        record.seq is not None and record.thread_id is not None
    ):
        return record.thread_id, ""
    stream = thread_log.config.stream_name
    if record.subject is not None and not record.subject.startswith(f"{stream}."):
        return None, f"a message of another stream ({record.subject}), not of {stream!r}"
    assert record.stream_seq is not None
    msg = await thread_log.wal.get(record.stream_seq)
    if msg is None:
        return None, "no longer in the stream: drop it"
    decoded = classify(
        thread_log.fmt, thread_log.config.stream_name, msg.subject, msg.data, msg.seq
    )
    if isinstance(decoded, Undecodable):
        return None, f"not an entry of this front-end ({decoded.reason}): drop it"
    return decoded.thread_id, ""


async def _thread_of_payload(
    thread_log: ThreadLog[Any, Any], stream_seq: int, record: QuarantineRecord
) -> str:
    msg = await thread_log.wal.get(stream_seq)
    if msg is None:
        raise QuarantineError(
            f"message {stream_seq} is no longer in the stream; drop its record instead"
        )
    decoded = classify(
        thread_log.fmt, thread_log.config.stream_name, msg.subject, msg.data, msg.seq
    )
    if isinstance(decoded, Undecodable):
        raise QuarantineError(
            f"message {stream_seq} is not a WAL entry ({record.reason}): it holds no "
            f"checkpoint and cannot be replayed; drop it with "
            f"`bufstore quarantine drop --stream-seq {stream_seq}`"
        )
    return decoded.thread_id


async def _replay_thread(
    thread_log: ThreadLog[Any, Any],
    target: FlushSink[Any],
    quarantine: Quarantine,
    thread_id: str,
    extra: list[str],
) -> ReplayResult:
    record = await quarantine.thread_record(thread_id)
    if record is None and not extra:
        raise QuarantineError(f"thread {thread_id!r} is not quarantined")
    await flush_thread(thread_log, target, thread_id)
    keys = list(extra)
    if record is not None:
        keys.append(record.key)
        keys.extend(message_key(s) for s in record.stream_seqs)
    for key in dict.fromkeys(keys):
        await quarantine.delete(key)
    # Entries quarantined while this replay ran (before the thread record was deleted)
    # were terminated without being applied: flushing again picks them up from the stream.
    flushed = await flush_thread(thread_log, target, thread_id)
    log.info(
        "replayed quarantined thread",
        extra={"action": "quarantine_replayed", "flushed_seq": flushed, "records": len(keys)},
    )
    return ReplayResult(
        thread_id=thread_id, flushed_seq=flushed, removed=tuple(dict.fromkeys(keys))
    )


async def drop(
    wal: Wal, *, stream_seq: int | None = None, thread_id: str | None = None
) -> list[str]:
    """Forget quarantine records without flushing anything; returns the keys deleted.

    Dropping a thread only forgets it: its unflushed entries are still in the stream, and
    the next entry of the thread makes a flusher try them again.
    """
    if (stream_seq is None) == (thread_id is None):
        raise ValidationError("drop needs exactly one of stream_seq or thread_id")
    quarantine = Quarantine(wal)
    keys: list[str] = []
    if stream_seq is not None:
        if await quarantine.message_record(stream_seq) is not None:
            keys.append(message_key(stream_seq))
    else:
        assert thread_id is not None
        record = await quarantine.thread_record(thread_id)
        if record is not None:
            keys.append(record.key)
            keys.extend(message_key(s) for s in record.stream_seqs)
    for key in keys:
        await quarantine.delete(key)
    if not keys:
        raise QuarantineError("nothing to drop: no such quarantine record")
    return keys
