"""`GenericFlushTarget`: the `FlushTarget` of a plain `ThreadRunStore`, at least once.

Inner stores that implement `FlushTarget` themselves (`PostgresThreadRunStore`,
`InMemoryThreadRunStore`) apply a batch and its watermark in one transaction. Any other
`ThreadRunStore` only offers `checkpoint()` and `delete_thread()`, so this adapter replays
a thread's coalesced entries through those calls and keeps the watermark beside the store
(in a `WatermarkBook`), which gives weaker guarantees, stated precisely:

- **At least once, not atomic.** The inner writes and the watermark update are separate
  steps. A crash (or a failure) between them leaves the data written and the watermark
  behind: the same entries are replayed later. Replaying is harmless because a
  checkpoint overwrites the thread's messages and upserts its runs by id, so the state
  converges to the same result; only store-assigned fields such as ``updated_at`` move.
- **A failed batch may be half written.** If `checkpoint()` fails after `delete_thread()`
  (or after an earlier run's checkpoint) succeeded, readers of the inner store see the
  intermediate state until the retry completes.
- **One writer per thread.** A per-thread lock serialises applies within one process.
  Nothing fences two *processes*: two flushers replaying overlapping batches of one thread
  concurrently can interleave and leave the older state last. Run a single flusher
  process with a non-transactional inner store, or implement `FlushTarget` natively.
- **Store-assigned metadata.** `created_at`/`updated_at` are whatever the inner store
  stamps at replay time, not the times of the original checkpoints.
- **Versions are approximate.** `read_run`/`read_runs` report the thread's watermark as
  each run's version, which is at or above the seq that wrote it: enough for the read
  overlay, where entries above the watermark win.

Coalescing still pays: a batch of N entries of one thread costs one `checkpoint()` per
distinct run in it (usually one), not N.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from buffered_store.engine.flushing import ApplyOutcome, ApplyStatus, failed_outcome
from buffered_store.errors import (
    BackendUnavailableError,
    CommitUnknownError,
    ConflictError,
    CorruptEntryError,
    DatabaseRefusedError,
    DatabaseUnavailableError,
    ValidationError,
)
from buffered_store.model.changes import (
    EntryKind,
    WalEntry,
)
from buffered_store.model.messages import decode_message, encode_message
from buffered_store.model.planning import (
    PlanStatus,
    ThreadChange,
    coalesce,
    deletes_first,
    plan_entries,
)
from buffered_store.model.protocol import ThreadRunStore
from buffered_store.model.records import RunRecord, RunStatus
from buffered_store.model.target import StoredThread, VersionedRun
from buffered_store.threadrun.entry import (
    HotRecord,
)

if TYPE_CHECKING:
    from buffered_store.engine.threadlog import ThreadLog

__all__ = ["GenericFlushTarget", "KvWatermarks", "MemoryWatermarks", "WatermarkBook"]


class WatermarkBook(Protocol):
    """Where `GenericFlushTarget` keeps each thread's `flushed_seq`."""

    async def get_many(self, thread_ids: Sequence[str]) -> dict[str, int]:
        """Watermarks of several threads (0 for unknown ones)."""
        ...

    async def advance(self, thread_id: str, seq: int, stream_seq: int) -> None:
        """Raise a thread's watermark to `seq` (never lowers it)."""
        ...


class MemoryWatermarks:
    """Watermarks in process memory: lost on restart, so everything still in the WAL is
    replayed into the inner store once more (harmless, see the module docstring)."""

    def __init__(self) -> None:
        self._marks: dict[str, int] = {}

    async def get_many(self, thread_ids: Sequence[str]) -> dict[str, int]:
        """Watermarks of several threads (0 for unknown ones)."""
        return {thread_id: self._marks.get(thread_id, 0) for thread_id in thread_ids}

    async def advance(self, thread_id: str, seq: int, stream_seq: int) -> None:
        """Raise a thread's watermark to `seq`."""
        self._marks[thread_id] = max(seq, self._marks.get(thread_id, 0))


class KvWatermarks:
    """Watermarks in the KV flushed marks (``f.<thread>``) that flushers raise anyway:
    shared by every process of the deployment and kept across restarts."""

    def __init__(self, thread_log: ThreadLog[WalEntry, HotRecord]) -> None:
        self.thread_log = thread_log

    async def get_many(self, thread_ids: Sequence[str]) -> dict[str, int]:
        """Watermarks of several threads (0 for unknown ones)."""
        marks = await asyncio.gather(*(self.thread_log.mark(t) for t in thread_ids))
        return {t: (m.seq if m else 0) for t, m in zip(thread_ids, marks, strict=True)}

    async def advance(self, thread_id: str, seq: int, stream_seq: int) -> None:
        """Raise the thread's KV flushed mark to `seq`."""
        await self.thread_log.raise_mark(thread_id, seq, stream_seq)


