"""What users of AsyncPostgresSaver expect of a drop-in (issue 24): `from_conn_string` as
an async context manager, and `alist(None, ...)` (a search across threads) that reads
the unflushed entries without flushing every pending thread first."""

from __future__ import annotations

import uuid

import pytest
from langchain_core.runnables import RunnableConfig
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
