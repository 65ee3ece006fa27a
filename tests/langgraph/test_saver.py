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
from buffered_store.nats import NatsWal


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


async def test_a_growing_message_list_costs_the_wal_only_its_new_messages(
    lg_config: LangGraphConfig, pg_dsn: str
) -> None:
    """Issue 23, item 3: a list channel whose new value extends the previous one (the
    messages channel under add_messages) is written as its new items: WAL bytes per put
    do not grow with the history, and after a flush Postgres holds the whole lists, as
    AsyncPostgresSaver would."""
    tid = thread()
    sizes: list[int] = []
    history: list[Any] = []
    head = cfg(tid)
    async with BufferedCheckpointSaver.connect(lg_config) as saver:
        for step in range(1, 201):
            history = [*history, {"role": "ai", "content": f"message {step} " + "x" * 200}]
            cp = generate_checkpoint(
                channel_values={"messages": history}, channel_versions={"messages": step}
            )
            before = saver.stats()["wal_bytes"]
            head = await saver.aput(head, cp, {"source": "loop", "step": step}, {"messages": step})
            sizes.append(saver.stats()["wal_bytes"] - before)
        assert saver.stats()["delta_blobs"] == 199
        assert max(sizes[100:]) < 1.2 * sizes[1]  # flat, while the history grew 200 times
        ours = await saver.aget_tuple(cfg(tid))
        assert ours is not None
        assert ours.checkpoint["channel_values"]["messages"] == history  # read from the tail
        await saver.force_flush(tid)
    async with AsyncPostgresSaver.from_conn_string(pg_dsn) as reference:
        theirs = [t async for t in reference.alist(cfg(tid))]
    assert len(theirs) == 200
    assert theirs[0].checkpoint["channel_values"]["messages"] == history
    assert theirs[-1].checkpoint["channel_values"]["messages"] == history[:1]


async def test_another_writer_in_between_makes_the_next_list_whole(
    lg_config: LangGraphConfig,
) -> None:
    """A delta assumes the base this saver put last is the thread's latest value of the
    channel; after another writer's put it is not, and the blob is written whole."""
    tid = thread()
    first = [{"role": "user", "content": "a"}]
    async with (
        BufferedCheckpointSaver.connect(lg_config) as mine,
        BufferedCheckpointSaver.connect(lg_config) as theirs,
    ):

        async def put(saver: BufferedCheckpointSaver, values: list[Any], version: int) -> None:
            cp = generate_checkpoint(
                channel_values={"messages": values}, channel_versions={"messages": version}
            )
            await saver.aput(cfg(tid), cp, {"step": version}, {"messages": version})

        await put(mine, first, 1)
        await put(theirs, [{"role": "user", "content": "other"}], 2)
        await put(mine, [*first, {"role": "ai", "content": "b"}], 3)  # extends ITS base
        assert mine.stats()["delta_blobs"] == 1
        assert mine.stats()["deltas_dropped"] == 1  # rebuilt whole on the fresh cursor
        latest = await theirs.aget_tuple(cfg(tid))
        assert latest is not None
        assert latest.checkpoint["channel_values"]["messages"] == [
            {"role": "user", "content": "a"},
            {"role": "ai", "content": "b"},
        ]


async def test_check_deltas_catches_an_item_changed_in_place(lg_config: LangGraphConfig) -> None:
    """A delta assumes saved items are not changed in place (LangGraph's reducers never
    do); ``check_deltas`` verifies it, and writes such a list whole."""
    tid = thread()
    history: list[dict[str, Any]] = [{"role": "user", "content": "a"}]
    async with BufferedCheckpointSaver.connect(lg_config.replace(check_deltas=True)) as saver:

        async def put(values: list[Any], version: int) -> None:
            cp = generate_checkpoint(
                channel_values={"messages": values}, channel_versions={"messages": version}
            )
            await saver.aput(cfg(tid), cp, {"step": version}, {"messages": version})

        await put(history, 1)
        history = [*history, {"role": "ai", "content": "b"}]
        await put(history, 2)
        history[0]["content"] = "changed in place"
        history = [*history, {"role": "ai", "content": "c"}]
        await put(history, 3)
        assert saver.stats()["delta_blobs"] == 1
        assert saver.stats()["deltas_refused"] == 1
        latest = await saver.aget_tuple(cfg(tid))
        assert latest is not None
        assert latest.checkpoint["channel_values"]["messages"][0]["content"] == "changed in place"


