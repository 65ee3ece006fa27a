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
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Generic, Protocol

from buffered_store.backoff import backoff_s
from buffered_store.config import WriterConfig
from buffered_store.engine.cursors import (
    Cursor,
    CursorCache,
    S,
    Seeded,
)
from buffered_store.engine.deadlines import Deadlines
from buffered_store.engine.entries import E, Format, H, follows
from buffered_store.engine.hotupdates import HotUpdates, merged_recent
from buffered_store.engine.ids import check_aware, utcnow
from buffered_store.engine.keys import hot_key, msg_id, wal_subject
from buffered_store.engine.ports import StoredMsg, Wal
from buffered_store.engine.threadlog import EntryCache, ThreadLog
from buffered_store.errors import (
    BackendUnavailableError,
    CommitUnknownError,
    ConflictError,
    DatabaseUnavailableError,
    PayloadTooLargeError,
    StoreError,
    WalEntriesExpiredError,
    WalFullError,
    WalUnavailableError,
)

log = logging.getLogger("buffered_store.engine.appender")

MAX_CONFLICTS = 100


def jump_seq(now: datetime) -> int:
    """The seq after which a chain starts when the thread's stored seq cannot be read.

    The writer of a thread the WAL has never seen asks the inner store where the thread's
    seqs stand; when it cannot answer (the database is down), the first entry *jumps* to
    this seq instead of guessing 1: microseconds since the epoch, above any seq a thread
    can have reached (a checkpoint takes far longer than a microsecond, so even a chain
    started by an earlier jump stays below), so the flush never mistakes the new entries
    for stale ones.
    """
    check_aware(now, "now")
    return int(now.timestamp() * 1_000_000)


class WriteFormat(Format[E, H], Protocol[E, H, S]):
    """What the appender asks of a front-end: its hot records and cursor state.

    The engine never looks inside a hot record beyond `HotView`, nor inside the state.
    """

    def advance_hot(self, previous: H | None, entry: E, stream_seq: int, *, window: int) -> H:
        """The hot record after `entry` was stored at `stream_seq`."""
        ...

    def encode_hot(self, record: H, *, limit: int) -> bytes:
        """KV bytes of a hot record, at most `limit` bytes (a KV value is a message)."""
        ...

    def with_recent(self, record: H, recent: Sequence[tuple[int, int]]) -> H:
        """The record with another `recent` list."""
        ...

    def placed(self, entry: E, stream_seq: int) -> E | None:
        """The entry as read back from the stream at `stream_seq`, to keep for reads
        (`EntryCache`); None when the built entry cannot stand for it (it holds the
        caller's mutable objects)."""
        ...

    def known_state(self, hot: H | None, same_seq: S | None) -> S | None:
        """The state at `hot`'s seq when it follows from `hot` alone (a new or deleted
        thread), else `same_seq` (an older cursor's state at the same seq), else None."""
        ...

    def state_after(self, state: S | None, entry: E, *, owned: bool) -> S | None:
        """The state after `entry` on top of `state` (None: unknown). With `owned`, the
        caller gives `state` up, so it may be extended in place."""
        ...

    def state_bytes(self, state: S) -> int:
        """About how many bytes of memory `state` holds (what the cursor cache counts)."""
        ...

    def added_bytes(self, entry: E) -> int:
        """What `state_after(..., owned=True)` adds to `state_bytes` when it extends the
        state in place with `entry` (so a cursor is weighed in O(entry), not O(state))."""
        ...


@dataclass(slots=True)
class AppendAttempt:
    """Tracks whether a publish may have reached the server (for 'commit unknown')."""

    sent: bool = False


