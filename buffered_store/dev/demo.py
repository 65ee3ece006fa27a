"""`make demo`: the buffered store against the direct Postgres store, on a realistic workload.

Starts its own NATS and Postgres (or uses NATS_URL / DATABASE_URL), then:

1. drives the same multi-thread agent workload through the direct `PostgresThreadRunStore`
   and through `BufferedThreadRunStore` (no flusher running yet), with a progress bar;
2. reads a thread back from a second store instance before any flush (read-your-writes);
3. calls the `force_flush` admin API on one thread;
4. starts a flusher process (`python -m flusher`) and waits until everything is flushed;
5. prints checkpoints against Postgres transactions and row writes for both stores.

Run with ``python -m buffered_store.dev.demo [--threads N] [--steps N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from buffered_store.config import BufferedStoreConfig
from buffered_store.dev.processes import register, stop_on_sigterm, unregister
from buffered_store.dev.services import Services, start_services
from buffered_store.engine.ids import utcnow
from buffered_store.stores.postgres import PostgresThreadRunStore
from buffered_store.stores.urls import to_libpq_url
from buffered_store.threadrun.protocol import ThreadRunStore
from buffered_store.threadrun.records import RunRecord, RunStatus
from buffered_store.threadrun.store import BufferedThreadRunStore

console = Console(highlight=False, width=None if sys.stdout.isatty() else 110)


@dataclass
class PhaseResult:
    """What one store did with the workload."""

    name: str
    checkpoints: int
    seconds: float
    latencies_ms: list[float]
    transactions: int
    row_writes: int

    @property
    def p50(self) -> float:
        return statistics.median(self.latencies_ms)

    @property
    def p99(self) -> float:
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def agent_message(thread: int, step: int, role: str) -> dict[str, Any]:
    """A plausible chat message of ~300 bytes."""
    return {
        "role": role,
        "content": f"[thread {thread} step {step}] "
        + ("tool output " if role == "tool" else "reasoning ") * 20,
        "meta": {"step": step, "tokens": 40 + step % 7},
    }


async def drive(
    store: ThreadRunStore, threads: int, steps: int, label: str, prefix: str
) -> tuple[float, list[float]]:
    """Each thread runs one agent run: every step appends two messages and checkpoints."""
    latencies: list[float] = []
    with Progress(
        TextColumn(f"{label:>9}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task(label, total=threads * steps)

        async def one_thread(index: int) -> None:
            thread_id = f"{prefix}-{index}"
            messages: list[dict[str, Any]] = []
            run = RunRecord(
                run_id=f"{thread_id}-run", thread_id=thread_id, agent_id=f"agent-{index % 4}"
            )
            for step in range(steps):
                messages.append(agent_message(index, step, "assistant"))
                messages.append(agent_message(index, step, "tool"))
                done = step == steps - 1
                run = run.replace(
                    steps=step + 1,
                    input_tokens=run.input_tokens + 120,
                    output_tokens=run.output_tokens + 40,
                    status=RunStatus.DONE if done else RunStatus.RUNNING,
                    updated_at=utcnow(),
                    finished_at=utcnow() if done else None,
                )
                started = time.perf_counter()
                await store.checkpoint(thread_id, messages, run)
                latencies.append((time.perf_counter() - started) * 1000)
                progress.advance(task)

        started = time.perf_counter()
        await asyncio.gather(*(one_thread(i) for i in range(threads)))
    return time.perf_counter() - started, latencies


class PgCounters:
    """Write transactions and tuple writes, read from Postgres itself.

    Write transactions are counted by transaction ids consumed (the next xid of a fresh
    snapshot): exact and immediate, and read-only transactions (overlay reads, status
    polls) use none. Tuple writes come from `pg_stat_user_tables`, which backends report
    lazily, so they are read once the writers' connections are closed and the counters
    have settled.
    """

    def __init__(self, url: str) -> None:
        self.conninfo = to_libpq_url(url)

    def next_xid(self) -> int:
        """The transaction id the next writing transaction will get."""
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            row = conn.execute("SELECT pg_snapshot_xmax(pg_current_snapshot())::text").fetchone()
        assert row is not None
        return int(row[0])

    def row_writes(self, schema: str) -> int:
        """Tuple inserts + updates + deletes in `schema`, once the counters settle."""
        query = (
            "SELECT coalesce(sum(n_tup_ins + n_tup_upd + n_tup_del), 0) "
            "FROM pg_stat_user_tables WHERE schemaname = %s"
        )
        previous = -1
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline:
            with psycopg.connect(self.conninfo, autocommit=True) as conn:
                row = conn.execute(query, (schema,)).fetchone()
            assert row is not None
            current = int(row[0])
            if current == previous:
                return current
            previous = current
            time.sleep(0.5)
        return previous


async def run_direct(
    services: Services, counters: PgCounters, threads: int, steps: int
) -> PhaseResult:
    schema = f"demo_direct_{uuid.uuid4().hex[:6]}"
    store = await PostgresThreadRunStore.connect(services.database_url, schema=schema, migrate=True)
    try:
        first_xid = counters.next_xid()
        seconds, latencies = await drive(store, threads, steps, "direct", "direct")
        transactions = counters.next_xid() - first_xid
        sample = await store.load_messages("direct-0")
        console.print(f"  read back 'direct-0': {len(sample or [])} messages")
    finally:
        await store.close()
    return PhaseResult(
        "direct Postgres",
        threads * steps,
        seconds,
        latencies,
        transactions,
        counters.row_writes(schema),
    )


async def run_buffered(
    services: Services, counters: PgCounters, threads: int, steps: int
) -> PhaseResult:
    tag = uuid.uuid4().hex[:6]
    schema = f"demo_buffered_{tag}"
    config = BufferedStoreConfig(
        nats_url=services.nats_url,
        stream_name=f"DEMO_{tag}",
        hot_bucket=f"demo-hot-{tag}",
        quarantine_bucket=f"demo-quarantine-{tag}",
        consumer_name=f"demo-flusher-{tag}",
        drain_on_close=False,
    )
    inner = await PostgresThreadRunStore.connect(services.database_url, schema=schema, migrate=True)
    first_xid = counters.next_xid()
    flusher: ChildProcess | None = None
    try:
        async with BufferedThreadRunStore.connect(inner, config) as store:
            seconds, latencies = await drive(store, threads, steps, "buffered", "buffered")

            console.rule("read-your-writes before any flush")
            async with BufferedThreadRunStore.connect(inner, config) as other:
                thread_id = "buffered-0"
                seen = await other.load_messages(thread_id)
                run = await other.latest_run(thread_id)
                in_db = await inner.load_messages(thread_id)
                status = await other.flush_status(thread_id)
                console.print(
                    f"  second instance reads {thread_id!r}: {len(seen or [])} messages, "
                    f"run {run.run_id if run else None} status={run.status if run else None}"
                )
                console.print(
                    f"  Postgres holds {len(in_db or [])} messages for it "
                    f"(latest seq {status.latest_seq}, flushed {status.flushed_seq})"
                )

                console.rule("force_flush admin call")
                started = time.perf_counter()
                seq = await other.force_flush(thread_id)
                took = (time.perf_counter() - started) * 1000
                in_db = await inner.load_messages(thread_id)
                console.print(
                    f"  force_flush({thread_id!r}) -> seq {seq} in {took:.1f} ms; "
                    f"Postgres now holds {len(in_db or [])} messages"
                )

            console.rule("flusher process")
            flusher = start_flusher(services, config, schema)
            await wait_until(
                lambda: all_flushed(store, [f"buffered-{i}" for i in range(threads)]),
                timeout_s=120,
                what="the flusher to drain the WAL",
            )
            console.print(f"  flusher (pid {flusher.pid}) drained every thread")
            transactions = counters.next_xid() - first_xid
            flusher.close()
            flusher = None

            console.rule("Spark run statistics over unflushed checkpoints")
            await drive(store, 4, 3, "late", "late")
            console.print(f"  {4 * 3} more checkpoints on 4 new runs, no flusher running")
            await asyncio.to_thread(spark_run_stats, services, config, schema)
    finally:
        if flusher is not None:
            flusher.close()
        await inner.close()
    return PhaseResult(
        "buffered (NATS WAL)",
        threads * steps,
        seconds,
        latencies,
        transactions,
        counters.row_writes(schema),
    )


def spark_run_stats(services: Services, config: BufferedStoreConfig, schema: str) -> None:
    """The run-statistics job in READ_YOUR_WRITES and EVENTUAL mode, side by side."""
    from buffered_store.spark import StoreSource, format_run_stats, run_stats, spark_session

    # The JVM's warnings and Spark's log lines go to a file: the demo's output is only ours.
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"bufstore-demo-spark-{os.getpid()}.log"
    console.print(f"  starting a local Spark session  (JVM log: {log})")
    spark = spark_session(
        "bufstore-demo", conf={"spark.ui.showConsoleProgress": "false"}, jvm_log=log
    )
    try:
        source = StoreSource.from_urls(services.database_url, schema=schema, wal=config)
        totals: dict[str, int] = {}
        for mode in ("read_your_writes", "eventual"):
            rows = run_stats(spark, source, mode).collect()
            totals[mode] = sum(int(row["runs"]) for row in rows)
            console.print(f"  run statistics, {mode}:")
            print(format_run_stats(rows), flush=True)
        console.print(
            f"  READ_YOUR_WRITES counts {totals['read_your_writes']} runs, EVENTUAL "
            f"{totals['eventual']}: the {totals['read_your_writes'] - totals['eventual']} "
            "unflushed runs are counted"
        )
    finally:
        spark.stop()


class ChildProcess:
    """A process the demo started, stopped by `close` (SIGTERM, then SIGKILL after 15 s),
    also when the demo ends at interpreter exit or by SIGTERM (`stop_on_sigterm` closes
    it before the servers it needs to drain)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        register(self)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def close(self) -> None:
        # Registered until reaped: a SIGTERM while this waits for the drain closes it
        # again (a second wait) before the servers, never the servers under it.
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        finally:
            unregister(self)


