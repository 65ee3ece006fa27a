"""The `ThreadRunStore` and `FlushTarget` conformance suites against `PostgresThreadRunStore`.

Each test gets a fresh schema (migrated by ``connect(..., migrate=True)``) that is dropped
afterwards, so `store` is empty and owned by the test, and `empty_store` is the same store.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator

import psycopg
import pytest

from buffered_store import PostgresThreadRunStore, StoreClosedError, ThreadRunStore
from buffered_store.stores.urls import to_libpq_url
from buffered_store.testing import InnerStore
from tests.conformance.flush_target import FlushTargetContract
from tests.conformance.suite import ThreadRunStoreContract

pytestmark = pytest.mark.integration


async def _drop_schema(database_url: str, schema: str) -> None:
    async with await psycopg.AsyncConnection.connect(
        to_libpq_url(database_url), autocommit=True
    ) as conn:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


class TestPostgresConformance(ThreadRunStoreContract):
    """The suite with the store's snapshot cache on (the default) and off."""

    @pytest.fixture(params=["cached", "uncached"])
    async def store(
        self, database_url: str, request: pytest.FixtureRequest
    ) -> AsyncIterator[ThreadRunStore]:
        schema = f"cf_{uuid.uuid4().hex[:16]}"
        cache_threads = 1024 if request.param == "cached" else 0
        try:
            store = await PostgresThreadRunStore.connect(
                database_url, schema=schema, migrate=True, cache_threads=cache_threads
            )
            try:
                yield store
            finally:
                with contextlib.suppress(StoreClosedError):
                    await store.close()
        finally:
            await _drop_schema(database_url, schema)

    @pytest.fixture
    def empty_store(self, store: ThreadRunStore) -> ThreadRunStore:
        return store


class TestPostgresFlushTarget(FlushTargetContract):
    """The `FlushTarget` contract, on a fresh schema per test."""

    @pytest.fixture
    async def target(self, database_url: str) -> AsyncIterator[InnerStore]:
        schema = f"cf_{uuid.uuid4().hex[:16]}"
        try:
            store = await PostgresThreadRunStore.connect(database_url, schema=schema, migrate=True)
            try:
                yield store
            finally:
                await store.close()
        finally:
            await _drop_schema(database_url, schema)
