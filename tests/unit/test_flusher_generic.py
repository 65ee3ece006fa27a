"""`buffered_store.threadrun.generic.GenericFlushTarget`: replaying coalesced entries through the
plain `ThreadRunStore` calls, with watermarks kept beside the store."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import pytest

from buffered_store.engine.flushing import ApplyOutcome, ApplyStatus
from buffered_store.errors import (
    ConflictError,
    DatabaseRefusedError,
    DatabaseUnavailableError,
    SchemaError,
    StoreClosedError,
    StoreError,
    ValidationError,
)
from buffered_store.model.changes import (
    WalEntry,
)
from buffered_store.model.checkpointing import (
    build_checkpoint_entry,
    build_delete_entry,
    validate_checkpoint,
)
from buffered_store.model.records import CheckpointReceipt, Message, RunRecord, Thread
from buffered_store.model.target import FlushTarget
from buffered_store.stores.memory import InMemoryThreadRunStore
from buffered_store.testing import make_messages, make_run
from buffered_store.threadrun.generic import GenericFlushTarget, MemoryWatermarks, replay_again

T0 = datetime(2026, 1, 1, tzinfo=UTC)


class PlainStore:
    """A `ThreadRunStore` only (no FlushTarget methods), counting writes, with faults."""

    def __init__(self) -> None:
        self.inner = InMemoryThreadRunStore()
        self.calls: Counter[str] = Counter()
        self.fail_with: BaseException | None = None

    async def checkpoint(
        self,
        thread_id: str,
        messages: Sequence[Message],
        run: RunRecord,
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> CheckpointReceipt:
        self.calls["checkpoint"] += 1
        if self.fail_with is not None:
            raise self.fail_with
        return await self.inner.checkpoint(thread_id, messages, run, metadata=metadata)

    async def append(
        self,
        thread_id: str,
        messages: Sequence[Message],
        run: RunRecord,
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> CheckpointReceipt:
        self.calls["append"] += 1
        if self.fail_with is not None:
            raise self.fail_with
        return await self.inner.append(thread_id, messages, run, metadata=metadata)

    async def delete_thread(self, thread_id: str) -> None:
        self.calls["delete_thread"] += 1
        await self.inner.delete_thread(thread_id)

    async def load_thread(self, thread_id: str) -> Thread | None:
        return await self.inner.load_thread(thread_id)

    async def load_messages(self, thread_id: str) -> list[Message] | None:
        return await self.inner.load_messages(thread_id)

    async def load_run(self, run_id: str) -> RunRecord | None:
        return await self.inner.load_run(run_id)

    async def latest_run(self, thread_id: str) -> RunRecord | None:
        return await self.inner.latest_run(thread_id)

    async def list_runs(
        self,
        thread_id: str | None = None,
        *,
        status: Any = None,
        limit: int = 50,
        offset: int = 0,
    ) -> list[RunRecord]:
        return await self.inner.list_runs(thread_id, status=status, limit=limit, offset=offset)

    async def list_threads(self, *, limit: int = 50, offset: int = 0) -> list[Thread]:
        return await self.inner.list_threads(limit=limit, offset=offset)

    async def close(self) -> None:
        await self.inner.close()


class Chain:
    """Builds a thread's entries the way the writers do."""

    def __init__(self, thread_id: str = "t") -> None:
        self.thread_id = thread_id
        self.seq = 0
        self.thread: Thread | None = None
        self.snapshot: list[bytes] | None = None

    def checkpoint(self, messages: list[Message], run: RunRecord) -> WalEntry:
        call = validate_checkpoint(self.thread_id, messages, run, {"n": len(messages)})
        self.seq += 1
        entry = build_checkpoint_entry(
            call, previous=self.thread, previous_messages=self.snapshot, seq=self.seq, now=T0
        )
        self.thread, self.snapshot = entry.thread, call.encoded
        return dataclasses.replace(entry, stream_seq=100 + self.seq)

    def delete(self) -> WalEntry:
        self.seq += 1
        self.thread, self.snapshot = None, None
        return build_delete_entry(self.thread_id, seq=self.seq, now=T0)


def target() -> tuple[GenericFlushTarget, PlainStore]:
    plain = PlainStore()
    return GenericFlushTarget(plain, MemoryWatermarks()), plain


def test_it_is_a_flush_target() -> None:
    generic, plain = target()
    assert isinstance(generic, FlushTarget)
    assert not isinstance(plain, FlushTarget)


