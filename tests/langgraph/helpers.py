"""Helpers of the LangGraph front-end's tests."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit, urlunsplit

import psycopg

from buffered_store.langgraph import LangGraphConfig


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
    return LangGraphConfig(**values)


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
