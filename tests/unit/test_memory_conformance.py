"""`InMemoryThreadRunStore`: the conformance suites, its counters and its own extras."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime, timedelta

import pytest

from buffered_store import (
    InMemoryThreadRunStore,
    RunOwnershipError,
    RunStatus,
    StoreClosedError,
    ThreadRunStore,
    ValidationError,
)
from buffered_store.engine.flushing import ApplyStatus
from buffered_store.testing import FaultyFlushTarget, InnerStore, make_messages, make_run
from buffered_store.testing.conformance import (
    T0,
    Chain,
    TickingClock,
    fresh_id,
    replace_entry,
)
from buffered_store.testing.conformance.pytest_suite import FlushTargetSuite, ThreadRunStoreSuite


class TestInMemoryConformance(ThreadRunStoreSuite):
    """The suite with the real clock and with a fake one."""

    @pytest.fixture(params=["real-clock", "ticking-clock"])
    async def store(self, request: pytest.FixtureRequest) -> AsyncIterator[ThreadRunStore]:
        store = (
            InMemoryThreadRunStore()
            if request.param == "real-clock"
            else InMemoryThreadRunStore(clock=TickingClock())
        )
        yield store
        await store.close()

    @pytest.fixture
    def empty_store(self, store: ThreadRunStore) -> ThreadRunStore:
        return store


class TestFaultyWrapperConformance(ThreadRunStoreSuite):
    """`FaultyFlushTarget` with no fault armed is indistinguishable from its inner store."""

    @pytest.fixture
    async def store(self) -> AsyncIterator[ThreadRunStore]:
        store = FaultyFlushTarget(InMemoryThreadRunStore())
        yield store
        await store.close()

    @pytest.fixture
    def empty_store(self, store: ThreadRunStore) -> ThreadRunStore:
        return store


class TestInMemoryFlushTarget(FlushTargetSuite):
    """The `FlushTarget` contract, directly and through an idle `FaultyFlushTarget`."""

    @pytest.fixture(params=["direct", "wrapped"])
    async def target(self, request: pytest.FixtureRequest) -> AsyncIterator[InnerStore]:
        store: InnerStore = InMemoryThreadRunStore(clock=TickingClock())
        if request.param == "wrapped":
            store = FaultyFlushTarget(store)
        yield store
        await store.close()


# -- counters and memory-only behaviour -----------------------------------------------------


@pytest.fixture
async def memory() -> AsyncIterator[InMemoryThreadRunStore]:
    store = InMemoryThreadRunStore(clock=TickingClock())
    yield store
    await store.close()


async def test_stats_after_apply(memory: InMemoryThreadRunStore) -> None:
    chain = Chain()
    await memory.apply([[chain.checkpoint(make_messages(n)) for n in (1, 2, 3)]])
    assert memory.stats() == {
        "apply_calls": 1,
        "thread_applications": 1,
        "applied_entries": 3,
        "checkpoints": 0,
        "deletes": 0,
        "threads": 1,
        "runs": 3,
    }


async def test_ten_checkpoints_reach_the_store_in_fewer_applications(
    memory: InMemoryThreadRunStore,
) -> None:
    chain = Chain()
    run = make_run(chain.thread_id)
    entries = [chain.checkpoint(make_messages(n), run.replace(steps=n)) for n in range(1, 11)]
    for start in range(0, 10, 4):
        await memory.apply([entries[start : start + 4]])
    assert memory.thread_applications == 3 < 10
    assert memory.applied_entries == 10


async def test_several_threads_count_one_application_each(
    memory: InMemoryThreadRunStore,
) -> None:
    chains = [Chain() for _ in range(8)]
    await memory.apply(
        [[chain.checkpoint(make_messages(n)) for n in range(1, 6)] for chain in chains]
    )
    assert (memory.apply_calls, memory.thread_applications, memory.applied_entries) == (1, 8, 40)


async def test_stale_gap_and_failed_applications_are_not_counted(
    memory: InMemoryThreadRunStore,
) -> None:
    chain = Chain()
    e1, e2, e3 = (chain.checkpoint(make_messages(n)) for n in (1, 2, 3))
    await memory.apply([[e1]])
    await memory.apply([[e1], [e3], [replace_entry(e2, keep=9, message_count=10)]])
    assert (memory.apply_calls, memory.thread_applications, memory.applied_entries) == (2, 1, 1)


async def test_inconsistent_message_count_fails(memory: InMemoryThreadRunStore) -> None:
    chain = Chain()
    entry = replace_entry(chain.checkpoint(make_messages(2)), message_count=7)
    [outcome] = await memory.apply([[entry]])
    assert (outcome.status, outcome.retriable) == (ApplyStatus.FAILED, False)
    assert "CorruptEntryError" in (outcome.error or "")
    assert await memory.load_thread(chain.thread_id) is None


async def test_injected_clock_sets_thread_times() -> None:
    clock = TickingClock(T0)
    store = InMemoryThreadRunStore(clock=clock)
    tid = fresh_id()
    await store.checkpoint(tid, [], make_run(tid))
    await store.checkpoint(tid, [], make_run(tid))
    thread = await store.load_thread(tid)
    assert thread is not None
    assert (thread.created_at, thread.updated_at) == (
        T0 + timedelta(milliseconds=1),
        T0 + timedelta(milliseconds=2),
    )


async def test_naive_clock_is_rejected_before_writing() -> None:
    store = InMemoryThreadRunStore(clock=lambda: datetime(2026, 1, 1))
    tid = fresh_id()
    with pytest.raises(ValidationError):
        await store.checkpoint(tid, [], make_run(tid))
    assert await store.load_thread(tid) is None


async def test_run_of_another_thread_is_refused_until_that_thread_is_deleted(
    memory: InMemoryThreadRunStore,
) -> None:
    # Runs never move between threads (issue 9, finding 6); this test used to assert
    # that they did. Deleting the owner frees the id.
    first, second = fresh_id(), fresh_id()
    run = make_run(first)
    await memory.checkpoint(first, [], run)
    moved = run.replace(thread_id=second)
    with pytest.raises(RunOwnershipError):
        await memory.checkpoint(second, [], moved)
    assert await memory.load_run(run.run_id) == run
    assert await memory.list_runs(first) == [run]
    await memory.delete_thread(first)
    await memory.checkpoint(second, [], moved)
    assert await memory.load_run(run.run_id) == moved


async def test_list_runs_status_may_be_a_string(memory: InMemoryThreadRunStore) -> None:
    tid = fresh_id()
    run = make_run(tid, status=RunStatus.DONE)
    await memory.checkpoint(tid, [], run)
    assert await memory.list_runs(tid, status=RunStatus("done")) == [run]
    assert await memory.list_runs(tid, status="done") == [run]  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        await memory.list_runs(tid, status="finished")  # type: ignore[arg-type]


async def test_counters_count_direct_writes_apart(memory: InMemoryThreadRunStore) -> None:
    tid = fresh_id()
    await memory.checkpoint(tid, [], make_run(tid))
    await memory.checkpoint(tid, [], make_run(tid))
    await memory.delete_thread(tid)
    await memory.delete_thread(tid)
    stats = memory.stats()
    assert (stats["checkpoints"], stats["deletes"]) == (2, 1)
    assert (stats["apply_calls"], stats["thread_applications"], stats["threads"]) == (0, 0, 0)


async def test_closed_store_refuses_flush_target_calls() -> None:
    store = InMemoryThreadRunStore()
    async with store:
        pass
    assert store.closed
    calls = [
        store.apply([]),
        store.read_thread("t", with_messages=False),
        store.read_run("r"),
        store.read_runs(None, status=None, limit=1, offset=0),
        store.read_threads(limit=1, offset=0),
        store.flushed_seqs(["t"]),
    ]
    for call in calls:
        with pytest.raises(StoreClosedError):
            await call
    with pytest.raises(StoreClosedError):
        async with store:
            pass
