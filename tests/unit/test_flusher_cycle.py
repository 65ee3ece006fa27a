"""`flusher.cycle.CycleRunner` against fakes: the order of marks and acks, gap filling,
retries, quarantine. No services: messages, the thread log and the quarantine bucket are
in-process twins recording what the runner does."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, cast

import pytest

from buffered_store.engine.flushing import ApplyOutcome, ApplyStatus
from buffered_store.engine.keys import wal_subject
from buffered_store.engine.threadlog import ThreadLog
from buffered_store.errors import (
    DatabaseUnavailableError,
    WalEntriesMissingError,
    WalUnavailableError,
)
from buffered_store.model.changes import (
    WalEntry,
)
from buffered_store.model.records import RunRecord
from buffered_store.stores.memory import InMemoryThreadRunStore
from buffered_store.testing import FaultyFlushTarget, make_entries, make_messages, make_run
from buffered_store.testing.conformance.flush_target import Chain
from buffered_store.threadrun.entry import (
    FORMAT,
    HotRecord,
    encode_entry,
)
from flusher.config import FlusherConfig
from flusher.cycle import CycleRunner
from flusher.quarantine import Quarantine, QuarantineKind, QuarantineRecord
from flusher.stats import FlusherStats

T0 = datetime(2026, 1, 1, tzinfo=UTC)
STREAM = "S"
CONFIG = FlusherConfig(
    stream_name=STREAM,
    poison_attempts=3,
    db_retry_initial_s=0.001,
    db_retry_max_s=0.002,
    max_rounds=4,
)


class Events(list[tuple[Any, ...]]):
    """What happened, in order."""


class FakeMsg:
    def __init__(
        self, events: Events, subject: str, data: bytes, stream_seq: int, delivered: int = 1
    ) -> None:
        self.events = events
        self.subject = subject
        self.data = data
        self.stream_seq = stream_seq
        self.num_delivered = delivered

    async def ack(self) -> None:
        self.events.append(("ack", self.stream_seq))

    async def nak(self, delay_s: float | None = None) -> None:
        self.events.append(("nak", self.stream_seq, delay_s))

    async def term(self) -> None:
        self.events.append(("term", self.stream_seq))

    async def in_progress(self) -> None:
        self.events.append(("wip", self.stream_seq))


class FakeThreadLog:
    """The stream as a dict of entries per thread, and the KV marks."""

    def __init__(self, events: Events, stream: Iterable[WalEntry] = ()) -> None:
        self.events = events
        self.stream = {(e.thread_id, e.seq): e for e in stream}
        self.marks: dict[str, tuple[int, int]] = {}
        self.fail_marks = False
        self.unreadable: set[str] = set()
        """Threads whose entries cannot be read back (the stream unreachable)."""
        self.fmt = FORMAT

    def subject(self, thread_id: str) -> str:
        return wal_subject(STREAM, thread_id)

    async def hot(self, thread_id: str) -> None:
        return None

    async def latest(self, thread_id: str) -> tuple[None, int]:
        return None, max((seq for (t, seq) in self.stream if t == thread_id), default=0)

    async def entries_between(
        self, thread_id: str, after: int, upto: int, hot: HotRecord | None
    ) -> list[WalEntry]:
        self.events.append(("fetch", thread_id, after, upto))
        if thread_id in self.unreadable:
            raise WalUnavailableError("stream unreachable")
        try:
            return [self.stream[(thread_id, seq)] for seq in range(after + 1, upto + 1)]
        except KeyError:
            raise WalEntriesMissingError("entries are not in the WAL") from None

    async def raise_mark(self, thread_id: str, seq: int, stream_seq: int) -> None:
        if self.fail_marks:
            raise WalUnavailableError("KV down")
        self.events.append(("mark", thread_id, seq))
        old = self.marks.get(thread_id, (0, 0))
        self.marks[thread_id] = max(old, (seq, stream_seq))


class FakeQuarantine:
    def __init__(self) -> None:
        self.records: dict[str, QuarantineRecord] = {}
        self.broken = False

    async def add_message(self, record: QuarantineRecord) -> bool:
        if self.broken:
            raise WalUnavailableError("bucket gone")
        if record.key in self.records:
            return False
        self.records[record.key] = record
        return True

    async def add_thread(
        self,
        thread_id: str,
        *,
        reason: str,
        seq: int | None,
        stream_seqs: Iterable[int],
        now: datetime,
    ) -> bool:
        if self.broken:
            raise WalUnavailableError("bucket gone")
        key = f"t.{thread_id}"
        old = self.records.get(key)
        merged = tuple(sorted(set(stream_seqs) | set(old.stream_seqs if old else ())))
        self.records[key] = QuarantineRecord(
            kind=QuarantineKind.THREAD,
            reason=reason,
            at=now,
            thread_id=thread_id,
            seq=old.seq if old else seq,
            stream_seqs=merged,
        )
        return old is None

    async def thread_record(self, thread_id: str) -> QuarantineRecord | None:
        return self.records.get(f"t.{thread_id}")


def chain(thread_id: str, count: int, first_stream_seq: int = 1) -> list[WalEntry]:
    return make_entries(thread_id, count, now=T0, first_stream_seq=first_stream_seq)


@dataclasses.dataclass
class Rig:
    events: Events
    log: FakeThreadLog
    quarantine: FakeQuarantine
    target: Any
    stats: FlusherStats
    runner: CycleRunner

    def msg(self, entry: WalEntry, delivered: int = 1) -> Any:
        subject = wal_subject(STREAM, entry.thread_id)
        return FakeMsg(self.events, subject, encode_entry(entry), entry.stream_seq, delivered)

    def raw(self, subject: str, data: bytes, stream_seq: int, delivered: int = 1) -> Any:
        return FakeMsg(self.events, subject, data, stream_seq, delivered)

    def settled(self, kind: str) -> list[int]:
        return [event[1] for event in self.events if event[0] == kind]


def rig(
    target: Any,
    stream: Iterable[WalEntry] = (),
    config: FlusherConfig = CONFIG,
    events: Events | None = None,
) -> Rig:
    events = Events() if events is None else events
    log = FakeThreadLog(events, stream)
    quarantine = FakeQuarantine()
    stats = FlusherStats()
    runner = CycleRunner(
        target=target,
        thread_log=cast(ThreadLog[Any, Any], log),
        quarantine=cast(Quarantine, quarantine),
        config=config,
        stats=stats,
        clock=lambda: T0,
    )
    return Rig(events, log, quarantine, target, stats, runner)


class CommitRecorder:
    """The target, recording when each apply (its commit) returned."""

    def __init__(self, inner: InMemoryThreadRunStore, events: Events) -> None:
        self.inner = inner
        self.events = events

    async def apply(self, batches: Any) -> Any:
        outcomes = await self.inner.apply(batches)
        self.events.append(("commit", tuple(o.thread_id for o in outcomes)))
        return outcomes

    async def flushed_seqs(self, thread_ids: Any) -> Any:
        return await self.inner.flushed_seqs(thread_ids)


async def test_one_apply_per_cycle_acks_after_the_commit_and_no_kv_mark() -> None:
    inner = InMemoryThreadRunStore()
    a, b = chain("a", 3, 1), chain("b", 2, 10)
    events = Events()
    r = rig(CommitRecorder(inner, events), events=events)
    await r.runner.run([r.msg(e) for e in [*a, *b]])
    assert inner.apply_calls == 1
    assert await inner.flushed_seqs(["a", "b"]) == {"a": 3, "b": 2}
    committed = r.events.index(("commit", ("a", "b")))
    assert all(r.events.index(("ack", seq)) > committed for seq in [1, 2, 3, 10, 11])
    # The watermark is committed with the data: no KV mark per thread and cycle.
    assert not [e for e in r.events if e[0] == "mark"]
    assert r.stats.entries_applied == 5
    assert r.stats.threads_applied == 2
    assert r.stats.as_dict()["coalesced_entries"] == 3


async def test_cycle_cpu_is_split_by_stage() -> None:
    """Per stage: decoding, the apply call and what follows its outcomes (acks) are
    measured in the cycle; `as_dict` reports each per applied entry, and the rest of the
    process's CPU as intake."""
    inner = InMemoryThreadRunStore()
    r = rig(inner)
    await r.runner.run([r.msg(e) for e in chain("a", 40, 1)])
    stats = r.stats
    assert min(stats.cpu_decode_s, stats.cpu_apply_s, stats.cpu_settle_s) > 0
    stats.cpu_s = stats.cpu_decode_s + stats.cpu_apply_s + stats.cpu_settle_s + 0.004
    figures = stats.as_dict()
    assert figures["cpu_per_entry_apply_s"] == stats.cpu_apply_s / 40
    assert figures["cpu_per_entry_intake_s"] == pytest.approx(0.004 / 40)
    total = sum(figures[f"cpu_per_entry_{s}_s"] for s in ("decode", "apply", "settle", "intake"))
    assert total == pytest.approx(figures["cpu_per_entry_s"])


