"""`bufstore flusher` and `bufstore quarantine list|replay|drop`.

Loaded by the `bufstore` command line through the ``bufstore.commands`` entry points
(`register_flusher`, `register_quarantine`: one per command), so `buffered_store` never
imports this package. Configuration comes from ``BUFSTORE_*`` variables
(`FlusherConfig.from_env`), options override them; progress and logs go to stderr,
results to stdout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from buffered_store.backoff import backoff_s
from buffered_store.cli.common import (
    langgraph_config,
    nats_access,
    nats_url_option,
    require,
    run,
    store_options,
)
from buffered_store.config import ENV_PREFIX
from buffered_store.engine.entries import Format
from buffered_store.engine.threadlog import ThreadLog
from buffered_store.errors import BackendUnavailableError
from buffered_store.nats import NatsWal
from buffered_store.tasks import cancel_and_wait
from buffered_store.threadrun.entry import FORMAT
from flusher.config import FlusherConfig
from flusher.heap import settle_heap
from flusher.quarantine import (
    BulkReplay,
    QuarantineKind,
    QuarantineRecord,
    ReplayResult,
    drop,
    list_quarantine,
    replay,
    replay_all,
)

if TYPE_CHECKING:
    from buffered_store.langgraph import LangGraphConfig

log = logging.getLogger("flusher.cli")
T = TypeVar("T")

STARTUP_RETRY_INITIAL_S = 0.2
STARTUP_RETRY_MAX_S = 5.0


def register_flusher(group: click.Group) -> None:
    """The ``flusher`` entry point: `bufstore flusher`."""
    group.add_command(flusher_command)


def register_quarantine(group: click.Group) -> None:
    """The ``quarantine`` entry point: `bufstore quarantine ...`."""
    group.add_command(quarantine)


def setup_logging(level: str, fmt: str | None = None) -> None:
    """Log lines on stderr: ``time level logger [event] message fields`` or JSON objects
    (`buffered_store.logs`); `fmt` None reads ``BUFSTORE_LOG_FORMAT``."""
    from buffered_store.logs import configure_logging

    configure_logging(level, fmt="json" if fmt == "json" else "text" if fmt else None)


def flusher_config(nats_url: str | None, **overrides: Any) -> FlusherConfig:
    """`FlusherConfig.from_env()` with the options that were given applied."""
    values = {name: value for name, value in overrides.items() if value is not None}
    values.update(nats_access())
    if nats_url:
        values["nats_url"] = nats_url
    return FlusherConfig.from_env(**values)


def langgraph_flusher_config(lg: LangGraphConfig, **overrides: Any) -> FlusherConfig:
    """The flusher of the LangGraph front-end: the stream, consumer and bucket settings
    are the saver's own (``BUFSTORE_LG_*``: ``max_age_s``, ``replicas``,
    ``duplicate_window_s``, ``ack_wait_s``, ...), so it opens the objects the savers
    created; the flusher's own knobs read ``BUFSTORE_LG_<FIELD>``, then
    ``BUFSTORE_<FIELD>``. Overrides that are None are ignored."""
    from buffered_store.langgraph.config import LG_ENV_PREFIX

    given = {name: value for name, value in overrides.items() if value is not None}
    return FlusherConfig.for_front_end(lg, env_prefixes=(LG_ENV_PREFIX, ENV_PREFIX), **given)


@click.command("flusher", context_settings={"help_option_names": ["-h", "--help"]})
@store_options
@click.option("--consumer", "consumer_name", default=None, help="Durable consumer name.")
@click.option("--flush-interval", "flush_interval_s", type=float, default=None, help="Seconds.")
@click.option("--batch-size", "flush_batch_size", type=int, default=None, help="Messages.")
@click.option(
    "--batch-bytes", "flush_batch_bytes", type=int, default=None, help="Payload bytes (about)."
)
@click.option(
    "--stats-interval",
    type=float,
    default=30.0,
    show_default=True,
    help="Seconds between progress lines on stderr (0: none).",
)
@click.option("--log-level", default="INFO", show_default=True, help="Python logging level.")
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default=None,
    help="Log line format  [default: $BUFSTORE_LOG_FORMAT or text]",
)
@click.option(
    "--metrics-port",
    type=int,
    envvar="BUFSTORE_METRICS_PORT",
    default=None,
    show_envvar=True,
    help="Serve Prometheus metrics on this port at /metrics (needs the metrics extra).",
)
@click.option(
    "--front-end",
    type=click.Choice(["threadrun", "langgraph"]),
    default="threadrun",
    show_default=True,
    help="Whose WAL to drain. langgraph: the LangGraph checkpointer's (its stream, buckets "
    "and consumer from BUFSTORE_LG_* variables; LangGraph's tables at --database-url or "
    "BUFSTORE_LG_DATABASE_URL, found through the URL's search_path; needs the langgraph "
    "extra).",
)
def flusher_command(
    nats_url: str | None,
    database_url: str | None,
    schema: str,
    consumer_name: str | None,
    flush_interval_s: float | None,
    flush_batch_size: int | None,
    flush_batch_bytes: int | None,
    stats_interval: float,
    log_level: str,
    log_format: str | None,
    metrics_port: int | None,
    front_end: str,
) -> None:
    """Drain the WAL into Postgres until SIGINT/SIGTERM, then stop with a drain."""
    setup_logging(log_level, log_format)
    knobs = {
        "consumer_name": consumer_name,
        "flush_interval_s": flush_interval_s,
        "flush_batch_size": flush_batch_size,
        "flush_batch_bytes": flush_batch_bytes,
    }
    if front_end == "langgraph":
        from buffered_store.langgraph import LG_FORMAT, LangGraphSink

        lg = langgraph_config(nats_url, database_url)
        config = langgraph_flusher_config(lg, **knobs)
        run(
            lambda: _serve(
                config,
                lambda: LangGraphSink.open(lg.conninfo),
                stats_interval,
                metrics_port,
                LG_FORMAT,
            )
        )
        return
    config = flusher_config(nats_url, **knobs)
    url = require(database_url, "--database-url")

    def open_store() -> Awaitable[Any]:
        from buffered_store.stores.postgres import PostgresThreadRunStore

        return PostgresThreadRunStore.connect(url, schema=schema)

    run(lambda: _serve(config, open_store, stats_interval, metrics_port))


async def _serve(
    config: FlusherConfig,
    open_inner: Callable[[], Awaitable[Any]],
    stats_interval: float,
    metrics_port: int | None = None,
    fmt: Format[Any, Any] | None = None,
) -> None:
    """Run a flusher into what `open_inner` opens (a `PostgresThreadRunStore`, or a
    front-end's `FlushSink` with its format `fmt`) until SIGINT/SIGTERM."""
    from flusher.service import Flusher

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    inner = await start_patiently(open_inner, stop, "connect to Postgres")
    if inner is None:
        return
    metrics = None
    try:
        flusher = Flusher(inner, config, fmt=fmt)
        if metrics_port is not None:
            from buffered_store.metrics import StatsCollector, serve_metrics

            # A front-end's sink exports the inner-store metrics through its `metrics`.
            store = getattr(inner, "metrics", inner)
            sources = [flusher, store] if callable(getattr(store, "stats", None)) else [flusher]
            metrics = serve_metrics(metrics_port, StatsCollector(sources))
            click.echo(f"metrics on http://0.0.0.0:{metrics.port}/metrics", err=True)

        async def start() -> Flusher:
            await flusher.start()
            return flusher

        if await start_patiently(start, stop, "start the flusher") is None:
            return
        settle_heap()  # this process is a flusher: its start-up objects are for good
        click.echo(
            f"flusher running: consumer {config.consumer_name!r} on stream "
            f"{config.stream_name!r}; Ctrl-C or SIGTERM stops it",
            err=True,
        )
        try:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), stats_interval or None)
                if stats_interval and not stop.is_set():
                    click.echo(_progress(flusher.stats()), err=True)
        finally:
            click.echo("stopping: flushing what is held ...", err=True)
            await flusher.stop(drain=True)
            click.echo(_progress(flusher.stats()), err=True)
    finally:
        if metrics is not None:
            metrics.close()
        await inner.close()


