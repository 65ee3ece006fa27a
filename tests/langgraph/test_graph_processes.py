"""A real graph interrupted in this process and resumed from a second one, with no
flusher running: the second process reads the interrupt from the WAL's tail, and so
does this one the result. After `force_flush_all`, AsyncPostgresSaver reads the same."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from pathlib import Path

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

from buffered_store.langgraph import BufferedCheckpointSaver, LangGraphConfig
from tests.langgraph.graph import build_graph

ROOT = Path(__file__).resolve().parents[2]


def child_env(config: LangGraphConfig) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUFSTORE_")}
    for name in ("nats_url", "database_url", "stream_name", "hot_bucket", "consumer_name"):
        env[f"BUFSTORE_LG_{name.upper()}"] = str(getattr(config, name))
    env["BUFSTORE_LG_QUARANTINE_BUCKET"] = config.quarantine_bucket
    return env


async def run_child(config: LangGraphConfig, *args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.langgraph.graph",
        *args,
        cwd=ROOT,
        env=child_env(config),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 0, err.decode()[-3000:]
    return out.decode()


async def test_interrupted_here_resumed_in_another_process_without_a_flusher(
    lg_config: LangGraphConfig, pg_dsn: str
) -> None:
    config = lg_config.replace(drain_on_close=False)
    thread_id = f"graph-{uuid.uuid4().hex[:8]}"
    run: RunnableConfig = {"configurable": {"thread_id": thread_id}}
    async with BufferedCheckpointSaver.connect(config) as saver:
        graph = build_graph(saver)
        out = await graph.ainvoke({"items": ["a"], "answer": ""}, run)
        assert out["__interrupt__"][0].value == {"question": "approve?", "items": ["a"]}
        assert (await saver.sink.flushed_seqs([thread_id]))[thread_id] == 0

        result = json.loads(await run_child(config, thread_id, "yes"))

        assert result == {"items": ["a", "done:yes"], "answer": "yes"}
        state = await graph.aget_state(run)
        assert state.values == result
        assert state.next == ()
        # Nothing was flushed: both processes read the WAL's tail.
        assert (await saver.sink.flushed_seqs([thread_id]))[thread_id] == 0
        history = [s async for s in graph.aget_state_history(run)]

        assert await saver.force_flush_all() == 1
        async with AsyncPostgresSaver.from_conn_string(pg_dsn) as reference:
            theirs = build_graph(reference)
            assert (await theirs.aget_state(run)).values == result
            their_history = [s async for s in theirs.aget_state_history(run)]
        assert [s.config for s in their_history] == [s.config for s in history]
        assert [s.values for s in their_history] == [s.values for s in history]
        assert len(history) >= 4
