"""The write path of the buffered store: per-thread cursors, the CAS append, the hot record.

A checkpoint costs two sequential round trips in the steady state: the WAL publish (a
compare-and-set on the thread's subject through `Nats-Expected-Last-Subject-Sequence`)
and the KV update of the hot record (a compare-and-set on its revision). Both expected
values come from this instance's cursor of the thread, so nothing is read first.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from buffered_store.config import BufferedStoreConfig
from buffered_store.engine.ids import utcnow
from buffered_store.engine.keys import decode_run_claim, hot_key, msg_id, run_key, wal_subject
from buffered_store.engine.ports import StoredMsg, Wal
from buffered_store.errors import ConflictError, CorruptEntryError, WalUnavailableError
from buffered_store.threadrun.checkpointing import jump_seq
from buffered_store.threadrun.entry import (
    EntryKind,
    HotRecord,
    WalEntry,
    advance_hot,
    decode_entry,
    decode_hot,
    encode_hot_within,
    seeded_hot,
)
from buffered_store.threadrun.messages import apply_delta
from buffered_store.threadrun.planning import follows
from buffered_store.threadrun.target import StoredThread

log = logging.getLogger("buffered_store.engine.appender")

MAX_CONFLICTS = 100


@dataclass(slots=True)
class Cursor:
    """What this instance knows of a thread's WAL position."""

    seq: int
    """Highest thread seq known to be in the stream."""
    stream_seq: int
    """Stream seq of the last message on the thread's subject (the CAS expectation)."""
    hot: HotRecord | None
    """Hot record at `seq` (what the KV holds, or will once our update lands)."""
    revision: int | None
    """KV revision of the hot key (None: the key does not exist)."""
    snapshot: list[bytes] | None
    """Canonical message bytes at `seq`, when known (None: send a full snapshot)."""
    runs: set[str] = field(default_factory=set)
    """Run ids already claimed for this thread in KV by this instance."""
    jump: bool = False
    """The thread's stored seq could not be read: the next entry jumps (see `jump_seq`)."""
    hot_behind: bool = False
    """The KV hot record (at `revision`) is older than `hot`: entries past it were found
    on the subject (a writer's KV update was lost). Readers do not see them yet."""


class CursorCache:
    """Bounded LRU of cursors, one per recently written thread."""

    def __init__(self, capacity: int) -> None:
        self._items: OrderedDict[str, Cursor] = OrderedDict()
        self._capacity = capacity

    def get(self, thread_id: str) -> Cursor | None:
        """The cursor, marked as recently used."""
        cursor = self._items.get(thread_id)
        if cursor is not None:
            self._items.move_to_end(thread_id)
        return cursor

    def put(self, thread_id: str, cursor: Cursor) -> None:
        """Store a cursor, evicting the least recently used one past capacity."""
        self._items[thread_id] = cursor
        self._items.move_to_end(thread_id)
        while len(self._items) > self._capacity:
            self._items.popitem(last=False)

    def drop(self, thread_id: str) -> None:
        """Forget a thread (its next write reloads from NATS)."""
        self._items.pop(thread_id, None)

    def threads(self) -> list[str]:
        """Threads with a cursor."""
        return list(self._items)


class ThreadLocks:
    """One lock per thread id, created on demand and dropped when nobody holds it.

    Serialises this instance's own writes to one thread (they would only conflict with
    each other); different threads never wait for each other.
    """

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextmanager
    def _track(self, thread_id: str) -> Iterator[asyncio.Lock]:
        lock, users = self._locks.get(thread_id, (asyncio.Lock(), 0))
        self._locks[thread_id] = (lock, users + 1)
        try:
            yield lock
        finally:
            lock, users = self._locks[thread_id]
            if users == 1:
                del self._locks[thread_id]
            else:
                self._locks[thread_id] = (lock, users - 1)

    async def run(self, thread_id: str, work: Callable[[], Any]) -> Any:
        """Run `work()` (a coroutine factory) holding the thread's lock."""
        with self._track(thread_id) as lock:
            async with lock:
                return await work()