async def start_patiently(
    attempt: Callable[[], Awaitable[T]],
    stop: asyncio.Event,
    what: str,
    *,
    initial_s: float = STARTUP_RETRY_INITIAL_S,
    max_s: float = STARTUP_RETRY_MAX_S,
) -> T | None:
    """`attempt()` until it succeeds, backing off while a service is unavailable.

    A flusher process started while NATS or Postgres is down (or too slow to answer its
    set-up requests, as under load) waits for them instead of exiting; errors that
    another attempt cannot cure (configuration, schema, refused credentials or TLS:
    `StoreError.retriable` false) stop it at once. Returns None as soon as `stop` is
    set, also while an attempt is still waiting for a server (it is cancelled).
    """
    failures = 0
    while not stop.is_set():
        try:
            started = await _unless_stopped(attempt(), stop)
        except BackendUnavailableError as exc:
            if not exc.retriable:
                raise
            failures += 1
            log.warning(
                "could not %s yet (%s); retrying",
                what,
                exc,
                extra={"action": "flusher_start_retry", "failures": failures},
            )
        else:
            return started  # None when `stop` came first
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                stop.wait(), backoff_s(failures, initial_s=initial_s, max_s=max_s)
            )
    return None


async def _unless_stopped(work: Awaitable[T], stop: asyncio.Event) -> T | None:
    """The result of `work`, or None once `stop` is set first (`work` is cancelled)."""
    task = asyncio.ensure_future(work)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        await cancel_and_wait(task)  # also when `work` swallows the first cancellation
    if task.cancelled():
        return None
    return task.result()


