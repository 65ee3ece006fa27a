"""Operations: the Prometheus exporter against a real workload, `bufstore health` through
a Postgres outage, payload-free logs, and the shipped dashboard.

The scrape test counts what Postgres itself saw: write transactions by xid consumption
(``pg_snapshot_xmax`` before and after; read-only transactions take no xid) and rows
updated from ``pg_stat_user_tables``, so the exporter's figures are checked against the
database, not against the same counters they were read from.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path
from typing import Any
from urllib.request import urlopen

import psycopg
import pytest
from click.testing import CliRunner, Result

from buffered_store.cli import main as bufstore
from buffered_store.config import BufferedStoreConfig
from buffered_store.dev.proxy import CuttableProxy
from buffered_store.dev.services import Services
from buffered_store.logs import JsonFormatter, TextFormatter, ThreadIdMode
from buffered_store.metrics import StatsCollector, metric_names, serve_metrics
from buffered_store.model.records import Message
from buffered_store.stores.urls import to_libpq_url
from buffered_store.testing import FaultyFlushTarget, make_run
from buffered_store.threadrun.store import BufferedThreadRunStore
from flusher import Flusher, FlusherConfig
from tests.plugins.stores import ConfigFactory, PostgresFactory
from tests.plugins.waiting import eventually

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "grafana" / "bufstore-dashboard.json"
OPERATIONS = ROOT / "docs" / "operations.md"
MARKER = "PAYLOAD-MARKER-c0ffee"
NAME = re.compile(r"\bbufstore_[a-z0-9_]+")

SHARED: dict[str, Any] = {"flush_interval_s": 0.05, "ack_wait_s": 5.0, "drain_on_close": False}
"""Settings of the store that the flusher copies (the consumer is created with them)."""
FAST: dict[str, Any] = {
    "fetch_timeout_s": 0.2,
    "db_retry_initial_s": 0.05,
    "db_retry_max_s": 0.2,
    "requeue_delay_s": 0.02,
    "drain_timeout_s": 5.0,
}

Scrape = dict[tuple[str, frozenset[tuple[str, str]]], float]


def tid() -> str:
    return f"ops-{uuid.uuid4().hex[:10]}"


def chat(step: int) -> list[Message]:
    return [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"{MARKER} says {i}"}
        for i in range(step)
    ]


async def scrape(port: int) -> Scrape:
    from prometheus_client.parser import text_string_to_metric_families

    def get() -> str:
        with urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            return str(response.read().decode())

    text = await asyncio.to_thread(get)
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Scrape, name: str, **labels: str) -> float:
    """A sample of the thread-run front-end (unless `labels` name another)."""
    if not name.startswith("process_"):
        labels.setdefault("front_end", "threadrun")
    return samples[(name, frozenset(labels.items()))]


async def sql(database_url: str, statement: str) -> Any:
    async with await psycopg.AsyncConnection.connect(
        to_libpq_url(database_url), autocommit=True
    ) as conn:
        cursor = await conn.execute(statement)
        return await cursor.fetchone() if cursor.description else None


async def next_xid(database_url: str) -> int:
    """The next transaction id Postgres will hand out (reading it consumes none)."""
    row = await sql(database_url, "SELECT pg_snapshot_xmax(pg_current_snapshot())::text")
    return int(row[0])


@contextlib.asynccontextmanager
async def autovacuum_paused(services: Services, database_url: str) -> AsyncIterator[bool]:
    """Autovacuum's ANALYZE takes xids too: pause it on our throwaway cluster so the xid
    count is exact (an external database only gets the lower bound)."""
    if not services.postgres_managed:
        yield False
        return
    await sql(database_url, "ALTER SYSTEM SET autovacuum = off")
    await sql(database_url, "SELECT pg_reload_conf()")
    try:
        yield True
    finally:
        await sql(database_url, "ALTER SYSTEM RESET autovacuum")
        await sql(database_url, "SELECT pg_reload_conf()")


class Capture(logging.Handler):
    """Every record of the test, formatted as JSON and as text (thread ids hashed)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.lines: list[str] = []
        self._formatters = (JsonFormatter(ThreadIdMode.HASH), TextFormatter(ThreadIdMode.HASH))

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.lines.extend(f.format(record) for f in self._formatters)

    def events(self) -> list[str]:
        return [str(getattr(r, "action", "")) for r in self.records]

    def assert_clean(self, thread_ids: list[str]) -> None:
        leaks = [line for line in self.lines if MARKER in line]
        leaks += [line for line in self.lines for t in thread_ids if t in line]
        assert leaks == []


