"""Running one side of a scenario (direct or buffered) and collecting its figures.

A side runs in two phases on a database of its own:

1. seed (unmeasured): each thread's starting history is written, and for the buffered
   side flushed; then every pool is closed;
2. measured: counters are read with no backend connected; the stores are opened afresh
   (as a new process would), the workload runs, the buffered side waits until the flusher
   drained the WAL, the stores are closed and the counters are read again.

So the Postgres figures of the buffered side include every transaction its checkpoints
cost, the flushing of all of them included.
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import io
import os
import pstats
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from buffered_store.config import BufferedStoreConfig
from buffered_store.model.protocol import ThreadRunStore
from buffered_store.stores.postgres import PostgresThreadRunStore
from buffered_store.threadrun.store import BufferedThreadRunStore

from .flush import LAG_METHOD, backlog_figures, flush_lag, flusher_figures
from .harness import Bench, SideDb
from .measure import (
    CpuMeter,
    LatencyLog,
    PgSnapshot,
    PgStats,
    Timeline,
    cdf_points,
    cpu_delta,
    pg_delta,
    rate_series,
    runqueue_wait_s,
    settle_harness_heap,
    steady_rate,
    summarize,
    wait_or_stop,
)
from .processes import FlusherProcess, WalMonitor
from .workload import ThreadState, Workload, drive, make_threads, seed


@dataclass(frozen=True)
class TimedEvent:
    """Something done to the system at a time of the measured phase (pg-outage)."""

    at_s: float
    label: str
    action: Callable[[], Awaitable[None]]


@dataclass
class SidePlan:
    """What one side is."""

    key: str
    label: str
    kind: Literal["direct", "buffered"]
    nats_url: str | None = None
    flusher: bool = True
    route: tuple[str, int] | None = None
    """Host and port through which the stores reach Postgres (the remote-db proxy)."""
    events: Sequence[TimedEvent] = ()
    config: dict[str, Any] = field(default_factory=dict)
    extra_cpu: dict[str, Callable[[], int | None]] = field(default_factory=dict)
    drain_timeout_s: float = 180.0


AfterHook = Callable[
    ["OpenSide", list[ThreadState], BufferedStoreConfig | None], Awaitable[dict[str, Any]]
]


@dataclass
class OpenSide:
    """The stores of one side while they are open."""

    store: ThreadRunStore
    inner: PostgresThreadRunStore
    url: str
    """SQLAlchemy URL the side's stores use (through the proxy, if any)."""
    schema: str
    flusher: FlusherProcess | None = None
    monitor: WalMonitor | None = None
    flusher_final: dict[str, Any] = field(default_factory=dict)
    flusher_cpu_at_start: float = 0.0
    flusher_wait_at_start: float | None = None

    def store_stats(self) -> dict[str, float]:
        """The store's own counters."""
        stats = getattr(self.store, "stats", None)
        return dict(stats()) if callable(stats) else {}


@contextlib.asynccontextmanager
async def open_side(
    bench: Bench,
    plan: SidePlan,
    db: SideDb,
    config: BufferedStoreConfig | None,
    *,
    phase: str,
    keep_wal: bool = False,
) -> AsyncIterator[OpenSide]:
    """Open the side's stores (and its flusher process); close them all on exit.

    `phase` is "seed" or names a measured phase ("measured", or the scenario's name for
    one of several); the WAL stream and buckets are deleted after a measured phase unless
    `keep_wal` (another phase follows on the same WAL) or `--keep`.
    """
    measured = phase != "seed"
    url = db.via(*plan.route) if plan.route else db.url
    inner = await PostgresThreadRunStore.connect(url, schema=db.schema)
    side = OpenSide(store=inner, inner=inner, url=url, schema=db.schema)
    buffered: BufferedThreadRunStore | None = None
    try:
        if plan.kind == "buffered":
            assert config is not None
            side.monitor = await WalMonitor.connect(config)
            if plan.flusher:
                profile = None
                if bench.options.profile and measured:
                    profile = bench.output / f"profile-flusher-{_name(plan, phase)}.pstats"
                side.flusher = await FlusherProcess.start(
                    database_url=url,
                    schema=db.schema,
                    config=config,
                    log_path=bench.output / "logs" / f"flusher-{plan.key}-{phase}.log",
                    profile_path=profile,
                )
                side.flusher_cpu_at_start = side.flusher.cpu_s or 0.0
                side.flusher_wait_at_start = flusher_waited(side.flusher)
            buffered = await BufferedThreadRunStore.connect(inner, config)
            side.store = buffered
        yield side
    finally:
        if buffered is not None:
            await buffered.close()
        if side.flusher is not None:
            side.flusher_final = await side.flusher.stop()
            if "Traceback" in side.flusher.log_path.read_text(errors="replace"):
                bench.note(f"the flusher logged errors: see {side.flusher.log_path}")
        await inner.close()
        if side.monitor is not None:
            if measured and not keep_wal and not bench.options.keep:
                await side.monitor.delete_objects()
            await side.monitor.close()


