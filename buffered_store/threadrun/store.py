"""`BufferedThreadRunStore`: a `ThreadRunStore` decorator that writes to a NATS JetStream
WAL and reads through an overlay of the unflushed WAL tail on the inner store.

Data flow of one checkpoint: validate → build a delta entry against this instance's
cursor → publish with a per-thread CAS (`writer.Writer`) → CAS the hot record in KV →
receipt. A flusher (or `force_flush`) later applies the entries to the inner store
through `FlushTarget.apply`, which checks the watermark inside the inner store.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from types import TracebackType
from typing import Any

from buffered_store.backoff import Backoff
from buffered_store.config import BufferedStoreConfig, ReadConsistency
from buffered_store.engine.appender import Cursor, Seeded, ThreadLocks, Writer
from buffered_store.engine.flushing import FlushStatus
from buffered_store.engine.frontend import THREADRUN
from buffered_store.engine.ids import check_id, utcnow
from buffered_store.engine.pending import PendingIndex, PendingThread
from buffered_store.engine.ports import Wal
from buffered_store.engine.threadlog import (
    FlushProgress,
    ThreadLog,
    flush_thread,
    force_flush,
    force_flush_all,
)
from buffered_store.errors import (
    BackendUnavailableError,
    CommitUnknownError,
    ConflictError,
    DatabaseUnavailableError,
    PayloadTooLargeError,
    StoreClosedError,
    StoreError,
    ValidationError,
    WalFullError,
    WalUnavailableError,
)
from buffered_store.metrics_core import CHECKPOINT_BUCKETS_S, Histogram, HistogramSnapshot
from buffered_store.nats import NatsWal
from buffered_store.opening import Opening
from buffered_store.threadrun.checkpointing import (
    build_checkpoint_entry,
    build_delete_entry,
    check_page,
    run_owned_elsewhere,
    validate_checkpoint,
)
from buffered_store.threadrun.claims import decode_run_claim, encode_run_claim, run_key
from buffered_store.threadrun.entry import (
    FORMAT,
    EntryKind,
    HotRecord,
    WalEntry,
    encode_entry,
    messages_of,
    seeded_hot,
)
from buffered_store.threadrun.messages import MessageSnapshot
from buffered_store.threadrun.planning import ThreadView, fold
from buffered_store.threadrun.protocol import ThreadRunStore
from buffered_store.threadrun.records import (
    CheckpointReceipt,
    Message,
    RunRecord,
    RunStatus,
    Thread,
)
from buffered_store.threadrun.target import (
    FlushTarget,
    StoredThread,
    run_sort_key,
    thread_sort_key,
)

log = logging.getLogger("buffered_store.threadrun.store")

Versions = dict[str, tuple[RunRecord, int]]

FAILURE_KINDS = ("invalid", "unavailable", "wal_full", "commit_unknown", "cancelled", "error")
"""Causes of failed checkpoints, as counted in `stats()` (``checkpoints_<kind>``)."""


RunCursor = Cursor[HotRecord, list[bytes]]
"""A writer's cursor of a thread: hot record and message snapshot."""


