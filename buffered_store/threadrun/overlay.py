"""The read side of `BufferedThreadRunStore`: the inner store's rows with the unflushed
WAL tail laid over them (read-your-writes), as `ReadConsistency` asks.

A thread's reads fold its entries above the stored watermark on the stored row; run
reads take the run versions of the pending entries (from the hot record when it holds
them); list reads merge the pending threads (the WAL tail) with one page of the store:
O(page + pending), never a scan of every thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from buffered_store.config import BufferedStoreConfig, ReadConsistency
from buffered_store.engine.buffer import WriteBuffer
from buffered_store.engine.flushing import FlushStatus
from buffered_store.engine.ids import check_id
from buffered_store.errors import BackendUnavailableError
from buffered_store.model.changes import (
    EntryKind,
    WalEntry,
)
from buffered_store.model.checkpointing import check_page
from buffered_store.model.planning import ThreadView, fold
from buffered_store.model.protocol import ThreadRunStore
from buffered_store.model.records import Message, RunRecord, RunStatus, Thread
from buffered_store.model.target import (
    FlushTarget,
    StoredThread,
    run_sort_key,
    thread_sort_key,
)
from buffered_store.threadrun.claims import decode_run_claim, run_key
from buffered_store.threadrun.entry import (
    HotRecord,
    messages_of,
)

Versions = dict[str, tuple[RunRecord, int]]
"""run id -> (the run's newest pending version, the seq that wrote it)."""

FLUSH_TIMEOUT_S = 10.0
"""How long a STRONG read of one thread waits for its flush."""
FLUSH_ALL_TIMEOUT_S = 60.0
"""How long a STRONG list read waits for every pending thread's flush."""


async def no_pending() -> tuple[Versions, int, int]:
    """`Overlay.pending_runs_at` of a thread that need not be read."""
    return {}, 0, 0


class Overlay:
    """Reads of a `BufferedThreadRunStore` over its inner store, its flush target and
    the engine (`WriteBuffer`) it writes through. The store checks it is open first."""

    def __init__(
        self,
        inner: ThreadRunStore,
        target: FlushTarget,
        buffer: WriteBuffer[WalEntry, HotRecord, Any],
        config: BufferedStoreConfig,
    ) -> None:
        self.inner = inner
        self.target = target
        self.config = config
        self._buffer = buffer
        self._log = buffer.log

    async def load_thread(self, thread_id: str) -> Thread | None:
        """The thread summary as of the latest acknowledged checkpoint."""
        check_id(thread_id, "thread_id")
        if await self.inner_only(thread_id):
            return await self.inner.load_thread(thread_id)
        hot, (_, last) = await asyncio.gather(
            self._log.hot(thread_id), self._log.last_entry(thread_id)
        )
        record = hot.record if hot is not None else None
        if last is not None and (record is None or last.seq > record.seq):
            # The stream is ahead of the hot record (advanced in the background, or its
            # update lost: commit unknown): the subject's last entry is the thread's
            # latest, and it carries the summary after it (None after a delete).
            return last.thread
        if record is None:
            return await self.inner.load_thread(thread_id)
        return record.thread

    async def load_messages(self, thread_id: str) -> list[Message] | None:
        """The latest message snapshot, unflushed checkpoints included."""
        check_id(thread_id, "thread_id")
        if await self.inner_only(thread_id):
            return await self.inner.load_messages(thread_id)
        view = await self.view(thread_id)
        return None if view.thread is None else messages_of(view.messages)

    async def load_run(self, run_id: str) -> RunRecord | None:
        """A run by id, unflushed versions included."""
        check_id(run_id, "run_id")
        if self.config.read_consistency is not ReadConsistency.READ_YOUR_WRITES:
            thread_id = await self.run_thread(run_id)
            if thread_id is not None:
                await self.inner_only(thread_id)
            return await self.inner.load_run(run_id)
        return await self.load_run_overlay(run_id)

    async def load_run_overlay(self, run_id: str) -> RunRecord | None:
        """The newest version of a run: stored, or in its thread's unflushed entries."""
        indexed, stored = await asyncio.gather(
            self.run_thread(run_id), self.target.read_run(run_id)
        )
        thread_id = indexed or (stored.run.thread_id if stored else None)
        if thread_id is None:
            return None
        # The pending entries of the claimant and, when the claim has moved on from the
        # stored row's thread (deleted, the run taken over), of that thread too.
        owner = stored.run.thread_id if stored else thread_id
        (versions, deleted_at, flushed), (_, owner_deleted_at, _) = await asyncio.gather(
            self.pending_runs_at(thread_id),
            self.pending_runs_at(owner) if owner != thread_id else no_pending(),
        )
        found = versions.get(run_id)
        if found is None and (stored is None or owner != thread_id or stored.thread_seq < flushed):
            # The stored row was read concurrently with the watermarks: a flush committing
            # in between moved the run's newest version out of the pending entries, or
            # applied the old owner's delete, after that read. Read it again, now that
            # the watermarks are known (rare: only runs last written below the watermark,
            # or whose claim moved, get here, and they read one more row).
            stored = await self.target.read_run(run_id)
            if stored is not None and stored.run.thread_id not in (thread_id, owner):
                # A third thread's row meanwhile (rare): its own pending delete, read now.
                owner_deleted_at = (await self.pending_runs(stored.run.thread_id))[1]
        if stored is None:
            return found[0] if found else None
        if stored.run.thread_id == thread_id:
            # Seqs of one thread: the newer version wins; a pending delete hides the row.
            if stored.thread_seq > deleted_at and (found is None or found[1] < stored.thread_seq):
                return stored.run
            return found[0] if found else None
        # The stored row is another thread's, and the claim has moved on: a pending
        # version of the claimant wins whatever the seqs, which count different threads.
        # Without one, the row stands unless its own thread has a pending delete above it.
        if found is not None:
            return found[0]
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
        check_page(limit, offset)
        if thread_id is not None:
            check_id(thread_id, "thread_id")
        mode = self.config.read_consistency
        if mode is ReadConsistency.STRONG:
            await (
                self._buffer.force_flush(thread_id, timeout_s=FLUSH_TIMEOUT_S)
                if thread_id
                else self._buffer.force_flush_all(timeout_s=FLUSH_ALL_TIMEOUT_S)
            )
        if mode is not ReadConsistency.READ_YOUR_WRITES:
            return await self.inner.list_runs(thread_id, status=status, limit=limit, offset=offset)
        if thread_id is not None:
            pending = {thread_id: await self.pending_runs(thread_id)}
        else:
            pending = await self.all_pending_runs()
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
        check_page(limit, offset)
        mode = self.config.read_consistency
        if mode is ReadConsistency.STRONG:
            await self._buffer.force_flush_all(timeout_s=FLUSH_ALL_TIMEOUT_S)
        if mode is not ReadConsistency.READ_YOUR_WRITES:
            return await self.inner.list_threads(limit=limit, offset=offset)
        overlay = {p.thread_id: p.record.thread for p in await self._buffer.scan_pending()}
        stored = await self.target.read_threads(limit=offset + limit + len(overlay), offset=0)
        threads = [s.thread for s in stored if s.thread and s.thread_id not in overlay]
        threads.extend(t for t in overlay.values() if t is not None)
        threads.sort(key=thread_sort_key, reverse=True)
        return threads[offset : offset + limit]

    async def inner_only(self, thread_id: str) -> bool:
        """True when the read must go to the inner store (STRONG flushes first)."""
        mode = self.config.read_consistency
        if mode is ReadConsistency.STRONG:
            await self._buffer.force_flush(thread_id, timeout_s=FLUSH_TIMEOUT_S)
        return mode is not ReadConsistency.READ_YOUR_WRITES

    async def view(self, thread_id: str) -> ThreadView:
        """The thread with its messages as of the latest acknowledged checkpoint."""
        cursor = self._buffer.writer.cursors.get(thread_id)
        if cursor is not None and cursor.state is not None:
            # This instance's snapshot is the latest when the subject's last entry is the
            # one it wrote last (one direct get, no database).
            _, last = await self._log.last_entry(thread_id)
            if last is not None and last.seq == cursor.seq:
                return ThreadView(
                    seq=cursor.seq, thread=last.thread, messages=cursor.state, runs={}
                )
        # The subject's last entry beside the hot record: the record may lag the entries
        # acknowledged (advanced in the background, or its update lost).
        (hot, upto), stored = await asyncio.gather(
            self._log.latest(thread_id), self.target.read_thread(thread_id, with_messages=True)
        )
        base = base_view(stored)
        if upto <= stored.flushed_seq:
            return base
        entries = await self._log.entries_between(
            thread_id, stored.flushed_seq, upto, hot.record if hot is not None else None
        )
        return fold(base, entries)

    async def pending_runs(self, thread_id: str) -> tuple[Versions, int]:
        """Run versions of the thread's unflushed entries, and the seq of a pending delete."""
        versions, deleted_at, _ = await self.pending_runs_at(thread_id)
        return versions, deleted_at

    async def pending_runs_at(self, thread_id: str) -> tuple[Versions, int, int]:
        """`pending_runs`, and the flushed seq they are above."""
        (hot, upto), flushed = await asyncio.gather(
            self._log.latest(thread_id), self.target.flushed_seqs([thread_id])
        )
        watermark = flushed[thread_id]
        record = hot.record if hot is not None else None
        versions, deleted_at = await self.runs_above(thread_id, record, watermark, upto)
        return versions, deleted_at, watermark

    async def all_pending_runs(self) -> dict[str, tuple[Versions, int]]:
        pending = await self._buffer.scan_pending()
        found = await asyncio.gather(
            *(self.runs_above(p.thread_id, p.record, p.flushed_seq, p.record.seq) for p in pending)
        )
        return {p.thread_id: runs for p, runs in zip(pending, found, strict=True)}

    async def runs_above(
        self, thread_id: str, record: HotRecord | None, flushed: int, upto: int
    ) -> tuple[Versions, int]:
        """Run versions written above the flushed seq up to seq `upto`: from the hot
        record when it reaches `upto` and covers them (no entry read), else from the
        entries themselves."""
        if upto <= flushed:
            return {}, 0
        if record is not None and record.seq == upto and record.covers_runs_after(flushed):
            versions = {run.run_id: (run, seq) for run, seq in record.runs if seq > flushed}
            return versions, (record.deleted_seq if record.deleted_seq > flushed else 0)
        entries = await self._log.entries_between(thread_id, flushed, upto, record)
        return runs_of(entries)

    async def run_thread(self, run_id: str) -> str | None:
        """The thread that claimed a run id, from the KV run claims."""
        value = await self._buffer.wal.kv_get(run_key(run_id))
        return decode_run_claim(value.value)[0] if value else None

    async def flush_status(self, thread_id: str) -> FlushStatus:
        """Latest acknowledged and flushed seqs of a thread."""
        check_id(thread_id, "thread_id")
        hot, upto = await self._log.latest(thread_id)
        try:
            flushed = (await self.target.flushed_seqs([thread_id]))[thread_id]
        except BackendUnavailableError:
            flushed = await self.acknowledged_seq(thread_id, upto)
        latest = max(upto, flushed)
        return FlushStatus(
            thread_id=thread_id,
            latest_seq=latest,
            flushed_seq=flushed,
            pending_from=hot.record.chain_from if hot else 0,
        )

    async def acknowledged_seq(self, thread_id: str, latest: int) -> int:
        """While the inner store cannot answer: a lower bound of the thread's watermark.

        The flusher acknowledges an entry only after its commit, and every message below
        the durable consumer's ack floor is acknowledged: the thread's first entry above
        the floor is the first that may be unflushed (no entry above it: all of them are
        flushed). A KV flushed mark raises the bound where one is kept (the generic
        target of stores without a watermark of their own keeps them).
        """
        mark, consumer = await asyncio.gather(
            self._log.mark(thread_id), self._buffer.wal.consumer_state()
        )
        bound = latest
        async for _, entry in self._log.walk(thread_id, consumer.ack_floor + 1):
            if entry is not None:
                # Below a jump entry the thread's seqs are unknown: nothing can be told.
                bound = 0 if entry.jump else entry.seq - 1
                break
        return max(bound, mark.seq if mark else 0)


def base_view(stored: StoredThread) -> ThreadView:
    return ThreadView(
        seq=stored.flushed_seq,
        thread=stored.thread,
        messages=list(stored.messages or []) if stored.thread else [],
        runs={},
    )


def runs_of(entries: Sequence[WalEntry]) -> tuple[Versions, int]:
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