def flusher_waited(flusher: FlusherProcess | None) -> float | None:
    """The flusher process's run-queue wait so far (`runqueue_wait_s`), if it runs."""
    pid = flusher.pid if flusher is not None else None
    return runqueue_wait_s(pid) if pid else None


def process_cpu_sources(bench: Bench, plan: SidePlan) -> dict[str, Callable[[], int | None]]:
    """Processes whose CPU time counts for a side (this process, servers, helpers)."""
    durable = plan.nats_url is not None and bench.durable_nats is not None
    durable = durable and plan.nats_url == bench.durable_nats.url  # type: ignore[union-attr]
    nats_key = "nats_server_durable" if durable else "nats_server"
    sources: dict[str, Callable[[], int | None]] = {
        "harness": os.getpid,
        "postgres": lambda: bench.pids()["postgres"],
    }
    if plan.kind == "buffered":
        sources["nats_server"] = lambda: bench.pids()[nats_key]
    sources.update(plan.extra_cpu)
    return sources


def add_flusher_cpu(cpu: dict[str, Any], flusher_s: float, checkpoints: int) -> None:
    """Count the flusher process's own report (`flusher_s` CPU seconds) in a side's CPU
    figures (`cpu_delta`): in the total, out of the machine's other processes (whose
    busy time held it), and every figure per 1,000 checkpoints again."""
    seconds = cpu["seconds"]
    flusher_s = round(flusher_s, 3)
    seconds["flusher"] = flusher_s
    seconds["total"] = round(seconds["total"] + flusher_s, 3)
    seconds["other_processes"] = round(seconds["other_processes"] - flusher_s, 3)
    cpu["seconds_per_1k_checkpoints"] = {
        name: round(value * 1000 / checkpoints, 4) if checkpoints else None
        for name, value in seconds.items()
    }


async def sample_loop(
    bench: Bench,
    task: Any,
    timeline: Timeline,
    clock_zero: float,
    probe: Callable[[], Awaitable[dict[str, float | None]]],
    *,
    interval_s: float,
    total_s: float,
    stop: asyncio.Event,
) -> None:
    """Sample `probe()` into the timeline and refresh the progress line until `stop` is
    set (see `wait_or_stop`)."""
    last_t, last_n, last_said = 0.0, 0.0, 0.0
    while True:
        t = time.perf_counter() - clock_zero
        values = await probe()
        timeline.add(t, **values)
        n = values.get("checkpoints") or 0.0
        rate = (n - last_n) / (t - last_t) if t > last_t else 0.0
        last_t, last_n = t, n
        info = f"{int(n):>8,} ok  {rate:>7,.0f}/s"
        if values.get("failed"):
            info += f"  {int(values['failed'] or 0):,} failed"
        if values.get("backlog") is not None:
            info += f"  backlog {int(values['backlog'] or 0):,}"
        bench.progress.update(task, completed=min(t, total_s), info=info)
        if not bench.console.is_terminal and t - last_said >= 10:
            # Logged runs (nohup ... > log) get a plain line every 10 s instead of a bar.
            last_said = t
            name = next((x.description for x in bench.progress.tasks if x.id == task), "")
            bench.say(f"  {name} t={t:5.0f}s {info}")
        if await wait_or_stop(stop, interval_s):
            return


def _name(plan: SidePlan, phase: str) -> str:
    """File-name stem of a side's phase: its key, plus the phase unless "measured"."""
    return plan.key if phase == "measured" else f"{plan.key}-{phase}"


