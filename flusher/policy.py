"""Pure decisions of the flusher: what a fetched message is, what an apply outcome means
for the messages a cycle holds, and how long to wait before trying again.

No I/O and no clock reads: the service feeds facts in (outcomes, seqs, delivery counts)
and carries the decisions out, so every branch here is tested without services.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from buffered_store.backoff import Backoff
from buffered_store.engine.entries import Entry, Format
from buffered_store.engine.flushing import ApplyOutcome, ApplyStatus
from buffered_store.engine.keys import thread_from_subject
from buffered_store.errors import CorruptEntryError

PREVIEW_BYTES = 32
"""Bytes of an undecodable payload kept (as hex) in its quarantine record."""


@dataclass(frozen=True, slots=True)
class Undecodable:
    """A fetched message that is not a WAL entry of its subject's thread."""

    reason: str
    thread_id: str | None
    """The thread its subject names, or None when the subject is not a thread subject."""


def classify(
    fmt: Format[Entry, Any], stream: str, subject: str, data: bytes, stream_seq: int
) -> Entry | Undecodable:
    """Decode a fetched message, or say why it cannot be an entry.

    Decoding is deterministic, so an undecodable payload is never retried: the same bytes
    would fail again. It holds no seq either, so quarantining it blocks nobody.
    """
    thread_id = thread_from_subject(stream, subject)
    if thread_id is None:
        return Undecodable("subject is not a thread subject of the WAL", None)
    try:
        entry = fmt.decode_entry(data, stream_seq=stream_seq)
    except CorruptEntryError as exc:
        return Undecodable(str(exc), thread_id)
    if entry.thread_id != thread_id:
        return Undecodable("entry names another thread than its subject", thread_id)
    return entry


class Settle(StrEnum):
    """How a held message is given back to the server."""

    ACK = "ack"
    NAK = "nak"
    TERM = "term"


def undecodable_action(*, recorded: bool, num_delivered: int, poison_attempts: int) -> Settle:
    """What to do with an undecodable message once its quarantine write was tried.

    `recorded` is True when its quarantine record exists now (written by us, or already
    there from an earlier delivery). When the write fails the message is given back, but
    only for a bounded number of deliveries: it holds no data, so the consumer must never
    loop on it forever just because the quarantine bucket is unusable.
    """
    if recorded or num_delivered >= 2 * poison_attempts:
        return Settle.TERM
    return Settle.NAK


class Step(StrEnum):
    """What remains to do for a thread after one apply round."""

    DONE = "done"
    """Every held message is settled by the acks of this plan."""
    FETCH = "fetch"
    """Fetch entries (`fetch_after`, `fetch_upto`] from the stream and apply again."""
    RETRY = "retry"
    """Apply the held entries above the watermark again (nothing to fetch)."""
    NAK = "nak"
    """Give the unsettled held messages back with `delay_s`."""
    QUARANTINE = "quarantine"
    """The thread's entries kept failing: isolate the culprit and quarantine."""


@dataclass(frozen=True, slots=True)
class HeldSeq:
    """What the plan needs to know of one held message: its entry's seqs and deliveries."""

    seq: int
    stream_seq: int
    num_delivered: int


@dataclass(frozen=True, slots=True)
class ThreadPlan:
    """Decision for one thread after an apply round."""

    step: Step
    ack_upto: int = 0
    """Held messages whose entry seq is at or below this are acked (their data and the
    watermark are committed)."""
    fetch_after: int = 0
    fetch_upto: int = 0
    delay_s: float = 0.0
    reason: str = ""


def plan_outcome(
    outcome: ApplyOutcome,
    batch: Sequence[Entry],
    held: Sequence[HeldSeq],
    *,
    failures: int,
    poison_attempts: int,
    backoff: Backoff,
) -> ThreadPlan:
    """Decide what follows an apply outcome for one thread.

    `batch` is what was applied (held entries plus any fetched from the stream), `held`
    the messages this cycle still holds for the thread, `failures` the non-retriable
    failures of the thread's current first unflushed entry counted so far, this one
    included (the caller keeps that count across cycles).
    """
    status = outcome.status
    watermark = outcome.flushed_seq
    if status is ApplyStatus.APPLIED or status is ApplyStatus.STALE:
        above = sorted(h.seq for h in held if h.seq > watermark)
        if not above:
            return ThreadPlan(Step.DONE, ack_upto=watermark)
        if above[0] == watermark + 1:
            return ThreadPlan(Step.RETRY, ack_upto=watermark)
        # Held entries sit above a hole (another flusher holds the ones in between):
        # fetch the hole from the stream rather than wait for a redelivery.
        return ThreadPlan(
            Step.FETCH,
            ack_upto=watermark,
            fetch_after=watermark,
            fetch_upto=above[0] - 1,
        )
    if status is ApplyStatus.GAP:
        first = min((e.seq for e in batch), default=0)
        after = max(outcome.missing_from - 1, watermark)
        if first - 1 <= after:
            return ThreadPlan(Step.NAK, delay_s=backoff.initial_s, reason="inconsistent gap")
        return ThreadPlan(Step.FETCH, fetch_after=after, fetch_upto=first - 1)
    # FAILED
    deliveries = max((h.num_delivered for h in held), default=1)
    reason = outcome.error or "apply failed"
    if outcome.retriable:
        return ThreadPlan(Step.NAK, delay_s=backoff.delay(deliveries), reason=reason)
    attempts = max(failures, deliveries)
    if attempts >= poison_attempts:
        return ThreadPlan(Step.QUARANTINE, reason=reason)
    return ThreadPlan(Step.NAK, delay_s=backoff.delay(attempts), reason=reason)


class Isolation:
    """Bisection of a thread's failing entries down to the first one that cannot apply.

    The whole run already failed once. Halves of it are tried in order: a prefix that
    applies is dropped and the search goes on after it; a failing single entry is the
    culprit. Costs O(log n) apply calls per culprit instead of one per entry.
    """

    def __init__(self, entries: Sequence[Entry]) -> None:
        self.entries = sorted(entries, key=lambda e: e.seq)
        self.size = max(1, len(self.entries) // 2)
        self.culprit: Entry | None = None

    @property
    def done(self) -> bool:
        """True once the culprit is found or nothing is left to try."""
        return self.culprit is not None or not self.entries

    def chunk(self) -> list[Entry]:
        """The prefix to try next."""
        return self.entries[: self.size]

    def applied(self, watermark: int) -> None:
        """The chunk applied up to `watermark`: continue after it."""
        self.entries = [e for e in self.entries if e.seq > watermark]
        self.size = max(1, min(self.size, len(self.entries)))

    def failed(self) -> None:
        """The chunk failed: a single entry is the culprit, else try its first half."""
        if self.size == 1:
            self.culprit = self.entries[0]
        else:
            self.size //= 2
