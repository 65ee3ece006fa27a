"""`BufferedCheckpointSaver` beyond the conformance suite: what it refuses before writing,
ownership claims, the payload limit, read consistency, the sync bridge, and switching to
AsyncPostgresSaver after `force_flush_all`."""

from __future__ import annotations

import asyncio
import math
import uuid
from typing import Any, cast

import pytest
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import CheckpointMetadata
from langgraph.checkpoint.conformance.test_utils import generate_checkpoint
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

from buffered_store.config import ReadConsistency
from buffered_store.errors import (
    PayloadTooLargeError,
    StoreClosedError,
    ThreadOwnershipError,
    ValidationError,
)
from buffered_store.langgraph import BufferedCheckpointSaver, LangGraphConfig


def cfg(thread_id: str, checkpoint_id: str | None = None) -> RunnableConfig:
    configurable: dict[str, Any] = {"thread_id": thread_id, "checkpoint_ns": ""}
    if checkpoint_id is not None:
        configurable["checkpoint_id"] = checkpoint_id
    return {"configurable": configurable}


def thread() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


async def put(saver: BufferedCheckpointSaver, tid: str, **values: Any) -> RunnableConfig:
    cp = generate_checkpoint(channel_values=values, channel_versions=dict.fromkeys(values, 1))
    return await saver.aput(cfg(tid), cp, {"source": "input", "step": 0}, dict.fromkeys(values, 1))


@pytest.mark.parametrize(
    ("values", "metadata", "where"),
    [
        ({"a": math.nan}, {}, r"checkpoint\.channel_values\.a"),
        ({"a": "x\x00"}, {}, r"checkpoint\.channel_values\.a"),
        ({"a": 2**70}, {}, r"checkpoint\.channel_values\.a"),
        ({}, {"deep": {"k": "a\x00"}}, r"metadata\.deep\.k"),
        ({}, {"score": math.inf}, r"metadata\.score"),
        ({}, {"big": [2**64]}, r"metadata\.big\[0\]"),
    ],
)
async def test_what_postgres_would_refuse_is_refused_before_anything_is_written(
    saver: BufferedCheckpointSaver, values: dict[str, Any], metadata: dict[str, Any], where: str
) -> None:
    tid = thread()
    cp = generate_checkpoint(channel_values=values, channel_versions=dict.fromkeys(values, 1))
    with pytest.raises(ValidationError, match=where):
        await saver.aput(cfg(tid), cp, cast(CheckpointMetadata, {"step": 0, **metadata}), {})
    assert saver.stats()["entries"] == 0
    assert await saver.aget_tuple(cfg(tid)) is None
    with pytest.raises(ValidationError, match="thread_id contains a NUL"):
        await put(saver, "bad\x00id")


async def test_a_claim_shuts_out_every_other_writer(lg_config: LangGraphConfig) -> None:
    tid = thread()
    async with (
        BufferedCheckpointSaver.connect(lg_config.replace(owner="A")) as a,
        BufferedCheckpointSaver.connect(lg_config.replace(owner="B")) as b,
        BufferedCheckpointSaver.connect(lg_config) as anonymous,
    ):
        await a.claim(tid)
        await put(a, tid, x="1")
        await put(anonymous, thread())  # other threads stay open to anyone
        with pytest.raises(ThreadOwnershipError) as refused:
            await put(anonymous, tid, x="2")
        assert refused.value.owner == "A"
        await b.claim(tid)
        with pytest.raises(ThreadOwnershipError, match="claimed by 'B'"):
            await put(a, tid, x="3")  # A's cursor is stale: the CAS reloads it, then refuses
        with pytest.raises(ThreadOwnershipError):
            await a.aput_writes(cfg(tid, "x"), [("ch", 1)], "task")
        await put(b, tid, x="4")
        assert [t.checkpoint["channel_values"]["x"] async for t in a.alist(cfg(tid))] == [
            "4",
            "1",
        ]
        with pytest.raises(ValidationError, match="owner"):
            await anonymous.claim(tid)
        await anonymous.adelete_thread(tid)  # deleting stays open to anyone
        assert await b.aget_tuple(cfg(tid)) is None


async def test_an_entry_larger_than_the_server_takes_is_refused(
    saver: BufferedCheckpointSaver,
) -> None:
    tid = thread()
    with pytest.raises(PayloadTooLargeError, match="max_payload"):
        await put(saver, tid, big=["x" * 1024] * 1100)  # a blob of about 1.1 MiB
    assert saver.stats()["entries"] == 0
    assert await saver.aget_tuple(cfg(tid)) is None


