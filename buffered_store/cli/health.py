"""`bufstore health`: exit 0 when NATS and Postgres answer, the flush backlog and lag
are under their thresholds and a flusher consumes the WAL, 1 otherwise; usable as a
container probe. ``--front-end langgraph`` checks the LangGraph checkpointer's WAL.

It measures what `bufstore status` reports (backlog from the consumer info; lag as the
age of the oldest entry above its thread's flushed mark or Postgres watermark; whether
a pull request waits on the consumer and when it last delivered or saw an ack), but
bounded, as a probe must
be: a NATS connection that tries each server once and gives up at once when it is lost
(``NatsWal.connect(setup="open", reconnect="probe")``: like `status`, it creates nothing
and compares no setting with the caller's), and at most `SCAN_LIMIT` direct gets of the
tail however long the backlog grew. Postgres gets a ``SELECT 1``. Every check is bounded
by ``--timeout``. The NATS URL is shown with its password masked.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Literal, TypeVar

import click

from buffered_store.cli.common import (
    FrontEndView,
    database_url_option,
    front_end_option,
    front_end_view,
    nats_url_option,
)
from buffered_store.config import EngineConfig
from buffered_store.masking import mask_url

Status = Literal["ok", "fail", "skip"]
T = TypeVar("T")

DEFAULT_MAX_BACKLOG = 10_000
DEFAULT_MAX_LAG_S = 60.0
DEFAULT_MAX_IDLE_S = 60.0
SCAN_LIMIT = 2_000
"""Most entries of the unacknowledged tail one check reads (the oldest ones)."""


@dataclass(frozen=True, slots=True)
class Check:
    """The result of one health check."""

    name: str
    status: Status
    detail: str
    value: float | None = None
    threshold: float | None = None


@dataclass(frozen=True, slots=True)
class WalFigures:
    """What the WAL side of the health check measured."""

    backlog: int
    """Entries undelivered or unacknowledged (all flushers)."""
    lag_s: float
    """Age of the oldest unflushed entry (0 when none)."""
    pending_threads: int
    """Threads with unflushed entries (a lower bound when not `complete`)."""
    complete: bool
    """Whether the whole unacknowledged tail was read."""
    waiting_pulls: int = 0
    """Pull requests waiting on the consumer: flushers asking for entries right now."""
    idle_s: float | None = None
    """Seconds since the consumer last delivered or had an entry acknowledged (None:
    never)."""


def register(group: click.Group) -> None:
    """Add the command to the `bufstore` group."""
    group.add_command(health)


@click.command("health")
@click.option(
    "--max-backlog",
    type=int,
    envvar="BUFSTORE_HEALTH_MAX_BACKLOG",
    default=DEFAULT_MAX_BACKLOG,
    show_default=True,
    show_envvar=True,
    help="Most WAL entries waiting to be flushed (undelivered + unacknowledged).",
)
@click.option(
    "--max-lag-s",
    type=float,
    envvar="BUFSTORE_HEALTH_MAX_LAG_S",
    default=DEFAULT_MAX_LAG_S,
    show_default=True,
    show_envvar=True,
    help="Oldest unflushed checkpoint, in seconds.",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=float,
    default=5.0,
    show_default=True,
    help="Seconds each check may take.",
)
@click.option(
    "--max-idle-s",
    type=float,
    envvar="BUFSTORE_HEALTH_MAX_IDLE_S",
    default=DEFAULT_MAX_IDLE_S,
    show_default=True,
    show_envvar=True,
    help="With entries pending, longest time without a pull request waiting and without "
    "a delivery or ack before the consumer counts as consumed by no flusher.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@nats_url_option
@database_url_option
@front_end_option
def health(
    max_backlog: int,
    max_lag_s: float,
    timeout_s: float,
    max_idle_s: float,
    as_json: bool,
    nats_url: str | None,
    database_url: str | None,
    front_end: str,
) -> None:
    """Check NATS, Postgres, the flush backlog and lag, and that a flusher consumes the
    WAL; exit 1 if anything fails.

    Postgres is checked when a database URL is given (option or $DATABASE_URL; for
    --front-end langgraph also BUFSTORE_LG_DATABASE_URL); its watermarks then measure
    the lag. "No flusher consumes": entries are pending, no pull request waits on the
    consumer, and nothing was delivered or acknowledged for --max-idle-s.
    """
    view = front_end_view(front_end, nats_url, database_url)
    checks, figures = asyncio.run(
        run_checks(
            view.config,
            database_url=view.database_url,
            max_backlog=max_backlog,
            max_lag_s=max_lag_s,
            timeout_s=timeout_s,
            view=view,
            max_idle_s=max_idle_s,
        )
    )
    healthy = all(c.status != "fail" for c in checks)
    if as_json:
        report = {
            "healthy": healthy,
            "checks": [asdict(c) for c in checks],
            "wal": asdict(figures) if figures else None,
        }
        click.echo(json.dumps(report, indent=2, default=str))
    else:
        for check in checks:
            click.echo(f"{check.status.upper():<4}  {check.name:<8}  {check.detail}")
    if not healthy:
        raise click.exceptions.Exit(1)


async def run_checks(
    config: EngineConfig,
    *,
    database_url: str | None,
    max_backlog: int | None,
    max_lag_s: float | None,
    timeout_s: float,
    scan_limit: int = SCAN_LIMIT,
    view: FrontEndView | None = None,
    max_idle_s: float | None = DEFAULT_MAX_IDLE_S,
) -> tuple[list[Check], WalFigures | None]:
    """Every check, run concurrently; the WAL figures when NATS answered. `view` says
    whose WAL it is (default: the thread-run store's, its lag from the KV marks)."""
    if view is None:
        from buffered_store.threadrun.entry import FORMAT

        view = FrontEndView("threadrun", config, FORMAT, None)
    wal, postgres = await asyncio.gather(
        _wal_checks(config, max_backlog, max_lag_s, timeout_s, scan_limit, view, max_idle_s),
        _postgres_check(database_url, timeout_s, view.name),
    )
    checks, figures = wal
    return [*checks, postgres], figures


async def _wal_checks(
    config: EngineConfig,
    max_backlog: int | None,
    max_lag_s: float | None,
    timeout_s: float,
    scan_limit: int,
    view: FrontEndView,
    max_idle_s: float | None,
) -> tuple[list[Check], WalFigures | None]:
    shown_url = mask_url(config.nats_url)
    try:
        figures = await _bounded(
            lambda: wal_figures(config, timeout_s, scan_limit, view), timeout_s
        )
    except Exception as exc:
        names = ("backlog", "lag", "flusher")
        skipped = [Check(n, "skip", "not checked: NATS failed") for n in names]
        return [Check("nats", "fail", f"{shown_url}: {_describe(exc)}"), *skipped], None
    checks = [
        Check(
            "nats",
            "ok",
            f"{shown_url}: consumer {config.consumer_name!r} on {config.stream_name!r}",
        ),
        threshold_check("backlog", figures.backlog, max_backlog, "entries"),
        threshold_check("lag", round(figures.lag_s, 3), max_lag_s, "s"),
        consumed_check(figures, max_idle_s),
    ]
    return checks, figures


def consumed_check(figures: WalFigures, max_idle_s: float | None) -> Check:
    """fail when entries are pending and no flusher consumes them: no pull request waits
    on the consumer and nothing was delivered or acknowledged for `max_idle_s` (None: the
    check is off). A running flusher keeps a pull request waiting, or is busy with what
    it was delivered, so either sign clears it."""
    if figures.backlog == 0:
        return Check("flusher", "ok", "nothing pending")
    if figures.waiting_pulls:
        return Check("flusher", "ok", f"{figures.waiting_pulls} pull request(s) waiting")
    idle = figures.idle_s
    shown = "never active" if idle is None else f"last delivery or ack {idle:.1f} s ago"
    if max_idle_s is None or (idle is not None and idle <= max_idle_s):
        return Check("flusher", "ok", shown, idle)
    return Check(
        "flusher",
        "fail",
        f"{figures.backlog} entries pending and no flusher consumes them: no pull request "
        f"waiting, {shown} (max {max_idle_s:g} s)",
        idle,
        max_idle_s,
    )


def threshold_check(name: str, value: float, limit: float | None, unit: str) -> Check:
    """ok when `value` is at most `limit` (None: no limit)."""
    shown = f"{value:g} {unit}"
    if limit is None:
        return Check(name, "ok", shown, value)
    status: Status = "ok" if value <= limit else "fail"
    return Check(name, status, f"{shown} (max {limit:g})", value, limit)


async def wal_figures(
    config: EngineConfig, timeout_s: float, scan_limit: int, view: FrontEndView | None = None
) -> WalFigures:
    """Backlog and lag of the flusher consumer, over a connection of its own that creates
    and validates nothing (a missing stream or consumer is an error, and a probe whose
    settings differ from the flusher's in ``ack_wait_s`` still works).

    The lag is the age of the oldest entry above its thread's KV flushed mark among the
    first `scan_limit` entries of the unacknowledged tail: the tail is in stream order,
    so the oldest entries are always read; beyond it `pending_threads` is a lower bound.
    With a database URL in `view`, a thread's Postgres watermark raises its mark.
    """
    from buffered_store.engine.entries import decode_flushed
    from buffered_store.engine.ids import utcnow
    from buffered_store.engine.keys import flushed_key
    from buffered_store.engine.threadlog import ThreadLog, group_by_thread
    from buffered_store.nats import NatsWal
    from buffered_store.threadrun.entry import FORMAT

    wal = await NatsWal.connect(
        config,
        name="bufstore-health",
        setup="open",
        reconnect="probe",
        connect_timeout_s=timeout_s,
        front_end=view.name if view else None,
    )
    try:
        consumer = await wal.consumer_state()
        waiting_pulls, idle_s = await wal.consumer_activity()
        backlog = consumer.num_pending + consumer.num_ack_pending
        first = consumer.ack_floor + 1
        last = consumer.last_seq
        by_thread = group_by_thread(
            await ThreadLog(wal, config, view.fmt if view else FORMAT).read_tail(
                first, min(last, first + scan_limit - 1)
            )
        )
        threads = list(by_thread)
        marks, stored = await asyncio.gather(
            wal.kv_get_many([flushed_key(t) for t in threads]),
            _watermarks(view, threads, timeout_s / 2),
        )
        now = utcnow()
        oldest = [
            next(e.at for e in by_thread[t] if e.seq > flushed)
            for t, mark in zip(threads, marks, strict=True)
            if by_thread[t][-1].seq
            > (flushed := max(decode_flushed(mark.value).seq if mark else 0, stored.get(t, 0)))
        ]
        lag = max(((now - at).total_seconds() for at in oldest), default=0.0)
        return WalFigures(
            backlog=backlog,
            lag_s=max(0.0, lag),
            pending_threads=len(oldest),
            complete=last - first < scan_limit,
            waiting_pulls=waiting_pulls,
            idle_s=idle_s,
        )
    finally:
        await wal.close(drain=False)


async def _watermarks(
    view: FrontEndView | None, threads: list[str], limit_s: float
) -> dict[str, int]:
    """The Postgres watermarks of `threads`, or none when Postgres does not answer within
    `limit_s` (the postgres check reports that; the lag then falls back to the marks)."""
    if view is None:
        return {}
    try:
        async with asyncio.timeout(limit_s):
            return await view.watermarks(threads)
    except Exception:
        return {}


async def _postgres_check(
    database_url: str | None, timeout_s: float, front_end: str = "threadrun"
) -> Check:
    if not database_url:
        return Check("postgres", "skip", "no --database-url / $DATABASE_URL")
    try:
        took = await _bounded(
            lambda: ping_postgres(database_url, timeout_s, libpq=front_end == "langgraph"),
            timeout_s,
        )
    except Exception as exc:
        return Check("postgres", "fail", _describe(exc))
    return Check("postgres", "ok", f"SELECT 1 in {took * 1000:.0f} ms", round(took, 4))


async def ping_postgres(database_url: str, timeout_s: float, *, libpq: bool = False) -> float:
    """Seconds a fresh connection and ``SELECT 1`` took (`libpq`: the URL is a libpq URL
    or conninfo already, as LangGraph's is)."""
    import psycopg

    from buffered_store.stores.migrate import normalize_url
    from buffered_store.stores.urls import to_libpq_url

    url = database_url if libpq else to_libpq_url(normalize_url(database_url))
    started = time.perf_counter()
    conn = await psycopg.AsyncConnection.connect(
        url,
        autocommit=True,
        connect_timeout=max(1, round(timeout_s)),
    )
    async with conn:
        await conn.execute("SELECT 1")
    return time.perf_counter() - started


async def _bounded(make: Callable[[], Awaitable[T]], timeout_s: float) -> T:
    async with asyncio.timeout(timeout_s):
        return await make()


def _describe(exc: BaseException) -> str:
    from buffered_store.logs import scrub

    if isinstance(exc, TimeoutError):
        return "no answer in time"
    text = scrub(str(exc).strip().splitlines()[0] if str(exc).strip() else "", limit=300)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
