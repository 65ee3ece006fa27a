"""Postgres stopped while graphs run on new threads: puts keep succeeding (NATS only), the
graphs' reads come from the WAL alone (a thread the WAL holds from its first entry), and
once Postgres is back the flush brings LangGraph's tables to exactly that state.

The savers reach Postgres through a `CuttableProxy` (tests/plugins/network.py) and the
outage is a cut of that link, as in the thread-run outage tests: the shared server keeps
serving every other test, and the reference reads afterwards go to it directly.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from langgraph.types import Command

from buffered_store.dev.proxy import CuttableProxy
from buffered_store.errors import DatabaseUnavailableError
from buffered_store.langgraph import BufferedCheckpointSaver, LangGraphConfig
from tests.langgraph.graph import build_graph


async def test_graphs_on_new_threads_run_through_a_postgres_outage(
    lg_config: LangGraphConfig, pg_dsn: str, postgres_link: CuttableProxy
) -> None:
    config = lg_config.replace(
        database_url=postgres_link.via(pg_dsn), drain_on_close=False, db_timeout_s=0.5
    )
    old = f"old-{uuid.uuid4().hex[:8]}"
    threads = [f"outage-{i}-{uuid.uuid4().hex[:6]}" for i in range(3)]
    runs: dict[str, RunnableConfig] = {
        t: {"configurable": {"thread_id": t}} for t in [old, *threads]
    }
    async with BufferedCheckpointSaver.connect(config) as saver:
        graph = build_graph(saver)
        # A thread written and flushed before the outage: its history is in Postgres.
        await graph.ainvoke({"items": ["old"], "answer": ""}, runs[old])
        await graph.ainvoke(Command(resume="before"), runs[old])
        assert await saver.force_flush_all() == 1

        postgres_link.cut()
        try:
            for thread_id in threads:
                out = await graph.ainvoke({"items": [thread_id], "answer": ""}, runs[thread_id])
                assert out["__interrupt__"][0].value == {
                    "question": "approve?",
                    "items": [thread_id],
                }
            for thread_id in threads:
                done = await graph.ainvoke(Command(resume="during"), runs[thread_id])
                assert done == {"items": [thread_id, "done:during"], "answer": "during"}
                state = await graph.aget_state(runs[thread_id])
                assert state.values == done
                assert state.next == ()
            during = {
                t: [s.config async for s in graph.aget_state_history(runs[t])] for t in threads
            }
            assert saver.stats()["wal_only_reads"] > 0
            # A thread flushed before the outage reads from the WAL too: the stream still
            # holds its entries from its first one on.
            assert (await graph.aget_state(runs[old])).values["answer"] == "before"
        finally:
            postgres_link.restore()

        # The pool reconnects with a backoff grown during the outage: until it has, a
        # flush fails fast (retriable), as it did while Postgres was down.
        deadline = asyncio.get_running_loop().time() + 30
        while True:
            try:
                flushed = await saver.force_flush_all(timeout=30)
                break
            except DatabaseUnavailableError:
                assert asyncio.get_running_loop().time() < deadline, "Postgres never came back"
                await asyncio.sleep(0.2)
        assert flushed == len(threads)
        async with AsyncPostgresSaver.from_conn_string(pg_dsn) as reference:
            theirs = build_graph(reference)
            for thread_id in threads:
                ours = await graph.aget_state(runs[thread_id])
                assert (await theirs.aget_state(runs[thread_id])).values == ours.values
                history = [s.config async for s in theirs.aget_state_history(runs[thread_id])]
                assert history == during[thread_id]
            assert (await theirs.aget_state(runs[old])).values["answer"] == "before"


async def flush_once_back(saver: BufferedCheckpointSaver) -> int:
    """`force_flush_all` as soon as the pool has reconnected (it fails fast until then)."""
    deadline = asyncio.get_running_loop().time() + 30
    while True:
        try:
            return await saver.force_flush_all(timeout=30)
        except DatabaseUnavailableError:
            assert asyncio.get_running_loop().time() < deadline, "Postgres never came back"
            await asyncio.sleep(0.2)


async def test_the_saver_starts_while_postgres_is_down(
    lg_config: LangGraphConfig, pg_dsn: str, postgres_link: CuttableProxy
) -> None:
    """A process restarted during an outage starts, with the default pool (one connection
    kept open), runs a graph on a new thread and resumes the one the process before it
    left interrupted in the WAL; once Postgres is back their writes flush.
    (On main before this change: `DatabaseUnavailableError` after 10 s in connect.)"""
    config = lg_config.replace(
        database_url=postgres_link.via(pg_dsn), drain_on_close=False, db_timeout_s=0.5
    )
    assert config.pool_min_size == 1
    thread_id = f"cold-start-{uuid.uuid4().hex[:8]}"
    earlier = f"before-restart-{uuid.uuid4().hex[:8]}"
    run: RunnableConfig = {"configurable": {"thread_id": thread_id}}
    run_earlier: RunnableConfig = {"configurable": {"thread_id": earlier}}
    # The process before the restart left a thread interrupted, in the WAL only.
    async with BufferedCheckpointSaver.connect(config) as saver:
        await build_graph(saver).ainvoke({"items": ["e"], "answer": ""}, run_earlier)
    postgres_link.cut()
    try:
        started = asyncio.get_running_loop().time()
        async with BufferedCheckpointSaver.connect(config) as saver:
            assert asyncio.get_running_loop().time() - started < 5
            graph = build_graph(saver)
            out = await graph.ainvoke({"items": ["cold"], "answer": ""}, run)
            assert out["__interrupt__"][0].value == {"question": "approve?", "items": ["cold"]}
            done = await graph.ainvoke(Command(resume="down"), run)
            assert done == {"items": ["cold", "done:down"], "answer": "down"}
            resumed = await graph.ainvoke(Command(resume="after"), run_earlier)
            assert resumed == {"items": ["e", "done:after"], "answer": "after"}
            postgres_link.restore()
            assert await flush_once_back(saver) == 2
    finally:
        postgres_link.restore()
    async with AsyncPostgresSaver.from_conn_string(pg_dsn) as reference:
        theirs = build_graph(reference)
        assert (await theirs.aget_state(run)).values == done
        assert (await theirs.aget_state(run_earlier)).values == resumed


async def test_a_read_that_loses_postgres_half_way_answers_from_the_wal(
    lg_config: LangGraphConfig, pg_dsn: str, postgres_link: CuttableProxy
) -> None:
    """Postgres stops between a read's first statement (rows and watermark, answered) and
    its second (the stored blobs and writes of the unflushed checkpoints): the read
    answers from the WAL, as one that found Postgres down does. (On main before this
    change: `DatabaseUnavailableError` "read blobs".) Deterministic: the stop happens in
    the read, not in a race with it."""
    config = lg_config.replace(
        database_url=postgres_link.via(pg_dsn), drain_on_close=False, db_timeout_s=0.5
    )
    thread_id = f"half-way-{uuid.uuid4().hex[:8]}"
    run: RunnableConfig = {"configurable": {"thread_id": thread_id}}
    async with BufferedCheckpointSaver.connect(config) as saver:
        graph = build_graph(saver)
        await graph.ainvoke({"items": ["h"], "answer": ""}, run)
        await saver.force_flush(thread_id)  # the interrupted state is stored...
        done = await graph.ainvoke(Command(resume="yes"), run)  # ...the rest is not
        want = await graph.aget_state(run)
        want_history = [s.config async for s in graph.aget_state_history(run)]

        read = saver.sink.read
        stopped: list[str] = []

        async def read_then_lose_postgres(*args: Any, **kwargs: Any) -> Any:
            found = await read(*args, **kwargs)
            if not stopped:
                stopped.append(args[0])
                postgres_link.cut()
            return found

        saver.sink.read = read_then_lose_postgres  # type: ignore[method-assign]
        try:
            before = saver.stats()["wal_only_reads"]
            state = await graph.aget_state(run)
            assert stopped == [thread_id]
            assert saver.stats()["wal_only_reads"] == before + 1
            assert state.values == done == want.values
            assert state.config == want.config
            assert [s.config async for s in graph.aget_state_history(run)] == want_history
        finally:
            saver.sink.read = read  # type: ignore[method-assign]
            postgres_link.restore()
        assert await flush_once_back(saver) == 1
    async with AsyncPostgresSaver.from_conn_string(pg_dsn) as reference:
        assert (await build_graph(reference).aget_state(run)).values == done
