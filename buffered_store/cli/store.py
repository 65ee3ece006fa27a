"""`bufstore force-flush` and `bufstore status`: the admin calls of the buffered store."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import click

from buffered_store.cli.common import (
    FrontEndView,
    front_end_option,
    front_end_view,
    require,
    run,
    store_config,
    store_options,
)

PROGRESS_LINE_INTERVAL_S = 5.0
"""Seconds between progress lines of `force-flush --all` when stderr is no terminal."""


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
    """Apply the pending checkpoints of THREAD_ID (or of every thread) to Postgres now.

    With --all, progress goes to stderr: a bar on a terminal, else a line every few
    seconds.
    """
    if bool(thread_id) == flush_all:
        raise click.UsageError("give a THREAD_ID or --all (not both)")
    url = require(database_url, "--database-url")
    config = store_config(nats_url)

    async def main() -> None:
        from buffered_store.stores.postgres import PostgresThreadRunStore
        from buffered_store.threadrun.store import BufferedThreadRunStore

        inner = await PostgresThreadRunStore.connect(url, schema=schema)
        try:
            async with BufferedThreadRunStore.connect(inner, config) as store:
                started = time.perf_counter()
                if flush_all:
                    with flush_progress() as progress:
                        count = await store.force_flush_all(
                            timeout=timeout or 60.0, progress=progress
                        )
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


@dataclass(slots=True)
class ProgressLines:
    """When a progress line is due on an output that is no terminal: the first report,
    then one per `interval_s` at most, and the last (all done). Pure: given `now`."""

    interval_s: float = PROGRESS_LINE_INTERVAL_S
    _last: float | None = None

    def due(self, now: float, done: int, total: int) -> bool:
        """Whether to print (done, total) at `now` (monotonic seconds)."""
        if done >= total or self._last is None or now - self._last >= self.interval_s:
            self._last = now
            return True
        return False


@contextmanager
def flush_progress() -> Iterator[Callable[[int, int], None]]:
    """A `force_flush_all` progress callback showing on stderr."""
    err = sys.stderr
    if err.isatty():
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        with Progress(
            "flushing threads",
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(file=err),
        ) as bar:
            task = bar.add_task("flush", total=None)
            yield lambda done, total: bar.update(task, completed=done, total=total)
        return
    lines = ProgressLines()

    def report(done: int, total: int) -> None:
        if lines.due(time.monotonic(), done, total):
            click.echo(f"flushed {done}/{total} thread(s)", err=True)

    yield report


@click.command("status")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--limit", type=int, default=20, show_default=True, help="Pending threads listed.")
@store_options
@front_end_option
def status(
    as_json: bool,
    limit: int,
    nats_url: str | None,
    database_url: str | None,
    schema: str,
    front_end: str,
) -> None:
    """Pending threads, their lag, and the flusher consumer's backlog.

    Read-only: creates nothing (a stream, consumer or bucket that does not exist is an
    error). With a database URL, a thread counts as flushed up to the higher of its KV
    mark and the watermark stored in Postgres (for --front-end langgraph:
    bufstore_lg_threads; its URL may come from BUFSTORE_LG_DATABASE_URL too).
    """
    view = front_end_view(front_end, nats_url, database_url, schema)
    report = run(lambda: collect_status(view.config, limit=limit, view=view))
    if as_json:
        click.echo(json.dumps(report, indent=2, default=str))
        return
    consumer = report["consumer"]
    click.echo(
        f"stream {report['stream']} ({report['front_end']}): {report['stream_messages']} "
        f"messages, last seq {report['last_seq']}"
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


async def collect_status(
    config: Any,
    *,
    limit: int,
    database_url: str | None = None,
    schema: str = "public",
    view: FrontEndView | None = None,
) -> dict[str, Any]:
    """The status report as a dict (`status --json`), from what exists: nothing is
    created. Flushed seqs are the KV marks, raised to the Postgres watermarks when a
    database URL is given (a flush cut short after its commit leaves the mark behind).
    `view` says whose WAL it is (default: the thread-run store's, with `database_url`
    and `schema`)."""
    from buffered_store.engine.entries import decode_flushed
    from buffered_store.engine.ids import utcnow
    from buffered_store.engine.keys import flushed_key
    from buffered_store.engine.threadlog import ThreadLog, group_by_thread
    from buffered_store.nats import NatsWal
    from buffered_store.threadrun.entry import FORMAT

    if view is None:
        view = FrontEndView("threadrun", config, FORMAT, database_url, schema)
    wal = await NatsWal.connect(config, name="bufstore-status", setup="open", front_end=view.name)
    try:
        consumer = await wal.consumer_state()
        log = ThreadLog(wal, config, view.fmt)
        tail = await log.tail_entries()
        by_thread = group_by_thread(tail)
        threads = sorted(by_thread)
        hots, marks, stored = await asyncio.gather(
            asyncio.gather(*(log.hot(t) for t in threads)),
            wal.kv_get_many([flushed_key(t) for t in threads]),
            view.watermarks(threads),
        )
        now = utcnow()
        rows: list[dict[str, Any]] = []
        for thread_id, hot, mark in zip(threads, hots, marks, strict=True):
            flushed = max(decode_flushed(mark.value).seq if mark else 0, stored.get(thread_id, 0))
            # The hot record may lag the entries (LangGraph advances it after the ack).
            latest = max(hot.record.seq if hot else 0, by_thread[thread_id][-1].seq)
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
            "front_end": view.name,
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
