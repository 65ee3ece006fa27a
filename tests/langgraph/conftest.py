"""Fixtures of the LangGraph front-end's tests: real NATS and Postgres from the session's
services (tests/conftest.py: they fail loudly, never skip, when the services cannot
start), a fresh stream, buckets and consumer per test, LangGraph's tables set up once."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from buffered_store.langgraph import BufferedCheckpointSaver, LangGraphConfig, LangGraphSink
from buffered_store.stores.urls import to_libpq_url
from tests.langgraph.helpers import fresh_config, icu_schemas_of, two_schemas


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


@pytest.fixture
def lg_config(nats_url: str, lg_tables: str) -> LangGraphConfig:
    return fresh_config(nats_url, lg_tables)


@pytest.fixture
async def saver(lg_config: LangGraphConfig) -> AsyncIterator[BufferedCheckpointSaver]:
    async with BufferedCheckpointSaver.connect(lg_config) as opened:
        yield opened


@pytest.fixture
async def schemas(pg_dsn: str) -> AsyncIterator[tuple[str, str]]:
    """Two fresh schemas (reference, buffered) of the test database."""
    async with two_schemas(pg_dsn) as found:
        yield found


@pytest.fixture
async def icu_schemas(pg_dsn: str) -> AsyncIterator[tuple[str, str]]:
    """Two fresh schemas of a database collated by ICU ``en-US`` (`icu_schemas_of`)."""
    async with icu_schemas_of(pg_dsn) as found:
        yield found
