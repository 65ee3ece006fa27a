"""Fixtures of the buffered-store integration tests.

Every test gets its own WAL objects on the shared nats-server (a unique stream, hot
bucket, quarantine bucket and consumer, deleted afterwards) and, when it uses Postgres,
its own schema (dropped afterwards), so tests never see each other's data.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import nats
import psycopg
import pytest
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from buffered_store.config import BufferedStoreConfig, EngineConfig
from buffered_store.stores.memory import InMemoryThreadRunStore
from buffered_store.stores.urls import to_libpq_url
from buffered_store.testing import InnerStore
from buffered_store.threadrun.store import BufferedThreadRunStore

ConfigFactory = Callable[..., BufferedStoreConfig]
StoreFactory = Callable[..., Awaitable[BufferedThreadRunStore]]
PostgresFactory = Callable[..., Awaitable[InnerStore]]

INNER_KINDS = ("memory", "postgres")


def unique_names() -> dict[str, str]:
    """Stream, bucket and consumer names no other test uses (letters, digits, '_')."""
    token = uuid.uuid4().hex[:12]
    return {
        "stream_name": f"TL_{token}",
        "hot_bucket": f"hot_{token}",
        "quarantine_bucket": f"quar_{token}",
        "consumer_name": f"flusher_{token}",
    }


@asynccontextmanager
async def jetstream(config: EngineConfig) -> AsyncIterator[JetStreamContext]:
    """A JetStream context on a connection of the test's own, to look at (or tamper with)
    what the store keeps on the server; the store's adapter hands out no nats objects."""
    nc = await nats.connect(servers=config.servers, allow_reconnect=False, connect_timeout=5)
    try:
        yield nc.jetstream(timeout=5)
    finally:
        await nc.close()


async def delete_wal_objects(nats_url: str, config: BufferedStoreConfig) -> None:
    """Remove a test's stream and buckets from the shared server (best effort)."""
    nc = await nats.connect(nats_url, allow_reconnect=False, connect_timeout=2)
    try:
        js = nc.jetstream(timeout=5)
        for stream in (
            config.stream_name,
            f"KV_{config.hot_bucket}",
            f"KV_{config.quarantine_bucket}",
        ):
            with contextlib.suppress(NotFoundError):
                await js.delete_stream(stream)
    finally:
        await nc.close()


@pytest.fixture
async def make_config(nats_url: str) -> AsyncIterator[ConfigFactory]:
    """Builds configs sharing this test's unique WAL names; keyword overrides apply."""
    names = unique_names()
    made: list[BufferedStoreConfig] = []

    def factory(**overrides: Any) -> BufferedStoreConfig:
        settings: dict[str, Any] = {"nats_url": nats_url, **names}
        settings.update(overrides)
        config = BufferedStoreConfig(**settings)
        made.append(config)
        return config

    yield factory
    if made:
        with contextlib.suppress(Exception):
            await delete_wal_objects(nats_url, made[0])


@pytest.fixture
def config(make_config: ConfigFactory) -> BufferedStoreConfig:
    """This test's config: unique WAL names, defaults otherwise."""
    return make_config()


@pytest.fixture
def schema_name() -> str:
    """A Postgres schema no other test uses."""
    return f"t_{uuid.uuid4().hex[:16]}"


@pytest.fixture
async def open_postgres(database_url: str, schema_name: str) -> AsyncIterator[PostgresFactory]:
    """Opens `PostgresThreadRunStore`s on this test's schema (migrated on first use).

    Each call is a separate store with its own connection pool, like a separate process;
    all are closed and the schema is dropped after the test. ``url=`` reaches the same
    database another way (through a `CuttableProxy`, see tests/plugins/network.py).
    """
    from buffered_store.stores.postgres import PostgresThreadRunStore

    opened: list[Any] = []

    async def factory(*, url: str | None = None) -> InnerStore:
        store = await PostgresThreadRunStore.connect(
            url or database_url, schema=schema_name, migrate=True
        )
        opened.append(store)
        return store

    yield factory
    for store in opened:
        with contextlib.suppress(Exception):
            await store.close()
    if opened:
        with contextlib.suppress(Exception):
            async with await psycopg.AsyncConnection.connect(
                to_libpq_url(database_url), autocommit=True
            ) as conn:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema_name}" CASCADE')


@pytest.fixture
async def pg_inner(open_postgres: PostgresFactory) -> InnerStore:
    """A Postgres inner store on a fresh schema."""
    return await open_postgres()


@pytest.fixture(params=INNER_KINDS)
async def inner(request: pytest.FixtureRequest, open_postgres: PostgresFactory) -> InnerStore:
    """The inner store of the buffered store under test: in memory, then Postgres."""
    if request.param == "memory":
        return InMemoryThreadRunStore()
    return await open_postgres()


InnerPair = tuple[InnerStore, InnerStore]


@pytest.fixture(params=INNER_KINDS)
async def inner_pair(request: pytest.FixtureRequest, open_postgres: PostgresFactory) -> InnerPair:
    """Two handles on one inner database, as two application processes would have them
    (over Postgres: two stores with their own connection pools on the same schema)."""
    if request.param == "memory":
        shared = InMemoryThreadRunStore()
        return shared, shared
    return await open_postgres(), await open_postgres()


@pytest.fixture
async def open_store(make_config: ConfigFactory) -> AsyncIterator[StoreFactory]:
    """Opens buffered stores (each with its own NATS connection) on this test's WAL.

    ``await open_store(inner, drain_on_close=False)``: keyword arguments override the
    config. Every store still open at the end is closed.
    """
    opened: list[BufferedThreadRunStore] = []

    async def factory(inner: InnerStore, **overrides: Any) -> BufferedThreadRunStore:
        store = await BufferedThreadRunStore.connect(inner, make_config(**overrides))
        opened.append(store)
        return store

    yield factory
    for store in opened:
        with contextlib.suppress(Exception):
            await store.close()


@pytest.fixture
async def store(open_store: StoreFactory, inner: InnerStore) -> BufferedThreadRunStore:
    """A buffered store over `inner` (in memory and Postgres); nothing flushes by itself."""
    return await open_store(inner, drain_on_close=False)


RowsReader = Callable[[str], Awaitable[list[tuple[int, int, str]]]]


@pytest.fixture
def message_rows(database_url: str, schema_name: str) -> RowsReader:
    """Reads (position, thread_seq, xmin) of a thread's message rows straight from Postgres.

    `xmin` changes whenever a row is rewritten, so equal values prove a flush left it alone.
    """

    async def read(thread_id: str) -> list[tuple[int, int, str]]:
        async with await psycopg.AsyncConnection.connect(to_libpq_url(database_url)) as conn:
            cursor = await conn.execute(
                f'SELECT position, thread_seq, xmin::text FROM "{schema_name}".messages '
                "WHERE thread_id = %s ORDER BY position",
                (thread_id,),
            )
            return [(int(p), int(s), str(x)) for p, s, x in await cursor.fetchall()]

    return read


SubjectCounter = Callable[[BufferedThreadRunStore], Awaitable[dict[str, int]]]


@pytest.fixture
def subject_counts() -> SubjectCounter:
    """Messages per subject in a store's WAL stream, as the server counts them."""

    async def count(store: BufferedThreadRunStore) -> dict[str, int]:
        async with jetstream(store.config) as js:
            info = await js.stream_info(store.config.stream_name, subjects_filter=">")
        return dict(info.state.subjects or {})

    return count