def start_flusher(services: Services, config: BufferedStoreConfig, schema: str) -> ChildProcess:
    """`python -m flusher` as its own process, configured through the environment."""
    env = {
        **os.environ,
        **services.env(),
        "BUFSTORE_NATS_URL": config.nats_url,
        "BUFSTORE_STREAM_NAME": config.stream_name,
        "BUFSTORE_HOT_BUCKET": config.hot_bucket,
        "BUFSTORE_QUARANTINE_BUCKET": config.quarantine_bucket,
        "BUFSTORE_CONSUMER_NAME": config.consumer_name,
        "BUFSTORE_SCHEMA": schema,
    }
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"bufstore-demo-flusher-{os.getpid()}.log"
    console.print(f"  starting: {sys.executable} -m flusher  (log: {log})")
    with log.open("wb") as out:
        return ChildProcess(
            subprocess.Popen(
                [sys.executable, "-m", "flusher", "--database-url", services.database_url],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        )


async def all_flushed(store: BufferedThreadRunStore, thread_ids: list[str]) -> bool:
    statuses = await asyncio.gather(*(store.flush_status(t) for t in thread_ids))
    return all(s.pending == 0 for s in statuses)


async def wait_until(check: Callable[[], Awaitable[bool]], *, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.2)


def report(results: list[PhaseResult]) -> None:
    table = Table(title="checkpoints vs Postgres work (same workload, same run)", expand=True)
    for column in (
        "store",
        "checkpoints",
        "ckpt/s",
        "p50 ms",
        "p99 ms",
        "PG write tx",
        "tx per ckpt",
        "PG row writes",
    ):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(
            r.name,
            str(r.checkpoints),
            f"{r.checkpoints / r.seconds:,.0f}",
            f"{r.p50:.2f}",
            f"{r.p99:.2f}",
            str(r.transactions),
            f"{r.transactions / r.checkpoints:.3f}",
            str(r.row_writes),
        )
    console.print(table)
    direct, buffered = results
    if buffered.transactions:
        console.print(
            f"checkpoints per Postgres write transaction: buffered "
            f"{buffered.checkpoints / buffered.transactions:.1f}, "
            f"direct {direct.checkpoints / max(1, direct.transactions):.2f} "
            f"(buffered includes the force_flush call; write transactions counted by xids)"
        )


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--threads", type=int, default=32)
    parser.add_argument("--steps", type=int, default=25)
    args = parser.parse_args(argv)
    with start_services() as services:
        console.rule("services")
        console.print(f"  NATS {services.nats_url}\n  Postgres {services.database_url}")
        counters = PgCounters(services.database_url)
        console.rule(f"workload: {args.threads} threads x {args.steps} steps")
        direct = await run_direct(services, counters, args.threads, args.steps)
        buffered = await run_buffered(services, counters, args.threads, args.steps)
        console.rule("results")
        report([direct, buffered])
    return 0


if __name__ == "__main__":
    stop_on_sigterm()
    sys.exit(asyncio.run(main()))