async def test_coalesced_batch_costs_one_checkpoint_per_distinct_run() -> None:
    generic, plain = target()
    chain = Chain()
    first, second = make_run("t"), make_run("t")
    batch = [
        chain.checkpoint(make_messages(1), first),
        chain.checkpoint(make_messages(2), second),
        chain.checkpoint(make_messages(4), second.replace(steps=3)),
    ]
    [outcome] = await generic.apply([batch])
    assert (outcome.status, outcome.flushed_seq) == (ApplyStatus.APPLIED, 3)
    assert plain.calls["checkpoint"] == 2
    assert await plain.load_messages("t") == make_messages(4)
    latest = await plain.latest_run("t")
    assert latest is not None
    assert (latest.run_id, latest.steps) == (second.run_id, 3)
    assert {run.run_id for run in await plain.list_runs("t")} == {first.run_id, second.run_id}
    thread = await plain.load_thread("t")
    assert thread is not None
    assert thread.metadata == {"n": 4}
    stored = await generic.read_thread("t", with_messages=True)
    assert stored.flushed_seq == 3
    assert stored.messages is not None
    assert len(stored.messages) == 4


async def test_deltas_apply_on_top_of_what_the_store_holds() -> None:
    generic, plain = target()
    chain = Chain()
    run = make_run("t")
    await generic.apply([[chain.checkpoint(make_messages(3), run)]])
    rewrite = [{"role": "system", "content": "new"}, *make_messages(2, start=5)]
    [outcome] = await generic.apply([[chain.checkpoint(rewrite, run)]])
    assert outcome.status is ApplyStatus.APPLIED
    assert await plain.load_messages("t") == rewrite


async def test_stale_and_gap_write_nothing() -> None:
    generic, plain = target()
    chain = Chain()
    entries = [chain.checkpoint(make_messages(n), make_run("t")) for n in (1, 2, 3)]
    await generic.apply([entries[:1]])
    before = plain.calls["checkpoint"]
    stale, gap = await generic.apply([entries[:1], entries[2:]])
    assert (stale.status, stale.flushed_seq) == (ApplyStatus.STALE, 1)
    assert (gap.status, gap.missing_from) == (ApplyStatus.GAP, 2)
    assert plain.calls["checkpoint"] == before


async def test_delete_in_the_chain_resets_the_thread() -> None:
    generic, plain = target()
    chain = Chain()
    old_run, new_run = make_run("t"), make_run("t")
    batch = [
        chain.checkpoint(make_messages(3), old_run),
        chain.delete(),
        chain.checkpoint(make_messages(1), new_run),
    ]
    [outcome] = await generic.apply([batch])
    assert outcome.flushed_seq == 3
    assert await plain.load_messages("t") == make_messages(1)
    assert await plain.load_run(old_run.run_id) is None
    [gone] = await generic.apply([[chain.delete()]])
    assert gone.status is ApplyStatus.APPLIED
    assert await plain.load_thread("t") is None
    assert await generic.flushed_seqs(["t", "other"]) == {"t": 4, "other": 0}


async def test_rejected_data_fails_the_thread_alone() -> None:
    generic, plain = target()
    plain.fail_with = ValidationError("rejected by the store")
    [failed] = await generic.apply([[Chain("t").checkpoint(make_messages(1), make_run("t"))]])
    assert failed.status is ApplyStatus.FAILED
    assert not failed.retriable
    assert failed.error is not None
    assert "rejected" in failed.error
    assert await generic.flushed_seqs(["t"]) == {"t": 0}


async def test_a_thread_changed_under_the_replay_fails_it_retriably() -> None:
    generic, plain = target()
    plain.fail_with = ConflictError("moved meanwhile")
    [failed] = await generic.apply([[Chain("t").checkpoint(make_messages(1), make_run("t"))]])
    assert failed.status is ApplyStatus.FAILED
    assert failed.retriable
    assert await generic.flushed_seqs(["t"]) == {"t": 0}


@pytest.mark.parametrize(
    "error",
    [StoreClosedError("closed"), SchemaError("no tables"), DatabaseRefusedError("no privilege")],
)
async def test_a_refusal_that_is_not_the_threads_data_is_raised(error: StoreError) -> None:
    """Taken for bad data, it would fail (and in time quarantine) every thread in turn."""
    generic, plain = target()
    plain.fail_with = error
    with pytest.raises(type(error)):
        await generic.apply([[Chain("t").checkpoint(make_messages(1), make_run("t"))]])
    assert await generic.flushed_seqs(["t"]) == {"t": 0}


@pytest.mark.parametrize(
    "error", [DatabaseUnavailableError("down"), ConnectionResetError("reset"), TimeoutError()]
)
async def test_unreachable_store_raises_database_unavailable(error: BaseException) -> None:
    generic, plain = target()
    plain.fail_with = error
    with pytest.raises(DatabaseUnavailableError):
        await generic.apply([[Chain("t").checkpoint(make_messages(1), make_run("t"))]])
    assert await generic.flushed_seqs(["t"]) == {"t": 0}