def _progress(stats: dict[str, int | float]) -> str:
    return (
        f"entries applied {stats['entries_applied']} in {stats['transactions']} transactions, "
        f"acked {stats['acked']}, quarantined {stats['quarantined_messages']}, "
        f"db retries {stats['db_retries']}, lag {stats['last_lag_s']:.3f}s"
    )


@click.group("quarantine")
def quarantine() -> None:
    """Inspect, replay or drop WAL messages the flusher quarantined."""


front_end_option = click.option(
    "--front-end",
    type=click.Choice(["threadrun", "langgraph"]),
    default="threadrun",
    show_default=True,
    help="Whose WAL: langgraph reads the LangGraph checkpointer's stream and buckets "
    "(BUFSTORE_LG_* variables) and flushes into LangGraph's tables.",
)
bucket_option = click.option(
    "--quarantine-bucket",
    default=None,
    help="Read the records of this bucket instead of the front-end's own (e.g. those a "
    "flusher of another front-end wrote about this stream).",
)


def quarantine_config(
    front_end: str, nats_url: str | None, database_url: str | None, bucket: str | None
) -> FlusherConfig:
    """The configuration the quarantine commands of `front_end` use."""
    if front_end == "langgraph":
        config = langgraph_flusher_config(langgraph_config(nats_url, database_url))
    else:
        config = flusher_config(nats_url)
    return config.replace(quarantine_bucket=bucket) if bucket else config


@quarantine.command("list")
@nats_url_option
@front_end_option
@bucket_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def quarantine_list(
    nats_url: str | None, front_end: str, quarantine_bucket: str | None, as_json: bool
) -> None:
    """List quarantine records (threads first, then messages)."""
    config = quarantine_config(front_end, nats_url, None, quarantine_bucket)

    async def main() -> list[QuarantineRecord]:
        wal = await NatsWal.connect(config, name="bufstore-quarantine")
        try:
            return await list_quarantine(wal)
        finally:
            await wal.close()

    records = run(main)
    for record in records:
        if as_json:
            click.echo(json.dumps(record.to_json(), ensure_ascii=False))
        else:
            click.echo(_describe(record))
    if not as_json:
        click.echo(f"{len(records)} record(s)", err=True)


def _describe(record: QuarantineRecord) -> str:
    if record.kind is QuarantineKind.THREAD:
        seqs = ",".join(str(s) for s in record.stream_seqs)
        return (
            f"thread {record.thread_id!r} from seq {record.seq} (stream seqs {seqs}): "
            f"{record.reason}"
        )
    what = f"entry seq {record.seq}" if record.seq is not None else f"{record.payload_bytes} bytes"
    return (
        f"message {record.stream_seq} on {record.subject} ({what}, thread "
        f"{record.thread_id!r}, {record.at.isoformat()}): {record.reason}"
        + (f" [{record.preview_hex}]" if record.preview_hex else "")
    )