async def test_a_write_is_acknowledged_before_its_hot_record_and_read_anywhere(
    lg_config: LangGraphConfig,
) -> None:
    """Issue 23, item 4: the hot record is advanced in the background (a write costs one
    round trip), so it may lag. Readers on any instance still see every acknowledged
    write (they read the subject's last entry beside it), and another writer's write on
    top of the lagging record keeps the seqs in order."""
    tid = thread()
    released = asyncio.Event()
    async with (
        BufferedCheckpointSaver.connect(lg_config) as writer,
        BufferedCheckpointSaver.connect(lg_config) as reader,
    ):
        swap = writer.wal.kv_swap

        async def held_swap(key: str, value: bytes, *, revision: int | None) -> int:
            await released.wait()
            return await swap(key, value, revision=revision)

        writer.wal.kv_swap = held_swap  # type: ignore[method-assign]
        first = await put(writer, tid, step=1)
        assert writer.stats()["entries"] == 1  # acknowledged while the KV update waits
        seen = await reader.aget_tuple(cfg(tid))
        assert seen is not None
        assert seen.config == first
        cp = generate_checkpoint(channel_values={"step": 2}, channel_versions={"step": 2})
        second = await reader.aput(first, cp, {"source": "loop", "step": 2}, {"step": 2})
        released.set()
        await writer.force_flush_all()
        latest = await writer.aget_tuple(cfg(tid))
        assert latest is not None
        assert latest.config == second
        assert [t.config async for t in writer.alist(cfg(tid))] == [second, first]


async def test_reading_its_own_unflushed_thread_fetches_no_entry(
    saver: BufferedCheckpointSaver,
) -> None:
    """Issue 23, item 4: a run starts by reading its thread; the entries this saver wrote
    are kept (they never change), so the read's only NATS requests are the hot record and
    the subject's last entry, in one round trip."""
    tid = thread()
    for step in range(1, 6):
        await put(saver, tid, step=step)
    wal = saver.wal
    assert isinstance(wal, NatsWal)
    asked = wal.record_requests()
    found = await saver.aget_tuple(cfg(tid))
    assert found is not None
    assert found.checkpoint["channel_values"] == {"step": 5}
    assert len(asked) == 2, asked  # the KV get and the last message: no direct get by seq


async def test_an_overlay_read_takes_the_tails_rows_in_one_round_trip(
    saver: BufferedCheckpointSaver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 23, item 4: a run-start read over an unflushed tail costs two database
    round trips, one connection each: the checkpoint rows, then the stored blobs, writes
    and parent writes the tail refers to, together (they used to take three connections
    at once, one per kind)."""
    tid = thread()
    first = await put(saver, tid, items=["a", "b"])
    await saver.aput_writes(first, [("items", ["c"])], "task-1", "")
    await saver.force_flush(tid)  # the list's blob and the writes are now rows
    cp = generate_checkpoint(channel_values={"items": ["a", "b"]}, channel_versions={"items": 1})
    second = await saver.aput(
        cast(RunnableConfig, {"configurable": {**first["configurable"]}}),
        cp,
        cast(CheckpointMetadata, {"source": "loop", "step": 1}),
        {},  # no new version: the blob stays the stored one
    )
    await saver.aput_writes(second, [("items", ["d"])], "task-2", "")
    opened: list[str] = []
    connection = saver.sink.connection

    def counted(what: str) -> Any:
        opened.append(what)
        return connection(what)

    monkeypatch.setattr(saver.sink, "connection", counted)
    found = await saver.aget_tuple(cfg(tid))
    assert found is not None
    assert found.config["configurable"]["checkpoint_id"] == second["configurable"]["checkpoint_id"]
    assert found.checkpoint["channel_values"] == {"items": ["a", "b"]}  # the stored blob
    assert [w[1:] for w in found.pending_writes or []] == [("items", ["d"])]
    assert [w for w in opened if w != "order ids"] == ["read", "read the tail's rows"], opened
