"""The flusher as its own process for the LangGraph front-end (``python -m flusher
--front-end langgraph``), killed with SIGKILL while it drains and started again: every
acknowledged write reaches LangGraph's tables exactly as AsyncPostgresSaver would hold
it, with no flush from the saver itself."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import uuid
from pathlib import Path

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.conformance.test_utils import generate_checkpoint
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

from buffered_store.langgraph import BufferedCheckpointSaver, LangGraphConfig

ROOT = Path(__file__).resolve().parents[2]
THREADS = 8
PUTS = 25


async def start_flusher(config: LangGraphConfig) -> asyncio.subprocess.Process:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUFSTORE_")}
    env.update(
        BUFSTORE_LG_NATS_URL=config.nats_url,
        BUFSTORE_LG_DATABASE_URL=config.database_url,
        BUFSTORE_LG_STREAM_NAME=config.stream_name,
        BUFSTORE_LG_HOT_BUCKET=config.hot_bucket,
        BUFSTORE_LG_QUARANTINE_BUCKET=config.quarantine_bucket,
        BUFSTORE_LG_CONSUMER_NAME=config.consumer_name,
        DATABASE_URL="postgresql://127.0.0.1:1/not-this-one",  # the thread-run store's
    )
    return await asyncio.create_subprocess_exec(
        sys.executable,
        *("-m", "flusher", "--front-end", "langgraph"),
        *("--flush-interval", "0.05", "--batch-size", "16", "--batch-bytes", "200000"),
        *("--stats-interval", "0"),
        cwd=ROOT,
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )


async def wait_flushed(
    saver: BufferedCheckpointSaver, want: dict[str, int], *, at_least_one: bool = False
) -> dict[str, int]:
    """Poll the watermarks (another process moves them) until they reach `want`, or,
    with `at_least_one`, until some thread is fully flushed."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        marks = await saver.sink.flushed_seqs(list(want))
        done = [t for t in want if marks[t] >= want[t]]
        if len(done) == len(want) or (at_least_one and done):
            return marks
        await asyncio.sleep(0.02)
    raise AssertionError(f"not flushed in time: {marks} < {want}")


async def test_flusher_process_killed_and_restarted_loses_nothing(
    lg_config: LangGraphConfig, pg_dsn: str
) -> None:
    config = lg_config.replace(drain_on_close=False)
    threads = [f"fp-{uuid.uuid4().hex[:8]}" for _ in range(THREADS)]
    async with BufferedCheckpointSaver.connect(config) as saver:
        heads: dict[str, RunnableConfig] = {
            t: {"configurable": {"thread_id": t, "checkpoint_ns": ""}} for t in threads
        }

        async def write(thread_id: str, n: int) -> None:
            for step in range(n):
                cp = generate_checkpoint(
                    channel_values={"msgs": [f"m{i}" for i in range(step + 1)], "step": step},
                    channel_versions={"msgs": step + 1, "step": step + 1},
                )
                heads[thread_id] = await saver.aput(
                    heads[thread_id], cp, {"source": "loop", "step": step}, {"msgs": step + 1}
                )
                await saver.aput_writes(heads[thread_id], [("msgs", ["w"])], f"task-{step}")

        for thread_id in threads:  # one after the other: the first is flushed well before the last
            await write(thread_id, PUTS)
        want = dict.fromkeys(threads, 2 * PUTS)

        first = await start_flusher(config)
        try:
            marks = await wait_flushed(saver, want, at_least_one=True)
        finally:
            first.send_signal(signal.SIGKILL)
            await first.wait()
        assert first.returncode == -signal.SIGKILL
        assert any(marks[t] < want[t] for t in threads), "killed too late to mean anything"

        await asyncio.gather(*(write(t, 3) for t in threads))  # more while none runs
        want = dict.fromkeys(threads, 2 * (PUTS + 3))

        second = await start_flusher(config)
        try:
            await wait_flushed(saver, want)
        finally:
            second.send_signal(signal.SIGTERM)
            _, err = await asyncio.wait_for(second.communicate(), timeout=30)
        assert second.returncode == 0, err.decode()[-2000:]
        assert saver.stats()["inline_flushes"] == 0

        async with AsyncPostgresSaver.from_conn_string(pg_dsn) as reference:
            for thread_id in threads:
                run: RunnableConfig = {"configurable": {"thread_id": thread_id}}
                ours = [t async for t in saver.alist(run)]
                theirs = [t async for t in reference.alist(run)]
                assert len(theirs) == PUTS + 3
                assert [t.checkpoint for t in theirs] == [t.checkpoint for t in ours]
                assert [t.pending_writes for t in theirs] == [t.pending_writes for t in ours]