async def test_versioned_reads_report_the_watermark() -> None:
    generic, _ = target()
    chain = Chain()
    run = make_run("t")
    await generic.apply([[chain.checkpoint(make_messages(1), run), chain.checkpoint([], run)]])
    versioned = await generic.read_run(run.run_id)
    assert versioned is not None
    assert versioned.thread_seq == 2
    assert [v.thread_seq for v in await generic.read_runs("t", status=None, limit=5, offset=0)] == [
        2
    ]
    [stored] = await generic.read_threads(limit=5, offset=0)
    assert (stored.thread_id, stored.flushed_seq) == ("t", 2)
    assert await generic.read_run("unknown") is None


async def test_a_run_freed_by_a_delete_is_taken_over_in_the_same_call() -> None:
    """The owner's delete comes after the claimant's batch in the call: replayed in that
    order, the claimant's checkpoint found the run still on the owner."""
    generic, plain = target()
    owner, claimant = Chain("owner"), Chain("claimant")
    run = make_run("owner")
    await generic.apply([[owner.checkpoint(make_messages(1), run)]])
    taken = run.replace(thread_id="claimant", steps=4)
    outcomes = await generic.apply(
        [[claimant.checkpoint(make_messages(1), taken)], [owner.delete()]]
    )
    assert [o.status for o in outcomes] == [ApplyStatus.APPLIED, ApplyStatus.APPLIED]
    assert await plain.load_run(run.run_id) == taken
    assert await plain.load_thread("owner") is None


async def test_a_run_still_owned_elsewhere_names_its_owner() -> None:
    generic, _ = target()
    owner, claimant = Chain("owner"), Chain("claimant")
    run = make_run("owner")
    await generic.apply([[owner.checkpoint(make_messages(1), run)]])
    taken = run.replace(thread_id="claimant")
    [outcome] = await generic.apply([[claimant.checkpoint(make_messages(1), taken)]])
    assert (outcome.status, outcome.retriable, outcome.waits_for) == (
        ApplyStatus.FAILED,
        False,
        "owner",
    )
    assert "RunOwnershipError" in (outcome.error or "")


async def test_two_re_created_threads_swapping_their_runs_in_one_call() -> None:
    """A and B deleted, A re-created with B's old run and B with A's: replayed thread by
    thread, each checkpoint found its run still on the other thread (not deleted yet)."""
    generic, plain = target()
    a, b = Chain("a"), Chain("b")
    run_a, run_b = make_run("a"), make_run("b")
    await generic.apply(
        [[a.checkpoint(make_messages(2), run_a)], [b.checkpoint(make_messages(1), run_b)]]
    )
    a_takes, b_takes = run_b.replace(thread_id="a", steps=3), run_a.replace(thread_id="b", steps=5)
    outcomes = await generic.apply(
        [
            [a.delete(), a.checkpoint(make_messages(1, start=4), a_takes)],
            [b.delete(), b.checkpoint(make_messages(1, start=6), b_takes)],
        ]
    )
    assert [(o.status, o.flushed_seq) for o in outcomes] == [(ApplyStatus.APPLIED, 3)] * 2
    assert await plain.list_runs("a") == [a_takes]
    assert await plain.list_runs("b") == [b_takes]
    assert await plain.load_messages("a") == make_messages(1, start=4)
    assert await plain.load_messages("b") == make_messages(1, start=6)


@pytest.mark.parametrize(
    ("statuses", "expected"),
    [
        # thread: (status, waits_for); threads "a".."c" re-created, "d" deleted for good
        ({"a": ("failed", "b"), "b": ("failed", "a")}, [0, 1]),  # swapped
        ({"a": ("failed", "b"), "b": ("applied", None)}, [0]),  # its delete came too late
        ({"a": ("failed", "d"), "b": ("applied", None)}, [0]),  # deleted for good, applied
        ({"a": ("failed", "b"), "b": ("failed", None)}, []),  # b failed for its own reason
        ({"a": ("failed", "b"), "b": ("failed", "c"), "c": ("failed", None)}, []),  # chain
        ({"a": ("failed", "x"), "b": ("applied", None)}, []),  # owner not in the call
        ({"a": ("failed", "b"), "b": ("failed", "c"), "c": ("failed", "a")}, [0, 1, 2]),
    ],
)
def test_which_re_created_threads_are_replayed_again(
    statuses: dict[str, tuple[str, str | None]], expected: list[int]
) -> None:
    chains = {t: Chain(t) for t in [*statuses, "d"]}
    batches = [[chains[t].delete()] for t in [*statuses, "d"]]
    outcomes = {
        i: ApplyOutcome(t, ApplyStatus(status), 0, waits_for=owner)
        for i, (t, (status, owner)) in enumerate(statuses.items())
    }
    outcomes[len(statuses)] = ApplyOutcome("d", ApplyStatus.APPLIED, 1)
    groups = [[len(statuses)], list(range(len(statuses))), []]
    assert replay_again(batches, groups, outcomes) == expected