@dataclass
class SeededSide:
    """A side's database and WAL names, its threads seeded: ready for measured phases."""

    plan: SidePlan
    db: SideDb
    config: BufferedStoreConfig | None
    counters: PgStats
    snapshot: tuple[PgSnapshot, bool] | None = None
    """Counters settled at the end of the last phase: where the next phase starts from."""


@dataclass
class Phase:
    """One measured phase: its figures, and what reading its flush lags needs."""

    figures: dict[str, Any]
    wall_zero: float
    wall_end: float
    acks: dict[tuple[str, int], float]


async def seed_side(
    bench: Bench, plan: SidePlan, thread_sets: Sequence[Sequence[ThreadState]]
) -> SeededSide:
    """A fresh database (and WAL names) for the side, every thread's starting history
    written (and flushed) in one unmeasured phase, then every pool closed."""
    db = await bench.new_database(plan.key)
    config = (
        bench.buffered_config(plan.nats_url or bench.nats_url, plan.key, **plan.config)
        if plan.kind == "buffered"
        else None
    )
    states = [state for states in thread_sets for state in states]
    seeding = bench.task(f"{plan.label}: seed", total=1)
    async with open_side(bench, plan, db, config, phase="seed") as side:
        await seed(side.store, states)
        if side.monitor is not None and side.flusher is not None:
            await side.monitor.wait_drained(plan.drain_timeout_s)
    bench.progress.update(seeding, completed=1, info=f"{len(states)} threads")
    counters = PgStats(bench.admin_libpq_url, db.libpq_url, db.name, db.schema)
    return SeededSide(plan, db, config, counters)


async def run_side(
    bench: Bench,
    plan: SidePlan,
    workload: Workload,
    *,
    probe_extra: Callable[[list[ThreadState]], dict[str, float | None]] | None = None,
    analyse: Callable[[LatencyLog, Timeline, list[dict[str, Any]]], dict[str, Any]] | None = None,
    after: AfterHook | None = None,
) -> dict[str, Any]:
    """Seed, measure and return every figure of one side.

    `probe_extra` adds series to the timeline; `analyse(log, timeline, events)` adds
    scenario figures (under "analysis"); `after(side, states, config)` runs once the
    writes are drained, before the stores close (under "after").
    """
    states = make_threads(plan.key, workload)
    seeded = await seed_side(bench, plan, [states])
    phase = await measure_phase(
        bench,
        seeded,
        states,
        workload,
        probe_extra=probe_extra,
        analyse=analyse,
        after=after,
    )
    await read_flush_lag(seeded, phase)
    return phase.figures


