"""`buffered_store.testing`: the fault-injecting wrapper and the record factories."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from buffered_store import (
    DatabaseUnavailableError,
    InMemoryThreadRunStore,
    RunStatus,
    ThreadRunStore,
    WalUnavailableError,
)
from buffered_store.engine.flushing import ApplyStatus
from buffered_store.engine.ids import utcnow
from buffered_store.model.changes import (
    WalEntry,
)
from buffered_store.model.checkpointing import build_checkpoint_entry, validate_checkpoint
from buffered_store.model.target import FlushTarget
from buffered_store.testing import FaultyFlushTarget, InnerStore, make_messages, make_run
from buffered_store.testing.conformance import fresh_id


def _entries(thread_id: str, count: int) -> list[WalEntry]:
    entries, previous, encoded = [], None, None
    for seq in range(1, count + 1):
        call = validate_checkpoint(thread_id, make_messages(seq), make_run(thread_id), None)
        entry = build_checkpoint_entry(
            call, previous=previous, previous_messages=encoded, seq=seq, now=utcnow()
        )
        entries.append(entry)
        previous, encoded = entry.thread, call.encoded
    return entries


def _batch(thread_id: str | None = None, count: int = 1) -> Sequence[Sequence[WalEntry]]:
    return [_entries(thread_id or fresh_id(), count)]


async def test_wrapper_implements_both_protocols() -> None:
    faulty = FaultyFlushTarget(InMemoryThreadRunStore())
    assert isinstance(faulty, ThreadRunStore)
    assert isinstance(faulty, FlushTarget)
    assert isinstance(faulty, InnerStore)
    assert isinstance(faulty.inner, InMemoryThreadRunStore)


async def test_forwards_and_counts_calls() -> None:
    inner = InMemoryThreadRunStore()
    faulty = FaultyFlushTarget(inner)
    tid = fresh_id()
    await faulty.checkpoint(tid, make_messages(2), make_run(tid), metadata={"k": 1})
    assert await faulty.load_messages(tid) == make_messages(2)
    assert await inner.load_messages(tid) == make_messages(2)
    [outcome] = await faulty.apply(_batch())
    assert outcome.status is ApplyStatus.APPLIED
    assert (await faulty.read_thread(tid, with_messages=False)).flushed_seq == 1
    assert await faulty.flushed_seqs([tid]) == {tid: 1}
    assert len(await faulty.read_threads(limit=5, offset=0)) == 2
    assert await faulty.read_runs(tid, status=RunStatus.RUNNING, limit=5, offset=0)
    assert faulty.calls["checkpoint"] == 1
    assert faulty.calls["apply"] == 1
    assert (faulty.apply_calls, faulty.forwarded_applies, inner.apply_calls) == (1, 1, 1)


async def test_fail_next_applies_then_recovers() -> None:
    inner = InMemoryThreadRunStore()
    faulty = FaultyFlushTarget(inner)
    batch = _batch(count=2)
    faulty.fail_next_applies(3)
    for _ in range(3):
        with pytest.raises(DatabaseUnavailableError) as info:
            await faulty.apply(batch)
        assert info.value.retriable
    assert inner.apply_calls == 0, "a failed apply never reaches the inner store"
    [outcome] = await faulty.apply(batch)
    assert (outcome.status, outcome.flushed_seq) == (ApplyStatus.APPLIED, 2)
    assert (faulty.apply_calls, faulty.failed_applies, faulty.forwarded_applies) == (4, 3, 1)


async def test_fail_next_applies_with_custom_error() -> None:
    faulty = FaultyFlushTarget(InMemoryThreadRunStore())
    faulty.fail_next_applies(1, WalUnavailableError)
    with pytest.raises(WalUnavailableError):
        await faulty.apply(_batch())
    error = RuntimeError("boom")
    faulty.fail_next_applies(1, error)
    with pytest.raises(RuntimeError) as info:
        await faulty.apply(_batch())
    assert info.value is error
    faulty.fail_next_applies(2)
    faulty.fail_next_applies(0)
    await faulty.apply(_batch())
    with pytest.raises(ValueError, match=">= 0"):
        faulty.fail_next_applies(-1)


async def test_blocked_apply_waits_until_unblocked() -> None:
    inner = InMemoryThreadRunStore()
    faulty = FaultyFlushTarget(inner)
    faulty.block_applies()
    task = asyncio.create_task(faulty.apply(_batch()))
    await faulty.wait_for_blocked_apply()
    assert faulty.blocked_applies == 1
    assert not task.done()
    assert inner.apply_calls == 0
    faulty.unblock_applies()
    [outcome] = await task
    assert outcome.status is ApplyStatus.APPLIED
    assert faulty.blocked_applies == 0


async def test_blocked_apply_can_time_out_without_writing() -> None:
    inner = InMemoryThreadRunStore()
    faulty = FaultyFlushTarget(inner)
    faulty.block_applies()
    tid = fresh_id()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(faulty.apply(_batch(tid)), timeout=0.01)
    assert faulty.blocked_applies == 0
    assert await inner.load_thread(tid) is None
    faulty.unblock_applies()
    [outcome] = await faulty.apply(_batch(tid))
    assert outcome.status is ApplyStatus.APPLIED


async def test_close_releases_blocked_applies() -> None:
    faulty = FaultyFlushTarget(InMemoryThreadRunStore())
    faulty.block_applies()
    task = asyncio.create_task(faulty.apply(_batch()))
    await faulty.wait_for_blocked_apply()
    await faulty.close()
    with pytest.raises(Exception, match="closed"):
        await task


async def test_apply_delay() -> None:
    faulty = FaultyFlushTarget(InMemoryThreadRunStore(), apply_delay_s=0.02)
    loop = asyncio.get_running_loop()
    started = loop.time()
    [outcome] = await faulty.apply(_batch())
    assert loop.time() - started >= 0.02
    assert outcome.status is ApplyStatus.APPLIED


def test_make_run() -> None:
    run = make_run("t1")
    assert (run.thread_id, run.agent_id, run.status) == ("t1", "agent", RunStatus.RUNNING)
    assert run.run_id != make_run("t1").run_id
    custom = make_run("t1", "r1", status=RunStatus.DONE, steps=3, agent_id="a2")
    assert (custom.run_id, custom.status, custom.steps, custom.agent_id) == (
        "r1",
        RunStatus.DONE,
        3,
        "a2",
    )


def test_make_messages() -> None:
    assert make_messages(2) == [
        {"role": "user", "content": "message 0"},
        {"role": "assistant", "content": "message 1"},
    ]
    assert make_messages(3) == make_messages(5)[:3]
    assert make_messages(2, start=3) == make_messages(5)[3:]
    sized = make_messages(3, size=1000)
    assert all(len(m["content"]) == 1000 for m in sized)
    assert len({m["content"] for m in sized}) == 3
    assert make_messages(0) == []
