"""Fixtures of the Spark tests: one local Spark session for the whole run, and per test a
fresh Postgres schema and fresh WAL objects with a buffered store writing to them.

No flusher runs: checkpoints stay pending in the WAL until a test flushes them with
`force_flush`, so each test decides exactly what is flushed and what is not.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

import nats
import psycopg
import pytest
from nats.js.errors import NotFoundError
from pyspark.sql import DataFrame, SparkSession

from buffered_store.config import BufferedStoreConfig
from buffered_store.dev.services import Services
from buffered_store.spark import jdbc, overlay
from buffered_store.spark.overlay import StoreSource
from buffered_store.spark.session import spark_session
from buffered_store.stores.postgres import PostgresThreadRunStore
from buffered_store.stores.urls import to_libpq_url
from buffered_store.threadrun.records import RunRecord, Thread
from buffered_store.threadrun.store import BufferedThreadRunStore


@pytest.fixture(autouse=True)
def close_pins(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Close every snapshot a test pinned, also when it failed with its reads still
    referenced (a traceback keeps them alive): an open pin is a transaction, and one left
    behind would hold back, say, the CREATE INDEX CONCURRENTLY of LangGraph's set-up
    in a later test of the run."""
    made: list[jdbc.PinnedSnapshot] = []
    original = jdbc.pin_snapshot

    def pinning(*args: Any, **kwargs: Any) -> jdbc.PinnedSnapshot:
        made.append(original(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(jdbc, "pin_snapshot", pinning)
    monkeypatch.setattr(overlay, "pin_snapshot", pinning)
    yield
    for pin in made:
        pin.close()


@pytest.fixture(scope="session")
def spark(services: Services) -> Iterator[SparkSession]:
    """A local Spark session (about 10 s to start) with the PostgreSQL JDBC driver."""
    session = spark_session(
        "bufstore-tests",
        master="local[2]",
        conf={
            "spark.ui.enabled": "false",
            "spark.sql.shuffle.partitions": "4",
            "spark.default.parallelism": "2",
        },
    )
    yield session
    session.stop()


@dataclass
class StoreEnv:
    """A buffered store over Postgres on a fresh schema and fresh WAL objects."""

    store: BufferedThreadRunStore
    inner: PostgresThreadRunStore
    config: BufferedStoreConfig
    source: StoreSource
    schema: str
    database_url: str

    def sql(self, statement: str) -> None:
        """Run SQL in this test's schema (autocommit)."""
        with psycopg.connect(to_libpq_url(self.database_url), autocommit=True) as conn:
            conn.execute(f'SET search_path TO "{self.schema}"')
            conn.execute(statement.encode())


@pytest.fixture
async def env(database_url: str, nats_url: str) -> AsyncIterator[StoreEnv]:
    token = uuid.uuid4().hex[:12]
    schema = f"spark_{token}"
    config = BufferedStoreConfig(
        nats_url=nats_url,
        stream_name=f"SP_{token}",
        hot_bucket=f"hot_{token}",
        quarantine_bucket=f"quar_{token}",
        consumer_name=f"flusher_{token}",
        drain_on_close=False,
    )
    inner = await PostgresThreadRunStore.connect(database_url, schema=schema, migrate=True)
    store = await BufferedThreadRunStore.connect(inner, config)
    # Every tail goes through the threadlog data source, however short (the driver reads
    # short tails itself by default; test_overlay checks both ways agree).
    source = StoreSource.from_urls(
        database_url, schema=schema, wal=config, partitions=4, driver_tail_max_entries=0
    )
    try:
        yield StoreEnv(store, inner, config, source, schema, database_url)
    finally:
        await store.close()
        await inner.close()
        with psycopg.connect(to_libpq_url(database_url), autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'.encode())
        nc = await nats.connect(nats_url, allow_reconnect=False)
        try:
            js = nc.jetstream()
            names = (
                config.stream_name,
                f"KV_{config.hot_bucket}",
                f"KV_{config.quarantine_bucket}",
            )
            for stream in names:
                with contextlib.suppress(NotFoundError):
                    await js.delete_stream(stream)
        finally:
            await nc.close()


# -- comparing what Spark shows with what the store's API shows ---------------------------

ThreadKey = tuple[object, ...]


@dataclass(frozen=True)
class View:
    """Threads, messages and runs in a form both sides can be compared in."""

    threads: dict[str, ThreadKey]
    messages: dict[str, list[Any]]
    runs: dict[str, tuple[object, ...]]


def _utc(value: datetime | None) -> datetime | None:
    # Spark hands timestamps back naive, in the local time zone of this process, which
    # is what astimezone() assumes of a naive datetime.
    return None if value is None else value.astimezone(UTC)


def _json(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def thread_key(thread: Thread) -> ThreadKey:
    return (
        thread.parent_thread_id,
        dict(thread.metadata),
        _utc(thread.created_at),
        _utc(thread.updated_at),
        thread.latest_run_id,
        thread.message_count,
    )


def run_key(run: RunRecord) -> tuple[object, ...]:
    return (
        run.thread_id,
        run.agent_id,
        run.status.value,
        run.parent_run_id,
        run.parent_thread_id,
        _utc(run.created_at),
        _utc(run.updated_at),
        _utc(run.finished_at),
        run.steps,
        run.input_tokens,
        run.output_tokens,
        run.error,
        run.output,
        dict(run.metadata),
    )


async def store_view(store: BufferedThreadRunStore) -> View:
    """What the buffered store's API shows (read-your-writes)."""
    threads = await store.list_threads(limit=10_000)
    messages = {t.thread_id: await store.load_messages(t.thread_id) or [] for t in threads}
    runs = await store.list_runs(limit=10_000)
    return View(
        {t.thread_id: thread_key(t) for t in threads},
        {k: v for k, v in messages.items() if v},
        {r.run_id: run_key(r) for r in runs},
    )


class Frames(Protocol):
    """Anything holding the three DataFrames (`Tables`, or Parquet read back)."""

    @property
    def threads(self) -> DataFrame: ...
    @property
    def messages(self) -> DataFrame: ...
    @property
    def runs(self) -> DataFrame: ...


def spark_view(tables: Frames) -> View:
    """What the Spark DataFrames show."""
    threads: dict[str, ThreadKey] = {
        r.thread_id: (
            r.parent_thread_id,
            _json(r.metadata),
            _utc(r.created_at),
            _utc(r.updated_at),
            r.latest_run_id,
            r.message_count,
        )
        for r in tables.threads.collect()
    }
    messages: dict[str, list[tuple[int, Any]]] = {}
    for r in tables.messages.collect():
        messages.setdefault(r.thread_id, []).append((r.position, _json(r.message)))
    runs: dict[str, tuple[object, ...]] = {
        r.run_id: (
            r.thread_id,
            r.agent_id,
            r.status,
            r.parent_run_id,
            r.parent_thread_id,
            _utc(r.created_at),
            _utc(r.updated_at),
            _utc(r.finished_at),
            r.steps,
            r.input_tokens,
            r.output_tokens,
            r.error,
            _json(r.output),
            _json(r.metadata),
        )
        for r in tables.runs.collect()
    }
    ordered: dict[str, list[Any]] = {}
    for thread_id, cells in messages.items():
        cells.sort(key=lambda cell: cell[0])
        assert [p for p, _ in cells] == list(range(len(cells))), f"holes in {thread_id}"
        ordered[thread_id] = [m for _, m in cells]
    return View(threads, ordered, runs)
