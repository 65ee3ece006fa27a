"""The `ThreadRunStore` protocol every store implements (inner stores and the decorator)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from buffered_store.model.records import (
    CheckpointReceipt,
    Message,
    RunRecord,
    RunStatus,
    Thread,
)


@runtime_checkable
class ThreadRunStore(Protocol):
    """An async store of conversation threads, their messages and their runs.

    Semantics shared by every implementation (the conformance suite checks them):

    - `checkpoint` stores the full, ordered snapshot of the thread's messages (overwrite
      semantics) and upserts `run` by `run.run_id`; `run.thread_id` must equal `thread_id`.
      ``metadata``, when given, replaces the thread's metadata. Bad input raises
      `ValidationError` and writes nothing.
    - `append` is `checkpoint` with the thread's current snapshot followed by `messages`
      (a thread that does not exist starts with them). The snapshot it extends is the
      store's, never the caller's list: a caller that edited earlier messages must use
      `checkpoint`. Concurrent appends to one thread all land, one after the other.
    - The thread's `created_at` is the time of its first checkpoint, `updated_at` the time
      of its latest; `latest_run_id` is the run of the latest checkpoint;
      `parent_thread_id` comes from the first run that names one and then never changes.
    - `list_threads` orders by `updated_at` descending, then `thread_id` descending;
      `list_runs` by `created_at` descending, then `run_id` descending.
    - After `delete_thread` every read behaves as if the thread never existed; a later
      checkpoint starts a new thread under the same id (its `thread_seq` continues).
    - Calls on a closed store raise `StoreClosedError`.
    """

    async def checkpoint(
        self,
        thread_id: str,
        messages: Sequence[Message],
        run: RunRecord,
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> CheckpointReceipt:
        """Store the snapshot of a thread after one step and upsert its run."""
        ...

    async def append(
        self,
        thread_id: str,
        messages: Sequence[Message],
        run: RunRecord,
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> CheckpointReceipt:
        """Checkpoint the thread's current snapshot followed by `messages` (the new ones
        only) and upsert its run; costs O(new messages), whatever the history length."""
        ...

    async def load_thread(self, thread_id: str) -> Thread | None:
        """The thread summary, or None if unknown."""
        ...

    async def load_messages(self, thread_id: str) -> list[Message] | None:
        """The latest message snapshot, or None if the thread is unknown."""
        ...

    async def load_run(self, run_id: str) -> RunRecord | None:
        """A run by id, or None."""
        ...

    async def latest_run(self, thread_id: str) -> RunRecord | None:
        """The run of the thread's latest checkpoint, or None."""
        ...

    async def list_runs(
        self,
        thread_id: str | None = None,
        *,
        status: RunStatus | None = None,
        limit: int = 50,
        offset: int = 0,
    ) -> list[RunRecord]:
        """Runs, newest `created_at` first, optionally of one thread and/or one status."""
        ...

    async def list_threads(self, *, limit: int = 50, offset: int = 0) -> list[Thread]:
        """Threads, newest `updated_at` first."""
        ...

    async def delete_thread(self, thread_id: str) -> None:
        """Remove a thread, its messages and its runs."""
        ...

    async def close(self) -> None:
        """Release resources; later calls raise `StoreClosedError`."""
        ...