class Writer(Generic[E, H, S]):
    """Appends entries for threads and keeps their hot records current.

    `seed` tells where a thread the WAL has never seen stands in the store behind the
    buffer (None when that store cannot answer: the first entry then jumps).
    """

    def __init__(
        self,
        wal: Wal,
        config: WriterConfig,
        fmt: WriteFormat[E, H, S],
        *,
        seed: Callable[[str], Awaitable[Seeded[H, S] | None]] | None = None,
        watermark: Callable[[str], Awaitable[int]] | None = None,
        clock: Callable[[], datetime] = utcnow,
        background_hot: bool = False,
        hot_linger_s: float = 0.0,
        too_large: Callable[[E, int, int], str] | None = None,
    ) -> None:
        self.wal = wal
        self.config = config
        self.fmt = fmt
        self.log = ThreadLog(wal, config, fmt, cache=EntryCache(config.entry_cache_bytes))
        self._seed = seed
        self._watermark = watermark
        """The thread's flushed seq in the store behind the buffer (None: unknown)."""
        self._too_large = too_large
        """The front-end's message for an entry the WAL cannot take."""
        self._clock = clock
        self.cursors: CursorCache[H, S] = CursorCache(
            config.cursor_cache_threads, max_bytes=config.cursor_cache_bytes, weigh=fmt.state_bytes
        )
        self.conflicts = 0
        self.commit_unknown = 0
        """Writes whose outcome could not be known (`CommitUnknownError`)."""
        self.wal_bytes = 0
        self.background_hot = background_hot
        """The hot record is advanced after `write` returns, off the caller's path (see
        `HotUpdates`): a write then costs one round trip."""
        self.hot_updates = HotUpdates(self, linger_s=hot_linger_s)
        self._deadlines = Deadlines()
        # Nonces: random per instance, then a counter (unique without a syscall per call).
        self._nonce_prefix = secrets.token_hex(8)
        self._nonces = itertools.count(1)
        max_payload = wal.max_payload
        # Leave room for headers and the publish envelope.
        self.max_entry_bytes = int(max_payload) - 4096

    def too_large(self, entry: E, size: int) -> PayloadTooLargeError:
        """The refusal of an entry of `size` bytes, in the front-end's words."""
        if self._too_large is not None:
            return PayloadTooLargeError(self._too_large(entry, size, self.max_entry_bytes))
        return PayloadTooLargeError(
            f"entry {entry.seq} of thread {entry.thread_id!r} is {size} bytes; the "
            f"WAL accepts {self.max_entry_bytes}: nothing was written"
        )

    def nonce(self) -> str:
        """A nonce identifying one write call (tells our publish from another writer's,
        also another instance's: the random prefix is drawn once per instance)."""
        return f"{self._nonce_prefix}{next(self._nonces):x}"

    def subject(self, thread_id: str) -> str:
        """WAL subject of a thread."""
        return wal_subject(self.config.stream_name, thread_id)

    async def cursor(self, thread_id: str) -> Cursor[H, S]:
        """This instance's cursor of the thread, loading it from the WAL when unknown."""
        cursor = self.cursors.get(thread_id)
        if cursor is None:
            cursor = await self.load_cursor(thread_id, None)
            self.cursors.put(thread_id, cursor)
        return cursor

    async def load_cursor(self, thread_id: str, old: Cursor[H, S] | None) -> Cursor[H, S]:
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
        hot = self.fmt.decode_hot(value.value) if value else None
        revision = value.revision if value else None
        # Claims made through the old cursor hold while the thread was not deleted
        # since (a deleted thread's ids may have been claimed by other threads).
        claims = old.claims if old and (hot is None or hot.deleted_seq <= old.seq) else set()
        if last is None and hot is None:
            return await self._cold_cursor(thread_id, claims)
        if hot is not None and hot.stream_seq and (last is None or last.seq < hot.stream_seq):
            # The thread's last entry left the stream: trimmed once flushed (then the
            # store holds it all), or expired or removed before (then it is lost).
            await self._check_flushed(thread_id, hot.seq)
        state = self.fmt.known_state(
            hot, old.state if old is not None and hot is not None and old.seq == hot.seq else None
        )
        if last is None or (hot is not None and last.seq == hot.stream_seq):
            seq = hot.seq if hot else 0
            stream_seq = last.seq if last else 0
            return Cursor(seq, stream_seq, hot, revision, state, claims)
        record = hot
        async for msg, entry in self.log.walk(thread_id, hot.stream_seq + 1 if hot else 1):
            if entry is not None and (record is None or follows(entry, record.seq)):
                base = state if record is not None else self.fmt.known_state(None, None)
                state = self.fmt.state_after(base, entry, owned=False)
                record = self.fmt.advance_hot(
                    record, entry, msg.seq, window=self.config.recent_window
                )
            if msg.seq >= last.seq:
                break
        if record is None:
            # Messages on the subject, none of them a readable entry of the thread, and no
            # hot record: the thread's seqs stand wherever the inner store says.
            cold = await self._cold_cursor(thread_id, claims)
            cold.stream_seq = last.seq
            return cold
        if old is not None and record.deleted_seq > old.seq:
            claims = set()
        behind = hot is None or record.seq > hot.seq
        return Cursor(record.seq, last.seq, record, revision, state, claims, hot_behind=behind)

    async def _check_flushed(self, thread_id: str, seq: int) -> None:
        """Refuse (`WalEntriesExpiredError`) when the entries up to `seq` are gone from
        the stream and the store behind the buffer does not hold them.

        Without `max_age_s` only the flushers' trimming removes entries, and only flushed
        ones: when the store cannot be asked, they were flushed.
        """
        if self._watermark is None:
            return
        try:
            flushed = await self._flushed_seq(thread_id)
        except BackendUnavailableError:
            if self.config.max_age_s is None:
                return
            raise
        if flushed < seq:
            raise self._expired(thread_id, flushed, seq)

    async def _flushed_seq(self, thread_id: str) -> int:
        """The store's watermark of the thread, within one request timeout."""
        assert self._watermark is not None
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                return await self._watermark(thread_id)
        except TimeoutError as exc:
            raise DatabaseUnavailableError(
                f"thread {thread_id!r}: the flushed seq could not be read in time"
            ) from exc

    def _expired(self, thread_id: str, flushed: int, latest: int) -> WalEntriesExpiredError:
        return WalEntriesExpiredError(
            f"thread {thread_id!r}: its entries after seq {flushed} up to {latest} were "
            "acknowledged but are no longer in the WAL and were never flushed (expired at "
            "max_age_s, or removed); nothing was written. See docs/operations.md, "
            "runbook: entries expiring before they are flushed.",
            thread_id=thread_id,
            flushed_seq=flushed,
            latest_seq=latest,
        )

    async def check_retained(self, thread_id: str, cursor: Cursor[H, S]) -> None:
        """With `max_age_s` set, make sure the thread's unflushed entries are all still in
        the stream before appending after them (`WalEntriesExpiredError` if not).

        Free until the oldest of them may expire (`Cursor.expires_at`); then one read of
        the watermark and of the subject's first entry.
        """
        max_age_s = self.config.max_age_s
        if max_age_s is None or self._watermark is None:
            return
        now = self._clock().timestamp()
        margin_s = self.config.checkpoint_timeout_s + 1.0
        if now + margin_s < cursor.expires_at:
            return
        flushed = await self._flushed_seq(thread_id)
        if flushed >= cursor.seq:
            cursor.expires_at = now + max_age_s  # later entries are younger
            return
        first: E | None = None
        async for _, entry in self.log.walk(thread_id, 1):
            if entry is not None:
                first = entry
                break
        # Entries leave a subject oldest first: the chain above the watermark is whole
        # when the oldest entry left is at or below it, or the next one of the chain.
        if first is None or not (first.seq <= flushed or follows(first, flushed)):
            raise self._expired(thread_id, flushed, cursor.seq)
        cursor.expires_at = first.at.timestamp() + max_age_s

    async def _cold_cursor(self, thread_id: str, claims: set[str]) -> Cursor[H, S]:
        """The cursor of a thread the WAL has never seen (no entry, no hot record).

        The inner store may hold it (data written before the buffered store was put in
        front of it): its seqs continue there, or the flush would judge our entries stale.
        When the inner store cannot tell (it is down), the first entry jumps.
        """
        empty = self.fmt.known_state(None, None)
        if self._seed is None:
            return Cursor(0, 0, None, None, empty, claims)
        stored = await self._seed(thread_id)
        if stored is None:
            return Cursor(jump_seq(self._clock()), 0, None, None, empty, claims, jump=True)
        if stored.seq == 0:
            return Cursor(0, 0, None, None, empty, claims)
        return Cursor(stored.seq, 0, stored.hot, None, stored.state, claims)

    async def append(
        self,
        thread_id: str,
        build: Callable[[Cursor[H, S]], tuple[E, bytes]],
        attempt: AppendAttempt,
    ) -> tuple[E, int, Cursor[H, S]]:
        """Publish the entry `build` makes from the current cursor, retrying on conflicts.

        Returns the published entry, its stream seq and the cursor it was built on;
        `attempt` records whether a publish went out.
        """
        cursor = self.cursors.get(thread_id) or await self.cursor(thread_id)
        for _ in range(MAX_CONFLICTS):
            if self.config.max_age_s is not None:
                await self.check_retained(thread_id, cursor)
            entry, payload = build(cursor)
            if len(payload) > self.max_entry_bytes:
                raise self.too_large(entry, len(payload))
            try:
                stream_seq = await self._publish(thread_id, entry, payload, cursor, attempt)
            except ConflictError:
                self.conflicts += 1
                cursor = await self.load_cursor(thread_id, cursor)
                self.cursors.put(thread_id, cursor)
                continue
            self.wal_bytes += len(payload)
            placed = self.fmt.placed(entry, stream_seq) if self.log.cache is not None else None
            if placed is not None and self.log.cache is not None:
                self.log.cache.put(thread_id, placed, len(payload))
            return entry, stream_seq, cursor
        raise ConflictError(f"thread {thread_id!r}: too many concurrent writers, gave up")

    async def write(
        self,
        thread_id: str,
        build: Callable[[Cursor[H, S]], tuple[E, bytes]],
        state: S | None,
        *,
        deadline: float,
        state_of: Callable[[E], S | None] | None = None,
    ) -> tuple[E, int]:
        """Publish the entry `build` makes, then advance the hot record; returns the entry
        and its stream seq. Both round trips share one timeout, up to `deadline` (a loop
        time); `state` is the front-end's state after the entry, when the caller knows it
        (`state_of`, when given, tells it from the entry published: for a state that
        `build` decides).

        When the outcome cannot be known, raises `CommitUnknownError`: the entry is in the
        WAL but its hot record could not be updated (it will be flushed, its seq is
        taken), or the publish went out and no answer came. `WalUnavailableError` or the
        refusal itself when nothing can be in the WAL.
        """
        attempt = AppendAttempt()
        written: E | None = None
        try:
            # One timeout scope for both round trips, on the timer all writes share.
            with self._deadlines.at(deadline):
                entry, stream_seq, base = await self.append(thread_id, build, attempt)
                written = entry
                after = state_of(entry) if state_of is not None else state
                cursor = self.record_written(thread_id, entry, stream_seq, base, after)
                assert cursor.hot is not None
                if self.background_hot:
                    self.hot_updates.submit(thread_id, cursor)
                else:
                    cursor.revision = await self.advance_hot(thread_id, cursor.hot, base.revision)
                    cursor.hot_behind = False
        except (StoreError, TimeoutError) as exc:
            if written is not None:
                self.cursors.drop(thread_id)
                self.commit_unknown += 1
                raise CommitUnknownError(
                    f"entry {written.seq} of thread {thread_id!r} is in the WAL but its "
                    f"hot record could not be updated ({exc}); it will be flushed",
                    thread_id=thread_id,
                    thread_seq=written.seq,
                ) from exc
            if not attempt.sent and not isinstance(exc, TimeoutError):
                raise  # refused before or by the publish: nothing is in the WAL
            self.cursors.drop(thread_id)
            if attempt.sent:
                self.commit_unknown += 1
                raise CommitUnknownError(
                    f"write to thread {thread_id!r}: the WAL did not confirm it ({exc!r}); "
                    "it may or may not have been stored",
                    thread_id=thread_id,
                ) from exc
            raise WalUnavailableError(f"write to thread {thread_id!r} timed out") from exc
        return entry, stream_seq

    async def _publish(
        self,
        thread_id: str,
        entry: E,
        payload: bytes,
        cursor: Cursor[H, S],
        attempt: AppendAttempt,
    ) -> int:
        subject = self.subject(thread_id)
        failures = 0
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
            except (PayloadTooLargeError, WalFullError):
                # Refused by the client (too large: it never left) or by the server (full:
                # nothing stored); an earlier attempt of this entry may still have landed.
                attempt.sent = resent
                raise
            except ConflictError:
                # Servers check the expected sequence before deduplicating, so a retry of a
                # publish that did land comes back as a conflict. Had it landed, it is the
                # first message after the one it expected (other writers may have appended
                # on top since): look there whether it is ours.
                if resent:
                    landed = await self._message_after(subject, cursor.stream_seq)
                    if landed is not None and self._is_ours(landed, entry):
                        return landed.seq
                # Another message follows the one we expected: ours is not in the stream
                # and can no longer land (its expectation is stale for good).
                attempt.sent = False
                raise
            except WalUnavailableError:
                failures += 1  # the checkpoint's timeout bounds these retries
                await asyncio.sleep(backoff_s(failures, initial_s=0.05, max_s=1.0))
                continue
            if duplicate:
                stored = await self.wal.get(stream_seq)
                if stored is None or not self._is_ours(stored, entry):
                    attempt.sent = False  # deduplicated against another writer's entry
                    raise ConflictError(f"seq {entry.seq} of {thread_id!r} is taken")
            return stream_seq

    async def _message_after(self, subject: str, stream_seq: int) -> StoredMsg | None:
        """The first message on `subject` after `stream_seq`, retried while the WAL is
        unreachable (the checkpoint's timeout bounds it): the answer decides between
        "stored" and "not stored", which a caller must not be told wrongly."""
        failures = 0
        while True:
            try:
                return await self.wal.next_on(subject, stream_seq + 1)
            except WalUnavailableError:
                failures += 1
                await asyncio.sleep(backoff_s(failures, initial_s=0.05, max_s=1.0))

    async def advance_hot(self, thread_id: str, record: H, revision: int | None) -> int:
        """CAS the hot record forward; never moves it back. Returns the new revision."""
        key = hot_key(thread_id)
        failures = 0
        while True:
            try:
                data = self.fmt.encode_hot(record, limit=self.max_entry_bytes)
                return await self.wal.kv_swap(key, data, revision=revision)
            except ConflictError:
                current = await self.wal.kv_get(key)
                if current is not None:
                    stored = self.fmt.decode_hot(current.value)
                    if stored.seq >= record.seq:
                        return current.revision
                    record = self._merge_recent(record, stored)
                revision = current.revision if current else None
            except WalUnavailableError:
                failures += 1
                await asyncio.sleep(backoff_s(failures, initial_s=0.02, max_s=1.0))

    def record_written(
        self,
        thread_id: str,
        entry: E,
        stream_seq: int,
        base: Cursor[H, S],
        state: S | None,
    ) -> Cursor[H, S]:
        """The cursor after `entry` was published at `stream_seq` on top of `base`.

        `state` is the front-end's state at `entry` when the caller knows it; None
        derives it from `base` (whose state the new cursor takes over).
        """
        weight = None
        if state is None:
            state = self.fmt.state_after(base.state, entry, owned=True)
            if state is not None and state is base.state and base.state_bytes is not None:
                weight = base.state_bytes + self.fmt.added_bytes(entry)  # extended in place
        cursor = Cursor(
            seq=entry.seq,
            stream_seq=stream_seq,
            hot=self.fmt.advance_hot(base.hot, entry, stream_seq, window=self.config.recent_window),
            revision=base.revision,
            state=state,
            # A deleted thread holds no claim: its ids may pass to other threads.
            claims=set() if entry.deletes else base.claims,
            # Until `advance_hot` lands, readers of the KV do not see the entry yet.
            hot_behind=True,
            state_bytes=weight,
            expires_at=base.expires_at,
        )
        self.cursors.put(thread_id, cursor)
        return cursor

    def _is_ours(self, msg: StoredMsg, entry: E) -> bool:
        stored = self.log.decode(entry.thread_id, msg)
        return stored is not None and stored.seq == entry.seq and stored.writer == entry.writer

    def _merge_recent(self, record: H, stored: H) -> H:
        recent = merged_recent(record.recent, stored.recent, self.config.recent_window)
        return self.fmt.with_recent(record, recent)
