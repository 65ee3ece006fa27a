"""The `langgraph` scenario's four checkpointers: each side's database (none for the
in-memory floor and the floor with one publish), and its checkpointer opened afresh for a
phase, behind the delaying link when there is one, the buffered side with its flusher
process and WAL monitor."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from psycopg import AsyncConnection
from psycopg.rows import DictRow, dict_row
from psycopg_pool import AsyncConnectionPool

from buffered_store.langgraph import BufferedCheckpointSaver, LangGraphConfig, LangGraphSink

from ..harness import Bench, SideDb
from ..link import Link
from ..measure import PgSnapshot, PgStats
from ..processes import FlusherProcess, WalMonitor
from .langgraph_onetrip import open_one_publish
from .langgraph_report import IN_MEMORY, SIDES

POOL_SIZE = 10
"""AsyncPostgresSaver's connections (the direct thread-run store's pool size here)."""


@dataclass
class Side:
    """One checkpointer under test: its database (None for the in-memory sides), its
    buffered config, its counters and the threads' checkpoints found in memory."""

    key: str
    label: str
    db: SideDb | None = None
    config: LangGraphConfig | None = None
    counters: PgStats | None = None
    snapshot: tuple[PgSnapshot, bool] | None = None
    """Counters settled at the end of the side's last phase: the next phase's start."""
    found: dict[str, tuple[int, int]] = field(default_factory=dict)
    """In-memory sides only: checkpoints and final messages per thread, read after each
    phase."""


async def prepare_side(bench: Bench, key: str, link: Link | None) -> Side:
    """The side's database with LangGraph's tables (set up directly, unmeasured)."""
    side = Side(key, SIDES[key])
    if key in IN_MEMORY:
        return side
    db = await bench.new_database(key, migrate=False)
    side.db = db
    side.counters = PgStats(bench.admin_libpq_url, db.libpq_url, db.name, "public")
    if key == "buffered":
        sink = await LangGraphSink.open(db.libpq_url)
        try:
            await sink.setup()
        finally:
            await sink.close()
        names = bench.buffered_config(bench.nats_url, key)
        side.config = LangGraphConfig(
            nats_url=names.nats_url,
            stream_name=names.stream_name,
            hot_bucket=names.hot_bucket,
            quarantine_bucket=names.quarantine_bucket,
            consumer_name=names.consumer_name,
            database_url=link.via(db.libpq_url) if link else db.libpq_url,
            drain_on_close=False,
        )
    else:
        async with AsyncPostgresSaver.from_conn_string(db.libpq_url) as saver:
            await saver.setup()
    return side


@dataclass
class OpenSaver:
    """A side's checkpointer while it is open, with its flusher process and WAL monitor."""

    saver: BaseCheckpointSaver[Any]
    flusher: FlusherProcess | None = None
    monitor: WalMonitor | None = None
    flusher_final: dict[str, Any] = field(default_factory=dict)


@contextlib.asynccontextmanager
async def open_saver(
    bench: Bench, side: Side, phase: str, link: Link | None
) -> AsyncIterator[OpenSaver]:
    """The side's checkpointer opened afresh for a phase, as a new process would (and the
    flusher process); closed on exit, the WAL objects deleted unless `--keep`."""
    if side.key == "onetrip":
        async with open_one_publish(bench.nats_url, phase) as one:
            yield OpenSaver(one)
        return
    if side.db is None:
        yield OpenSaver(InMemorySaver())
        return
    url = link.via(side.db.libpq_url) if link else side.db.libpq_url
    if side.config is None:
        pool: AsyncConnectionPool[AsyncConnection[DictRow]] = AsyncConnectionPool(
            url,
            min_size=POOL_SIZE,
            max_size=POOL_SIZE,
            # What AsyncPostgresSaver's own from_conn_string sets on its connection.
            kwargs={"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row},
            open=False,
        )
        await pool.open(wait=True)
        try:
            yield OpenSaver(AsyncPostgresSaver(pool))
        finally:
            await pool.close()
        return
    monitor = await WalMonitor.connect(side.config)
    flusher: FlusherProcess | None = None
    opened: OpenSaver | None = None
    try:
        name = f"{side.key}-{phase}"
        profile = bench.output / f"profile-flusher-{name}.pstats" if bench.options.profile else None
        flusher = await FlusherProcess.start(
            database_url=url,
            schema="public",
            config=side.config,
            log_path=bench.output / "logs" / f"flusher-{name}.log",
            profile_path=profile,
            front_end="langgraph",
        )
        saver = await BufferedCheckpointSaver.connect(side.config)
        opened = OpenSaver(saver, flusher, monitor)
        try:
            yield opened
        finally:
            await saver.close()
    finally:
        if flusher is not None:
            final = await flusher.stop()
            if opened is not None:
                opened.flusher_final = final
            if "Traceback" in flusher.log_path.read_text(errors="replace"):
                bench.note(f"the flusher logged errors: see {flusher.log_path}")
        if not bench.options.keep:
            await monitor.delete_objects()
        await monitor.close()


def cpu_sources(bench: Bench, side: Side, link: Link | None) -> dict[str, Callable[[], int | None]]:
    """The processes whose CPU a side's phase counts (the flusher reports its own)."""
    sources: dict[str, Callable[[], int | None]] = {
        "harness": os.getpid,
        "postgres": lambda: bench.pids()["postgres"],
    }
    if side.key in ("buffered", "onetrip"):
        sources["nats_server"] = lambda: bench.pids()["nats_server"]
    if link is not None:
        sources["proxy"] = lambda: link.proxy.pid
    return sources


def phase_label(phase: str) -> str:
    """'max' -> 'closed loop', '50' -> '50% of AsyncPostgresSaver's max'."""
    return "closed loop" if phase == "max" else f"{phase}% of AsyncPostgresSaver's max"