async def test_gap_is_filled_from_the_stream_in_the_same_cycle() -> None:
    inner = InMemoryThreadRunStore()
    entries = chain("t", 4)
    r = rig(inner, stream=entries)
    await r.runner.run([r.msg(e) for e in entries[2:]])
    assert ("fetch", "t", 0, 2) in r.events
    assert await inner.flushed_seqs(["t"]) == {"t": 4}
    assert sorted(r.settled("ack")) == [3, 4]
    assert inner.apply_calls == 2
    assert r.stats.gaps == 1
    assert r.stats.entries_fetched == 2


async def test_hole_between_held_entries_is_filled() -> None:
    inner = InMemoryThreadRunStore()
    entries = chain("t", 5)
    r = rig(inner, stream=entries)
    await r.runner.run([r.msg(entries[0]), r.msg(entries[3]), r.msg(entries[4])])
    assert ("fetch", "t", 1, 3) in r.events
    assert await inner.flushed_seqs(["t"]) == {"t": 5}
    assert sorted(r.settled("ack")) == [1, 4, 5]


async def test_stale_redelivery_is_acked() -> None:
    inner = InMemoryThreadRunStore()
    entries = chain("t", 3)
    await inner.apply([entries])
    r = rig(inner)
    await r.runner.run([r.msg(entries[0], delivered=2)])
    assert r.events == [("ack", 1)]
    assert r.stats.stale_entries == 1
    assert r.stats.redeliveries == 1


