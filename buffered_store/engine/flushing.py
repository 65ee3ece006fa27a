"""What the engine asks of the store it flushes into, and what it reports back.

A front-end's flush target applies a thread's entries atomically with the thread's
watermark (``flushed_seq``) and tells the engine what happened, one `ApplyOutcome` per
thread; `FlushStatus` is how far a thread has been flushed. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol, TypeVar, runtime_checkable

from buffered_store.engine.entries import Entry
from buffered_store.errors import RunOwnershipError

E_contra = TypeVar("E_contra", bound=Entry, contravariant=True)


class ApplyStatus(StrEnum):
    """Outcome of applying one thread's entries."""

    APPLIED = "applied"
    """The entries above the watermark were written; the watermark moved."""
    STALE = "stale"
    """Every entry was at or below the watermark; nothing was written."""
    GAP = "gap"
    """The first entry above the watermark is not watermark + 1; nothing was written."""
    FAILED = "failed"
    """Writing this thread failed (its part was rolled back); see `error`."""


@dataclass(frozen=True, slots=True)
class ApplyOutcome:
    """What `FlushSink.apply` did for one thread."""

    thread_id: str
    status: ApplyStatus
    flushed_seq: int
    """The thread's watermark after the call."""
    missing_from: int = 0
    """For GAP: the first seq that must be fetched before the batch can apply."""
    error: str | None = None
    """For FAILED: what went wrong (the thread's entries stay unacknowledged)."""
    retriable: bool = True
    """For FAILED: whether the same entries may apply later (False: data problem)."""
    waits_for: str | None = None
    """For FAILED: another thread whose unflushed entries may be what refuses this one
    (the owner of a run the batch names: the owner's delete, still in the WAL, frees the
    run). Once that thread is flushed the same entries may apply (`flush_thread` does
    that; the flusher's retries of a refused thread give it the time)."""
    retry_now: bool = False
    """For FAILED: what refused the batch is gone already (the run's owner let it go
    while the batch waited for the owner's transaction, as when two flushes of the owner
    and of the thread taking the run over run side by side): the same entries may apply
    at once (`flush_thread` tries again)."""


def failed_outcome(
    thread_id: str, watermark: int, exc: BaseException, *, retriable: bool
) -> ApplyOutcome:
    """The FAILED outcome of an exception, naming the run's owner as `waits_for` when
    the batch was refused a run another thread owns."""
    return ApplyOutcome(
        thread_id,
        ApplyStatus.FAILED,
        watermark,
        error=f"{type(exc).__name__}: {exc}",
        retriable=retriable,
        waits_for=exc.owner_thread_id if isinstance(exc, RunOwnershipError) else None,
    )


def let_go_outcome(thread_id: str, watermark: int) -> ApplyOutcome:
    """The FAILED outcome of a batch refused a run whose owner has let it go since (no
    other thread owns it now): the same entries may apply at once (`retry_now`)."""
    return ApplyOutcome(
        thread_id,
        ApplyStatus.FAILED,
        watermark,
        error=f"ConflictError: thread {thread_id!r}: a run it names belonged to another thread",
        retry_now=True,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class FlushStatus:
    """How far a thread's checkpoints have been flushed to the inner store."""

    thread_id: str
    latest_seq: int
    flushed_seq: int
    pending_from: int = 0
    """Lowest seq that can be pending when the thread's entries jumped past its stored
    seq (see docs/concepts/failure-modes.md): no entry sits between `flushed_seq` and
    it. 0 when they did not (or nobody knows)."""

    @property
    def pending(self) -> int:
        """Checkpoints acknowledged but not yet in the inner store."""
        return max(0, self.latest_seq - max(self.flushed_seq, self.pending_from - 1))


@runtime_checkable
class FlushSink(Protocol[E_contra]):
    """Where the engine flushes a front-end's entries: watermark-checked, atomic writes.

    A front-end's flush target implements it (and whatever reads its overlay needs).
    """

    async def apply(self, batches: Sequence[Sequence[E_contra]]) -> list[ApplyOutcome]:
        """Apply each thread's entries (one inner sequence per thread) with its watermark.

        For each thread: lock its watermark, drop entries at or below it, report a GAP
        when the first remaining entry does not follow it, else write the change and the
        new watermark atomically. A failure of one thread is reported as FAILED without
        affecting the others; losing the store itself raises `DatabaseUnavailableError`.
        Returns one outcome per batch, in order.
        """
        ...

    async def flushed_seqs(self, thread_ids: Sequence[str]) -> dict[str, int]:
        """Watermarks of several threads (0 for unknown ones)."""
        ...