@pytest.fixture
def captured_logs() -> Iterator[Capture]:
    root = logging.getLogger()
    handler = Capture()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


# -- the exporter against a real workload ------------------------------------------------------


async def test_scrape_agrees_with_the_workload_and_with_postgres(
    services: Services,
    database_url: str,
    schema_name: str,
    make_config: ConfigFactory,
    open_postgres: PostgresFactory,
    captured_logs: Capture,
) -> None:
    writer_pg = await open_postgres()
    flusher_pg = await open_postgres()  # its own pool, as a flusher process would have
    config = make_config(**SHARED)
    threads = [tid() for _ in range(8)]
    runs = {t: make_run(t, output={"answer": MARKER}) for t in threads}
    steps = dict.fromkeys(threads, 0)
    gate = FaultyFlushTarget(flusher_pg)
    flusher = Flusher(gate, FlusherConfig.from_store_config(config, **FAST), backlog_poll_s=0.1)
    store = await BufferedThreadRunStore.connect(writer_pg, config)
    server = serve_metrics(
        0, StatsCollector([store, flusher, flusher_pg]), addr="127.0.0.1", process_metrics=False
    )

    async def round_of_checkpoints() -> None:
        async def one(thread: str) -> None:
            steps[thread] += 1
            n = steps[thread]
            await store.checkpoint(
                thread, chat(n), runs[thread].replace(steps=n), metadata={"note": MARKER}
            )

        await asyncio.gather(*(one(t) for t in threads))

    try:
        async with autovacuum_paused(services, database_url) as exact:
            xid_before = await next_xid(database_url)
            # Phase 1: the flusher is stuck in its first transaction: the backlog shows.
            gate.block_applies()
            await flusher.start()
            for _ in range(5):
                await round_of_checkpoints()

            async def backlog_visible() -> bool:
                samples = await scrape(server.port)
                return (
                    value(samples, "bufstore_flusher_backlog_messages") == 40
                    and value(samples, "bufstore_flusher_pending_threads") == len(threads)
                    and value(samples, "bufstore_flusher_oldest_pending_age_seconds") > 0
                )

            await eventually(backlog_visible, timeout_s=10, what="the backlog gauges")
            gate.unblock_applies()
            # Phase 2: checkpoints while the flusher keeps up.
            for _ in range(5):
                await round_of_checkpoints()
            await flusher.wait_idle(timeout_s=20)

            async def drained() -> bool:
                samples = await scrape(server.port)
                return value(samples, "bufstore_flusher_backlog_messages") == 0

            await eventually(drained, timeout_s=10, what="the backlog to drain")
            samples = await scrape(server.port)
            await flusher.stop()
            xids = await next_xid(database_url) - xid_before
    finally:
        server.close()
        await store.close()
    made = sum(steps.values())
    assert made == 80

    # Every series the exporter knows is served, and nothing else (no per-thread labels).
    assert {name for name, _ in samples} == metric_names()
    assert {k for _, labels in samples for k, _ in labels} <= {
        "result",
        "outcome",
        "stage",
        "le",
        "front_end",
    }

    # Checkpoints: exactly the ones made, all successful.
    assert value(samples, "bufstore_store_checkpoints_total", result="ok") == made
    for result in ("invalid", "unavailable", "commit_unknown", "cancelled", "error"):
        assert value(samples, "bufstore_store_checkpoints_total", result=result) == 0
    assert value(samples, "bufstore_store_checkpoint_duration_seconds_count") == made
    assert value(samples, "bufstore_store_wal_bytes_total") > 0
    assert value(samples, "bufstore_store_nats_requests_total") >= 2 * made

    # Entries: what the flusher applied is what Postgres holds (watermarks add up to it).
    applied = value(samples, "bufstore_flusher_entries_applied_total")
    assert applied == made
    assert value(samples, "bufstore_inner_applied_entries_total") == made
    row = await sql(database_url, f'SELECT sum(flushed_seq) FROM "{schema_name}".threads')
    assert int(row[0]) == made
    coalesced = value(samples, "bufstore_flusher_coalesced_entries_total")
    threads_applied = value(samples, "bufstore_flusher_threads_applied_total")
    assert coalesced == made - threads_applied
    assert coalesced > 0  # the blocked first phase piled up entries per thread

    # Transactions: the flusher's count is Postgres' count of write transactions.
    transactions = value(samples, "bufstore_flusher_transactions_total")
    assert transactions == value(samples, "bufstore_inner_transactions_total")
    assert transactions == value(samples, "bufstore_inner_apply_calls_total")
    assert value(samples, "bufstore_flusher_db_retries_total") == 0
    if exact:
        assert xids == transactions
    else:
        assert xids >= transactions
    # ...and each applied thread batch is one UPDATE of its thread row.
    await flusher_pg.close()  # a backend reports its table statistics when it exits
    stats_sql = (
        "SELECT n_tup_ins, n_tup_upd FROM pg_stat_user_tables "
        f"WHERE schemaname = '{schema_name}' AND relname = 'threads'"
    )

    async def row_writes_reported() -> bool:
        ins, upd = await sql(database_url, stats_sql)
        return bool(ins == len(threads) and upd == threads_applied)

    await eventually(row_writes_reported, timeout_s=10, what="pg_stat_user_tables")

    # Lag and duration histograms have samples: one per applied entry and per cycle.
    assert value(samples, "bufstore_flusher_flush_lag_seconds_count") == made
    assert value(samples, "bufstore_flusher_flush_lag_seconds_sum") > 0
    buckets = sorted(
        (float(dict(labels)["le"]), v)
        for (name, labels), v in samples.items()
        if name == "bufstore_flusher_flush_lag_seconds_bucket"
    )
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)
    assert buckets[-1][1] == made
    batches = value(samples, "bufstore_flusher_batches_total")
    assert value(samples, "bufstore_flusher_flush_duration_seconds_count") == batches
    assert value(samples, "bufstore_flusher_running") == 1  # scraped before stop()
    assert value(samples, "bufstore_flusher_backlog_polled_timestamp_seconds") > 0

    captured_logs.assert_clean(threads)