class BufferedThreadRunStore:
    """Buffers checkpoints in a NATS JetStream WAL in front of an inner `ThreadRunStore`."""

    def __init__(
        self,
        inner: ThreadRunStore,
        target: FlushTarget,
        wal: Wal,
        config: BufferedStoreConfig,
        *,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.inner = inner
        self.target = target
        self.wal = wal
        self.config = config
        self._clock = clock
        self._writer: Writer[WalEntry, HotRecord, list[bytes]] = Writer(
            wal, config, FORMAT, seed=self._seed_from_inner, watermark=self._watermark, clock=clock
        )
        self._log = self._writer.log
        self._pending = PendingIndex(wal, target.flushed_seqs, FORMAT)
        self._locks = ThreadLocks()
        self._closed = False
        self._stats: dict[str, float] = {
            "checkpoints_ok": 0,
            "checkpoints_failed": 0,
            # checkpoints_failed by cause (see `_failure_kind`); they add up to it.
            **{f"checkpoints_{kind}": 0 for kind in FAILURE_KINDS},
            "deletes": 0,
            "checkpoint_seconds_total": 0.0,
        }
        self._checkpoint_seconds = Histogram(CHECKPOINT_BUCKETS_S)

    @classmethod
    def connect(
        cls,
        inner: ThreadRunStore,
        config: BufferedStoreConfig | None = None,
        *,
        clock: Callable[[], datetime] = utcnow,
    ) -> Opening[BufferedThreadRunStore]:
        """Open the WAL (creating the stream, bucket and consumer if needed) around `inner`.

        ``await BufferedThreadRunStore.connect(...)`` or
        ``async with BufferedThreadRunStore.connect(...) as store``.
        """
        return Opening(cls._open(inner, config or BufferedStoreConfig.from_env(), clock))

    @classmethod
    async def _open(
        cls,
        inner: ThreadRunStore,
        config: BufferedStoreConfig,
        clock: Callable[[], datetime],
    ) -> BufferedThreadRunStore:
        wal = await NatsWal.connect(config, name="bufstore-store", front_end=THREADRUN)
        return cls.over(inner, wal, config, clock=clock)

    @classmethod
    def over(
        cls,
        inner: ThreadRunStore,
        wal: Wal,
        config: BufferedStoreConfig,
        *,
        clock: Callable[[], datetime] = utcnow,
    ) -> BufferedThreadRunStore:
        """The store around `inner` on an open WAL (any implementation of the engine's
        ports: `connect` passes a `NatsWal`, tests a `testing.MemoryWal`). Closing the
        store closes `wal`.

        An inner store that is no `FlushTarget` is flushed through `GenericFlushTarget`,
        its watermarks in the KV flushed marks, shared with every flusher process.
        """
        if isinstance(inner, FlushTarget):
            target: FlushTarget = inner
        else:
            from buffered_store.threadrun.generic import GenericFlushTarget, KvWatermarks

            target = GenericFlushTarget(inner, KvWatermarks(ThreadLog(wal, config, FORMAT)))
        return cls(inner, target, wal, config, clock=clock)

    async def __aenter__(self) -> BufferedThreadRunStore:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # -- writes -------------------------------------------------------------------------

    async def checkpoint(
        self,
        thread_id: str,
        messages: Sequence[Message],
        run: RunRecord,
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> CheckpointReceipt:
        """Append the checkpoint to the WAL; returns once it is durable there."""
        return await self._measured(thread_id, messages, run, metadata, append=False)

    async def append(
        self,
        thread_id: str,
        messages: Sequence[Message],
        run: RunRecord,
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> CheckpointReceipt:
        """Append `messages` to the thread's snapshot in the WAL; returns once durable.

        The entry keeps the thread's current messages without reading, encoding or
        comparing them: the call costs the same whatever the history length.
        """
        return await self._measured(thread_id, messages, run, metadata, append=True)

    async def _measured(
        self,
        thread_id: str,
        messages: Sequence[Message],
        run: RunRecord,
        metadata: Mapping[str, Any] | None,
        *,
        append: bool,
    ) -> CheckpointReceipt:
        started = time.perf_counter()
        try:
            receipt = await self._checkpoint(thread_id, messages, run, metadata, append=append)
        except BaseException as exc:
            self._stats["checkpoints_failed"] += 1
            self._stats[f"checkpoints_{_failure_kind(exc)}"] += 1
            raise
        elapsed = time.perf_counter() - started
        self._stats["checkpoints_ok"] += 1
        self._stats["checkpoint_seconds_total"] += elapsed
        self._checkpoint_seconds.observe(elapsed)
        return receipt

    async def _checkpoint(
        self,
        thread_id: str,
        messages: Sequence[Message],
        run: RunRecord,
        metadata: Mapping[str, Any] | None,
        *,
        append: bool,
    ) -> CheckpointReceipt:
        self._check_open()
        cached = self._writer.cursors.get(thread_id) if isinstance(thread_id, str) else None
        call = validate_checkpoint(
            thread_id,
            messages,
            run,
            metadata,
            previous=cached.state if cached else None,
            append=append,
            check=self.config.check_snapshots,
        )
        # The snapshot after the entry follows from the cursor it lands on (its state
        # extended in place: see `ThreadRunFormat.state_after`), never copied here.
        snapshot = None
        nonce = self._writer.nonce()

        def build(cursor: RunCursor) -> tuple[WalEntry, bytes]:
            if run.run_id not in cursor.claims:
                raise _ClaimLost
            if append and cursor.jump:
                # The thread's stored messages are unknown (the inner store did not answer
                # for a thread the WAL has never seen): an append has nothing to extend.
                self._writer.cursors.drop(thread_id)  # the next call asks the store again
                raise DatabaseUnavailableError(
                    f"append to thread {thread_id!r}: its stored history could not be read "
                    "(the inner store is unavailable) and the WAL has none; nothing was "
                    "written. Retry, or checkpoint() the full snapshot"
                )
            entry = build_checkpoint_entry(
                call,
                previous=cursor.hot.thread if cursor.hot else None,
                previous_messages=cursor.state,
                seq=cursor.seq + 1,
                now=self._clock(),
                writer=nonce,
                jump=cursor.jump,
            )
            return entry, self._encode(entry, cursor)

        async def claimed_write(deadline: float) -> tuple[WalEntry, int]:
            # The run's claim must hold on the cursor the entry is built on: a cursor
            # reloaded after a conflict that saw the thread deleted has dropped it.
            for _ in range(MAX_RECLAIMS):
                await self._claim_run(thread_id, run.run_id, deadline)
                try:
                    return await self._write(thread_id, build, snapshot, deadline)
                except _ClaimLost:
                    continue
            raise ConflictError(f"thread {thread_id!r} keeps being deleted under this write")

        async def write() -> CheckpointReceipt:
            loop = asyncio.get_running_loop()
            try:
                entry, stream_seq = await claimed_write(
                    loop.time() + self.config.checkpoint_timeout_s
                )
            except PayloadTooLargeError:
                # A cold cursor sends the whole snapshot; for a thread larger than a WAL
                # message, learn its snapshot once and send the delta instead. (An append
                # sends only its new messages: knowing the snapshot would not help.)
                if append or not await self._prime_snapshot(thread_id):
                    raise
                entry, stream_seq = await claimed_write(
                    loop.time() + self.config.checkpoint_timeout_s
                )
            return CheckpointReceipt(
                thread_id=thread_id, thread_seq=entry.seq, stream_seq=stream_seq
            )

        receipt: CheckpointReceipt = await self._locks.run(thread_id, write)
        return receipt

    async def delete_thread(self, thread_id: str) -> None:
        """Append a delete entry: the thread disappears from every read at once.

        Decided on the thread's latest state, read from NATS (never from this instance's
        cache, which misses what other instances wrote), and written through the same
        per-thread compare-and-set as checkpoints: a delete racing another writer is
        ordered before or after it, never lost.
        """
        self._check_open()
        check_id(thread_id, "thread_id")
        nonce = self._writer.nonce()

        def build(cursor: RunCursor) -> tuple[WalEntry, bytes]:
            entry = build_delete_entry(
                thread_id, seq=cursor.seq + 1, now=self._clock(), writer=nonce, jump=cursor.jump
            )
            return entry, self._encode(entry, cursor)

        async def write() -> None:
            cursor = await self._writer.load_cursor(thread_id, self._writer.cursors.get(thread_id))
            self._writer.cursors.put(thread_id, cursor)
            known_absent = cursor.hot is None or cursor.hot.thread is None
            if known_absent and not cursor.jump:
                # Never written, or deleted already: nothing to write. A delete whose
                # hot-record update was lost is not visible yet: publish its hot record,
                # or this call would return while reads still show the thread.
                if cursor.hot is not None and cursor.hot_behind:
                    await self._show_hot(thread_id, cursor)
                return
            await self._write(thread_id, build, [])
            self._stats["deletes"] += 1

        await self._locks.run(thread_id, write)

    async def _show_hot(self, thread_id: str, cursor: RunCursor) -> None:
        """Advance the KV hot record to the cursor's, found on the subject past it."""
        assert cursor.hot is not None
        try:
            async with asyncio.timeout(self.config.checkpoint_timeout_s):
                cursor.revision = await self._writer.advance_hot(
                    thread_id, cursor.hot, cursor.revision
                )
        except TimeoutError as exc:
            self._writer.cursors.drop(thread_id)
            raise WalUnavailableError(
                f"thread {thread_id!r}: its delete is in the WAL but its hot record could not "
                "be updated; reads show it after the next flush, or retry"
            ) from exc
        cursor.hot_behind = False

    async def _claim_run(self, thread_id: str, run_id: str, deadline: float) -> None:
        """Claim `run_id` for the thread in the KV run claims before anything is written.

        Runs are keyed by id alone: a run id checkpointed on a second thread would move
        the run. The claim is a create-if-absent, made once per run and instance (one
        round trip on a run's first checkpoint, none after). An existing claim by another
        thread is honoured while that thread holds the run, and for `run_claim_grace_s`
        after it was made even when it does not (yet): the checkpoint that claimed it may
        still be on its way. After that the claim is stale (the thread was deleted, or
        its checkpoint never landed) and is taken over. Retried while NATS is
        unreachable, until `deadline` (the checkpoint's).
        """
        cursor = await self._writer.cursor(thread_id)
        if run_id in cursor.claims:
            return
        retry = Backoff(0.05, 1.0)
        try:
            async with asyncio.timeout_at(deadline):
                while True:
                    try:
                        if await self._try_claim(thread_id, run_id, cursor.seq):
                            break
                    except WalUnavailableError:
                        await asyncio.sleep(retry.next_delay())
        except TimeoutError as exc:
            raise WalUnavailableError(
                f"checkpoint of thread {thread_id!r}: could not claim run {run_id!r} in time"
            ) from exc
        cursor.claims.add(run_id)

    async def _try_claim(self, thread_id: str, run_id: str, seq: int) -> bool:
        """One claiming attempt: True when the thread holds the claim, False to retry.

        `seq` is the thread's seq as the claimer knows it: a delete of the owner with a
        higher seq happened after the claim (or after a stale cursor, whose checkpoint
        then fails its compare-and-set, sees the delete and claims again).
        """
        key = run_key(run_id)
        now_us = round(self._clock().timestamp() * 1e6)
        mine = encode_run_claim(thread_id, now_us, seq)
        try:
            await self.wal.kv_swap(key, mine, revision=None)
            return True
        except ConflictError:
            pass
        current = await self.wal.kv_get(key)
        if current is None:
            return False  # deleted meanwhile: create it again
        owner, claimed_at_us, claimed_seq = decode_run_claim(current.value)
        if owner != thread_id:
            run, owner_hot = await asyncio.gather(
                self._load_run_overlay(run_id), self._log.hot(owner)
            )
            if run is not None and run.thread_id != thread_id:
                raise run_owned_elsewhere(run_id, run.thread_id, thread_id)
            # Deleted after the claim, even if re-created since: its delete seq is above
            # the seq the claim was made at (claims without a seq: the thread is deleted
            # now and its hot record is newer than the claim, both in the hot bucket's
            # stream). A checkpoint built before the delete fails its CAS and, once it
            # has seen the delete, claims again (see `_ClaimLost`).
            deleted_since = owner_hot is not None and (
                (claimed_seq is not None and owner_hot.record.deleted_seq > claimed_seq)
                or (owner_hot.record.thread is None and owner_hot.revision > current.revision)
            )
            lapsed = now_us - claimed_at_us >= self.config.run_claim_grace_s * 1e6
            if run is None and not (deleted_since or lapsed):
                raise run_owned_elsewhere(run_id, owner, thread_id)
        # Our own claim is written again too, so that it is newer than any delete of the
        # thread this instance has seen.
        try:
            await self.wal.kv_swap(key, mine, revision=current.revision)
        except ConflictError:
            return False  # claimed by someone else meanwhile: judge the new claim
        return True

    def _encode(self, entry: WalEntry, cursor: RunCursor) -> bytes:
        payload = encode_entry(entry)
        if len(payload) > self._writer.max_entry_bytes:
            raise PayloadTooLargeError(
                f"checkpoint of thread {entry.thread_id!r} needs a {len(payload)}-byte WAL "
                f"entry; the server accepts {self._writer.max_entry_bytes} "
                f"({entry.keep} messages kept, {len(entry.messages)} sent)"
            )
        return payload

    async def _write(
        self,
        thread_id: str,
        build: Callable[[RunCursor], tuple[WalEntry, bytes]],
        snapshot: list[bytes] | None,
        deadline: float | None = None,
    ) -> tuple[WalEntry, int]:
        """`Writer.write` within the checkpoint's `checkpoint_timeout_s` (or what is left
        of it at `deadline`, a loop time)."""
        if deadline is None:
            deadline = asyncio.get_running_loop().time() + self.config.checkpoint_timeout_s
        return await self._writer.write(thread_id, build, snapshot, deadline=deadline)

    async def _watermark(self, thread_id: str) -> int:
        """The thread's flushed seq in the inner store."""
        return (await self.target.flushed_seqs([thread_id]))[thread_id]

    async def _seed_from_inner(self, thread_id: str) -> Seeded[HotRecord, list[bytes]] | None:
        """The inner store's state of a thread the WAL has never seen, if it answers soon.

        When it does not (Postgres down), the checkpoint goes ahead as a new thread:
        accepting writes during an outage matters more; a thread that existed only in the
        inner store and is first written through the buffer during an outage restarts
        its seqs (see docs/concepts/failure-modes.md).
        """
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                stored = await self.target.read_thread(thread_id, with_messages=True)
        except (StoreError, TimeoutError) as exc:
            log.warning(
                "could not read a new thread's stored state; treating it as new (%s)",
                type(exc).__name__,
                extra={"action": "cold_thread_unverified"},
            )
            return None
        if stored.flushed_seq == 0:
            return Seeded(0, None, [])
        hot = seeded_hot(stored.flushed_seq, stored.thread)
        return Seeded(stored.flushed_seq, hot, list(stored.messages or []))

    async def _run_thread(self, run_id: str) -> str | None:
        """The thread that claimed a run id, from the KV run claims."""
        value = await self.wal.kv_get(run_key(run_id))
        return decode_run_claim(value.value)[0] if value else None

    async def _prime_snapshot(self, thread_id: str) -> bool:
        cursor = await self._writer.cursor(thread_id)
        if cursor.state is not None:
            return False
        view = await self._view(thread_id)
        if view.seq != cursor.seq:
            self._writer.cursors.drop(thread_id)
            return True
        cursor.state = MessageSnapshot(view.messages)
        return True

    # -- reads --------------------------------------------------------------------------

    async def load_thread(self, thread_id: str) -> Thread | None:
        """The thread summary as of the latest acknowledged checkpoint."""
        self._check_open()
        check_id(thread_id, "thread_id")
        if await self._inner_only(thread_id):
            return await self.inner.load_thread(thread_id)
        hot, (_, last) = await asyncio.gather(
            self._log.hot(thread_id), self._log.last_entry(thread_id)
        )
        if hot is None:
            return await self.inner.load_thread(thread_id)
        if last is None or last.seq <= hot.record.seq:
            return hot.record.thread
        # The stream is ahead of the hot record: an entry whose hot-record update was lost
        # (commit unknown). Reads go by the hot record until that entry is flushed, then
        # by the inner store, as the other reads do (they compare with its watermark).
        flushed = (await self.target.flushed_seqs([thread_id]))[thread_id]
        if flushed > hot.record.seq:
            return (await self._view(thread_id)).thread
        return hot.record.thread

    async def load_messages(self, thread_id: str) -> list[Message] | None:
        """The latest message snapshot, unflushed checkpoints included."""
        self._check_open()
        check_id(thread_id, "thread_id")
        if await self._inner_only(thread_id):
            return await self.inner.load_messages(thread_id)
        view = await self._view(thread_id)
        return None if view.thread is None else messages_of(view.messages)

    async def load_run(self, run_id: str) -> RunRecord | None:
        """A run by id, unflushed versions included."""
        self._check_open()
        check_id(run_id, "run_id")
        if self.config.read_consistency is not ReadConsistency.READ_YOUR_WRITES:
            thread_id = await self._run_thread(run_id)
            if thread_id is not None:
                await self._inner_only(thread_id)
            return await self.inner.load_run(run_id)
        return await self._load_run_overlay(run_id)

    async def _load_run_overlay(self, run_id: str) -> RunRecord | None:
        """The newest version of a run: stored, or in its thread's unflushed entries."""
        indexed, stored = await asyncio.gather(
            self._run_thread(run_id), self.target.read_run(run_id)
        )
        thread_id = indexed or (stored.run.thread_id if stored else None)
        if thread_id is None:
            return None
        versions, deleted_at, flushed = await self._pending_runs_at(thread_id)
        if run_id not in versions and (stored is None or stored.thread_seq < flushed):
            # The stored row was read concurrently with the watermark: a flush committing
            # in between moved the run's newest version out of the pending entries after
            # that read. Read it again, now that the watermark is known (rare: only runs
            # last written below the watermark get here, and they read one more row).
            stored = await self.target.read_run(run_id)
        found = versions.get(run_id)
        if stored is None:
            return found[0] if found else None
        if stored.run.thread_id == thread_id:
            # Seqs of one thread: the newer version wins; a pending delete hides the row.
            if stored.thread_seq > deleted_at and (found is None or found[1] < stored.thread_seq):
                return stored.run
            return found[0] if found else None
        # The stored row is another thread's, and the claim has moved on (that thread was
        # deleted, the run taken over): a pending version of the claimant wins whatever
        # the seqs, which count different threads. Without one, the row stands unless its
        # own thread has a pending delete above it.
        if found is not None:
            return found[0]
        _, owner_deleted_at = await self._pending_runs(stored.run.thread_id)
        return stored.run if stored.thread_seq > owner_deleted_at else None

    async def latest_run(self, thread_id: str) -> RunRecord | None:
        """The run of the thread's latest checkpoint."""
        thread = await self.load_thread(thread_id)
        if thread is None or thread.latest_run_id is None:
            return None
        return await self.load_run(thread.latest_run_id)

    async def list_runs(
        self,
        thread_id: str | None = None,
        *,
        status: RunStatus | None = None,
        limit: int = 50,
        offset: int = 0,
    ) -> list[RunRecord]:
        """Runs, newest first; unflushed versions replace stored ones."""
        self._check_open()
        check_page(limit, offset)
        if thread_id is not None:
            check_id(thread_id, "thread_id")
        mode = self.config.read_consistency
        if mode is ReadConsistency.STRONG:
            await (self.force_flush(thread_id) if thread_id else self.force_flush_all())
        if mode is not ReadConsistency.READ_YOUR_WRITES:
            return await self.inner.list_runs(thread_id, status=status, limit=limit, offset=offset)
        if thread_id is not None:
            pending = {thread_id: await self._pending_runs(thread_id)}
        else:
            pending = await self._all_pending_runs()
        extra = sum(len(v) for v, _ in pending.values())
        want = offset + limit
        fetch = want + extra
        while True:
            stored = await self.target.read_runs(thread_id, status=status, limit=fetch, offset=0)
            merged: dict[str, tuple[RunRecord, int]] = {}
            for item in stored:
                versions, deleted_at = pending.get(item.run.thread_id, ({}, 0))
                if item.thread_seq > deleted_at:
                    merged[item.run.run_id] = (item.run, item.thread_seq)
            for versions, _ in pending.values():
                for run_id, (run, seq) in versions.items():
                    current = merged.get(run_id)
                    if current is None or current[1] < seq:
                        merged[run_id] = (run, seq)
            runs = [r for r, _ in merged.values() if status is None or r.status == status]
            if len(stored) < fetch or len(runs) >= want + extra:
                break
            fetch *= 2  # pending deletes hid stored rows: read further
        runs.sort(key=run_sort_key, reverse=True)
        return runs[offset : offset + limit]

    async def list_threads(self, *, limit: int = 50, offset: int = 0) -> list[Thread]:
        """Threads, newest `updated_at` first; unflushed checkpoints included."""
        self._check_open()
        check_page(limit, offset)
        mode = self.config.read_consistency
        if mode is ReadConsistency.STRONG:
            await self.force_flush_all()
        if mode is not ReadConsistency.READ_YOUR_WRITES:
            return await self.inner.list_threads(limit=limit, offset=offset)
        overlay = {p.thread_id: p.record.thread for p in await self._pending.scan()}
        stored = await self.target.read_threads(limit=offset + limit + len(overlay), offset=0)
        threads = [s.thread for s in stored if s.thread and s.thread_id not in overlay]
        threads.extend(t for t in overlay.values() if t is not None)
        threads.sort(key=thread_sort_key, reverse=True)
        return threads[offset : offset + limit]

    async def _inner_only(self, thread_id: str) -> bool:
        """True when the read must go to the inner store (STRONG flushes first)."""
        mode = self.config.read_consistency
        if mode is ReadConsistency.STRONG:
            await self.force_flush(thread_id)
        return mode is not ReadConsistency.READ_YOUR_WRITES

    async def _view(self, thread_id: str) -> ThreadView:
        """The thread with its messages as of the latest acknowledged checkpoint."""
        cursor = self._writer.cursors.get(thread_id)
        if cursor is not None and cursor.state is not None and not cursor.hot_behind:
            # This instance's snapshot is the latest when the subject's last entry is the
            # one it wrote last and the hot record shows it (one direct get, no database;
            # an entry whose hot-record update was lost is not shown until flushed).
            _, last = await self._log.last_entry(thread_id)
            if last is not None and last.seq == cursor.seq:
                return ThreadView(
                    seq=cursor.seq, thread=last.thread, messages=cursor.state, runs={}
                )
        hot, stored = await asyncio.gather(
            self._log.hot(thread_id), self.target.read_thread(thread_id, with_messages=True)
        )
        base = _base_view(stored)
        if hot is None or hot.record.seq <= stored.flushed_seq:
            return base
        entries = await self._log.entries_between(
            thread_id, stored.flushed_seq, hot.record.seq, hot.record
        )
        return fold(base, entries)

    async def _pending_runs(self, thread_id: str) -> tuple[Versions, int]:
        """Run versions of the thread's unflushed entries, and the seq of a pending delete."""
        versions, deleted_at, _ = await self._pending_runs_at(thread_id)
        return versions, deleted_at

    async def _pending_runs_at(self, thread_id: str) -> tuple[Versions, int, int]:
        """`_pending_runs`, and the flushed seq they are above."""
        hot, flushed = await asyncio.gather(
            self._log.hot(thread_id), self.target.flushed_seqs([thread_id])
        )
        watermark = flushed[thread_id]
        if hot is None:
            return {}, 0, watermark
        versions, deleted_at = await self._runs_above(
            PendingThread(thread_id, hot.record, watermark)
        )
        return versions, deleted_at, watermark

    async def _all_pending_runs(self) -> dict[str, tuple[Versions, int]]:
        pending = await self._pending.scan()
        found = await asyncio.gather(*(self._runs_above(p) for p in pending))
        return {p.thread_id: runs for p, runs in zip(pending, found, strict=True)}

    async def _runs_above(self, pending: PendingThread[HotRecord]) -> tuple[Versions, int]:
        """Run versions written above the flushed seq: from the hot record when it covers
        them (no entry read), else from the entries themselves."""
        record, flushed = pending.record, pending.flushed_seq
        if record.seq <= flushed:
            return {}, 0
        if record.covers_runs_after(flushed):
            versions = {run.run_id: (run, seq) for run, seq in record.runs if seq > flushed}
            return versions, (record.deleted_seq if record.deleted_seq > flushed else 0)
        entries = await self._log.entries_between(pending.thread_id, flushed, record.seq, record)
        return _runs_of(entries)

    # -- flushing -------------------------------------------------------------------------

    async def force_flush(self, thread_id: str, *, timeout: float = 10.0) -> int:  # noqa: ASYNC109
        """Apply every acknowledged checkpoint of the thread to the inner store now.

        Works with or without a flusher running; returns the flushed seq.
        """
        self._check_open()
        check_id(thread_id, "thread_id")
        return await force_flush(self._log, self.target, thread_id, timeout_s=timeout)

    async def force_flush_all(
        self,
        *,
        timeout: float = 60.0,  # noqa: ASYNC109
        progress: FlushProgress | None = None,
    ) -> int:
        """Flush every thread with unflushed entries; returns how many were flushed.

        `progress(flushed, total)` is called once the threads are known and after each
        one. On timeout, `FlushTimeoutError` counts the flushed threads (`flushed`) and
        lists the others (`not_flushed`).
        """
        self._check_open()
        return await force_flush_all(
            self._log,
            self.target,
            self._pending,
            timeout_s=timeout,
            parallel=16,
            progress=progress,
        )

    async def flush_status(self, thread_id: str) -> FlushStatus:
        """Latest acknowledged and flushed seqs of a thread."""
        self._check_open()
        check_id(thread_id, "thread_id")
        hot = await self._log.hot(thread_id)
        try:
            flushed = (await self.target.flushed_seqs([thread_id]))[thread_id]
        except StoreError:
            flushed = await self._acknowledged_seq(thread_id, hot.record.seq if hot else 0)
        latest = max(hot.record.seq if hot else 0, flushed)
        return FlushStatus(
            thread_id=thread_id,
            latest_seq=latest,
            flushed_seq=flushed,
            pending_from=hot.record.chain_from if hot else 0,
        )

    async def _acknowledged_seq(self, thread_id: str, latest: int) -> int:
        """While the inner store cannot answer: a lower bound of the thread's watermark.

        The flusher acknowledges an entry only after its commit, and every message below
        the durable consumer's ack floor is acknowledged: the thread's first entry above
        the floor is the first that may be unflushed (no entry above it: all of them are
        flushed). A KV flushed mark raises the bound where one is kept (the generic
        target of stores without a watermark of their own keeps them).
        """
        mark, consumer = await asyncio.gather(self._log.mark(thread_id), self.wal.consumer_state())
        bound = latest
        async for _, entry in self._log.walk(thread_id, consumer.ack_floor + 1):
            if entry is not None:
                # Below a jump entry the thread's seqs are unknown: nothing can be told.
                bound = 0 if entry.jump else entry.seq - 1
                break
        return max(bound, mark.seq if mark else 0)

    # -- lifecycle ------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Counters of this instance (no metrics dependency): checkpoints by result
        (``checkpoints_ok``; ``checkpoints_failed``, split into ``checkpoints_invalid``,
        ``_unavailable``, ``_commit_unknown``, ``_cancelled``, ``_error``), their total
        time, ``commit_unknown`` (deletes included), ``deletes``, ``cas_conflicts``,
        ``wal_bytes`` and ``nats_requests``; gauges of the writer's cursor cache:
        ``cursor_cache_threads`` and ``cursor_cache_bytes`` (what its snapshots weigh)."""
        return {
            **self._stats,
            "cursor_cache_threads": len(self._writer.cursors),
            "cursor_cache_bytes": self._writer.cursors.held_bytes,
            "commit_unknown": self._writer.commit_unknown,
            "cas_conflicts": self._writer.conflicts,
            "wal_bytes": self._writer.wal_bytes,
            "nats_requests": self.wal.requests,
        }

    def histograms(self) -> dict[str, HistogramSnapshot]:
        """Distributions of this instance: ``checkpoint_duration_seconds``, the latency of
        each successful `checkpoint()` call."""
        return {"checkpoint_duration_seconds": self._checkpoint_seconds.snapshot()}

    async def close(self) -> None:
        """Drain this instance's threads (best effort), then close the NATS connection.

        The inner store stays open: it belongs to the caller.
        """
        if self._closed:
            return
        self._closed = True
        if self.config.drain_on_close:
            await self._drain()
        await self.wal.close()

    async def _drain(self) -> None:
        threads = self._writer.cursors.threads()
        try:
            async with asyncio.timeout(self.config.drain_timeout_s):
                for thread_id in threads:
                    await flush_thread(self._log, self.target, thread_id)
        except (StoreError, TimeoutError) as exc:
            # Entries stay safe in the WAL; a flusher will apply them.
            log.warning(
                "close: could not drain every thread (%s)", exc, extra={"action": "drain_skipped"}
            )

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the buffered store is closed")


MAX_RECLAIMS = 5
"""Claims of a run one checkpoint makes before it gives up (each after a delete)."""


class _ClaimLost(Exception):
    """The cursor an entry was about to be built on has dropped the run's claim (it saw
    the thread deleted since the claim): claim again, then build."""


def _failure_kind(exc: BaseException) -> str:
    if isinstance(exc, ValidationError):
        return "invalid"  # the caller's input (too large included): nothing was written
    if isinstance(exc, CommitUnknownError):
        return "commit_unknown"
    if isinstance(exc, WalFullError):
        return "wal_full"  # nothing written; retriable once the flushers drained
    if isinstance(exc, BackendUnavailableError):
        return "unavailable"
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    return "error"


def _base_view(stored: StoredThread) -> ThreadView:
    return ThreadView(
        seq=stored.flushed_seq,
        thread=stored.thread,
        messages=list(stored.messages or []) if stored.thread else [],
        runs={},
    )


def _runs_of(entries: Sequence[WalEntry]) -> tuple[Versions, int]:
    """Latest run versions after the last delete among entries, and that delete's seq."""
    versions: Versions = {}
    deleted_at = 0
    for entry in entries:
        if entry.kind is EntryKind.DELETE:
            versions, deleted_at = {}, entry.seq
        elif entry.run is not None:
            current = versions.get(entry.run.run_id)
            if current is None or current[1] < entry.seq:
                versions[entry.run.run_id] = (entry.run, entry.seq)
    return versions, deleted_at