async def test_database_outage_is_retried_with_one_episode() -> None:
    inner = InMemoryThreadRunStore()
    faulty = FaultyFlushTarget(inner)
    faulty.fail_next_applies(4, DatabaseUnavailableError)
    entries = chain("t", 2)
    r = rig(faulty)
    await r.runner.run([r.msg(e) for e in entries])
    assert await inner.flushed_seqs(["t"]) == {"t": 2}
    assert r.stats.db_retries == 4
    assert r.stats.db_retry_episodes == 1
    assert r.stats.transactions == 5


async def test_unexpected_error_gives_every_message_back() -> None:
    faulty = FaultyFlushTarget(InMemoryThreadRunStore())
    faulty.fail_next_applies(1, RuntimeError("bug"))
    entries = chain("t", 2)
    r = rig(faulty)
    with pytest.raises(RuntimeError):
        await r.runner.run([r.msg(e) for e in entries])
    assert sorted(r.settled("nak")) == [1, 2]
    assert r.runner.held == []


async def test_undecodable_payload_is_recorded_and_terminated_once() -> None:
    r = rig(InMemoryThreadRunStore())
    subject = wal_subject(STREAM, "t")
    await r.runner.run([r.raw(subject, b"not-json", 5)])
    await r.runner.run([r.raw(subject, b"not-json", 5, delivered=2)])
    assert r.settled("term") == [5, 5]
    [record] = r.quarantine.records.values()
    assert record.stream_seq == 5
    assert record.thread_id == "t"
    assert record.preview_hex == b"not-json".hex()
    assert record.payload_bytes == 8
    assert r.stats.quarantined_messages == 1


@pytest.mark.parametrize(("delivered", "kind"), [(1, "nak"), (5, "nak"), (6, "term")])
async def test_unrecordable_payload_is_dropped_after_bounded_deliveries(
    delivered: int, kind: str
) -> None:
    r = rig(InMemoryThreadRunStore())
    r.quarantine.broken = True
    await r.runner.run([r.raw("S.t.x", b"?", 9, delivered=delivered)])
    assert r.settled(kind) == [9]
    assert r.stats.dropped_unrecorded == (1 if kind == "term" else 0)


class RejectSeq:
    """A target that rejects (not retriable) any batch holding `bad` of thread `thread`."""

    def __init__(self, inner: InMemoryThreadRunStore, thread: str, bad: int) -> None:
        self.inner = inner
        self.thread = thread
        self.bad = bad
        self.calls = 0

    async def apply(self, batches: Sequence[Sequence[WalEntry]]) -> list[ApplyOutcome]:
        self.calls += 1
        out: list[ApplyOutcome] = []
        for batch in batches:
            if any(e.thread_id == self.thread and e.seq == self.bad for e in batch):
                mark = (await self.inner.flushed_seqs([self.thread]))[self.thread]
                out.append(
                    ApplyOutcome(self.thread, ApplyStatus.FAILED, mark, error="no", retriable=False)
                )
            else:
                out.extend(await self.inner.apply([batch]))
        return out


