"""`WriteBuffer`: the engine assembled for one front-end.

A front-end hands it its format (`WriteFormat`), the `FlushSink` its entries flush into
and how a thread the WAL has never seen is seeded from that sink; it gets back the write
path (cursors, the CAS append, the hot record), the reader of a thread's entries, the
pending-thread index, per-thread locks, `force_flush`/`force_flush_all` and an ordered
`close` (stop intake, let the hot records land, drain this instance's threads, close the
WAL). The front-end keeps only its API: building entries from its calls, and its reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from datetime import datetime
from typing import Any, Generic

from buffered_store.config import WriterConfig
from buffered_store.engine.appender import WriteFormat, Writer
from buffered_store.engine.cursors import Cursor, S, Seeded, ThreadLocks
from buffered_store.engine.entries import E, H
from buffered_store.engine.flushing import FlushSink
from buffered_store.engine.ids import utcnow
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
    ConflictError,
    FlushFailedError,
    FlushTimeoutError,
    StoreClosedError,
    WalEntriesMissingError,
)

log = logging.getLogger("buffered_store.engine.buffer")

TooLarge = Callable[[E, int, int], str]
"""The front-end's words for an entry of (entry, its size, the WAL's limit) bytes that
the WAL cannot take (the message of the `PayloadTooLargeError`)."""


class WriteBuffer(Generic[E, H, S]):
    """The engine of one front-end over an open WAL and the sink its entries flush into.

    `seed` reads where a thread the WAL has never seen stands in the sink (None: not
    consulted, every new thread starts at seq 1); it is given `request_timeout_s`, and a
    sink that is unavailable or too slow makes the thread's first entry jump (see
    `appender.jump_seq`). `check_retained` lets the writer ask the sink's watermark when
    a thread's entries left the stream (`WalEntriesExpiredError` when they were never
    flushed). `background_hot` advances hot records off the caller's path.
    """

    def __init__(
        self,
        wal: Wal,
        config: WriterConfig,
        fmt: WriteFormat[E, H, S],
        sink: FlushSink[E],
        *,
        seed: Callable[[str], Awaitable[Seeded[H, S]]] | None = None,
        too_large: TooLarge[E] | None = None,
        check_retained: bool = True,
        clock: Callable[[], datetime] = utcnow,
        background_hot: bool = False,
        hot_linger_s: float = 0.0,
        flush_parallel: int = 16,
        what: str = "the buffered store",
    ) -> None:
        self.wal = wal
        self.config = config
        self.fmt = fmt
        self.sink = sink
        self._load_seed = seed
        self.writer: Writer[E, H, S] = Writer(
            wal,
            config,
            fmt,
            seed=self._seed if seed is not None else None,
            watermark=self.watermark if check_retained else None,
            clock=clock,
            background_hot=background_hot,
            hot_linger_s=hot_linger_s,
            too_large=too_large,
        )
        self.log: ThreadLog[E, H] = self.writer.log
        self.pending: PendingIndex[H] = PendingIndex(wal, sink.flushed_seqs, fmt)
        self.locks = ThreadLocks()
        self.flush_parallel = flush_parallel
        self.closed = False
        self._what = what

    @property
    def max_entry_bytes(self) -> int:
        """The largest entry the WAL takes (the server's `max_payload` less headers)."""
        return self.writer.max_entry_bytes

    def check_open(self) -> None:
        """`StoreClosedError` once `close` began."""
        if self.closed:
            raise StoreClosedError(f"{self._what} is closed")

    # -- the write path ---------------------------------------------------------------

    def write(
        self,
        thread_id: str,
        build: Callable[[Cursor[H, S]], tuple[E, bytes]],
        state: S | None,
        *,
        deadline: float | None = None,
        state_of: Callable[[E], S | None] | None = None,
    ) -> Coroutine[Any, Any, tuple[E, int]]:
        """`Writer.write` within `checkpoint_timeout_s`, or what is left of it at
        `deadline` (a loop time). The writer's own coroutine, to await: not one more
        coroutine around it on every checkpoint."""
        if deadline is None:
            deadline = asyncio.get_running_loop().time() + self.config.checkpoint_timeout_s
        return self.writer.write(thread_id, build, state, deadline=deadline, state_of=state_of)

    async def watermark(self, thread_id: str) -> int:
        """The thread's flushed seq in the sink."""
        return (await self.sink.flushed_seqs([thread_id]))[thread_id]

    async def _seed(self, thread_id: str) -> Seeded[H, S] | None:
        """The sink's state of a thread the WAL has never seen, if it answers soon.

        When it does not (the database down), the thread is written as new: accepting
        writes during an outage matters more; a thread that existed only in the sink and
        is first written through the buffer during an outage restarts its seqs with a
        jump (see docs/concepts/failure-modes.md).
        """
        assert self._load_seed is not None
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                return await self._load_seed(thread_id)
        except (BackendUnavailableError, TimeoutError) as exc:
            log.warning(
                "could not read a new thread's stored state; treating it as new (%s)",
                type(exc).__name__,
                extra={"action": "cold_thread_unverified"},
            )
            return None

    # -- the pending threads ------------------------------------------------------------

    async def scan_pending(self) -> list[PendingThread[H]]:
        """The threads with unflushed entries, sorted by id: the KV scan, with this
        instance's own threads whose hot records are still being advanced in the
        background, or whose update failed (`Cursor.hot_behind`), taken at their latest.

        The wait for this instance's background updates is bounded (one request timeout:
        with the KV down they would never land); another instance's write whose hot record
        is still lingering or in flight is not seen (the next scan finds it). With hot
        records advanced before `write` returns, the KV scan alone (a cursor behind then
        is a write not acknowledged yet: its update is in flight, or it failed and the
        cursor was dropped).
        """
        if not self.writer.background_hot:
            return await self.pending.scan()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.config.request_timeout_s):
                await self.writer.hot_updates.settled()
        pending = {p.thread_id: p for p in await self.pending.scan()}
        local: dict[str, H] = {}
        for thread_id, cursor in self.writer.cursors.behind().items():
            known = pending.get(thread_id)
            if cursor.hot is not None and (known is None or cursor.hot.seq > known.record.seq):
                local[thread_id] = cursor.hot
        if local:
            flushed = await self.sink.flushed_seqs(list(local))
            for thread_id, record in local.items():
                if record.seq > flushed[thread_id]:
                    pending[thread_id] = PendingThread(thread_id, record, flushed[thread_id])
        return [pending[t] for t in sorted(pending)]

    # -- flushing -----------------------------------------------------------------------

    async def force_flush(self, thread_id: str, *, timeout_s: float) -> int:
        """Apply every entry of the thread acknowledged before the call to the sink now;
        returns the flushed seq (`FlushTimeoutError` after `timeout_s`)."""
        return await force_flush(self.log, self.sink, thread_id, timeout_s=timeout_s)

    async def force_flush_all(
        self, *, timeout_s: float, progress: FlushProgress | None = None
    ) -> int:
        """Flush every thread with unflushed entries; returns how many were flushed.

        With hot records advanced in the background, this instance's are let land first
        (so the scan of the pending threads sees them), within the same timeout."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        if self.writer.background_hot:
            try:
                async with asyncio.timeout(timeout_s):
                    await self.writer.hot_updates.settled()
            except TimeoutError as exc:
                raise FlushTimeoutError(
                    f"force_flush_all: hot records not advanced within {timeout_s}s"
                ) from exc
        left = max(0.0, timeout_s - (loop.time() - started))
        return await force_flush_all(
            self.log,
            self.sink,
            self.scan_pending,
            timeout_s=left,
            parallel=self.flush_parallel,
            progress=progress,
        )

    # -- lifecycle ----------------------------------------------------------------------

    async def close(self, *, settle: Callable[[], Awaitable[None]] | None = None) -> None:
        """Close in order: stop intake (`check_open` refuses from now on), `settle` the
        front-end's writes still queued, let the hot records in flight land, drain this
        instance's threads when ``drain_on_close`` (best effort, within
        ``drain_timeout_s``), then close the WAL. The sink stays open: it belongs to
        the front-end."""
        if self.closed:
            return
        self.closed = True
        try:
            if settle is not None:
                await settle()
            if self.writer.background_hot:
                await self.writer.hot_updates.close(self.config.drain_timeout_s)
            if self.config.drain_on_close:
                await self.drain()
        finally:
            await self.wal.close()

    async def drain(self) -> None:
        """Flush the threads this instance wrote, within ``drain_timeout_s``; what cannot
        be flushed now stays in the WAL for a flusher."""
        threads = self.writer.cursors.threads()
        try:
            async with asyncio.timeout(self.config.drain_timeout_s):
                for thread_id in threads:
                    await flush_thread(self.log, self.sink, thread_id)
        except (
            BackendUnavailableError,
            FlushFailedError,
            WalEntriesMissingError,
            ConflictError,
            TimeoutError,
        ) as exc:
            # Best effort: the database or NATS away, a thread's data refused, entries
            # gone, a thread kept moving, the time up: the entries stay in the WAL for a
            # flusher, and close() goes on to close the WAL. Anything else (a closed or
            # misconfigured backend) is raised once the WAL is closed.
            log.warning(
                "close: could not drain every thread (%s)", exc, extra={"action": "drain_skipped"}
            )
