"""Fixtures of the LangGraph front-end's tests: real NATS and Postgres from the session's
services (tests/conftest.py: they fail loudly, never skip, when the services cannot
start), a fresh stream, buckets and consumer per test, LangGraph's tables set up once."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from buffered_store.langgraph import BufferedCheckpointSaver, LangGraphConfig, LangGraphSink
from buffered_store.stores.urls import to_libpq_url


@pytest.fixture(scope="session")
def pg_dsn(database_url: str) -> str:
    """libpq URL of the test database."""
    return to_libpq_url(database_url)


@pytest.fixture(scope="session")
async def lg_tables(pg_dsn: str) -> str:
    """LangGraph's tables and our watermark table, created once; the DSN."""
    sink = await LangGraphSink.open(pg_dsn)
    try:
        await sink.setup()
    finally:
        await sink.close()
    return pg_dsn


def fresh_config(nats_url: str, dsn: str, **overrides: object) -> LangGraphConfig:
    """A config whose WAL objects no other test uses."""
    run = uuid.uuid4().hex[:10]
    values: dict[str, object] = {
        "nats_url": nats_url,
        "database_url": dsn,
        "stream_name": f"LG{run}",
        "hot_bucket": f"lg-hot-{run}",
        "quarantine_bucket": f"lg-q-{run}",
        "consumer_name": f"lg-fl-{run}",
        "flush_interval_s": 0.05,
    }
    values.update(overrides)
    return LangGraphConfig(**values)  # type: ignore[arg-type]


@pytest.fixture
def lg_config(nats_url: str, lg_tables: str) -> LangGraphConfig:
    return fresh_config(nats_url, lg_tables)


@pytest.fixture
async def saver(lg_config: LangGraphConfig) -> AsyncIterator[BufferedCheckpointSaver]:
    async with BufferedCheckpointSaver.connect(lg_config) as opened:
        yield opened
