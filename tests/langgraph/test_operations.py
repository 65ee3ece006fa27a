"""Operating the LangGraph front-end from the command line (issue 24 items 6 and 7): its
flusher process takes the stream settings of ``BUFSTORE_LG_*``, a flusher of another
front-end refuses its stream, and `bufstore status`, `health` and `quarantine` work with
``--front-end langgraph``."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.conformance.test_utils import generate_checkpoint

from buffered_store.langgraph import BufferedCheckpointSaver, LangGraphConfig

ROOT = Path(__file__).resolve().parents[2]


def lg_env(config: LangGraphConfig, **extra: str) -> dict[str, str]:
    """The environment of a process configured for `config` through ``BUFSTORE_LG_*``
    (no ``BUFSTORE_*`` variable of the test runner leaks in)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUFSTORE_")}
    env.update(
        BUFSTORE_LG_NATS_URL=config.nats_url,
        BUFSTORE_LG_DATABASE_URL=config.database_url,
        BUFSTORE_LG_STREAM_NAME=config.stream_name,
        BUFSTORE_LG_HOT_BUCKET=config.hot_bucket,
        BUFSTORE_LG_QUARANTINE_BUCKET=config.quarantine_bucket,
        BUFSTORE_LG_CONSUMER_NAME=config.consumer_name,
        BUFSTORE_LG_MAX_AGE_S=repr(config.max_age_s),
        BUFSTORE_LG_DUPLICATE_WINDOW_S=repr(config.duplicate_window_s),
        BUFSTORE_LG_ACK_WAIT_S=repr(config.ack_wait_s),
        DATABASE_URL="postgresql://127.0.0.1:1/not-this-one",
    )
    env.update(extra)
    return env


async def bufstore(env: Mapping[str, str], *args: str, timeout_s: float = 60) -> tuple[int, str]:
    """Run ``bufstore ARGS`` to its end: (exit status, stdout + stderr)."""
    proc = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "bufstore"),
        *args,
        cwd=ROOT,
        env=dict(env),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


async def start_flusher(env: Mapping[str, str], *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        *("-m", "flusher", *args),
        *("--flush-interval", "0.05", "--stats-interval", "0"),
        cwd=ROOT,
        env=dict(env),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )


async def stop(proc: asyncio.subprocess.Process) -> tuple[int, str]:
    """SIGTERM (unless it ended already), then its exit status and stderr."""
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
    _, err = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert proc.returncode is not None
    return proc.returncode, err.decode()


async def put_steps(saver: BufferedCheckpointSaver, thread_id: str, steps: int) -> int:
    """`steps` puts (each with a write) on a thread; the thread's seq after them."""
    head: RunnableConfig = {"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}}
    for step in range(steps):
        cp = generate_checkpoint(
            channel_values={"msgs": [f"m{i}" for i in range(step + 1)]},
            channel_versions={"msgs": step + 1},
        )
        head = await saver.aput(head, cp, {"source": "loop", "step": step}, {"msgs": step + 1})
        await saver.aput_writes(head, [("msgs", ["w"])], f"task-{step}")
    return 2 * steps


async def wait_flushed(
    saver: BufferedCheckpointSaver, thread_id: str, seq: int, flusher: asyncio.subprocess.Process
) -> None:
    """Until the flusher process has flushed the thread up to `seq`; fails at once with
    its stderr when it exits."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if (await saver.sink.flushed_seqs([thread_id]))[thread_id] >= seq:
            return
        if flusher.returncode is not None:
            _, err = await stop(flusher)
            raise AssertionError(f"the flusher exited {flusher.returncode}: {err[-1500:]}")
        await asyncio.sleep(0.02)
    raise AssertionError(f"thread {thread_id!r} not flushed up to {seq} in time")


async def test_langgraph_flusher_takes_the_stream_settings_of_bufstore_lg(
    lg_config: LangGraphConfig,
) -> None:
    """Issue 24 item 6: with ``BUFSTORE_LG_MAX_AGE_S=3600`` (and a duplicate window and
    ack wait of its own) the saver creates its stream and consumer so; the flusher
    process, configured by the same variables, opens them and drains (it used to compare
    them with the ``BUFSTORE_*`` defaults and exit 1: "stream exists with a different
    configuration")."""
    config = lg_config.replace(
        max_age_s=3600.0, duplicate_window_s=60.0, ack_wait_s=20.0, drain_on_close=False
    )
    async with BufferedCheckpointSaver.connect(config) as saver:
        seq = await put_steps(saver, "settings-1", 3)
        flusher = await start_flusher(lg_env(config), "--front-end", "langgraph")
        try:
            await wait_flushed(saver, "settings-1", seq, flusher)
        finally:
            code, err = await stop(flusher)
        assert code == 0, err[-2000:]
        assert "different configuration" not in err
