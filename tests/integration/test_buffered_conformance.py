"""The `ThreadRunStore` conformance suite against `BufferedThreadRunStore`.

Six variants: over `InMemoryThreadRunStore` and over `PostgresThreadRunStore`, each in
the three read-consistency modes.

- READ_YOUR_WRITES and STRONG promise that a read sees every acknowledged checkpoint, so
  the store runs the suite as it is, with no flusher: RYW through the WAL overlay,
  STRONG by flushing before it reads.
- EVENTUAL reads the inner store only, and promises nothing about when a checkpoint gets
  there; the suite's "write, then read" assertions cannot hold for it by definition. We
  still run the whole suite, on an EVENTUAL store whose writes are each followed by
  `force_flush` of their thread (`FlushedWrites`): that is how an EVENTUAL user obtains
  read-your-writes, and it checks everything EVENTUAL does promise: validation and bad
  input, closed-store behaviour and unknown ids exactly as the protocol says, and reads
  that return the inner store's state, which must equal the state the WAL entries
  describe once flushed. Running with an embedded flusher instead would make every read
  a race against its batching window.

`store` is shared by the tests of one variant (the suite only touches fresh ids through
it); `empty_store` is a fresh store per test: new WAL objects and an empty inner store
(a fresh `InMemoryThreadRunStore`, or a truncated schema reserved for empty stores).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest

from buffered_store.config import BufferedStoreConfig, ReadConsistency
from buffered_store.model.protocol import ThreadRunStore
from buffered_store.stores.memory import InMemoryThreadRunStore
from buffered_store.stores.urls import to_libpq_url
from buffered_store.testing import InnerStore
from buffered_store.testing.conformance import FlushedWrites
from buffered_store.testing.conformance.pytest_suite import ThreadRunStoreSuite
from buffered_store.threadrun.store import BufferedThreadRunStore
from tests.plugins.stores import delete_wal_objects, unique_names

VARIANTS = [
    (inner, mode)
    for inner in ("memory", "postgres")
    for mode in (
        ReadConsistency.READ_YOUR_WRITES,
        ReadConsistency.STRONG,
        ReadConsistency.EVENTUAL,
    )
]


class Backend:
    """The inner databases of one variant, shared by its tests."""

    def __init__(self, kind: str, mode: ReadConsistency, nats_url: str, database_url: str):
        self.kind = kind
        self.mode = mode
        self.nats_url = nats_url
        self.database_url = database_url
        self.schemas: list[str] = []
        self._opened: list[InnerStore] = []
        self._configs: list[BufferedStoreConfig] = []
        self._empty_pg: InnerStore | None = None
        self._empty_schema = ""

    async def _postgres(self) -> InnerStore:
        from buffered_store.stores.postgres import PostgresThreadRunStore

        schema = f"cb_{uuid.uuid4().hex[:16]}"
        self.schemas.append(schema)
        store: InnerStore = await PostgresThreadRunStore.connect(
            self.database_url, schema=schema, migrate=True
        )
        self._opened.append(store)
        return store

    async def shared_inner(self) -> InnerStore:
        return InMemoryThreadRunStore() if self.kind == "memory" else await self._postgres()

    async def empty_inner(self) -> InnerStore:
        """An inner store holding nothing (Postgres: one schema, truncated per use)."""
        if self.kind == "memory":
            return InMemoryThreadRunStore()
        if self._empty_pg is None:
            self._empty_pg = await self._postgres()
            self._empty_schema = self.schemas[-1]
        else:
            await self._truncate(self._empty_schema)
        return self._empty_pg

    async def _truncate(self, schema: str) -> None:
        async with await psycopg.AsyncConnection.connect(
            to_libpq_url(self.database_url), autocommit=True
        ) as conn:
            cursor = await conn.execute(
                "SELECT table_name FROM information_schema.tables "
                "WHERE table_schema = %s AND table_name <> 'alembic_version'",
                (schema,),
            )
            tables = ", ".join(f'"{schema}"."{name}"' for (name,) in await cursor.fetchall())
            await conn.execute(f"TRUNCATE {tables}")

    async def open(self, inner: InnerStore) -> ThreadRunStore:
        settings: dict[str, Any] = {"nats_url": self.nats_url, **unique_names()}
        config = BufferedStoreConfig(read_consistency=self.mode, drain_on_close=False, **settings)
        self._configs.append(config)
        store = await BufferedThreadRunStore.connect(inner, config)
        if self.mode is ReadConsistency.EVENTUAL:
            return FlushedWrites(store)
        return store

    async def forget(self, store: ThreadRunStore) -> None:
        """Close a store opened by `open` and delete its WAL objects."""
        buffered = store.store if isinstance(store, FlushedWrites) else store
        assert isinstance(buffered, BufferedThreadRunStore)
        with contextlib.suppress(Exception):
            await buffered.close()
        with contextlib.suppress(Exception):
            await delete_wal_objects(self.nats_url, buffered.config)

    async def close(self) -> None:
        for inner in self._opened:
            with contextlib.suppress(Exception):
                await inner.close()
        if not self.schemas:
            return
        async with await psycopg.AsyncConnection.connect(
            to_libpq_url(self.database_url), autocommit=True
        ) as conn:
            for schema in self.schemas:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def _variant_id(variant: tuple[str, ReadConsistency]) -> str:
    return f"{variant[0]}-{variant[1].value}"


@pytest.fixture(scope="class", params=VARIANTS, ids=_variant_id)
async def backend(
    request: pytest.FixtureRequest, nats_url: str, database_url: str
) -> AsyncIterator[Backend]:
    kind, mode = request.param
    shared = Backend(kind, mode, nats_url, database_url)
    yield shared
    await shared.close()


@pytest.fixture(scope="class")
async def shared_store(backend: Backend) -> AsyncIterator[ThreadRunStore]:
    store = await backend.open(await backend.shared_inner())
    yield store
    await backend.forget(store)


class TestBufferedConformance(ThreadRunStoreSuite):
    """The whole suite, in each of the six variants."""

    @pytest.fixture
    def store(self, shared_store: ThreadRunStore) -> ThreadRunStore:
        return shared_store

    @pytest.fixture
    async def empty_store(self, backend: Backend) -> AsyncIterator[ThreadRunStore]:
        store = await backend.open(await backend.empty_inner())
        yield store
        await backend.forget(store)
