"""Fixtures of the LangGraph front-end's tests: real NATS and Postgres from the session's
services (tests/conftest.py: they fail loudly, never skip, when the services cannot
start), a fresh stream, buckets and consumer per test, LangGraph's tables set up once."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from buffered_store.langgraph import BufferedCheckpointSaver, LangGraphConfig, LangGraphSink
from buffered_store.stores.urls import to_libpq_url
from tests.langgraph.helpers import fresh_config


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


@asynccontextmanager
async def two_schemas(dsn: str) -> AsyncIterator[tuple[str, str]]:
    """Two fresh schemas (reference, buffered) of the database: libpq URLs searching
    each first; dropped afterwards."""
    run = uuid.uuid4().hex[:8]
    names = (f"ref_{run}", f"buf_{run}")
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        for name in names:
            await conn.execute(f"CREATE SCHEMA {name}")
    sep = "&" if "?" in dsn else "?"
    try:
        yield (
            f"{dsn}{sep}options=-csearch_path%3D{names[0]}",
            f"{dsn}{sep}options=-csearch_path%3D{names[1]}",
        )
    finally:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            for name in names:
                await conn.execute(f"DROP SCHEMA {name} CASCADE")


@pytest.fixture
async def schemas(pg_dsn: str) -> AsyncIterator[tuple[str, str]]:
    """Two fresh schemas (reference, buffered) of the test database."""
    async with two_schemas(pg_dsn) as found:
        yield found


@asynccontextmanager
async def icu_schemas_of(dsn: str) -> AsyncIterator[tuple[str, str]]:
    """Two fresh schemas of a new database whose collation is ICU ``en-US`` (not code
    point order: ``a < B < c``), dropped afterwards."""
    name = f"lgicu_{uuid.uuid4().hex[:8]}"
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(
            f"CREATE DATABASE {name} LOCALE_PROVIDER icu ICU_LOCALE 'en-US' LOCALE 'C' "
            "TEMPLATE template0"
        )
    try:
        async with two_schemas(urlunsplit(urlsplit(dsn)._replace(path=f"/{name}"))) as found:
            yield found
    finally:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await conn.execute(f"DROP DATABASE {name} WITH (FORCE)")


@pytest.fixture
async def icu_schemas(pg_dsn: str) -> AsyncIterator[tuple[str, str]]:
    """Two fresh schemas of a database collated by ICU ``en-US`` (`icu_schemas_of`)."""
    async with icu_schemas_of(pg_dsn) as found:
        yield found
