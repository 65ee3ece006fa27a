"""What users of AsyncPostgresSaver expect of a drop-in (issue 24): `from_conn_string` as
an async context manager, and `alist(None, ...)` (a search across threads) that reads
the unflushed entries without flushing every pending thread first."""

from __future__ import annotations

import uuid
from typing import Any, cast

import pytest
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import CheckpointMetadata, CheckpointTuple
from langgraph.checkpoint.conformance.test_utils import generate_checkpoint
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

from buffered_store.errors import StoreClosedError
from buffered_store.langgraph import BufferedCheckpointSaver, LangGraphConfig


def cfg(thread_id: str) -> RunnableConfig:
    return {"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}}


async def test_from_conn_string_opens_and_closes_like_async_postgres_savers(
    lg_config: LangGraphConfig, pg_dsn: str, nats_url: str
) -> None:
    wal = {
        name: getattr(lg_config, name)
        for name in ("stream_name", "hot_bucket", "quarantine_bucket", "consumer_name")
    }
    tid = f"fcs-{uuid.uuid4().hex[:8]}"
    cp = generate_checkpoint(channel_values={"x": [1, 2]}, channel_versions={"x": 1})
    async with BufferedCheckpointSaver.from_conn_string(pg_dsn, nats_url=nats_url, **wal) as saver:
        assert isinstance(saver, BufferedCheckpointSaver)
        assert saver.settings.conninfo == pg_dsn
        assert saver.settings.nats_url == nats_url
        await saver.setup()
        written = await saver.aput(cfg(tid), cp, {"source": "input", "step": 0}, {"x": 1})
        found = await saver.aget_tuple(cfg(tid))
        assert found is not None
        assert found.config == written
    with pytest.raises(StoreClosedError):
        await saver.aget_tuple(cfg(tid))
    # Closing drained the thread: AsyncPostgresSaver reads the same checkpoint.
    async with AsyncPostgresSaver.from_conn_string(pg_dsn) as reference:
        theirs = await reference.aget_tuple(cfg(tid))
        assert theirs is not None
        assert theirs.checkpoint["channel_values"] == {"x": [1, 2]}
        assert theirs.config == written


def tuple_view(t: CheckpointTuple) -> tuple[Any, ...]:
    return (
        t.config,
        t.checkpoint,
        t.metadata,
        t.parent_config,
        sorted(t.pending_writes or [], key=repr),
    )


async def test_a_search_across_threads_reads_pending_threads_without_flushing_them(
    lg_config: LangGraphConfig, pg_dsn: str
) -> None:
    """``alist(None, ...)`` over flushed threads, a thread only in the WAL, a thread with
    a pending checkpoint and pending writes on a stored one, a pending delete of a stored
    thread and a stored checkpoint put again with new metadata: every filter, `before`
    and `limit` answers as AsyncPostgresSaver does once everything is flushed, and
    nothing was flushed to answer. (On main before this change the search flushed every
    pending thread first.)"""
    run = uuid.uuid4().hex
    tids = {name: f"search-{name}-{run[:6]}" for name in "ABCDE"}
    parents: dict[str, str | None] = dict.fromkeys(tids.values())
    versions: dict[str, int] = dict.fromkeys(tids.values(), 0)

    async def put(saver: BufferedCheckpointSaver, tid: str, step: int, **extra: Any) -> str:
        versions[tid] += 1
        v = versions[tid]
        cp = generate_checkpoint(
            channel_values={"msgs": [f"{tid}-{i}" for i in range(v)], "n": v},
            channel_versions={"msgs": v, "n": v},
        )
        cp["v"] = 4
        config: dict[str, Any] = {"thread_id": tid, "checkpoint_ns": ""}
        if parents[tid] is not None:
            config["checkpoint_id"] = parents[tid]
        metadata: Any = {"test": run, "source": "loop", "step": step, **extra}
        await saver.aput({"configurable": config}, cp, metadata, {"msgs": v, "n": v})
        parents[tid] = cp["id"]
        return cp["id"]

    config = lg_config.replace(drain_on_close=False)
    async with BufferedCheckpointSaver.connect(config) as saver:
        ids: dict[str, list[str]] = {t: [] for t in tids.values()}
        for step in range(3):  # round robin: the threads' checkpoint ids interleave
            for tid in tids.values():
                if step < 2 or tid == tids["A"]:
                    ids[tid].append(await put(saver, tid, step))
        for name in "ACDE":
            await saver.force_flush(tids[name])
        c, d, e = tids["C"], tids["D"], tids["E"]
        stored_c: RunnableConfig = {
            "configurable": {"thread_id": c, "checkpoint_ns": "", "checkpoint_id": ids[c][1]}
        }
        await saver.aput_writes(stored_c, [("msgs", "w1"), ("n", 7)], "task-c")
        ids[c].append(await put(saver, c, 2, late=True))
        await saver.aput_writes(
            {"configurable": {"thread_id": c, "checkpoint_ns": "", "checkpoint_id": ids[c][2]}},
            [("msgs", "w2")],
            "task-c2",
        )
        await saver.adelete_thread(d)
        # E's stored newest checkpoint put again, with other metadata (replaces the row).
        again = generate_checkpoint(
            checkpoint_id=ids[e][1], channel_values={"n": 9}, channel_versions={"n": 9}
        )
        again["v"] = 4
        # (The same parent: a flush keeps the stored parent, and the overlay does not
        # model that yet.)
        await saver.aput(
            {"configurable": {"thread_id": e, "checkpoint_ns": "", "checkpoint_id": ids[e][0]}},
            again,
            cast(CheckpointMetadata, {"test": run, "source": "update", "step": 9}),
            {"n": 9},
        )

        every = sorted((i for tid in tids.values() for i in ids[tid]), reverse=True)
        queries: list[dict[str, Any]] = [
            {"filter": {"test": run}},
            *({"filter": {"test": run}, "limit": n} for n in (1, 2, 3, 5, 8)),
            {"filter": {"test": run, "step": 1}},
            {"filter": {"test": run, "source": "update"}},
            {"filter": {"test": run, "step": 9}, "limit": 1},
            *(
                {"filter": {"test": run}, "before": {"configurable": {"checkpoint_id": cid}}}
                for cid in every[1::3]
            ),
            {
                "filter": {"test": run},
                "before": {"configurable": {"checkpoint_id": every[4]}},
                "limit": 2,
            },
        ]
        # Postgres statements of one search, whatever the number of pending threads: the
        # scan's watermarks, every thread's rows, then the pending rows' blobs and writes.
        opened: list[str] = []
        connection = saver.sink.connection

        def counted(what: str) -> Any:
            opened.append(what)
            return connection(what)

        saver.sink.connection = counted  # type: ignore[method-assign]
        try:
            assert [t async for t in saver.alist(None, filter={"test": run})]
        finally:
            saver.sink.connection = connection  # type: ignore[method-assign]
        assert sorted(opened) == ["list", "list blobs", "list writes", "read watermarks"]
        inline = saver.stats()["inline_flushes"]
        ours = [[tuple_view(t) async for t in saver.alist(None, **q)] for q in queries]
        assert saver.stats()["inline_flushes"] == inline
        marks = await saver.sink.flushed_seqs([tids["B"], c, d, e])
        assert marks[tids["B"]] == 0  # nothing was flushed to answer
        assert ours[0], "the search found nothing"
        assert {t[0]["configurable"]["thread_id"] for t in ours[0]} == {tids[n] for n in "ABCE"}

        assert await saver.force_flush_all() == 4
        assert (await saver.sink.flushed_seqs([c]))[c] > marks[c]
    async with AsyncPostgresSaver.from_conn_string(pg_dsn) as reference:
        theirs = [[tuple_view(t) async for t in reference.alist(None, **q)] for q in queries]
    for query, mine, want in zip(queries, ours, theirs, strict=True):
        assert mine == want, query
