"""What the engine asks of the store it flushes into, and what it reports back.

A front-end's flush target applies a thread's entries atomically with the thread's
watermark (``flushed_seq``) and tells the engine what happened, one `ApplyOutcome` per
thread; `FlushStatus` is how far a thread has been flushed. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


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
    """What `FlushTarget.apply` did for one thread."""

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