async def test_read_consistency(lg_config: LangGraphConfig) -> None:
    tid = thread()
    async with (
        BufferedCheckpointSaver.connect(lg_config) as writer,
        BufferedCheckpointSaver.connect(
            lg_config.replace(read_consistency=ReadConsistency.EVENTUAL)
        ) as eventual,
        BufferedCheckpointSaver.connect(
            lg_config.replace(read_consistency=ReadConsistency.STRONG)
        ) as strong,
    ):
        written = await put(writer, tid, v="1")
        assert await eventual.aget_tuple(cfg(tid)) is None  # not flushed yet
        found = await writer.aget_tuple(cfg(tid))  # read-your-writes: the overlay
        assert found is not None
        assert found.config == written
        assert writer.stats()["overlay_reads"] == 1
        found = await strong.aget_tuple(cfg(tid))  # flushes first
        assert found is not None
        assert found.config == written
        found = await eventual.aget_tuple(cfg(tid))
        assert found is not None
        assert found.checkpoint["channel_values"] == {"v": "1"}


async def test_sync_methods_from_another_thread_only(saver: BufferedCheckpointSaver) -> None:
    tid = thread()
    written = await asyncio.to_thread(
        saver.put, cfg(tid), generate_checkpoint(), {"source": "input", "step": 0}, {}
    )
    found = await asyncio.to_thread(saver.get_tuple, cfg(tid))
    assert found is not None
    assert found.config == written
    assert len(await asyncio.to_thread(lambda: list(saver.list(cfg(tid))))) == 1
    with pytest.raises(asyncio.InvalidStateError, match="another thread"):
        saver.get_tuple(cfg(tid))


async def test_after_force_flush_all_async_postgres_saver_reads_the_same(
    saver: BufferedCheckpointSaver, lg_tables: str
) -> None:
    tids = [thread() for _ in range(3)]
    for tid in tids:
        first = await put(saver, tid, v={"n": 1}, s="inline")
        cp = generate_checkpoint(channel_values={"v": [1, 2]}, channel_versions={"v": 2})
        second = await saver.aput(first, cp, {"source": "loop", "step": 1}, {"v": 2})
        await saver.aput_writes(second, [("v", [3]), ("__interrupt__", "ask")], "task-1")
    assert await saver.force_flush_all() == 3
    assert await saver.force_flush_all() == 0
    async with AsyncPostgresSaver.from_conn_string(lg_tables) as reference:
        for tid in tids:
            ours = [t async for t in saver.alist(cfg(tid))]
            theirs = [t async for t in reference.alist(cfg(tid))]
            assert [t.checkpoint for t in ours] == [t.checkpoint for t in theirs]
            assert [t.pending_writes for t in ours] == [t.pending_writes for t in theirs]
            assert [t.metadata for t in ours] == [t.metadata for t in theirs]
            assert len(ours) == 2


async def test_a_closed_saver_refuses_calls(lg_config: LangGraphConfig) -> None:
    saver = await BufferedCheckpointSaver.connect(lg_config)
    await saver.close()
    await saver.close()  # idempotent
    with pytest.raises(StoreClosedError):
        await put(saver, thread())
    with pytest.raises(StoreClosedError):
        await saver.aget_tuple(cfg(thread()))


async def test_delete_for_runs_sees_a_checkpoint_flushed_while_it_looks(
    saver: BufferedCheckpointSaver,
) -> None:
    """Issue 24, defect 1, the interleaving made deterministic: a flusher commits the
    run's checkpoint right after delete_for_runs asked Postgres which threads hold the
    run. Looking in Postgres first and in the unflushed entries second found it in
    neither (not yet in Postgres, no longer pending) and left it in place."""
    tid = thread()
    cp = generate_checkpoint()
    run_config = cfg(tid)
    run_config["metadata"] = {"run_id": "doomed"}
    await saver.aput(run_config, cp, {"source": "loop", "step": 1}, {})
    asked = saver.sink.threads_with_runs

    async def flushed_meanwhile(run_ids: Any) -> set[str]:
        found = await asked(run_ids)
        await saver.force_flush(tid)  # what an embedded flusher may do at this moment
        return found

    saver.sink.threads_with_runs = flushed_meanwhile  # type: ignore[method-assign]
    await saver.adelete_for_runs(["doomed"])
    listed = [t async for t in saver.alist(cfg(tid))]
    assert [t.metadata.get("run_id") for t in listed] == []
