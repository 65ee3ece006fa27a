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
        from buffered_store.buffered import BufferedThreadRunStore
        from buffered_store.postgres import PostgresThreadRunStore

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
    from buffered_store.entry import decode_flushed
    from buffered_store.flushing import ThreadLog, group_by_thread, tail_entries
    from buffered_store.keys import flushed_key
    from buffered_store.records import utcnow
    from buffered_store.wal import Wal

    wal = await Wal.connect(config, name="bufstore-status")
    try:
        consumer, stream = await asyncio.gather(
            wal.js.consumer_info(config.stream_name, config.consumer_name),
            wal.js.stream_info(config.stream_name),
        )
        tail = await tail_entries(wal, config)
        by_thread = group_by_thread(tail)
        log = ThreadLog(wal, config)
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
            "stream_messages": stream.state.messages,
            "last_seq": stream.state.last_seq,
            "consumer": {
                "name": config.consumer_name,
                "num_pending": consumer.num_pending,
                "num_ack_pending": consumer.num_ack_pending,
                "num_redelivered": consumer.num_redelivered,
                "ack_floor": consumer.ack_floor.stream_seq if consumer.ack_floor else 0,
            },
            "tail_entries": len(tail),
            "pending_threads": len(rows),
            "max_lag_s": rows[0]["lag_s"] if rows else 0.0,
            "threads": rows[:limit],
        }
    finally:
        await wal.close()
