"""One benchmark invocation: its options, services, side databases and progress display.

Services come from `buffered_store.dev.services`: our own nats-server and PostgreSQL
cluster (Postgres with ``track_commit_timestamp=on``, so flush lags can be read from
commit times), or the servers whose URLs are given. Each side of a scenario gets a
database of its own, so Postgres counts its transactions apart from the other side's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from buffered_store.config import BufferedStoreConfig
from buffered_store.dev.services import (
    ExternalNats,
    ExternalPostgres,
    NatsServer,
    PostgresServer,
    Services,
)
from buffered_store.stores.postgres import PostgresThreadRunStore
from buffered_store.stores.urls import to_libpq_url, to_sqlalchemy_url

SCHEMA = "bench"


@dataclass(frozen=True)
class Options:
    """Command-line options shared by every scenario."""

    quick: bool = False
    output: Path | None = None
    nats_url: str | None = None
    database_url: str | None = None
    duration_s: float | None = None
    threads: int | None = None
    rate: float | None = None
    """Checkpoints per second per thread, for the paced scenarios."""
    api: str | None = None
    """`checkpoint` or `append`: the store call of each step (None: the scenario's default)."""
    steps: int | None = None
    """Graph steps per run (`langgraph`)."""
    runs: int | None = None
    """Graph runs per thread, one after the other (`langgraph`)."""
    db_delay_ms: float | None = None
    """Round trip (ms) a delaying proxy adds to every Postgres connection of the sides
    (`langgraph`; `remote-db` always adds 2 ms)."""
    hot_linger_s: float | None = None
    """The thread-run store's `hot_linger_s` on every buffered side (None: its default,
    the hot record advanced before `checkpoint()` returns)."""
    floor_rounds: int | None = None
    """Rounds of the durable write path alone and the raw loop, in turn (`hot-threads`;
    None: one)."""
    keep: bool = False
    profile: bool = False
    command: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SideDb:
    """A database of one side."""

    name: str
    url: str
    """SQLAlchemy URL (``postgresql+psycopg://``)."""
    libpq_url: str
    schema: str = SCHEMA

    def via(self, host: str, port: int) -> str:
        """The SQLAlchemy URL reaching the same database through `host:port`."""
        return with_host(self.url, host, port)


def with_database(url: str, database: str) -> str:
    """`url` naming another database."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + database))


def with_host(url: str, host: str, port: int) -> str:
    """`url` reaching another host and port (credentials kept)."""
    parts = urlsplit(url)
    auth = parts.netloc.rpartition("@")[0]
    netloc = f"{auth}@{host}:{port}" if auth else f"{host}:{port}"
    return urlunsplit(parts._replace(netloc=netloc))


class Bench:
    """Services, databases and display of one `bufstore bench` invocation."""

    def __init__(self, scenario: str, options: Options) -> None:
        self.scenario = scenario
        self.options = options
        self.tag = uuid.uuid4().hex[:6]
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.output = options.output or Path("benchmarks/results") / f"{stamp}-{scenario}"
        self.output.mkdir(parents=True, exist_ok=True)
        self.console = Console(stderr=True, highlight=False)
        self.services: Services | None = None
        self.durable_nats: NatsServer | None = None
        self.databases: list[str] = []
        self.notes: list[str] = []
        # The display refreshes from a thread of the measured process: rendering a dozen
        # rows on a terminal takes milliseconds of CPU with the GIL held, so once a second
        # only, and not at all when the output is not a terminal (the samplers print a
        # plain line every 10 s then).
        self.progress = Progress(
            TextColumn("{task.description:<34}"),
            BarColumn(bar_width=24),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
            auto_refresh=self.console.is_terminal,
            refresh_per_second=1,
        )

    # -- lifecycle ------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Bench]:
        """Start (or attach to) the services; on exit drop the side databases and stop."""
        self.services = await asyncio.to_thread(self._start_services)
        try:
            with self.progress:
                yield self
        finally:
            if not self.options.keep:
                for name in self.databases:
                    with contextlib.suppress(Exception):
                        await self._drop_database(name)
            if self.durable_nats is not None:
                await asyncio.to_thread(self.durable_nats.close)
            await asyncio.to_thread(self.services.close)

    def _start_services(self) -> Services:
        nats_url = self.options.nats_url or os.environ.get("NATS_URL")
        database_url = self.options.database_url or os.environ.get("DATABASE_URL")
        nats_svc: Any = ExternalNats(nats_url) if nats_url else NatsServer()
        pg_svc: Any = (
            ExternalPostgres(database_url)
            if database_url
            else PostgresServer(settings={"track_commit_timestamp": "on"})
        )
        services = Services(nats=nats_svc, postgres=pg_svc, mode="local")
        try:
            services.start()
        except BaseException:
            services.close()
            raise
        return services

    @property
    def svc(self) -> Services:
        """The running services."""
        assert self.services is not None, "use `async with bench.running()`"
        return self.services

    @property
    def nats_url(self) -> str:
        """URL of the default NATS server."""
        return self.svc.nats_url

    async def durable_nats_url(self) -> str:
        """A nats-server of our own with ``sync_interval: always`` (started on first use)."""
        if self.durable_nats is None:
            server = NatsServer(sync_always=True)
            await asyncio.to_thread(server.start)
            self.durable_nats = server
        return self.durable_nats.url

    def pids(self) -> dict[str, int | None]:
        """Pids of the server processes this run started (None: external or stopped)."""
        pg = self.svc.postgres
        nats = self.svc.nats
        return {
            "nats_server": getattr(nats, "pid", None),
            "nats_server_durable": self.durable_nats.pid if self.durable_nats else None,
            "postgres": getattr(pg, "pid", None),
        }

    # -- databases ------------------------------------------------------------------------

    @property
    def admin_libpq_url(self) -> str:
        """libpq URL of the `postgres` maintenance database."""
        return with_database(to_libpq_url(self.svc.database_url), "postgres")

    async def new_database(self, side: str, *, migrate: bool = True) -> SideDb:
        """A fresh database for one side, migrated to the head revision (the thread-run
        store's schema; `migrate=False` leaves it empty, for LangGraph's tables)."""
        name = re.sub(r"[^a-z0-9_]", "_", f"bench_{self.scenario}_{side}_{self.tag}".lower())
        async with await psycopg.AsyncConnection.connect(
            self.admin_libpq_url, autocommit=True
        ) as conn:
            await conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        self.databases.append(name)
        url = with_database(to_sqlalchemy_url(self.svc.database_url), name)
        if migrate:
            store = await PostgresThreadRunStore.connect(url, schema=SCHEMA, migrate=True)
            await store.close()
        return SideDb(name, url, with_database(to_libpq_url(self.svc.database_url), name))

    async def _drop_database(self, name: str) -> None:
        async with await psycopg.AsyncConnection.connect(
            self.admin_libpq_url, autocommit=True
        ) as conn:
            await conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )

    async def pg_settings(self) -> dict[str, str]:
        """Server settings that shape the figures (durability, stats, memory)."""
        names = (
            "server_version",
            "fsync",
            "synchronous_commit",
            "full_page_writes",
            "wal_level",
            "shared_buffers",
            "max_connections",
            "track_commit_timestamp",
        )
        async with await psycopg.AsyncConnection.connect(self.admin_libpq_url) as conn:
            cur = await conn.execute(
                "SELECT name, setting FROM pg_settings WHERE name = ANY(%s)", (list(names),)
            )
            return {str(n): str(v) for n, v in await cur.fetchall()}

    # -- WAL objects ----------------------------------------------------------------------

    def buffered_config(self, nats_url: str, side: str, **overrides: Any) -> BufferedStoreConfig:
        """Store config with WAL names of its own (no other side or run shares them)."""
        token = re.sub(r"[^A-Za-z0-9]", "", f"{side}{self.tag}")
        settings: dict[str, Any] = {
            "nats_url": nats_url,
            "stream_name": f"BENCH_{token}",
            "hot_bucket": f"bench-hot-{token}",
            "quarantine_bucket": f"bench-quar-{token}",
            "consumer_name": f"bench-flusher-{token}",
            "drain_on_close": False,
        }
        if self.options.hot_linger_s is not None:
            settings["hot_linger_s"] = self.options.hot_linger_s
        settings.update(overrides)
        return BufferedStoreConfig(**settings)

    # -- display --------------------------------------------------------------------------

    def task(self, description: str, total: float) -> Any:
        """A progress line; update it with `bench.progress.update(task, ...)`."""
        return self.progress.add_task(description, total=total, info="")

    def say(self, text: str) -> None:
        """A line above the progress display."""
        self.progress.console.print(text)

    def note(self, text: str) -> None:
        """A caveat that goes into the report."""
        self.notes.append(text)
        self.say(f"[yellow]note:[/] {text}")
