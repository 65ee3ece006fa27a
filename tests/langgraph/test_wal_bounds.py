"""The LangGraph front-end's WAL is bounded like the thread-run one (issue 25 items 3, 4):
its flusher trims flushed entries from its own stream after `retain_flushed_s`, and at
`wal_max_bytes` `aput` raises the retriable `WalFullError`, losing nothing."""

from __future__ import annotations

import uuid

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.conformance.test_utils import generate_checkpoint

from buffered_store.errors import WalFullError
from buffered_store.langgraph import LG_FORMAT, BufferedCheckpointSaver, LangGraphConfig
from flusher import Flusher, FlusherConfig
from tests.plugins.stores import jetstream
from tests.plugins.waiting import eventually


def cfg(thread_id: str) -> RunnableConfig:
    return {"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}}


async def stream_messages(config: LangGraphConfig) -> int:
    async with jetstream(config) as js:
        return int((await js.stream_info(config.stream_name)).state.messages)


async def put(saver: BufferedCheckpointSaver, head: RunnableConfig, step: int) -> RunnableConfig:
    checkpoint = generate_checkpoint(
        channel_values={"n": step, "pad": "p" * 200}, channel_versions={"n": step, "pad": step}
    )
    return await saver.aput(head, checkpoint, {"source": "loop", "step": step}, {"n": step})


async def test_the_langgraph_stream_is_trimmed_after_its_flush(lg_config: LangGraphConfig) -> None:
    config = lg_config.replace(retain_flushed_s=1.0, drain_on_close=False)
    trimming = FlusherConfig.from_store_config(config, trim_interval_s=0.2)
    threads = [f"lg-{uuid.uuid4().hex[:8]}" for _ in range(3)]
    async with BufferedCheckpointSaver.connect(config) as saver:
        heads = {t: cfg(t) for t in threads}
        for step in range(1, 6):
            for t in threads:
                heads[t] = await put(saver, heads[t], step)
        async with Flusher(saver.sink, trimming, fmt=LG_FORMAT, backlog_poll_s=0) as flusher:
            await flusher.wait_idle(10)

            async def trimmed() -> bool:
                return await stream_messages(config) == 0

            await eventually(trimmed)
            assert flusher.stats()["trims"] >= 1
            for t in threads:
                latest = await saver.aget_tuple(cfg(t))
                assert latest is not None
                assert latest.checkpoint["channel_values"]["n"] == 5
                heads[t] = await put(saver, heads[t], 6)  # a write on a trimmed thread
            await flusher.wait_idle(10)
        assert await saver.sink.flushed_seqs(threads) == dict.fromkeys(threads, 6)


async def test_aput_on_a_full_wal_raises_wal_full_and_loses_nothing(
    lg_config: LangGraphConfig,
) -> None:
    config = lg_config.replace(wal_max_bytes=8192, drain_on_close=False)
    thread_id = f"lg-{uuid.uuid4().hex[:8]}"
    async with BufferedCheckpointSaver.connect(config) as saver:
        head = cfg(thread_id)
        acknowledged = 0
        refused: WalFullError | None = None
        for step in range(1, 200):
            try:
                head = await put(saver, head, step)
            except WalFullError as exc:
                refused = exc
                break
            acknowledged = step
        assert refused is not None
        assert refused.retriable
        async with Flusher(
            saver.sink,
            FlusherConfig.from_store_config(config, trim_interval_s=0.2),
            fmt=LG_FORMAT,
            backlog_poll_s=0,
        ) as flusher:

            async def accepted() -> bool:
                nonlocal head, acknowledged
                try:
                    head = await put(saver, head, acknowledged + 1)
                except WalFullError:
                    return False
                acknowledged += 1
                return True

            await eventually(accepted)
            await flusher.wait_idle(10)
        assert await saver.sink.flushed_seqs([thread_id]) == {thread_id: acknowledged}
        latest = await saver.aget_tuple(cfg(thread_id))
        assert latest is not None
        assert latest.checkpoint["channel_values"]["n"] == acknowledged


async def test_idle_langgraph_threads_leave_the_hot_bucket(lg_config: LangGraphConfig) -> None:
    # No linger: the test waits for the hot record the puts left to be forgotten.
    config = lg_config.replace(retain_flushed_s=0.3, drain_on_close=False, hot_linger_s=0)
    flushing = FlusherConfig.from_store_config(config, trim_interval_s=0.2, hot_idle_s=1.0)
    thread_id = f"lg-{uuid.uuid4().hex[:8]}"
    bucket = config.hot_bucket
    async with BufferedCheckpointSaver.connect(config) as saver:
        head = cfg(thread_id)
        for step in range(1, 4):
            head = await put(saver, head, step)
        async with Flusher(saver.sink, flushing, fmt=LG_FORMAT, backlog_poll_s=0) as flusher:

            async def forgotten() -> bool:
                async with jetstream(config) as js:
                    info = await js.stream_info(f"KV_{bucket}", subjects_filter=f"$KV.{bucket}.h.>")
                return not info.state.subjects

            await eventually(forgotten, timeout_s=20)
            assert flusher.stats()["hot_records_forgotten"] == 1
            latest = await saver.aget_tuple(cfg(thread_id))
            assert latest is not None
            assert latest.checkpoint["channel_values"]["n"] == 3
            head = await put(saver, head, 4)
            await flusher.wait_idle(10)
        assert await saver.sink.flushed_seqs([thread_id]) == {thread_id: 4}
    async with BufferedCheckpointSaver.connect(config) as other:
        latest = await other.aget_tuple(cfg(thread_id))
        assert latest is not None
        assert latest.checkpoint["channel_values"]["n"] == 4
