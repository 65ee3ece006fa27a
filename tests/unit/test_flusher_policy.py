"""`flusher.policy`: classification, outcome plans and culprit isolation."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from buffered_store.backoff import Backoff
from buffered_store.engine.entries import Entry
from buffered_store.engine.flushing import ApplyOutcome, ApplyStatus
from buffered_store.engine.keys import wal_subject
from buffered_store.model.changes import (
    WalEntry,
)
from buffered_store.testing import make_entries
from buffered_store.threadrun.entry import (
    FORMAT,
    encode_entry,
)
from flusher.policy import (
    HeldSeq,
    Isolation,
    Settle,
    Step,
    Undecodable,
    classify,
    plan_outcome,
    undecodable_action,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)
BACKOFF = Backoff(0.5, 4.0)


def entries(thread_id: str, count: int, *, first_stream_seq: int = 10) -> list[WalEntry]:
    """Entries 1..count of a thread at stream seqs first_stream_seq, +1, ..."""
    return make_entries(thread_id, count, now=T0, first_stream_seq=first_stream_seq)


def held(batch: list[WalEntry], *, delivered: int = 1) -> list[HeldSeq]:
    return [HeldSeq(e.seq, e.stream_seq, delivered) for e in batch]


# -- classify ---------------------------------------------------------------------------------


def test_classify_decodes_an_entry_of_its_subject() -> None:
    [entry] = entries("t1", 1)
    result = classify(FORMAT, "S", wal_subject("S", "t1"), encode_entry(entry), 42)
    assert isinstance(result, WalEntry)
    assert result.seq == 1
    assert result.stream_seq == 42


@pytest.mark.parametrize(
    ("subject", "payload", "thread", "reason"),
    [
        (wal_subject("S", "t1"), b"not-json", "t1", "not JSON"),
        (wal_subject("S", "t1"), b'{"v": 99}', "t1", "known version"),
        ("S.other.kind", b"{}", None, "not a thread subject"),
        (wal_subject("S", "t2"), None, "t2", "another thread"),
    ],
)
def test_classify_explains_what_is_not_an_entry(
    subject: str, payload: bytes | None, thread: str | None, reason: str
) -> None:
    data = payload if payload is not None else encode_entry(entries("t1", 1)[0])
    result = classify(FORMAT, "S", subject, data, 7)
    assert isinstance(result, Undecodable)
    assert result.thread_id == thread
    assert reason in result.reason


# -- poison and back-off ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("recorded", "delivered", "expected"),
    [
        (True, 1, Settle.TERM),
        (False, 1, Settle.NAK),
        (False, 9, Settle.NAK),
        (False, 10, Settle.TERM),
        (False, 11, Settle.TERM),
    ],
)
def test_undecodable_is_terminated_once_recorded_or_after_bounded_deliveries(
    recorded: bool, delivered: int, expected: Settle
) -> None:
    action = undecodable_action(recorded=recorded, num_delivered=delivered, poison_attempts=5)
    assert action is expected


# -- plans ------------------------------------------------------------------------------------


def test_applied_acks_everything() -> None:
    batch = entries("t", 3)
    plan = plan_outcome(
        ApplyOutcome("t", ApplyStatus.APPLIED, 3),
        batch,
        held(batch),
        failures=0,
        poison_attempts=3,
        backoff=BACKOFF,
    )
    assert plan.step is Step.DONE
    assert plan.ack_upto == 3


def test_applied_below_a_hole_fetches_the_hole() -> None:
    batch = entries("t", 5)
    kept = [batch[0], batch[3], batch[4]]  # holds 1, 4, 5: 2-3 are elsewhere
    plan = plan_outcome(
        ApplyOutcome("t", ApplyStatus.APPLIED, 1),
        kept,
        held(kept),
        failures=0,
        poison_attempts=3,
        backoff=BACKOFF,
    )
    assert plan.step is Step.FETCH
    assert (plan.ack_upto, plan.fetch_after, plan.fetch_upto) == (1, 1, 3)


def test_applied_short_of_contiguous_held_entries_retries() -> None:
    batch = entries("t", 3)
    plan = plan_outcome(
        ApplyOutcome("t", ApplyStatus.APPLIED, 2),
        batch,
        held(batch),
        failures=0,
        poison_attempts=3,
        backoff=BACKOFF,
    )
    assert plan.step is Step.RETRY
    assert plan.ack_upto == 2


def test_stale_acks_what_the_watermark_covers() -> None:
    batch = entries("t", 2)
    plan = plan_outcome(
        ApplyOutcome("t", ApplyStatus.STALE, 9),
        batch,
        held(batch, delivered=4),
        failures=0,
        poison_attempts=3,
        backoff=BACKOFF,
    )
    assert plan.step is Step.DONE
    assert plan.ack_upto == 9


def test_gap_fetches_from_the_watermark_to_the_first_held_entry() -> None:
    batch = entries("t", 6)[3:]  # holds 4-6
    plan = plan_outcome(
        ApplyOutcome("t", ApplyStatus.GAP, 1, missing_from=2),
        batch,
        held(batch),
        failures=0,
        poison_attempts=3,
        backoff=BACKOFF,
    )
    assert plan.step is Step.FETCH
    assert (plan.fetch_after, plan.fetch_upto) == (1, 3)
    assert plan.ack_upto == 0


def test_inconsistent_gap_gives_messages_back() -> None:
    batch = entries("t", 2)
    plan = plan_outcome(
        ApplyOutcome("t", ApplyStatus.GAP, 0, missing_from=1),
        batch,
        held(batch),
        failures=0,
        poison_attempts=3,
        backoff=BACKOFF,
    )
    assert plan.step is Step.NAK


def test_retriable_failure_is_never_quarantined() -> None:
    batch = entries("t", 1)
    plan = plan_outcome(
        ApplyOutcome("t", ApplyStatus.FAILED, 0, error="lock timeout", retriable=True),
        batch,
        held(batch, delivered=50),
        failures=0,
        poison_attempts=3,
        backoff=BACKOFF,
    )
    assert plan.step is Step.NAK
    assert plan.delay_s == 4.0


@pytest.mark.parametrize(
    ("failures", "delivered", "step", "delay"),
    [
        (1, 1, Step.NAK, 0.5),
        (2, 1, Step.NAK, 1.0),
        (1, 2, Step.NAK, 1.0),
        (3, 1, Step.QUARANTINE, 0.0),
        (1, 3, Step.QUARANTINE, 0.0),
    ],
)
def test_data_failure_is_retried_then_quarantined(
    failures: int, delivered: int, step: Step, delay: float
) -> None:
    batch = entries("t", 1)
    plan = plan_outcome(
        ApplyOutcome("t", ApplyStatus.FAILED, 0, error="bad data", retriable=False),
        batch,
        held(batch, delivered=delivered),
        failures=failures,
        poison_attempts=3,
        backoff=BACKOFF,
    )
    assert plan.step is step
    assert plan.delay_s == delay
    assert plan.reason == "bad data"


# -- isolation --------------------------------------------------------------------------------


def run_isolation(batch: list[WalEntry], bad_seq: int | None) -> tuple[Entry | None, int, int]:
    """Simulate a target that applies everything below `bad_seq`; returns
    (culprit, watermark reached, apply calls)."""
    isolation = Isolation(batch)
    watermark, calls = 0, 0
    while not isolation.done:
        chunk = isolation.chunk()
        calls += 1
        good = [e for e in chunk if bad_seq is None or e.seq < bad_seq]
        if len(good) == len(chunk):
            watermark = chunk[-1].seq
            isolation.applied(watermark)
        else:  # a real target fails the whole chunk: nothing of it is written
            isolation.failed()
    return isolation.culprit, watermark, calls


@pytest.mark.parametrize("bad_seq", [1, 2, 7, 16, 31, 32])
def test_isolation_finds_the_culprit_and_applies_what_precedes_it(bad_seq: int) -> None:
    batch = entries("t", 32)
    culprit, watermark, calls = run_isolation(batch, bad_seq)
    assert culprit is not None
    assert culprit.seq == bad_seq
    assert watermark == bad_seq - 1
    assert calls <= 2 * 6 + 2  # logarithmic, not one call per entry


def test_isolation_without_a_culprit_applies_everything() -> None:
    culprit, watermark, _ = run_isolation(entries("t", 5), None)
    assert culprit is None
    assert watermark == 5
