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

from buffered_store.config import BufferedStoreConfig
from buffered_store.engine.buffer import WriteBuffer
from buffered_store.engine.cursors import Cursor, Seeded
from buffered_store.engine.flushing import FlushStatus
from buffered_store.engine.frontend import THREADRUN
from buffered_store.engine.ids import check_id, utcnow
from buffered_store.engine.ports import Wal
from buffered_store.engine.threadlog import (
    FlushProgress,
    ThreadLog,
)
from buffered_store.errors import (
    BackendUnavailableError,
    CommitUnknownError,
    ConflictError,
    DatabaseUnavailableError,
    PayloadTooLargeError,
    ValidationError,
    WalFullError,
    WalUnavailableError,
)
from buffered_store.metrics_core import CHECKPOINT_BUCKETS_S, Histogram, HistogramSnapshot
from buffered_store.model.changes import (
    WalEntry,
)
from buffered_store.model.checkpointing import (
    build_checkpoint_entry,
    build_delete_entry,
    validate_checkpoint,
)
from buffered_store.model.messages import MessageSnapshot, prove_prefix
from buffered_store.model.protocol import ThreadRunStore
from buffered_store.model.records import (
    CheckpointReceipt,
    Message,
    RunRecord,
    RunStatus,
    Thread,
)
from buffered_store.model.target import (
    FlushTarget,
)
from buffered_store.nats import NatsWal
from buffered_store.opening import Opening
from buffered_store.threadrun.claiming import RunClaims
from buffered_store.threadrun.entry import (
    FORMAT,
    HotRecord,
    encode_entry,
    seeded_hot,
)
from buffered_store.threadrun.overlay import Overlay