async def measure_phase(
    bench: Bench,
    seeded: SeededSide,
    states: list[ThreadState],
    workload: Workload,
    *,
    plan: SidePlan | None = None,
    phase: str = "measured",
    keep_wal: bool = False,
    probe_extra: Callable[[list[ThreadState]], dict[str, float | None]] | None = None,
    analyse: Callable[[LatencyLog, Timeline, list[dict[str, Any]]], dict[str, Any]] | None = None,
    after: AfterHook | None = None,
) -> Phase:
    """One measured phase of a seeded side on `states` (seeded, not yet written since).

    Counters are read with no backend connected (the previous phase's closing read, when
    there was one); the stores are opened afresh (as a new process would), the workload
    runs, the buffered side waits until the flusher drained the WAL, the stores close and
    the counters are read again. `plan` overrides the seeded side's (the same database
    and WAL with another label, or without its flusher). The flush lags need a query in
    the side's database, so they are read apart (`read_flush_lag`), after the last phase.
    """
    plan = plan or seeded.plan
    db, config, counters = seeded.db, seeded.config, seeded.counters
    pg_before, settled_before = seeded.snapshot or await counters.settled()
    meter = CpuMeter(process_cpu_sources(bench, plan))
    settle_harness_heap()  # before the stores open: their objects are walked as usual
    cpu_before = meter.sample()
    log = LatencyLog()
    timeline = Timeline()
    events: list[dict[str, Any]] = []
    task = bench.task(f"{plan.label}: run", total=workload.duration_s)
    profiler = cProfile.Profile() if bench.options.profile else None

    async with open_side(bench, plan, db, config, phase=phase, keep_wal=keep_wal) as side:
        clock_zero = time.perf_counter()
        wall_zero = time.time()

        async def probe() -> dict[str, float | None]:
            stats = side.store_stats()
            flusher = side.flusher.latest if side.flusher else {}
            values: dict[str, float | None] = {
                "checkpoints": float(log.count),
                "failed": float(len(log.failures)),
                "nats_requests": stats.get("nats_requests"),
                "wal_bytes": stats.get("wal_bytes"),
                "pg_statements": float(side.inner.stats().get("statements", 0)),
                "backlog": await side.monitor.backlog() if side.monitor else None,
                "flusher_last_lag_s": flusher.get("last_lag_s"),
                "flusher_transactions": flusher.get("transactions"),
                # No CPU sample here: it reads /proc for every process of the side, in
                # the writers' event loop, stalling the calls in flight; no figure used
                # it (the side's CPU is the two samples around the run).
            }
            if probe_extra is not None:
                values.update(probe_extra(states))
            return values

        stop_sampling = asyncio.Event()
        sampler = asyncio.create_task(
            sample_loop(
                bench,
                task,
                timeline,
                clock_zero,
                probe,
                # Several samples per flush cycle, so the troughs of the backlog show.
                interval_s=0.2 if bench.options.quick else 0.25,
                total_s=workload.duration_s,
                stop=stop_sampling,
            )
        )
        happenings = [asyncio.create_task(_happen(e, clock_zero, events)) for e in plan.events]
        if profiler is not None:
            profiler.enable()
        try:
            result = await drive(side.store, states, workload, log, clock_zero=clock_zero)
        finally:
            if profiler is not None:
                profiler.disable()
        writes_end_s = time.perf_counter() - clock_zero
        wall_end = time.time()
        store_stats = side.store_stats()
        await asyncio.gather(*happenings)
        drain_s = None
        if side.monitor is not None and side.flusher is not None:
            drain_s = await side.monitor.wait_drained(plan.drain_timeout_s)
        stop_sampling.set()
        await sampler
        timeline.add(time.perf_counter() - clock_zero, **(await probe()))
        cpu_after = meter.sample()
        flusher_wait_at_end = flusher_waited(side.flusher)
        after_figures = await after(side, states, config) if after is not None else None
    bench.progress.update(task, completed=workload.duration_s)

    cpu = cpu_delta(cpu_before, cpu_after, log.count)
    if side.flusher is not None and side.flusher.cpu_s is not None:
        add_flusher_cpu(cpu, side.flusher.cpu_s - side.flusher_cpu_at_start, log.count)
    if side.flusher_wait_at_start is not None and flusher_wait_at_end is not None:
        waited = flusher_wait_at_end - side.flusher_wait_at_start
        cpu["runqueue_wait_seconds"]["flusher"] = round(waited, 3)
    cpu["method"] = (
        "psutil user+system seconds of this process, the Postgres postmaster with its "
        "backends (live and exited), the nats-server and helper processes; the flusher "
        "worker reports its own process_time() minus its start-up. other_processes is the "
        "machine's busy CPU time (psutil.cpu_times) minus all of these: load from outside "
        "the benchmark, which disturbs its figures. runqueue_wait_seconds: per process, "
        "the seconds its threads (Postgres: with its live backends) were runnable but "
        "waited for a core over the run (Linux schedstat): contention for the two cores. "
        "gc_seconds: of this process's CPU, the time in its garbage collector "
        "(gc.callbacks), which walks the workload's histories as well as the store's objects"
    )
    pg_after, settled_after = seeded.snapshot = await counters.settled()
    if profiler is not None:
        write_profile(bench, profiler, f"profile-writers-{_name(plan, phase)}")

    ok = log.count
    warm_s = min(2.0, workload.duration_s / 5)
    t = timeline.t_s
    figures: dict[str, Any] = {
        "key": plan.key,
        "label": plan.label,
        "kind": plan.kind,
        "workload": asdict(workload),
        "database": db.name,
        "checkpoints": ok,
        "failed": len(log.failures),
        "failure_kinds": log.failure_kinds(),
        "write_seconds": round(result.seconds, 3),
        "writes_end_s": round(writes_end_s, 3),
        "throughput_per_s": ok / result.seconds if result.seconds else None,
        "offered_per_s": workload.target_rate,
        "late_slots": result.late_slots,
        "latency_ms": summarize(log.durations_ms),
        "latency_warm_ms": log.warm_summary(
            "every successful call but each thread's first of the phase (the stores were "
            "just opened: a cold call)"
        ),
        "latency_cdf_ms": cdf_points(log.durations_ms),
        "pg": {**pg_delta(pg_before, pg_after, ok), "settled": settled_before and settled_after},
        "store_stats": store_stats,
        "cpu": cpu,
        "events": events,
        "timeline": {
            **timeline.as_dict(),
            "checkpoints_per_s": rate_series(t, timeline.series.get("checkpoints", [])),
        },
        "unavailable": {},
    }
    offered = workload.target_rate
    achieved = figures["throughput_per_s"]
    if offered and achieved is not None and achieved < 0.9 * offered:
        bench.note(
            f"{plan.label}: offered {offered:,.0f} checkpoints/s but achieved {achieved:,.0f}/s "
            f"({result.late_slots:,} scheduled slots skipped): the side could not sustain the "
            "load on this machine, so its latencies include waiting for CPU"
        )
    if analyse is not None:
        figures["analysis"] = analyse(log, timeline, events)
    if after_figures is not None:
        figures["after"] = after_figures
    if plan.kind == "buffered":
        requests = store_stats.get("nats_requests", 0.0)
        wal = store_stats.get("wal_bytes", 0.0)
        series = timeline.series
        figures["nats"] = {
            "requests": requests,
            "requests_per_checkpoint": requests / ok if ok else None,
            "requests_per_checkpoint_steady": steady_rate(
                t, series["nats_requests"], series["checkpoints"], warm_s
            ),
            "wal_bytes": wal,
            "wal_bytes_per_checkpoint": wal / ok if ok else None,
            "wal_bytes_per_checkpoint_steady": steady_rate(
                t, series["wal_bytes"], series["checkpoints"], warm_s
            ),
            "steady_state_from_s": warm_s,
            "method": "BufferedThreadRunStore.stats(): nats_requests (every request of the "
            "store's connection is one round trip) and wal_bytes, sampled; 'steady' is the "
            f"delta from t={warm_s}s (every thread past its first, cold checkpoint) to the end",
        }
        figures["flush"] = {
            "drain_s": drain_s,
            "backlog": backlog_figures(t, series.get("backlog", []), writes_end_s, warm_s),
            "flusher_stats": side.flusher_final,
            **flusher_figures(side.flusher_final),
        }
    else:
        figures["unavailable"].update(
            {
                "nats": "the direct store makes no NATS requests and has no NATS WAL",
                "flush_lag": "no flush: a direct checkpoint is committed when it returns "
                "(its commit lag is in commit_lag_ms, equal to its latency by construction)",
                "backlog": "no backlog: direct writes are synchronous",
            }
        )
    return Phase(figures, wall_zero, wall_end, log.acks)