async def test_flusher_process_serves_metrics_and_writes_json_logs(
    nats_url: str,
    database_url: str,
    schema_name: str,
    make_config: ConfigFactory,
    open_postgres: PostgresFactory,
) -> None:
    pg = await open_postgres()
    config = make_config(**SHARED)
    thread = tid()
    async with BufferedThreadRunStore.connect(pg, config) as store:
        for step in range(1, 6):
            await store.checkpoint(thread, chat(step), make_run(thread, run_id=f"r-{thread}"))
    env = {
        **os.environ,
        **_env(config, nats_url),
        "BUFSTORE_ACK_WAIT_S": "5",
        "BUFSTORE_FLUSH_INTERVAL_S": "0.05",
        "BUFSTORE_LOG_THREAD_IDS": "hash",
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "flusher",
        "--database-url",
        database_url,
        "--schema",
        schema_name,
        "--metrics-port",
        "0",
        "--log-format",
        "json",
        "--stats-interval",
        "0",
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    assert proc.stderr is not None
    lines: list[str] = []
    try:
        port = 0
        while not port:
            line = (await asyncio.wait_for(proc.stderr.readline(), 20)).decode()
            assert line, "the flusher exited: " + "".join(lines)
            lines.append(line)
            if found := re.search(r"metrics on http://[^:]+:(\d+)/metrics", line):
                port = int(found.group(1))

        async def all_applied() -> bool:
            samples = await scrape(port)
            return value(samples, "bufstore_flusher_entries_applied_total") == 5

        await eventually(all_applied, timeout_s=20, what="the flusher process to apply")
        samples = await scrape(port)
        assert value(samples, "bufstore_inner_applied_entries_total") == 5
        assert any(name.startswith("process_") for name, _ in samples)
    finally:
        if proc.returncode is None:
            proc.terminate()
        _, rest = await asyncio.wait_for(proc.communicate(), 20)
    lines.extend(rest.decode().splitlines(keepends=True))
    assert proc.returncode == 0, "".join(lines)
    records = [json.loads(line) for line in lines if line.startswith("{")]
    events = [r["event"] for r in records]
    assert "flusher_started" in events
    assert "flusher_stopped" in events
    # The process is a flusher: once it runs, its start-up objects are frozen.
    settled = next(r for r in records if r["event"] == "heap_settled")
    assert settled["frozen_objects"] > 10_000
    assert all(r["ts"] and r["level"] and r["logger"] for r in records)
    text = "".join(lines)
    assert MARKER not in text
    assert thread not in text


# -- health through a Postgres outage ----------------------------------------------------------


async def test_health_fails_while_postgres_is_down_and_passes_after_recovery(
    nats_url: str,
    database_url: str,
    postgres_link: CuttableProxy,
    make_config: ConfigFactory,
    open_postgres: PostgresFactory,
    captured_logs: Capture,
) -> None:
    """Postgres goes away for the flusher and for `bufstore health` (a cut link to the
    shared server): health fails on postgres, then on lag; once the link is back, it
    passes again and the flusher logged one outage, not one line per retry."""
    # Everything that must see the outage reaches Postgres through the link.
    database_url = postgres_link.via(database_url)
    pg = await open_postgres(url=database_url)
    config = make_config(**SHARED)
    env = _env(config, nats_url)
    max_lag_s = 1.5
    threads = [tid() for _ in range(3)]
    steps = dict.fromkeys(threads, 0)
    store = await BufferedThreadRunStore.connect(pg, config)
    flusher = Flusher(pg, FlusherConfig.from_store_config(config, **FAST), backlog_poll_s=0.2)

    async def checkpoint_all() -> None:
        async def one(thread: str) -> None:
            steps[thread] += 1
            run = make_run(thread, run_id=f"run-{thread}", steps=steps[thread])
            await store.checkpoint(thread, chat(steps[thread]), run)

        await asyncio.gather(*(one(t) for t in threads))

    # No $DATABASE_URL from the outer environment: Postgres is checked only when asked.
    cli_env: dict[str, str | None] = {**env, "DATABASE_URL": None}

    def health(*args: str) -> Awaitable[Result]:
        argv = ["health", "--max-lag-s", str(max_lag_s), "--max-backlog", "1000", *args]
        return asyncio.to_thread(CliRunner().invoke, bufstore, argv, env=cli_env)

    await flusher.start()
    try:
        await checkpoint_all()
        await flusher.wait_idle(timeout_s=10)
        healthy = await health("--database-url", database_url)
        assert healthy.exit_code == 0, healthy.output
        assert [line.split()[:2] for line in healthy.output.splitlines()] == [
            ["OK", "nats"],
            ["OK", "backlog"],
            ["OK", "lag"],
            ["OK", "flusher"],
            ["OK", "postgres"],
        ]

        postgres_link.cut()
        try:
            started = time.monotonic()
            down = await health("--database-url", database_url, "--timeout", "3")
            assert time.monotonic() - started < 3 + 2
            assert down.exit_code == 1, down.output
            assert "FAIL  postgres" in down.output

            # Checkpoints keep landing in the WAL; once the oldest unflushed one is older
            # than --max-lag-s, health fails on lag alone (no database URL given). The clock
            # starts before the first of them is written: that one is the oldest unflushed.
            outage_began = time.monotonic()
            await checkpoint_all()
            lag_failed: list[dict[str, Any]] = []

            async def lag_over_threshold() -> bool:
                await checkpoint_all()
                result = await health("--json")
                report = json.loads(result.output)
                checks = {c["name"]: c for c in report["checks"]}
                if result.exit_code == 1 and checks["lag"]["status"] == "fail":
                    lag_failed.append(report)
                    return True
                assert result.exit_code == 0, result.output
                return False

            took = await eventually(
                lag_over_threshold,
                timeout_s=max_lag_s + 5,
                what="health to fail on lag",
                every_s=0.05,
            )
            assert time.monotonic() - outage_began >= max_lag_s
            assert took <= max_lag_s + 3
            report = lag_failed[0]
            assert report["healthy"] is False
            assert {c["name"]: c["status"] for c in report["checks"]} == {
                "nats": "ok",
                "backlog": "ok",
                "lag": "fail",
                "flusher": "ok",  # it runs, retrying against the unreachable Postgres
                "postgres": "skip",
            }
        finally:
            postgres_link.restore()

        async def recovered() -> bool:
            result = await health("--database-url", database_url)
            return result.exit_code == 0

        await eventually(recovered, timeout_s=30, what="health to pass again", every_s=0.2)
        # A real process, as a container probe runs it: exit status 0.
        probe = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            "from buffered_store.cli import main; main()",
            "health",
            "--database-url",
            database_url,
            env={**os.environ, **env},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(probe.communicate(), 30)
        assert probe.returncode == 0, (out, err)
    finally:
        await flusher.stop()
        await store.close()

    # One WARNING when the outage began and one INFO when it ended, not one per retry.
    stats = flusher.stats()
    assert stats["db_retries"] > stats["db_retry_episodes"] >= 1
    events = captured_logs.events()
    assert events.count("db_unavailable") == stats["db_retry_episodes"]
    assert events.count("db_recovered") == stats["db_retry_episodes"]
    captured_logs.assert_clean(threads)


def _env(config: BufferedStoreConfig, nats_url: str) -> dict[str, str]:
    return {
        "BUFSTORE_NATS_URL": nats_url,
        "BUFSTORE_STREAM_NAME": config.stream_name,
        "BUFSTORE_HOT_BUCKET": config.hot_bucket,
        "BUFSTORE_QUARANTINE_BUCKET": config.quarantine_bucket,
        "BUFSTORE_CONSUMER_NAME": config.consumer_name,
    }


async def test_health_fails_when_nats_is_unreachable_or_the_consumer_missing(
    nats_url: str, make_config: ConfigFactory
) -> None:
    from buffered_store.cli.common import store_config
    from buffered_store.cli.health import run_checks

    config = make_config()  # never connected: its stream and consumer do not exist
    checks, _ = await run_checks(
        config, database_url=None, max_backlog=10, max_lag_s=1.0, timeout_s=3
    )
    by_name = {c.name: c for c in checks}
    assert by_name["nats"].status == "fail"
    assert "does not exist" in by_name["nats"].detail
    assert by_name["postgres"].status == "skip"

    dead = store_config("nats://127.0.0.1:1")
    started = time.monotonic()
    checks, _ = await run_checks(
        dead,
        database_url="postgresql://nobody@127.0.0.1:1/x",
        max_backlog=10,
        max_lag_s=1.0,
        timeout_s=10,
    )
    assert time.monotonic() - started < 3  # refused connections fail fast, not at the timeout
    assert {c.name: c.status for c in checks} == {
        "nats": "fail",
        "backlog": "skip",
        "lag": "skip",
        "flusher": "skip",
        "postgres": "fail",
    }


# -- the shipped dashboard -----------------------------------------------------------------------


def _exprs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, item in node.items():
            if key in ("expr", "query", "definition") and isinstance(item, str):
                yield item
            else:
                yield from _exprs(item)
    elif isinstance(node, list):
        for item in node:
            yield from _exprs(item)


def test_dashboard_parses_and_uses_only_served_metric_names() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert dashboard["title"]
    assert dashboard["uid"]
    exprs = list(_exprs(dashboard))
    assert len(exprs) >= 15
    used = {name for expr in exprs for name in NAME.findall(expr)}
    served = metric_names()
    assert used <= served, sorted(used - served)
    # The signals operators alert on are all on the dashboard.
    for needed in (
        "bufstore_flusher_backlog_messages",
        "bufstore_flusher_oldest_pending_age_seconds",
        "bufstore_flusher_flush_lag_seconds_bucket",
        "bufstore_flusher_db_retries_total",
        "bufstore_flusher_quarantined_messages_total",
        "bufstore_store_checkpoint_duration_seconds_bucket",
        "bufstore_store_checkpoints_total",
    ):
        assert needed in used, needed


def test_operations_guide_names_only_served_metrics() -> None:
    text = OPERATIONS.read_text(encoding="utf-8")
    used = set(NAME.findall(text))
    assert len(used) > 20, "the guide should name the metrics to alert on"
    served = metric_names()
    # A histogram may be named by its family (bufstore_..._seconds) as well.
    unknown = {n for n in used if n not in served and f"{n}_bucket" not in served}
    assert unknown == set()
