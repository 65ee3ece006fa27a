"""`buffered_store.testing.conformance` used the way a user uses it, without pytest: a
registered factory, `validate()`, and a report that names what a broken store got wrong."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from buffered_store import CheckpointReceipt, InMemoryThreadRunStore, Message, RunRecord
from buffered_store.testing import FaultyFlushTarget
from buffered_store.testing.conformance import (
    CheckResult,
    flush_target_checks,
    flush_target_test,
    store_checks,
    thread_run_store_test,
    validate,
)

opened: list[InMemoryThreadRunStore] = []


@thread_run_store_test("in-memory")
async def memory_store() -> AsyncIterator[InMemoryThreadRunStore]:
    store = InMemoryThreadRunStore()
    opened.append(store)
    yield store
    await store.close()  # idempotent: some checks close it themselves


@flush_target_test("in-memory, wrapped")
async def wrapped_target() -> AsyncIterator[FaultyFlushTarget]:
    target = FaultyFlushTarget(InMemoryThreadRunStore())
    yield target
    await target.close()


async def test_the_in_memory_store_passes_every_check_and_each_empty_check_gets_a_store() -> None:
    opened.clear()
    heard: list[CheckResult] = []
    report = await validate(memory_store, on_result=heard.append)
    assert report.passed_all(), report.summary()
    assert sorted(r.check for r in report.results) == sorted(c.id for c in store_checks())
    assert heard == report.results
    # One store shared by the checks that may share, one per check needing it empty.
    assert len(opened) == 1 + len(store_checks(empty=True))
    assert all(store.closed for store in opened)
    assert report.to_dict()["failed"] == 0


async def test_the_flush_target_suite_passes_on_the_in_memory_store() -> None:
    report = await validate(wrapped_target)
    assert report.passed_all(), report.summary()
    assert len(report.results) == len(flush_target_checks())


class DropsTheLastMessage(InMemoryThreadRunStore):
    """A broken store: every checkpoint loses its snapshot's last message."""

    async def checkpoint(
        self, thread_id: str, messages: Sequence[Message], run: RunRecord, **kwargs: Any
    ) -> CheckpointReceipt:
        return await super().checkpoint(thread_id, list(messages)[:-1], run, **kwargs)


@thread_run_store_test("broken")
async def broken_store() -> AsyncIterator[DropsTheLastMessage]:
    store = DropsTheLastMessage()
    yield store
    await store.close()


async def test_a_broken_store_gets_a_report_naming_the_failed_checks() -> None:
    report = await validate(broken_store, groups={"snapshots", "lifecycle"})
    assert not report.passed_all()
    failed = {r.check for r in report.failed}
    assert "snapshots/messages_round_trip" in failed
    assert "snapshots/empty_snapshot_clears_messages" not in failed  # nothing to drop
    assert not any(check.startswith("lifecycle/") for check in failed)
    assert {r.group for r in report.results} == {"snapshots", "lifecycle"}
    first = next(r for r in report.failed if r.check == "snapshots/messages_round_trip")
    assert first.error is not None
    assert "AssertionError" in first.error
    assert "FAILED snapshots/messages_round_trip" in report.summary()


async def test_a_factory_that_cannot_open_fails_every_check_with_its_error() -> None:
    @thread_run_store_test("unreachable")
    async def unreachable() -> AsyncIterator[InMemoryThreadRunStore]:
        raise ConnectionRefusedError("no server")
        yield InMemoryThreadRunStore()  # pragma: no cover

    report = await validate(unreachable, groups={"threads", "lifecycle"})
    assert report.results
    assert not report.passed
    assert all("ConnectionRefusedError" in (r.error or "") for r in report.failed)


async def test_a_lifespan_runs_once_around_the_whole_run() -> None:
    events: list[str] = []

    async def lifespan() -> AsyncIterator[None]:
        events.append("up")
        yield
        events.append("down")

    @thread_run_store_test("with lifespan", lifespan=lifespan)
    async def factory() -> AsyncIterator[InMemoryThreadRunStore]:
        events.append("store")
        store = InMemoryThreadRunStore()
        yield store
        await store.close()

    report = await validate(factory, groups={"lifecycle"})
    assert report.passed_all(), report.summary()
    assert events[0] == "up"
    assert events[-1] == "down"
    assert events.count("up") == events.count("down") == 1
