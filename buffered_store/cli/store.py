"""`bufstore force-flush` and `bufstore status`: the admin calls of the buffered store."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import click

from buffered_store.cli.common import require, run, store_config, store_options


def register(group: click.Group) -> None:
    """Add the commands to the `bufstore` group."""
    group.add_command(force_flush)
    group.add_command(status)


@click.command("force-flush")
@click.argument("thread_id", required=False)
@click.option("--all", "flush_all", is_flag=True, help="Flush every thread with pending entries.")
@click.option("--timeout", type=float, default=None, help="Seconds before giving up.")
@store_options
def force_flush(
    thread_id: str | None,
    flush_all: bool,
    timeout: float | None,
    nats_url: str | None,
    database_url: str | None,
    schema: str,
) -> None:
    """Apply the pending checkpoints of THREAD_ID (or of every thread) to Postgres now."""
    if bool(thread_id) == flush_all:
        raise click.UsageError("give a THREAD_ID or --all (not both)")
    url = require(database_url, "--database-url")

    async def main() -> None:
        from buffered_store.stores.postgres import PostgresThreadRunStore
        from buffered_store.threadrun.store import BufferedThreadRunStore

        inner = await PostgresThreadRunStore.connect(url, schema=schema)
        try:
            async with BufferedThreadRunStore.connect(inner, store_config(nats_url)) as store:
                started = time.perf_counter()
                if flush_all:
                    count = await store.force_flush_all(timeout=timeout or 60.0)
                    took = (time.perf_counter() - started) * 1000
                    click.echo(f"flushed {count} thread(s) in {took:.1f} ms")
                else:
                    assert thread_id is not None
                    seq = await store.force_flush(thread_id, timeout=timeout or 10.0)
                    took = (time.perf_counter() - started) * 1000
                    click.echo(f"thread {thread_id!r} flushed up to seq {seq} in {took:.1f} ms")
        finally:
            await inner.close()

    run(main)


@click.command("status")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--limit", type=int, default=20, show_default=True, help="Pending threads listed.")
@store_options
def status(
    as_json: bool, limit: int, nats_url: str | None, database_url: str | None, schema: str
) -> None:
    """Pending threads, their lag, and the flusher consumer's backlog."""
    report = run(lambda: collect_status(store_config(nats_url), limit=limit))
    if as_json:
        click.echo(json.dumps(report, indent=2, default=str))
        return
    consumer = report["consumer"]
    click.echo(
        f"stream {report['stream']}: {report['stream_messages']} messages, "
        f"last seq {report['last_seq']}"
    )
    click.echo(
        f"consumer {consumer['name']}: {consumer['num_pending']} undelivered, "
        f"{consumer['num_ack_pending']} unacknowledged, "
        f"{consumer['num_redelivered']} redelivered, ack floor {consumer['ack_floor']}"
    )
    click.echo(f"pending threads: {report['pending_threads']} (oldest lag {report['max_lag_s']} s)")
    for item in report["threads"]:
        click.echo(
            f"  {item['thread_id']!r}: latest {item['latest_seq']}, flushed "
            f"{item['flushed_seq']}, pending {item['pending']}, lag {item['lag_s']} s"
        )


async def collect_status(config: Any, *, limit: int) -> dict[str, Any]:
    """The status report as a dict (shared by `status --json` and health checks)."""
    from buffered_store.engine.entries import decode_flushed
    from buffered_store.engine.ids import utcnow
    from buffered_store.engine.keys import flushed_key
    from buffered_store.engine.threadlog import ThreadLog, group_by_thread
    from buffered_store.nats import NatsWal
    from buffered_store.threadrun.entry import FORMAT

    wal = await NatsWal.connect(config, name="bufstore-status")
    try:
        consumer = await wal.consumer_state()
        log = ThreadLog(wal, config, FORMAT)
        tail = await log.tail_entries()
        by_thread = group_by_thread(tail)
        threads = sorted(by_thread)
        hots, marks = await asyncio.gather(
            asyncio.gather(*(log.hot(t) for t in threads)),
            wal.kv_get_many([flushed_key(t) for t in threads]),
        )
        now = utcnow()
        rows: list[dict[str, Any]] = []
        for thread_id, hot, mark in zip(threads, hots, marks, strict=True):
            flushed = decode_flushed(mark.value).seq if mark else 0
            latest = hot.record.seq if hot else 0
            if latest <= flushed or by_thread[thread_id][-1].seq <= flushed:
                continue
            first_pending = next(e for e in by_thread[thread_id] if e.seq > flushed)
            lag = (now - first_pending.at).total_seconds()
            rows.append(
                {
                    "thread_id": thread_id,
                    "latest_seq": latest,
                    "flushed_seq": flushed,
                    "pending": latest - flushed,
                    "lag_s": round(lag, 3),
                }
            )
        rows.sort(key=lambda r: -float(r["lag_s"]))
        return {
            "stream": config.stream_name,
            "stream_messages": consumer.messages,
            "last_seq": consumer.last_seq,
            "consumer": {
                "name": config.consumer_name,
                "num_pending": consumer.num_pending,
                "num_ack_pending": consumer.num_ack_pending,
                "num_redelivered": consumer.num_redelivered,
                "ack_floor": consumer.ack_floor,
            },
            "tail_entries": len(tail),
            "pending_threads": len(rows),
            "max_lag_s": rows[0]["lag_s"] if rows else 0.0,
            "threads": rows[:limit],
        }
    finally:
        await wal.close()
