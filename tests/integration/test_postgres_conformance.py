"""The `ThreadRunStore` and `FlushTarget` conformance suites against `PostgresThreadRunStore`,
through pytest (`pytest_suite`) and through `validate()`.

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
from buffered_store.testing.conformance import flush_target_test, thread_run_store_test, validate
from buffered_store.testing.conformance.pytest_suite import FlushTargetSuite, ThreadRunStoreSuite

pytestmark = pytest.mark.integration


async def _drop_schema(database_url: str, schema: str) -> None:
    async with await psycopg.AsyncConnection.connect(
        to_libpq_url(database_url), autocommit=True
    ) as conn:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


class TestPostgresConformance(ThreadRunStoreSuite):
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


class TestPostgresFlushTarget(FlushTargetSuite):
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


async def test_validate_passes_against_postgres(database_url: str) -> None:
    """The user's way in (`validate()`, no pytest): a factory making a fresh schema per
    call, a lifespan dropping them all at the end."""
    schemas: list[str] = []

    async def lifespan() -> AsyncIterator[None]:
        yield
        for schema in schemas:
            await _drop_schema(database_url, schema)

    async def fresh_store() -> AsyncIterator[PostgresThreadRunStore]:
        schemas.append(f"cv_{uuid.uuid4().hex[:16]}")
        store = await PostgresThreadRunStore.connect(database_url, schema=schemas[-1], migrate=True)
        yield store
        with contextlib.suppress(StoreClosedError):
            await store.close()

    for registered in (
        thread_run_store_test("postgres", lifespan=lifespan)(fresh_store),
        flush_target_test("postgres", lifespan=lifespan)(fresh_store),
    ):
        report = await validate(registered)
        assert report.passed_all(), report.summary()
        assert len(report.results) == len(registered.checks())
