"""A real graph interrupted in this process and resumed from a second one, with no
flusher running: the second process reads the interrupt from the WAL's tail, and so
does this one the result. After `force_flush_all`, AsyncPostgresSaver reads the same."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import uuid
from pathlib import Path

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from langgraph.types import Command

from buffered_store.engine.threadlog import ThreadLog
from buffered_store.langgraph import LG_FORMAT, BufferedCheckpointSaver, LangGraphConfig
from tests.langgraph.graph import build_graph
from tests.langgraph.test_flusher_process import start_flusher, wait_flushed

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


async def test_graphs_interrupted_and_resumed_while_the_flusher_is_killed_and_restarted(
    lg_config: LangGraphConfig, pg_dsn: str
) -> None:
    """Graphs run with a flusher process draining; it is SIGKILLed mid-way, half the
    threads are resumed from a second process while none runs, then it is started
    again: LangGraph's tables end up holding what the buffered saver reads, with no flush
    from the saver itself."""
    config = lg_config.replace(drain_on_close=False)
    threads = [f"kill-{i}-{uuid.uuid4().hex[:6]}" for i in range(6)]
    runs: dict[str, RunnableConfig] = {t: {"configurable": {"thread_id": t}} for t in threads}
    async with BufferedCheckpointSaver.connect(config) as saver:
        graph = build_graph(saver)
        log = ThreadLog(saver.wal, config, LG_FORMAT)

        async def latest() -> dict[str, int]:
            return {t: (await log.latest(t))[1] for t in threads}

        flusher = await start_flusher(config)
        try:
            for thread_id in threads:
                out = await graph.ainvoke({"items": [thread_id], "answer": ""}, runs[thread_id])
                assert "__interrupt__" in out
            await wait_flushed(saver, await latest(), at_least_one=True)
        finally:
            flusher.send_signal(signal.SIGKILL)
            await flusher.wait()
        assert flusher.returncode == -signal.SIGKILL

        resumed = threads[::2]
        for thread_id in resumed:  # another process, no flusher anywhere
            result = json.loads(await run_child(config, thread_id, f"ok-{thread_id}"))
            assert result["items"] == [thread_id, f"done:ok-{thread_id}"]
        for thread_id in threads[1::2]:  # and this one
            await graph.ainvoke(Command(resume="here"), runs[thread_id])

        want = await latest()
        flusher = await start_flusher(config)
        try:
            await wait_flushed(saver, want)
        finally:
            flusher.send_signal(signal.SIGTERM)
            _, err = await asyncio.wait_for(flusher.communicate(), timeout=30)
        assert flusher.returncode == 0, err.decode()[-2000:]
        assert saver.stats()["inline_flushes"] == 0

        async with AsyncPostgresSaver.from_conn_string(pg_dsn) as reference:
            theirs = build_graph(reference)
            for thread_id in threads:
                ours = await graph.aget_state(runs[thread_id])
                answer = f"ok-{thread_id}" if thread_id in resumed else "here"
                assert ours.values == {"items": [thread_id, f"done:{answer}"], "answer": answer}
                assert (await theirs.aget_state(runs[thread_id])).values == ours.values
                their_history = [s.config async for s in theirs.aget_state_history(runs[thread_id])]
                our_history = [s.config async for s in graph.aget_state_history(runs[thread_id])]
                assert their_history == our_history