class GenericFlushTarget:
    """`FlushTarget` over any `ThreadRunStore`, at least once (see the module docstring)."""

    def __init__(self, inner: ThreadRunStore, watermarks: WatermarkBook | None = None) -> None:
        """`watermarks` defaults to `MemoryWatermarks` (this process only); pass
        `KvWatermarks` to share them with flushers and other store instances."""
        self.inner = inner
        self.watermarks: WatermarkBook = (
            watermarks if watermarks is not None else MemoryWatermarks()
        )
        self._locks: dict[str, asyncio.Lock] = {}

    async def apply(self, batches: Sequence[Sequence[WalEntry]]) -> list[ApplyOutcome]:
        """Replay each thread's entries above its watermark, threads concurrently (the
        threads holding a delete first: another thread may take one of their runs over).

        Raises `DatabaseUnavailableError` when the inner store is unreachable (threads
        that completed before keep their raised watermark and come back STALE).
        """
        outcomes: dict[int, ApplyOutcome] = {}
        groups = deletes_first(batches)
        for group in groups:
            done = await asyncio.gather(*(self._apply_thread(batches[i]) for i in group))
            outcomes.update(zip(group, done, strict=True))
        # Re-created threads refused a run that another thread of the call held until its
        # delete: replayed side by side, the delete may have come too late, and two
        # threads that swapped their runs each wait for the other's. Failed replays did
        # delete their threads, so a second replay finds the runs free.
        again = replay_again(batches, groups, outcomes)
        if again:
            done = await asyncio.gather(*(self._apply_thread(batches[i]) for i in again))
            outcomes.update(zip(again, done, strict=True))
        return [outcomes[index] for index in range(len(batches))]

    async def _apply_thread(self, batch: Sequence[WalEntry]) -> ApplyOutcome:
        if not batch:
            return ApplyOutcome("", ApplyStatus.FAILED, 0, error="empty batch", retriable=False)
        thread_id = batch[0].thread_id
        lock = self._locks.setdefault(thread_id, asyncio.Lock())
        try:
            async with lock:
                return await self._apply_locked(thread_id, batch)
        finally:
            if not lock.locked() and self._locks.get(thread_id) is lock:
                del self._locks[thread_id]

    async def _apply_locked(self, thread_id: str, batch: Sequence[WalEntry]) -> ApplyOutcome:
        watermark = (await self.watermarks.get_many([thread_id]))[thread_id]
        if any(entry.thread_id != thread_id for entry in batch):
            return _failed(thread_id, watermark, "a batch holds entries of several threads")
        plan = plan_entries(batch, watermark)
        if plan.status is PlanStatus.STALE:
            return ApplyOutcome(thread_id, ApplyStatus.STALE, watermark)
        if plan.status is PlanStatus.GAP:
            return ApplyOutcome(
                thread_id, ApplyStatus.GAP, watermark, missing_from=plan.missing_from
            )
        try:
            await self._replay(thread_id, plan.entries)
        except BackendUnavailableError as exc:
            raise DatabaseUnavailableError(f"inner store unavailable: {exc}") from exc
        except (ConnectionError, TimeoutError) as exc:
            raise DatabaseUnavailableError(f"inner store unavailable: {exc!r}") from exc
        except (ValidationError, CorruptEntryError, ConflictError, CommitUnknownError) as exc:
            # The inner store refused this thread's data (not retriable), or it changed
            # under the replay (retriable): the thread's outcome says so. Anything else
            # (closed, schema, a refused statement) is no fault of the thread: it is raised.
            return failed_outcome(thread_id, watermark, exc, retriable=exc.retriable)
        except (TypeError, ValueError, KeyError) as exc:
            return _failed(thread_id, watermark, repr(exc))
        last = plan.entries[-1]
        try:
            await self.watermarks.advance(thread_id, last.seq, last.stream_seq)
        except (BackendUnavailableError, ConflictError, DatabaseRefusedError) as exc:
            # The data is written but its watermark is not: report a retriable failure so
            # the entries are replayed (at least once) rather than acknowledged unmarked.
            return _failed(thread_id, watermark, f"watermark not raised: {exc}", retriable=True)
        return ApplyOutcome(thread_id, ApplyStatus.APPLIED, last.seq)

    async def _replay(self, thread_id: str, entries: Sequence[WalEntry]) -> None:
        stored = await self.inner.load_messages(thread_id) or []
        base = [encode_message(message, index) for index, message in enumerate(stored)]
        change = coalesce(entries, stored_count=len(base))
        if change.reset:
            await self.inner.delete_thread(thread_id)
            base = []
        if change.thread is None:
            return  # the chain ends with a delete
        messages = [decode_message(item) for item in base[: change.keep] + change.messages]
        metadata = dict(change.thread.metadata)
        for run in _runs_in_order(change, entries):
            await self.inner.checkpoint(thread_id, messages, run, metadata=metadata)

    # -- versioned reads ---------------------------------------------------------------

    async def read_thread(self, thread_id: str, *, with_messages: bool) -> StoredThread:
        """The inner thread and its watermark (read separately: not one snapshot)."""
        watermark = (await self.watermarks.get_many([thread_id]))[thread_id]
        thread = await self.inner.load_thread(thread_id)
        messages: list[bytes] | None = None
        if with_messages:
            stored = await self.inner.load_messages(thread_id) or []
            messages = [encode_message(message, index) for index, message in enumerate(stored)]
        return StoredThread(
            thread_id=thread_id, flushed_seq=watermark, thread=thread, messages=messages
        )

    async def read_run(self, run_id: str) -> VersionedRun | None:
        """A stored run, versioned by its thread's watermark."""
        run = await self.inner.load_run(run_id)
        if run is None:
            return None
        marks = await self.watermarks.get_many([run.thread_id])
        return VersionedRun(run, marks[run.thread_id])

    async def read_runs(
        self, thread_id: str | None, *, status: RunStatus | None, limit: int, offset: int
    ) -> list[VersionedRun]:
        """Stored runs in `list_runs` order, versioned by their threads' watermarks."""
        runs = await self.inner.list_runs(thread_id, status=status, limit=limit, offset=offset)
        marks = await self.watermarks.get_many(sorted({run.thread_id for run in runs}))
        return [VersionedRun(run, marks[run.thread_id]) for run in runs]

    async def read_threads(self, *, limit: int, offset: int) -> list[StoredThread]:
        """Stored threads in `list_threads` order, with their watermarks."""
        threads = await self.inner.list_threads(limit=limit, offset=offset)
        marks = await self.watermarks.get_many([thread.thread_id for thread in threads])
        return [
            StoredThread(thread_id=t.thread_id, flushed_seq=marks[t.thread_id], thread=t)
            for t in threads
        ]

    async def flushed_seqs(self, thread_ids: Sequence[str]) -> dict[str, int]:
        """Watermarks of several threads (0 for unknown ones)."""
        return await self.watermarks.get_many(thread_ids)