async def read_flush_lag(seeded: SeededSide, phase: Phase) -> None:
    """Add the phase's flush lags (buffered) or commit lags (direct) to its figures.

    One read-only transaction in the side's database: run it after the side's last
    phase, or the next phase's Postgres figures would count it.
    """
    lag = await flush_lag(seeded.db, phase.wall_zero, phase.acks, until_wall=phase.wall_end)
    figures = phase.figures
    if figures["kind"] == "buffered":
        figures["flush"] = {
            "lag_ms": lag["lag_ms"] if lag else None,
            "lag_from_ack_ms": lag["lag_from_ack_ms"] if lag else None,
            "lag_timeline": lag["timeline"] if lag else None,
            "lag_method": LAG_METHOD if lag else None,
            **figures["flush"],
        }
    else:
        figures["commit_lag_ms"] = lag["lag_ms"] if lag else None


async def _happen(event: TimedEvent, clock_zero: float, out: list[dict[str, Any]]) -> None:
    delay = event.at_s - (time.perf_counter() - clock_zero)
    if delay > 0:
        await asyncio.sleep(delay)
    began = time.perf_counter() - clock_zero
    await event.action()
    done = time.perf_counter() - clock_zero
    out.append({"label": event.label, "began_s": round(began, 3), "done_s": round(done, 3)})


def write_profile(bench: Bench, profiler: cProfile.Profile, name: str) -> None:
    """Save cProfile stats and a text summary (top functions by own and total time)."""
    path = bench.output / f"{name}.pstats"
    profiler.dump_stats(path)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(30)
    (bench.output / f"{name}.txt").write_text(text.getvalue())