async def test_failing_entry_is_retried_then_its_thread_quarantined() -> None:
    inner = InMemoryThreadRunStore()
    target = RejectSeq(inner, "t", bad=3)
    entries = chain("t", 5)
    other = chain("o", 1, 100)
    r = rig(target, stream=entries)
    for attempt in (1, 2):
        await r.runner.run([r.msg(e, delivered=attempt) for e in [*entries, *other]])
        assert r.quarantine.records == {}
    assert sorted(r.settled("nak")) == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    await r.runner.run([r.msg(e, delivered=3) for e in entries])
    assert await inner.flushed_seqs(["t", "o"]) == {"t": 2, "o": 1}
    assert sorted(r.settled("term")) == [3, 4, 5]
    assert sorted(r.settled("ack")) == [1, 2, 100, 100]  # "o": applied, then stale
    thread = r.quarantine.records["t.t"]
    assert thread.seq == 3
    assert thread.stream_seqs == (3, 4, 5)
    assert r.quarantine.records["m.3"].seq == 3
    assert r.stats.quarantined_threads == 1
    # A later entry of the thread joins the quarantine at once.
    late = chain("t", 6)[5]
    r.log.stream[("t", 6)] = late
    r.events.clear()
    await r.runner.run([r.msg(late)])
    assert r.settled("term") == [6]
    assert r.quarantine.records["t.t"].stream_seqs == (3, 4, 5, 6)


async def test_entries_are_not_terminated_without_a_record() -> None:
    inner = InMemoryThreadRunStore()
    r = rig(RejectSeq(inner, "t", bad=1))
    r.quarantine.broken = True
    [entry] = chain("t", 1)
    await r.runner.run([r.msg(entry, delivered=50)])
    assert r.settled("term") == []
    assert r.settled("nak") == [1]


async def test_missing_entries_quarantine_the_thread_after_attempts() -> None:
    inner = InMemoryThreadRunStore()
    entries = chain("t", 3)
    r = rig(inner, stream=[])  # entries 1-2 expired from the stream
    await r.runner.run([r.msg(entries[2], delivered=1)])
    assert r.settled("nak") == [3]
    await r.runner.run([r.msg(entries[2], delivered=3)])
    assert r.settled("term") == [3]
    assert r.quarantine.records["t.t"].seq == 1


async def test_rounds_are_bounded() -> None:
    class NeverMoves:
        """Claims success without moving the watermark: the runner would retry forever."""

        calls = 0

        async def apply(self, batches: Sequence[Sequence[WalEntry]]) -> list[ApplyOutcome]:
            self.calls += 1
            return [ApplyOutcome("t", ApplyStatus.APPLIED, 0) for _ in batches]

    entries = chain("t", 3)
    target = NeverMoves()
    r = rig(target, stream=entries)
    await r.runner.run([r.msg(entries[2])])
    assert target.calls == CONFIG.max_rounds
    assert r.settled("nak") == [3]


async def run_taken_over_from_a_deleted_owner() -> tuple[
    InMemoryThreadRunStore, RunRecord, WalEntry, WalEntry
]:
    """Thread "a" flushed with run R; its delete (stream seq 2) and "b"'s checkpoint
    taking R over (stream seq 3), neither applied."""
    inner = InMemoryThreadRunStore()
    owner, claimant = Chain("a"), Chain("b")
    run = make_run("a")
    await inner.apply([[owner.checkpoint(make_messages(1), run)]])
    delete = dataclasses.replace(owner.delete(), stream_seq=2)
    taken = dataclasses.replace(
        claimant.checkpoint(make_messages(1), run.replace(thread_id="b")), stream_seq=3
    )
    return inner, run, delete, taken


