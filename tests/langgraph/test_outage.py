"""Postgres stopped while graphs run on new threads: puts keep succeeding (NATS only), the
graphs' reads come from the WAL alone (a thread the WAL holds from its first entry), and
once Postgres is back the flush brings LangGraph's tables to exactly that state.

The test stops the session's own Postgres (`services`), as the thread-run outage tests do.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from langgraph.types import Command

from buffered_store.dev.services import Services
from buffered_store.errors import DatabaseUnavailableError
from buffered_store.langgraph import BufferedCheckpointSaver, LangGraphConfig
from tests.langgraph.graph import build_graph


async def test_graphs_on_new_threads_run_through_a_postgres_outage(
    services: Services, lg_config: LangGraphConfig, pg_dsn: str
) -> None:
    if not services.postgres_managed:
        pytest.skip("Postgres is external (DATABASE_URL): this test must stop it")
    postgres = services.postgres
    assert postgres is not None
    config = lg_config.replace(drain_on_close=False, db_timeout_s=0.5)
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

        await asyncio.to_thread(postgres.stop)
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
            await asyncio.to_thread(postgres.start)

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
