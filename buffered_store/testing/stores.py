"""Inner-store helpers of `buffered_store.testing` (import them from there).

- `FaultyFlushTarget` wraps an inner store (for instance `InMemoryThreadRunStore`) and
  injects the failures a flusher must survive: applies that raise, applies that never
  return, slow applies. Everything else is forwarded untouched.
- `make_run` and `make_messages` build valid records with little typing.

Example::

    inner = FaultyFlushTarget(InMemoryThreadRunStore())
    inner.fail_next_applies(3)          # the database is down for three flushes
    ...                                  # run the code under test
    assert inner.failed_applies == 3
    assert await inner.load_messages("t1") == make_messages(2)
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol, runtime_checkable

from buffered_store.engine.flushing import ApplyOutcome
from buffered_store.errors import DatabaseUnavailableError
from buffered_store.model.changes import (
    WalEntry,
)
from buffered_store.model.checkpointing import build_checkpoint_entry, validate_checkpoint
from buffered_store.model.protocol import ThreadRunStore
from buffered_store.model.records import (
    CheckpointReceipt,
    Message,
    RunRecord,
    RunStatus,
    Thread,
)
from buffered_store.model.target import FlushTarget, StoredThread, VersionedRun

__all__ = ["FaultyFlushTarget", "InnerStore", "make_entries", "make_messages", "make_run"]


@runtime_checkable
class InnerStore(ThreadRunStore, FlushTarget, Protocol):
    """A store usable as the inner store of the buffered store: both protocols at once."""


class FaultyFlushTarget:
    """An inner store that fails, hangs or slows down `apply()` on demand.

    Wraps any object implementing `ThreadRunStore` and `FlushTarget` and forwards every
    call to it; only `apply()` can be disturbed, in this order:

    1. `fail_next_applies(n, error)`: the next ``n`` calls raise ``error`` (by default
       `DatabaseUnavailableError`, as a real store does when the database is down)
       without reaching the inner store.
    2. `block_applies()`: calls wait until `unblock_applies()`, like a database that
       never answers. `wait_for_blocked_apply()` returns once a call is parked.
       Cancelling a parked call (a timeout) leaves the inner store untouched.
    3. `apply_delay_s`: every call sleeps this long before it is forwarded.

    Counters: `apply_calls` (every call), `failed_applies` (raised by injection),
    `forwarded_applies` (reached the inner store), `blocked_applies` (parked right now),
    and `calls`, a `Counter` of every forwarded method by name.
    """

    def __init__(self, inner: InnerStore, *, apply_delay_s: float = 0.0) -> None:
        self.inner = inner
        self.apply_delay_s = apply_delay_s
        self.apply_calls = 0
        self.failed_applies = 0
        self.forwarded_applies = 0
        self.blocked_applies = 0
        self.calls: Counter[str] = Counter()
        self._failures_left = 0
        self._failure: type[BaseException] | BaseException = DatabaseUnavailableError
        self._open_gate = asyncio.Event()
        self._open_gate.set()
        self._parked = asyncio.Event()

    # -- fault injection ---------------------------------------------------------------

    def fail_next_applies(
        self, n: int, error: type[BaseException] | BaseException = DatabaseUnavailableError
    ) -> None:
        """Make the next `n` calls of `apply()` raise `error` (a class or an instance)."""
        if n < 0:
            raise ValueError("n must be >= 0")
        self._failures_left = n
        self._failure = error

    def block_applies(self) -> None:
        """Make `apply()` wait until `unblock_applies()`: an inner store that never returns."""
        self._open_gate.clear()

    def unblock_applies(self) -> None:
        """Release every parked and future `apply()` call."""
        self._open_gate.set()

    async def wait_for_blocked_apply(self) -> None:
        """Return once at least one `apply()` call is parked by `block_applies()`."""
        await self._parked.wait()

    # -- FlushTarget -------------------------------------------------------------------

    async def apply(self, batches: Sequence[Sequence[WalEntry]]) -> list[ApplyOutcome]:
        """Forward to the inner store, unless a failure, block or delay is armed."""
        self.apply_calls += 1
        self.calls["apply"] += 1
        if self._failures_left > 0:
            self._failures_left -= 1
            self.failed_applies += 1
            error = self._failure
            raise error() if isinstance(error, type) else error
        if not self._open_gate.is_set():
            self.blocked_applies += 1
            self._parked.set()
            try:
                await self._open_gate.wait()
            finally:
                self.blocked_applies -= 1
                if self.blocked_applies == 0:
                    self._parked.clear()
        if self.apply_delay_s > 0:
            await asyncio.sleep(self.apply_delay_s)
        self.forwarded_applies += 1
        return await self.inner.apply(batches)

    async def read_thread(self, thread_id: str, *, with_messages: bool) -> StoredThread:
        """Forwarded."""
        self.calls["read_thread"] += 1
        return await self.inner.read_thread(thread_id, with_messages=with_messages)

    async def read_run(self, run_id: str) -> VersionedRun | None:
        """Forwarded."""
        self.calls["read_run"] += 1
        return await self.inner.read_run(run_id)

    async def read_runs(
        self, thread_id: str | None, *, status: RunStatus | None, limit: int, offset: int
    ) -> list[VersionedRun]:
        """Forwarded."""
        self.calls["read_runs"] += 1
        return await self.inner.read_runs(thread_id, status=status, limit=limit, offset=offset)

    async def read_threads(self, *, limit: int, offset: int) -> list[StoredThread]:
        """Forwarded."""
        self.calls["read_threads"] += 1
        return await self.inner.read_threads(limit=limit, offset=offset)

    async def flushed_seqs(self, thread_ids: Sequence[str]) -> dict[str, int]:
        """Forwarded."""
        self.calls["flushed_seqs"] += 1
        return await self.inner.flushed_seqs(thread_ids)

    # -- ThreadRunStore ----------------------------------------------------------------

    async def checkpoint(
        self,
        thread_id: str,
        messages: Sequence[Message],
        run: RunRecord,
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> CheckpointReceipt:
        """Forwarded."""
        self.calls["checkpoint"] += 1
        return await self.inner.checkpoint(thread_id, messages, run, metadata=metadata)

    async def append(
        self,
        thread_id: str,
        messages: Sequence[Message],
        run: RunRecord,
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> CheckpointReceipt:
        """Forwarded."""
        self.calls["append"] += 1
        return await self.inner.append(thread_id, messages, run, metadata=metadata)

    async def load_thread(self, thread_id: str) -> Thread | None:
        """Forwarded."""
        self.calls["load_thread"] += 1
        return await self.inner.load_thread(thread_id)

    async def load_messages(self, thread_id: str) -> list[Message] | None:
        """Forwarded."""
        self.calls["load_messages"] += 1
        return await self.inner.load_messages(thread_id)

    async def load_run(self, run_id: str) -> RunRecord | None:
        """Forwarded."""
        self.calls["load_run"] += 1
        return await self.inner.load_run(run_id)

    async def latest_run(self, thread_id: str) -> RunRecord | None:
        """Forwarded."""
        self.calls["latest_run"] += 1
        return await self.inner.latest_run(thread_id)

    async def list_runs(
        self,
        thread_id: str | None = None,
        *,
        status: RunStatus | None = None,
        limit: int = 50,
        offset: int = 0,
    ) -> list[RunRecord]:
        """Forwarded."""
        self.calls["list_runs"] += 1
        return await self.inner.list_runs(thread_id, status=status, limit=limit, offset=offset)

    async def list_threads(self, *, limit: int = 50, offset: int = 0) -> list[Thread]:
        """Forwarded."""
        self.calls["list_threads"] += 1
        return await self.inner.list_threads(limit=limit, offset=offset)

    async def delete_thread(self, thread_id: str) -> None:
        """Forwarded."""
        self.calls["delete_thread"] += 1
        await self.inner.delete_thread(thread_id)

    async def close(self) -> None:
        """Release parked applies, then close the inner store."""
        self.calls["close"] += 1
        self.unblock_applies()
        await self.inner.close()


def make_run(thread_id: str, run_id: str | None = None, **overrides: Any) -> RunRecord:
    """A valid `RunRecord` of `thread_id`; `run_id` defaults to a fresh unique id.

    Any other field can be given as a keyword (``status=RunStatus.DONE, steps=3``).
    """
    fields: dict[str, Any] = {"agent_id": "agent", **overrides}
    return RunRecord(run_id=run_id or f"run-{uuid.uuid4().hex}", thread_id=thread_id, **fields)


def make_messages(n: int, *, size: int = 0, start: int = 0) -> list[Message]:
    """`n` chat messages numbered from `start`, alternating ``user`` and ``assistant``.

    Message ``i`` is the same dict whatever `n` and `start`, so ``make_messages(3)`` is a
    prefix of ``make_messages(5)``. With `size`, each message's ``content`` is exactly
    `size` characters long (padded with ``x``).
    """
    messages: list[Message] = []
    for index in range(start, start + n):
        content = f"{index}:".ljust(size, "x") if size else f"message {index}"
        messages.append({"role": "user" if index % 2 == 0 else "assistant", "content": content})
    return messages


def make_entries(
    thread_id: str, count: int, *, now: datetime, first_stream_seq: int = 1
) -> list[WalEntry]:
    """Checkpoint entries 1..`count` of a thread, as a writer that knew each previous one
    builds them (each a delta on the last: entry ``seq`` holds ``make_messages(seq)``
    and a run of its own), at stream seqs `first_stream_seq`, +1, ..."""
    out: list[WalEntry] = []
    previous: WalEntry | None = None
    snapshot: list[bytes] | None = None
    for seq in range(1, count + 1):
        call = validate_checkpoint(thread_id, make_messages(seq), make_run(thread_id), None)
        entry = build_checkpoint_entry(
            call,
            previous=previous.thread if previous else None,
            previous_messages=snapshot,
            seq=seq,
            now=now,
        )
        out.append(dataclasses.replace(entry, stream_seq=first_stream_seq + seq - 1))
        previous, snapshot = entry, call.encoded
    return out