log = logging.getLogger("buffered_store.threadrun.store")

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
        self._buffer: WriteBuffer[WalEntry, HotRecord, list[bytes]] = WriteBuffer(
            wal,
            config,
            FORMAT,
            target,
            seed=self._seed_from_inner,
            too_large=_too_large,
            clock=clock,
            flush_parallel=16,
            background_hot=config.hot_linger_s is not None,
            hot_linger_s=config.hot_linger_s or 0.0,
        )
        # The engine's parts the write path uses, held directly (no layer per call).
        self._writer = self._buffer.writer
        self._log = self._buffer.log
        self._locks = self._buffer.locks
        self._reads = Overlay(inner, target, self._buffer, config)
        self._claims = RunClaims(self._buffer, self._reads, config, clock=clock)
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
        return await self._checkpoint(thread_id, messages, run, metadata, append=False)

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
        return await self._checkpoint(thread_id, messages, run, metadata, append=True)

    async def _checkpoint(
        self,
        thread_id: str,
        messages: Sequence[Message],
        run: RunRecord,
        metadata: Mapping[str, Any] | None,
        *,
        append: bool,
    ) -> CheckpointReceipt:
        """`checkpoint()` or `append()`, counted and timed. One coroutine from the call
        down to the writer's: every checkpoint passes here."""
        started = time.perf_counter()
        try:
            entry, stream_seq = await self._write(thread_id, messages, run, metadata, append)
        except BaseException as exc:
            self._stats["checkpoints_failed"] += 1
            self._stats[f"checkpoints_{_failure_kind(exc)}"] += 1
            raise
        elapsed = time.perf_counter() - started
        self._stats["checkpoints_ok"] += 1
        self._stats["checkpoint_seconds_total"] += elapsed
        self._checkpoint_seconds.observe(elapsed)
        return CheckpointReceipt(thread_id=thread_id, thread_seq=entry.seq, stream_seq=stream_seq)

    async def _write(
        self,
        thread_id: str,
        messages: Sequence[Message],
        run: RunRecord,
        metadata: Mapping[str, Any] | None,
        append: bool,
    ) -> tuple[WalEntry, int]:
        self._buffer.check_open()
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
            hot = cursor.hot
            cold = cursor.state is None and not (append or cursor.jump)
            if cold and hot is not None and hot.thread is not None and hot.digest:
                # A cursor that does not know the thread's snapshot (another instance
                # wrote it, or this one restarted): prove the stored snapshot a prefix
                # of this one by its digest, and send a delta rather than the history.
                proven = prove_prefix(call.snapshot, hot.thread.message_count, hot.digest)
                if proven is not None:
                    cursor.state, cursor.state_bytes = proven, None
            entry = build_checkpoint_entry(
                call,
                previous=hot.thread if hot else None,
                previous_messages=cursor.state,
                seq=cursor.seq + 1,
                now=self._clock(),
                writer=nonce,
                jump=cursor.jump,
                previous_digest=hot.digest if hot else b"",
                digest=True,
            )
            return entry, encode_entry(entry)

        # The thread's lock held, and its cursor pinned (the claim and a snapshot read
        # back live in it: keep it cached until the write is done); inline rather than
        # in a coroutine or context manager of their own. The snapshot after the entry
        # follows from the cursor it lands on (its state extended in place: see
        # `ThreadRunFormat.state_after`), never copied here: the writer is given none.
        loop = asyncio.get_running_loop()
        cursors = self._writer.cursors
        lock = self._locks.hold(thread_id)
        try:
            async with lock:
                cursors.pin(thread_id)
                try:
                    deadline = loop.time() + self.config.checkpoint_timeout_s
                    primed = False
                    lost = 0
                    while True:
                        # The run's claim must hold on the cursor the entry is built on: a
                        # cursor reloaded after a conflict that saw the thread deleted has
                        # dropped it.
                        if not self._claims.held(thread_id, run.run_id):
                            await self._claims.claim(thread_id, run.run_id, deadline)
                        try:
                            return await self._buffer.write(
                                thread_id, build, None, deadline=deadline
                            )
                        except _ClaimLost:
                            lost += 1
                            if lost == MAX_RECLAIMS:
                                raise ConflictError(
                                    f"thread {thread_id!r} keeps being deleted under this write"
                                ) from None
                        except PayloadTooLargeError:
                            # A cold cursor sends the whole snapshot; for a thread larger
                            # than a WAL message, learn its snapshot once and send the
                            # delta instead. (An append sends only its new messages:
                            # knowing the snapshot would not help.)
                            if primed or append or not await self._prime_snapshot(thread_id):
                                raise
                            primed, lost = True, 0
                            deadline = loop.time() + self.config.checkpoint_timeout_s
                finally:
                    cursors.unpin(thread_id)
        finally:
            self._locks.release(thread_id)

    async def delete_thread(self, thread_id: str) -> None:
        """Append a delete entry: the thread disappears from every read at once.

        Decided on the thread's latest state, read from NATS (never from this instance's
        cache, which misses what other instances wrote), and written through the same
        per-thread compare-and-set as checkpoints: a delete racing another writer is
        ordered before or after it, never lost.
        """
        self._buffer.check_open()
        check_id(thread_id, "thread_id")
        nonce = self._writer.nonce()

        def build(cursor: RunCursor) -> tuple[WalEntry, bytes]:
            entry = build_delete_entry(
                thread_id, seq=cursor.seq + 1, now=self._clock(), writer=nonce, jump=cursor.jump
            )
            return entry, encode_entry(entry)

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
            await self._buffer.write(thread_id, build, [])
            self._stats["deletes"] += 1
            written = self._writer.cursors.get(thread_id)
            if written is not None and written.hot is not None and written.hot_behind:
                # Hot records advanced in the background (`hot_linger_s`): reads see the
                # delete already, but run claims judge a thread's deletes by its hot
                # record (see `RunClaims`); deletes are rare enough to pay the second
                # round trip. Should it fail, the background update still retries it.
                try:
                    await self._show_hot(thread_id, written)
                except WalUnavailableError as exc:
                    log.warning(
                        "delete of a thread is in the WAL; its hot record lags (%s)",
                        exc,
                        extra={"action": "delete_hot_behind"},
                    )

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

    async def _seed_from_inner(self, thread_id: str) -> Seeded[HotRecord, list[bytes]]:
        """The inner store's state of a thread the WAL has never seen (the buffer gives
        up on it, and the thread's first entry jumps, when the store does not answer)."""
        stored = await self.target.read_thread(thread_id, with_messages=True)
        if stored.flushed_seq == 0:
            return Seeded(0, None, [])
        hot = seeded_hot(stored.flushed_seq, stored.thread)
        return Seeded(stored.flushed_seq, hot, list(stored.messages or []))

    async def _prime_snapshot(self, thread_id: str) -> bool:
        cursor = await self._writer.cursor(thread_id)
        if cursor.state is not None:
            return False
        view = await self._reads.view(thread_id)
        if view.seq != cursor.seq:
            self._writer.cursors.drop(thread_id)
            return True
        cursor.state, cursor.state_bytes = MessageSnapshot(view.messages), None
        return True

    # -- reads (see `threadrun.overlay`) ------------------------------------------------

    async def load_thread(self, thread_id: str) -> Thread | None:
        """The thread summary as of the latest acknowledged checkpoint."""
        self._buffer.check_open()
        return await self._reads.load_thread(thread_id)

    async def load_messages(self, thread_id: str) -> list[Message] | None:
        """The latest message snapshot, unflushed checkpoints included."""
        self._buffer.check_open()
        return await self._reads.load_messages(thread_id)

    async def load_run(self, run_id: str) -> RunRecord | None:
        """A run by id, unflushed versions included."""
        self._buffer.check_open()
        return await self._reads.load_run(run_id)

    async def latest_run(self, thread_id: str) -> RunRecord | None:
        """The run of the thread's latest checkpoint."""
        self._buffer.check_open()
        return await self._reads.latest_run(thread_id)

    async def list_runs(
        self,
        thread_id: str | None = None,
        *,
        status: RunStatus | None = None,
        limit: int = 50,
        offset: int = 0,
    ) -> list[RunRecord]:
        """Runs, newest first; unflushed versions replace stored ones."""
        self._buffer.check_open()
        return await self._reads.list_runs(thread_id, status=status, limit=limit, offset=offset)

    async def list_threads(self, *, limit: int = 50, offset: int = 0) -> list[Thread]:
        """Threads, newest `updated_at` first; unflushed checkpoints included."""
        self._buffer.check_open()
        return await self._reads.list_threads(limit=limit, offset=offset)

    # -- flushing -------------------------------------------------------------------------

    async def force_flush(self, thread_id: str, *, timeout: float = 10.0) -> int:  # noqa: ASYNC109
        """Apply every acknowledged checkpoint of the thread to the inner store now.

        Works with or without a flusher running; returns the flushed seq.
        """
        self._buffer.check_open()
        check_id(thread_id, "thread_id")
        return await self._buffer.force_flush(thread_id, timeout_s=timeout)

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
        self._buffer.check_open()
        return await self._buffer.force_flush_all(timeout_s=timeout, progress=progress)

    async def flush_status(self, thread_id: str) -> FlushStatus:
        """Latest acknowledged and flushed seqs of a thread."""
        self._buffer.check_open()
        return await self._reads.flush_status(thread_id)

    # -- lifecycle ------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Counters of this instance (no metrics dependency): checkpoints by result
        (``checkpoints_ok``; ``checkpoints_failed``, split into ``checkpoints_invalid``,
        ``_unavailable``, ``_commit_unknown``, ``_cancelled``, ``_error``), their total
        time, ``commit_unknown`` (deletes included), ``deletes``, ``cas_conflicts``,
        ``wal_bytes``, ``nats_requests``, and with ``hot_linger_s`` ``hot_updates`` (hot
        records advanced in the background) and ``hot_updates_coalesced`` (checkpoints
        whose record was superseded before it was written); gauges of the writer's
        cursor cache: ``cursor_cache_threads`` and ``cursor_cache_bytes`` (what its
        snapshots weigh)."""
        return {
            **self._stats,
            "cursor_cache_threads": len(self._writer.cursors),
            "cursor_cache_bytes": self._writer.cursors.held_bytes,
            "commit_unknown": self._writer.commit_unknown,
            "cas_conflicts": self._writer.conflicts,
            "wal_bytes": self._writer.wal_bytes,
            "nats_requests": self.wal.requests,
            "hot_updates": self._writer.hot_updates.updates,
            "hot_updates_coalesced": self._writer.hot_updates.coalesced,
        }

    def histograms(self) -> dict[str, HistogramSnapshot]:
        """Distributions of this instance: ``checkpoint_duration_seconds``, the latency of
        each successful `checkpoint()` call."""
        return {"checkpoint_duration_seconds": self._checkpoint_seconds.snapshot()}

    async def close(self) -> None:
        """Drain this instance's threads (best effort), then close the NATS connection.

        The inner store stays open: it belongs to the caller.
        """
        await self._buffer.close()


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


def _too_large(entry: WalEntry, size: int, limit: int) -> str:
    return (
        f"checkpoint of thread {entry.thread_id!r} needs a {size}-byte WAL entry; the "
        f"server accepts {limit} ({entry.keep} messages kept, {len(entry.messages)} sent)"
    )