async def test_a_thread_refused_by_an_unflushed_owner_is_applied_with_the_owners_entries() -> None:
    """B took over run R of thread A, deleted since; A's delete is in the WAL but not in
    this cycle (another flusher holds it, or it backs off). B is applied again at once in
    one call with A's entries read from the stream (A's delete first), and acked."""
    inner, run, delete, taken = await run_taken_over_from_a_deleted_owner()
    r = rig(inner, stream=[delete, taken])
    await r.runner.run([r.msg(taken)])
    assert ("fetch", "a", 1, 2) in r.events
    assert await inner.flushed_seqs(["a", "b"]) == {"a": 2, "b": 1}
    assert await inner.load_run(run.run_id) == run.replace(thread_id="b")
    assert r.settled("ack") == [3]
    assert (r.stats.applied_with_owner, r.stats.transactions) == (1, 2)
    assert r.quarantine.records == {}
    await r.runner.run([r.msg(delete)])  # the owner's own message: found applied
    assert r.settled("ack") == [3, 2]


async def test_two_re_created_threads_that_swapped_their_runs_in_two_cycles_are_applied() -> None:
    """A and B deleted, A re-created with B's old run and B with A's, their entries in
    two cycles: alone, each is refused the run the other still holds, however often it
    is delivered again; with the other's entries read from the stream both apply."""
    inner = InMemoryThreadRunStore()
    a, b = Chain("a"), Chain("b")
    run_a, run_b = make_run("a"), make_run("b")
    await inner.apply(
        [[a.checkpoint(make_messages(1), run_a)], [b.checkpoint(make_messages(2), run_b)]]
    )
    a_entries = [
        dataclasses.replace(a.delete(), stream_seq=3),
        dataclasses.replace(
            a.checkpoint(make_messages(1, start=5), run_b.replace(thread_id="a")), stream_seq=4
        ),
    ]
    b_entries = [
        dataclasses.replace(b.delete(), stream_seq=5),
        dataclasses.replace(
            b.checkpoint(make_messages(1, start=7), run_a.replace(thread_id="b")), stream_seq=6
        ),
    ]
    r = rig(inner, stream=[*a_entries, *b_entries])
    await r.runner.run([r.msg(e) for e in a_entries])
    assert await inner.flushed_seqs(["a", "b"]) == {"a": 3, "b": 3}
    assert await inner.list_runs("a") == [run_b.replace(thread_id="a")]
    assert await inner.list_runs("b") == [run_a.replace(thread_id="b")]
    assert sorted(r.settled("ack")) == [3, 4]
    await r.runner.run([r.msg(e) for e in b_entries])
    assert sorted(r.settled("ack")) == [3, 4, 5, 6]
    assert r.quarantine.records == {}


async def test_a_thread_waiting_for_the_owner_of_its_run_is_not_quarantined() -> None:
    """As above, but A's entries cannot be read back (the stream unreachable for the
    fetch). B's refusal (RunOwnershipError, not retriable) used to count towards B's
    quarantine; while A has unflushed entries it is given back without counting, and
    applies once A's delete has."""
    inner, run, delete, taken = await run_taken_over_from_a_deleted_owner()
    r = rig(inner, stream=[delete, taken])
    r.log.unreadable.add("a")
    for delivered in range(1, 2 * CONFIG.poison_attempts):
        await r.runner.run([r.msg(taken, delivered=delivered)])
        assert r.settled("nak")[-1] == 3
        assert r.quarantine.records == {}
    assert r.stats.applied_with_owner == 0
    await r.runner.run([r.msg(delete), r.msg(taken, delivered=2 * CONFIG.poison_attempts)])
    assert await inner.flushed_seqs(["a", "b"]) == {"a": 2, "b": 1}
    assert await inner.load_run(run.run_id) == run.replace(thread_id="b")
    assert sorted(r.settled("ack")) == [2, 3]


async def test_a_run_owned_for_good_elsewhere_still_ends_in_quarantine() -> None:
    """The owner has nothing unflushed: the refusal is the claimant's own, counted."""
    inner = InMemoryThreadRunStore()
    owner, claimant = Chain("a"), Chain("b")
    run = make_run("a")
    first = dataclasses.replace(owner.checkpoint(make_messages(1), run), stream_seq=1)
    await inner.apply([[first]])
    taken = dataclasses.replace(
        claimant.checkpoint(make_messages(1), run.replace(thread_id="b")), stream_seq=2
    )
    r = rig(inner, stream=[first, taken])
    await r.runner.run([r.msg(taken, delivered=CONFIG.poison_attempts)])
    assert r.settled("term") == [2]
    assert "RunOwnershipError" in r.quarantine.records["t.b"].reason
