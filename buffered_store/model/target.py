"""The `FlushTarget` seam: what the buffered store and the flusher need from an inner store.

An inner store that implements it keeps a per-thread watermark (`flushed_seq`) with its
data, applies a batch of WAL entries atomically with that watermark (so stale, duplicated
or reordered entries can never move a thread backwards) and returns versions with its
reads (so the read overlay can merge without races). `PostgresThreadRunStore` and
`InMemoryThreadRunStore` implement it natively; any other `ThreadRunStore` is wrapped by
the at-least-once `GenericFlushTarget`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from buffered_store.engine.flushing import FlushSink
from buffered_store.model.changes import (
    WalEntry,
)
from buffered_store.model.records import RunRecord, RunStatus, Thread


@dataclass(frozen=True, kw_only=True, slots=True)
class StoredThread:
    """A thread as the inner store holds it, read in one transaction with its watermark."""

    thread_id: str
    flushed_seq: int
    """Seq of the last checkpoint applied (0 when the store never saw the thread)."""
    thread: Thread | None
    """None when the thread is absent or deleted (a tombstone keeps `flushed_seq`)."""
    messages: list[bytes] | None = None
    """Canonical message bytes, when requested."""


@dataclass(frozen=True, slots=True)
class VersionedRun:
    """A stored run with the thread seq of the checkpoint that wrote it."""

    run: RunRecord
    thread_seq: int


@runtime_checkable
class FlushTarget(FlushSink[WalEntry], Protocol):
    """Versioned reads and watermark-checked writes of an inner store: the engine's
    `FlushSink` of thread-run entries, plus the reads the buffered store overlays."""

    async def read_thread(self, thread_id: str, *, with_messages: bool) -> StoredThread:
        """The stored thread and its watermark, consistently."""
        ...

    async def read_run(self, run_id: str) -> VersionedRun | None:
        """A stored run with its version."""
        ...

    async def read_runs(
        self, thread_id: str | None, *, status: RunStatus | None, limit: int, offset: int
    ) -> list[VersionedRun]:
        """Stored runs in `list_runs` order, with their versions."""
        ...

    async def read_threads(self, *, limit: int, offset: int) -> list[StoredThread]:
        """Stored live threads in `list_threads` order, with their watermarks (no messages)."""
        ...


def run_sort_key(run: RunRecord) -> tuple[float, str]:
    """Sort key for `list_runs` order (use with reverse=True)."""
    return (run.created_at.timestamp(), run.run_id)


def thread_sort_key(thread: Thread) -> tuple[float, str]:
    """Sort key for `list_threads` order (use with reverse=True)."""
    return (thread.updated_at.timestamp(), thread.thread_id)