@dataclass(slots=True)
class AppendAttempt:
    """Tracks whether a publish may have reached the server (for 'commit unknown')."""

    sent: bool = False


class Writer:
    """Appends entries for threads and keeps their hot records current."""

    def __init__(
        self,
        wal: Wal,
        config: BufferedStoreConfig,
        *,
        seed: Callable[[str], Awaitable[StoredThread | None]] | None = None,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.wal = wal
        self.config = config
        self._seed = seed
        self._clock = clock
        self.cursors = CursorCache(config.cursor_cache_threads)
        self.conflicts = 0
        self.wal_bytes = 0
        # Nonces: random per instance, then a counter (unique without a syscall per call).
        self._nonce_prefix = secrets.token_hex(8)
        self._nonces = itertools.count(1)
        max_payload = wal.max_payload
        # Leave room for headers and the publish envelope.
        self.max_entry_bytes = int(max_payload) - 4096

    def nonce(self) -> str:
        """A nonce identifying one write call (tells our publish from another writer's,
        also another instance's: the random prefix is drawn once per instance)."""
        return f"{self._nonce_prefix}{next(self._nonces):x}"

    def subject(self, thread_id: str) -> str:
        """WAL subject of a thread."""
        return wal_subject(self.config.stream_name, thread_id)

    async def cursor(self, thread_id: str) -> Cursor:
        """This instance's cursor of the thread, loading it from NATS when unknown."""
        cursor = self.cursors.get(thread_id)
        if cursor is None:
            cursor = await self.load_cursor(thread_id, None)
            self.cursors.put(thread_id, cursor)
        return cursor

    async def load_cursor(self, thread_id: str, old: Cursor | None) -> Cursor:
        """Rebuild the cursor from the hot record and the entries on the thread's subject.

        The stream is the source of truth for seqs: when the subject holds entries the hot
        record does not cover (a writer's KV update was lost, or it died between its
        publish and its KV update, or there is no hot record at all), they are walked and
        folded in, whatever seq the first of them has, so their seqs are never reused.
        """
        subject = self.subject(thread_id)
        value, last = await asyncio.gather(
            self.wal.kv_get(hot_key(thread_id)), self.wal.last_on(subject)
        )
        hot = decode_hot(value.value) if value else None
        revision = value.revision if value else None
        # Run claims made through the old cursor hold while the thread was not deleted
        # since (a deleted thread's runs may have been claimed by other threads).
        runs = old.runs if old and (hot is None or hot.deleted_seq <= old.seq) else set()
        if last is None and hot is None:
            return await self._cold_cursor(thread_id, runs)
        snapshot = _known_snapshot(hot, old)
        if last is None or (hot is not None and last.seq == hot.stream_seq):
            seq = hot.seq if hot else 0
            stream_seq = last.seq if last else 0
            return Cursor(seq, stream_seq, hot, revision, snapshot, runs)
        record = hot
        msg: StoredMsg | None = await self.wal.next_on(subject, hot.stream_seq + 1 if hot else 1)
        while msg is not None:
            entry = _entry_of(thread_id, msg)
            if entry is not None and (record is None or follows(entry, record.seq)):
                snapshot = _advance_snapshot(snapshot if record else [], entry)
                record = advance_hot(record, entry, msg.seq, window=self.config.recent_window)
            if msg.seq >= last.seq:
                break
            msg = await self.wal.next_on(subject, msg.seq + 1)
        if record is None:
            # Messages on the subject, none of them a readable entry of the thread, and no
            # hot record: the thread's seqs stand wherever the inner store says.
            cold = await self._cold_cursor(thread_id, runs)
            cold.stream_seq = last.seq
            return cold
        if old is not None and record.deleted_seq > old.seq:
            runs = set()
        behind = hot is None or record.seq > hot.seq
        return Cursor(record.seq, last.seq, record, revision, snapshot, runs, hot_behind=behind)

    async def _cold_cursor(self, thread_id: str, runs: set[str]) -> Cursor:
        """The cursor of a thread the WAL has never seen (no entry, no hot record).

        The inner store may hold it (data written before the buffered store was put in
        front of it): its seqs continue there, or the flush would judge our entries stale.
        When the inner store cannot tell (it is down), the first entry jumps.
        """
        if self._seed is None:
            return Cursor(0, 0, None, None, [], runs)
        stored = await self._seed(thread_id)
        if stored is None:
            return Cursor(jump_seq(self._clock()), 0, None, None, [], runs, jump=True)
        if stored.flushed_seq == 0:
            return Cursor(0, 0, None, None, [], runs)
        hot = seeded_hot(stored.flushed_seq, stored.thread)
        return Cursor(stored.flushed_seq, 0, hot, None, list(stored.messages or []), runs)

    async def append(
        self,
        thread_id: str,
        build: Callable[[Cursor], tuple[WalEntry, bytes]],
        attempt: AppendAttempt,
    ) -> tuple[WalEntry, int, Cursor]:
        """Publish the entry `build` makes from the current cursor, retrying on conflicts.

        Returns the published entry, its stream seq and the cursor it was built on;
        `attempt` records whether a publish went out.
        """
        cursor = await self.cursor(thread_id)
        for _ in range(MAX_CONFLICTS):
            entry, payload = build(cursor)
            try:
                stream_seq = await self._publish(thread_id, entry, payload, cursor, attempt)
            except ConflictError:
                self.conflicts += 1
                cursor = await self.load_cursor(thread_id, cursor)
                self.cursors.put(thread_id, cursor)
                continue
            self.wal_bytes += len(payload)
            return entry, stream_seq, cursor
        raise ConflictError(f"thread {thread_id!r}: too many concurrent writers, gave up")

    async def _publish(
        self,
        thread_id: str,
        entry: WalEntry,
        payload: bytes,
        cursor: Cursor,
        attempt: AppendAttempt,
    ) -> int:
        subject = self.subject(thread_id)
        delay = 0.05
        while True:
            resent = attempt.sent
            attempt.sent = True
            try:
                stream_seq, duplicate = await self.wal.publish(
                    subject,
                    payload,
                    msg_id=msg_id(thread_id, entry.seq),
                    expected_last_subject_seq=cursor.stream_seq,
                )
            except ConflictError:
                # Servers check the expected sequence before deduplicating, so a retry of a
                # publish that did land comes back as a conflict. Had it landed, it is the
                # first message after the one it expected (other writers may have appended
                # on top since): look there whether it is ours.
                if resent:
                    landed = await self._message_after(subject, cursor.stream_seq)
                    if landed is not None and _is_ours(landed, entry):
                        return landed.seq
                # Another message follows the one we expected: ours is not in the stream
                # and can no longer land (its expectation is stale for good).
                attempt.sent = False
                raise
            except WalUnavailableError:
                await asyncio.sleep(delay)  # the checkpoint's timeout bounds these retries
                delay = min(delay * 2, 1.0)
                continue
            if duplicate:
                stored = await self.wal.get(stream_seq)
                if stored is None or not _is_ours(stored, entry):
                    attempt.sent = False  # deduplicated against another writer's entry
                    raise ConflictError(f"seq {entry.seq} of {thread_id!r} is taken")
            return stream_seq

    async def _message_after(self, subject: str, stream_seq: int) -> StoredMsg | None:
        """The first message on `subject` after `stream_seq`, retried while NATS is
        unreachable (the checkpoint's timeout bounds it): the answer decides between
        "stored" and "not stored", which a caller must not be told wrongly."""
        delay = 0.05
        while True:
            try:
                return await self.wal.next_on(subject, stream_seq + 1)
            except WalUnavailableError:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def advance_hot(self, thread_id: str, record: HotRecord, revision: int | None) -> int:
        """CAS the hot record forward; never moves it back. Returns the new revision."""
        key = hot_key(thread_id)
        delay = 0.02
        while True:
            try:
                data = encode_hot_within(record, self.max_entry_bytes)
                return await self.wal.kv_swap(key, data, revision=revision)
            except ConflictError:
                current = await self.wal.kv_get(key)
                if current is not None:
                    stored = decode_hot(current.value)
                    if stored.seq >= record.seq:
                        return current.revision
                    record = _merge_recent(record, stored, self.config.recent_window)
                revision = current.revision if current else None
            except WalUnavailableError:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def run_thread(self, run_id: str) -> str | None:
        """The thread that claimed a run id, from the KV run claims."""
        value = await self.wal.kv_get(run_key(run_id))
        return decode_run_claim(value.value)[0] if value else None

    def record_written(
        self,
        thread_id: str,
        entry: WalEntry,
        stream_seq: int,
        base: Cursor,
        snapshot: list[bytes] | None,
    ) -> Cursor:
        """The cursor after `entry` was published at `stream_seq` on top of `base`.

        `snapshot` is the thread's snapshot at `entry` when the caller knows it; None
        derives it from `base` (an append: the base's snapshot, when known, extended).
        """
        if snapshot is None:
            snapshot = _appended_snapshot(base.snapshot, entry)
        cursor = Cursor(
            seq=entry.seq,
            stream_seq=stream_seq,
            hot=advance_hot(base.hot, entry, stream_seq, window=self.config.recent_window),
            revision=base.revision,
            snapshot=snapshot,
            # A deleted thread holds no run: its claims may pass to other threads.
            runs=set() if entry.kind is EntryKind.DELETE else base.runs,
        )
        self.cursors.put(thread_id, cursor)
        return cursor


def _entry_of(thread_id: str, msg: StoredMsg) -> WalEntry | None:
    try:
        entry = decode_entry(msg.data, stream_seq=msg.seq)
    except CorruptEntryError:
        return None
    return entry if entry.thread_id == thread_id else None


def _is_ours(msg: StoredMsg, entry: WalEntry) -> bool:
    stored = _entry_of(entry.thread_id, msg)
    return stored is not None and stored.seq == entry.seq and stored.writer == entry.writer


def _known_snapshot(hot: HotRecord | None, old: Cursor | None) -> list[bytes] | None:
    if hot is None or hot.thread is None:
        return []  # new or deleted thread: its snapshot is empty
    if old is not None and old.seq == hot.seq:
        return old.snapshot
    return None


def _advance_snapshot(snapshot: list[bytes] | None, entry: WalEntry) -> list[bytes] | None:
    if entry.kind is EntryKind.DELETE:
        return []
    if entry.keep == 0:
        return list(entry.messages)
    if snapshot is None or entry.keep > len(snapshot):
        return None
    return apply_delta(snapshot, entry.keep, entry.messages)


def _appended_snapshot(snapshot: list[bytes] | None, entry: WalEntry) -> list[bytes] | None:
    """`_advance_snapshot` for the entry just written on top of the cursor that owns
    `snapshot`: an append extends the list in place instead of copying the history.

    Safe because that cursor is replaced by the new one and its list is nobody else's:
    cursors hand their snapshot out only to readers that decode it before yielding.
    """
    extends = entry.kind is EntryKind.CHECKPOINT and entry.keep > 0
    if extends and snapshot is not None and entry.keep == len(snapshot):
        snapshot.extend(entry.messages)
        return snapshot
    return _advance_snapshot(snapshot, entry)


def _merge_recent(record: HotRecord, stored: HotRecord, window: int) -> HotRecord:
    merged = dict(stored.recent)
    merged.update(record.recent)
    recent = tuple(sorted(merged.items()))[-window:]
    return replace(record, recent=recent)