def _selector(stream_seq: int | None, thread_id: str | None, every: bool = False) -> None:
    if (stream_seq is not None) + (thread_id is not None) + every != 1:
        raise click.UsageError(
            "give --stream-seq or --thread-id (exactly one)"
            if not every and stream_seq is None and thread_id is None
            else "give exactly one of --stream-seq, --thread-id or --all"
        )


@quarantine.command("replay")
@store_options
@front_end_option
@bucket_option
@click.option("--stream-seq", type=int, default=None, help="A quarantined message.")
@click.option("--thread-id", default=None, help="A quarantined thread (all its records).")
@click.option("--all", "every", is_flag=True, help="Every quarantined thread, in bulk.")
def quarantine_replay(
    nats_url: str | None,
    database_url: str | None,
    schema: str,
    front_end: str,
    quarantine_bucket: str | None,
    stream_seq: int | None,
    thread_id: str | None,
    every: bool,
) -> None:
    """Flush quarantined threads into Postgres again, from their stored watermarks.

    --thread-id replays the thread and removes all its records; --all does so for every
    thread with a record, one flush per thread, and lists the records it left (payloads
    that are no entry of this front-end). Exit status 1 when a thread still fails.
    """
    _selector(stream_seq, thread_id, every)
    config = quarantine_config(front_end, nats_url, database_url, quarantine_bucket)
    fmt: Format[Any, Any] = FORMAT
    if front_end == "langgraph":
        from buffered_store.langgraph import LG_FORMAT, LangGraphSink

        conninfo = langgraph_config(nats_url, database_url).conninfo
        fmt = LG_FORMAT

        def open_target() -> Awaitable[Any]:
            return LangGraphSink.open(conninfo)

    else:
        url = require(database_url, "--database-url")

        def open_target() -> Awaitable[Any]:
            from buffered_store.stores.postgres import PostgresThreadRunStore

            return PostgresThreadRunStore.connect(url, schema=schema)

    async def main() -> list[ReplayResult] | BulkReplay:
        target = await open_target()
        try:
            wal = await NatsWal.connect(config, name="bufstore-quarantine", front_end=front_end)
            try:
                thread_log = ThreadLog(wal, config, fmt)
                if every:
                    return await replay_all(thread_log, target)
                one = await replay(thread_log, target, stream_seq=stream_seq, thread_id=thread_id)
                return [one]
            finally:
                await wal.close()
        finally:
            await target.close()

    outcome = run(main)
    bulk = outcome if isinstance(outcome, BulkReplay) else BulkReplay(tuple(outcome))
    for result in bulk.replayed:
        click.echo(
            f"thread {result.thread_id!r} flushed up to seq {result.flushed_seq}; "
            f"removed {len(result.removed)} record(s)"
        )
    for key, why in bulk.skipped:
        click.echo(f"left {key}: {why}")
    for failed_thread, error in bulk.failed:
        click.echo(f"thread {failed_thread!r} still fails: {error}", err=True)
    if every:
        click.echo(
            f"{len(bulk.replayed)} thread(s) replayed, {len(bulk.failed)} failed, "
            f"{len(bulk.skipped)} record(s) left",
            err=True,
        )
    if bulk.failed:
        raise click.exceptions.Exit(1)


@quarantine.command("drop")
@nats_url_option
@front_end_option
@bucket_option
@click.option("--stream-seq", type=int, default=None, help="A quarantined message.")
@click.option("--thread-id", default=None, help="A quarantined thread.")
def quarantine_drop(
    nats_url: str | None,
    front_end: str,
    quarantine_bucket: str | None,
    stream_seq: int | None,
    thread_id: str | None,
) -> None:
    """Forget quarantine records without flushing anything."""
    _selector(stream_seq, thread_id)
    config = quarantine_config(front_end, nats_url, None, quarantine_bucket)

    async def main() -> list[str]:
        wal = await NatsWal.connect(config, name="bufstore-quarantine")
        try:
            return await drop(wal, stream_seq=stream_seq, thread_id=thread_id)
        finally:
            await wal.close()

    keys = run(main)
    click.echo(f"dropped {len(keys)} record(s): {', '.join(keys)}")