def replay_again(
    batches: Sequence[Sequence[WalEntry]],
    groups: Sequence[Sequence[int]],
    outcomes: Mapping[int, ApplyOutcome],
) -> list[int]:
    """The batches of re-created threads (`groups[1]` of `deletes_first`) to replay
    once more: FAILED waiting for (`ApplyOutcome.waits_for`) a thread of the call holding
    a delete that has applied since, or that is itself to be replayed again (each
    waiting for the other's delete: two threads that swapped their runs). In order."""
    deleting = {batches[i][0].thread_id: i for group in groups[:2] for i in group}
    waiting = {
        batches[i][0].thread_id: (i, owner)
        for i in groups[1]
        if outcomes[i].status is ApplyStatus.FAILED and (owner := outcomes[i].waits_for) in deleting
    }
    while True:
        stuck = [
            thread_id
            for thread_id, (_, owner) in waiting.items()
            if owner not in waiting and outcomes[deleting[owner]].status is not ApplyStatus.APPLIED
        ]
        if not stuck:
            return sorted(i for i, _ in waiting.values())
        for thread_id in stuck:
            del waiting[thread_id]


def _runs_in_order(change: ThreadChange, entries: Sequence[WalEntry]) -> list[RunRecord]:
    """Each run written since the last reset, oldest first, the last entry's run last, so
    that the final `checkpoint()` leaves the thread's latest run right."""
    ordered = [run for run, _seq in sorted(change.runs.values(), key=lambda item: item[1])]
    last = entries[-1]
    if last.kind is EntryKind.CHECKPOINT and last.run is not None:
        ordered = [run for run in ordered if run.run_id != last.run.run_id] + [last.run]
    if not ordered:
        raise CorruptEntryError(
            f"thread {last.thread_id!r}: entries without a run cannot be replayed through "
            "checkpoint()"
        )
    return ordered


def _failed(thread_id: str, watermark: int, error: str, *, retriable: bool = False) -> ApplyOutcome:
    return ApplyOutcome(thread_id, ApplyStatus.FAILED, watermark, error=error, retriable=retriable)
