"""Figures of one benchmark side: latencies, timelines, Postgres counters and CPU time.

Pure summaries (`summarize`, `cdf_points`) take numbers in and give numbers out; the
counter readers (`PgStats`, `CpuMeter`) say in their docstrings how they measure, and the
report repeats it, because every figure here has a method that a reader must be able to
judge.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import os
import time
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil
import psycopg

PG_XACT_METHOD = (
    "pg_stat_database.xact_commit + xact_rollback of a database used only by this side, "
    "read from another database before and after the side ran, each time with no backend "
    "connected to the side's database (pools closed, backends exited and so reported their "
    "statistics) and the counters unchanged over two reads 0.5 s apart; the harness's own "
    "read of the table statistics (one read-only transaction per snapshot) is subtracted"
)
PG_TUPLE_METHOD = (
    "pg_stat_user_tables n_tup_ins + n_tup_upd + n_tup_del over the side's schema, same "
    "before/after points"
)
OWN_READS_PER_SNAPSHOT = 1
"""Read-only transactions the harness runs in a side's database per snapshot."""
PG_WAL_METHOD = "pg_current_wal_lsn() difference over the side's run (cluster-wide)"


async def wait_or_stop(stop: asyncio.Event, interval_s: float) -> bool:
    """Wait `interval_s`, or less if `stop` is set meanwhile; whether it is set.

    Sampling loops end on an event, not by cancellation: nats-py waits for its replies
    with `asyncio.wait_for`, which on Python 3.11 can swallow a cancellation that lands
    as the reply arrives (CPython gh-86296); a sampler cancelled so runs on forever (a
    `langgraph` run hung that way after its graphs had finished)."""
    if not stop.is_set():
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(interval_s):
                await stop.wait()
    return stop.is_set()


def summarize(values: Sequence[float]) -> dict[str, float | int | None]:
    """count, mean, p50/p95/p99 (nearest rank) and max of `values`."""
    if not values:
        return {"count": 0, "mean": None, "p50": None, "p95": None, "p99": None, "max": None}
    ordered = sorted(values)
    return {
        "count": len(ordered),
        "mean": math.fsum(ordered) / len(ordered),
        "p50": _rank(ordered, 0.50),
        "p95": _rank(ordered, 0.95),
        "p99": _rank(ordered, 0.99),
        "max": ordered[-1],
    }


def _rank(ordered: Sequence[float], q: float) -> float:
    return float(ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))])


def cdf_points(values: Sequence[float], points: int = 400) -> list[tuple[float, float]]:
    """(value, fraction at or below) at `points` evenly spaced ranks, plus the tail ranks."""
    if not values:
        return []
    ordered = sorted(values)
    n = len(ordered)
    ranks = {round(i * (n - 1) / max(1, points - 1)) for i in range(points)}
    ranks.update(max(0, n - k) for k in (1, 2, 5, 10, 20, 50, 100) if k <= n)
    return [(float(ordered[r]), (r + 1) / n) for r in sorted(ranks)]


@dataclass
class LatencyLog:
    """Checkpoint outcomes of one side: start offsets and durations (ms), failures."""

    starts_s: array[float] = field(default_factory=lambda: array("d"))
    durations_ms: array[float] = field(default_factory=lambda: array("d"))
    failures: list[tuple[float, str]] = field(default_factory=list)
    acks: dict[tuple[str, int], float] = field(default_factory=dict)
    """(thread id, step) -> wall-clock time the checkpoint call returned."""
    cold: set[int] = field(default_factory=set)
    """Indices (in `durations_ms`) of each thread's first call of the phase: the store was
    just opened, so it knew nothing of the thread yet."""

    def ok(self, start_s: float, duration_ms: float, *, cold: bool = False) -> None:
        """Record a successful call started at `start_s` (phase clock) taking `duration_ms`."""
        if cold:
            self.cold.add(len(self.durations_ms))
        self.starts_s.append(start_s)
        self.durations_ms.append(duration_ms)

    def warm_ms(self) -> list[float]:
        """Durations of the successful calls that were not a thread's first of the phase."""
        return [d for i, d in enumerate(self.durations_ms) if i not in self.cold]

    def warm_summary(self, method: str) -> dict[str, Any]:
        """`summarize` of the warm calls, with how many cold ones were left out and why."""
        warm = summarize(self.warm_ms())
        return {**warm, "cold_calls_left_out": len(self.cold), "method": method}

    def fail(self, start_s: float, error: BaseException) -> None:
        """Record a failed call."""
        self.failures.append((start_s, type(error).__name__))

    @property
    def count(self) -> int:
        """Successful calls so far."""
        return len(self.durations_ms)

    def between(self, start_s: float, end_s: float) -> list[float]:
        """Durations of successful calls started in [start_s, end_s)."""
        return [
            d for s, d in zip(self.starts_s, self.durations_ms, strict=True) if start_s <= s < end_s
        ]

    def failure_kinds(self) -> dict[str, int]:
        """Failures per error class."""
        return dict(Counter(kind for _, kind in self.failures))


class Laps:
    """Consecutive steps timed one after the other: each `mark` records, under its name,
    the time since the previous mark (or since the `Laps` was made), so no step can be
    measured from the wrong starting point."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._last = clock()
        self.seconds: dict[str, float] = {}

    def mark(self, name: str) -> None:
        """End the step `name` now (a name may be marked only once)."""
        if name in self.seconds:
            raise ValueError(f"step {name!r} already marked")
        now = self._clock()
        self.seconds[name] = now - self._last
        self._last = now


@dataclass
class Timeline:
    """Samples over time: `t_s` plus one list per named series."""

    t_s: list[float] = field(default_factory=list)
    series: dict[str, list[float | None]] = field(default_factory=dict)

    def add(self, t_s: float, **values: float | None) -> None:
        """Append one sample; series missing from this sample get None."""
        self.t_s.append(round(t_s, 3))
        for name in set(self.series) | set(values):
            column = self.series.setdefault(name, [None] * (len(self.t_s) - 1))
            column.append(values.get(name))

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"t_s": self.t_s, **self.series}


def rate_series(t_s: Sequence[float], counts: Sequence[float | None]) -> list[float | None]:
    """Per-second rate between consecutive samples of a growing counter."""
    out: list[float | None] = [None]
    for i in range(1, len(t_s)):
        a, b = counts[i - 1], counts[i]
        dt = t_s[i] - t_s[i - 1]
        out.append(None if a is None or b is None or dt <= 0 else (b - a) / dt)
    return out


def steady_rate(
    t_s: Sequence[float],
    numer: Sequence[float | None],
    denom: Sequence[float | None],
    from_s: float,
) -> float | None:
    """Δnumer/Δdenom between the first sample at or after `from_s` and the last sample."""
    index = next((i for i, t in enumerate(t_s) if t >= from_s), None)
    if index is None or index >= len(t_s) - 1:
        return None
    n0, n1, d0, d1 = numer[index], numer[-1], denom[index], denom[-1]
    if n0 is None or n1 is None or d0 is None or d1 is None:
        return None
    return (n1 - n0) / (d1 - d0) if d1 > d0 else None


# -- Postgres counters ---------------------------------------------------------------------


@dataclass(frozen=True)
class PgSnapshot:
    """Counters of one side's database at one moment."""

    xact_commit: int
    xact_rollback: int
    wal_lsn: int
    tables: dict[str, tuple[int, int, int]]
    """relname -> (inserted, updated, deleted) tuples, from pg_stat_user_tables."""

    @property
    def tuple_writes(self) -> int:
        """All tuple writes in the side's schema."""
        return sum(sum(v) for v in self.tables.values())


def pg_delta(before: PgSnapshot, after: PgSnapshot, checkpoints: int) -> dict[str, Any]:
    """Postgres figures of a side from two snapshots."""
    commits = after.xact_commit - before.xact_commit - OWN_READS_PER_SNAPSHOT
    rollbacks = after.xact_rollback - before.xact_rollback
    tuples = after.tuple_writes - before.tuple_writes
    wal = after.wal_lsn - before.wal_lsn
    per = 1 / checkpoints if checkpoints else None
    tables = {
        name: [a - b for a, b in zip(values, before.tables.get(name, (0, 0, 0)), strict=True)]
        for name, values in after.tables.items()
    }
    return {
        "transactions": commits + rollbacks,
        "commits": commits,
        "rollbacks": rollbacks,
        "transactions_per_checkpoint": (commits + rollbacks) * per if per else None,
        "tuple_writes": tuples,
        "tuple_writes_per_checkpoint": tuples * per if per else None,
        "tables_ins_upd_del": tables,
        "pg_wal_bytes": wal,
        "pg_wal_bytes_per_checkpoint": wal * per if per else None,
        "method": {"transactions": PG_XACT_METHOD, "tuples": PG_TUPLE_METHOD, "wal": PG_WAL_METHOD},
    }


class PgStats:
    """Reads one side's counters: transactions from another database, tuples from its own.

    Postgres 15 reports a backend's statistics lazily (at most once a second while busy,
    up to 10 s late when idle, at once when the backend exits). `settled()` therefore
    first waits until no backend is connected to the side's database, then until two
    reads 0.5 s apart agree.
    """

    def __init__(self, admin_url: str, side_url: str, database: str, schema: str) -> None:
        self.admin_url = admin_url
        self.side_url = side_url
        self.database = database
        self.schema = schema

    async def _admin(self) -> tuple[int, int, int, int]:
        async with await psycopg.AsyncConnection.connect(self.admin_url, autocommit=True) as conn:
            cur = await conn.execute(
                "SELECT d.xact_commit, d.xact_rollback, "
                "(pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint, "
                "(SELECT count(*) FROM pg_stat_activity a WHERE a.datname = d.datname) "
                "FROM pg_stat_database d WHERE d.datname = %s",
                (self.database,),
            )
            row = await cur.fetchone()
        assert row is not None, f"database {self.database!r} not found"
        return int(row[0]), int(row[1]), int(row[2]), int(row[3])

    async def tables(self) -> dict[str, tuple[int, int, int]]:
        """Tuple writes per table of the side's schema (a read-only transaction there)."""
        async with await psycopg.AsyncConnection.connect(self.side_url, autocommit=True) as conn:
            cur = await conn.execute(
                "SELECT relname, n_tup_ins, n_tup_upd, n_tup_del FROM pg_stat_user_tables "
                "WHERE schemaname = %s",
                (self.schema,),
            )
            return {str(r[0]): (int(r[1]), int(r[2]), int(r[3])) for r in await cur.fetchall()}

    async def _quiet(self, deadline: float) -> tuple[tuple[int, int, int, int], bool]:
        previous: tuple[int, int, int, int] | None = None
        while True:
            current = await self._admin()
            quiet = current[3] == 0
            if quiet and previous is not None and current[:2] == previous[:2]:
                return current, True
            if time.monotonic() > deadline:
                return current, False
            previous = current if quiet else None
            await asyncio.sleep(0.5)

    async def settled(self, *, timeout_s: float = 30.0) -> tuple[PgSnapshot, bool]:
        """A snapshot once the counters stopped moving; False when they did not in time.

        The per-table read is one read-only transaction in the side's database; it is
        taken between two quiet points, so the snapshot includes it and `pg_delta`
        subtracts the one of the later snapshot.
        """
        deadline = time.monotonic() + timeout_s
        _, ok_first = await self._quiet(deadline)
        tables = await self.tables()
        current, ok = await self._quiet(deadline)
        return PgSnapshot(current[0], current[1], current[2], tables), ok and ok_first


# -- CPU time ------------------------------------------------------------------------------


WITH_CHILDREN = frozenset({"postgres"})
"""Names whose children count as theirs: the postmaster's backends. Not this process:
its children are the servers and the flusher it started, each counted on its own."""


class CpuMeter:
    """CPU seconds (user + system) of named processes, surviving restarts of a process.

    For the names in `with_children`, a process's figure includes its reaped children
    (`children_user/system`: Postgres backends that exited) and the live children
    (backends still connected); the others count their own process only. When the
    process behind a name changes (Postgres restarted), the old one's last sample is kept
    as a base, so at most one sampling interval of its CPU is lost.
    """

    def __init__(
        self,
        pids: dict[str, Callable[[], int | None]],
        *,
        with_children: frozenset[str] = WITH_CHILDREN,
    ) -> None:
        self._pids = pids
        self._with_children = with_children
        self._base: dict[str, float] = dict.fromkeys(pids, 0.0)
        self._last: dict[str, tuple[int, float]] = {}

    def sample(self) -> dict[str, float]:
        """Cumulative CPU seconds per name, and `total`; each name's run-queue wait under
        `WAITED + name` and, for this process, its time in the garbage collector under
        `IN_GC + name` (neither in the total)."""
        out: dict[str, float] = {}
        apart: dict[str, float] = {}
        for name, get_pid in self._pids.items():
            pid = get_pid()
            children = name in self._with_children
            # The descendants found once for both readings: the search is most of a
            # sample's cost, and a sample runs in the writers' event loop.
            kids = descendants(pid) if pid and children else None
            value = process_cpu(pid, children=children, kids=kids) if pid else None
            waited = runqueue_wait_s(pid, children=children, kids=kids) if pid else None
            if waited is not None:
                apart[WAITED + name] = waited
            if pid == os.getpid():
                apart[IN_GC + name] = gc_seconds()
            last = self._last.get(name)
            if last is not None and (pid != last[0] or value is None):
                self._base[name] += last[1]
                del self._last[name]
            if pid and value is not None:
                self._last[name] = (pid, value)
            out[name] = self._base[name] + (value if value is not None and pid else 0.0)
        out["total"] = sum(out.values())
        out["machine_busy"] = machine_busy_s()
        out.update(apart)
        return out


WAITED = "runqueue_wait:"
"""Prefix of `CpuMeter.sample`'s keys that hold a process's run-queue wait, not its CPU."""
IN_GC = "gc:"
"""Prefix of `CpuMeter.sample`'s keys that hold the seconds this process (the one name
whose pid is the harness's own) spent in its garbage collector: part of its CPU, so not
added to the total."""


class _GcClock:
    """A `gc.callbacks` hook adding up the time of every collection."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started


def settle_harness_heap() -> int:
    """Before a measured phase: collect, then freeze what this process holds (`gc.freeze`),
    so the phase's collections walk only the objects made from then on; returns how many
    objects are frozen. The harness keeps every earlier side's results, timelines and
    stores' leftovers; without this, each side would pay for walking the sides before
    it, and the raw loop, measured first, least. The previous freeze is undone first:
    what an earlier side left as garbage is freed, not carried into the next."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


_gc_clock: _GcClock | None = None


def gc_seconds() -> float:
    """Seconds this process spent in collections of its garbage collector since the first
    call (which installs the hook). A collection runs on the thread that triggered it,
    holding the GIL, so its wall time is this process's CPU (page faults aside). The
    writers' histories live in the harness's heap; what a phase adds to them, each full
    collection walks, on every side alike, raw loop included (what was there before the
    phase is frozen: `settle_harness_heap`)."""
    global _gc_clock
    if _gc_clock is None:
        _gc_clock = _GcClock()
        gc.callbacks.append(_gc_clock)
    return _gc_clock.seconds


def descendants(pid: int, *, proc: str = "/proc") -> list[int]:
    """Pids of the live descendants of process `pid` (children, theirs, ...).

    From Linux's /proc/PID/task/TID/children: a few small reads. Where the kernel has no
    such file, psutil's search, which reads the stat file of every process on the
    machine (about a millisecond per hundred processes: a stall for whatever event loop
    the caller runs in)."""
    found: list[int] = []
    todo = [pid]
    while todo:
        one = todo.pop()
        try:
            tids = os.listdir(f"{proc}/{one}/task")
        except OSError:
            continue  # exited meanwhile: it has no descendants left to count
        for tid in tids:
            try:
                with open(f"{proc}/{one}/task/{tid}/children") as listing:
                    kids = [int(kid) for kid in listing.read().split()]
            except FileNotFoundError:
                if not os.path.exists(f"{proc}/{one}/task/{tid}"):
                    continue  # the thread exited
                return _descendants_by_scan(pid)  # no such file on this kernel
            except (OSError, ValueError):
                continue
            found += kids
            todo += kids
    return found


def _descendants_by_scan(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def runqueue_wait_s(
    pid: int, *, children: bool = False, kids: Sequence[int] | None = None
) -> float | None:
    """Seconds the threads of process `pid` (with `children`: and of its live
    descendants, `kids` when the caller found them already) spent runnable but waiting
    for a core since they started, from Linux's /proc/PID/task/TID/schedstat; None where
    there is none (or the process is gone). Over a run, a process's wait beside its CPU
    time says whether the cores were contended: a process that waited a tenth of the
    time could have run that much more."""
    pids = [pid]
    if children:
        pids += descendants(pid) if kids is None else kids
    total_ns = 0
    for one in pids:
        try:
            for tid in os.listdir(f"/proc/{one}/task"):
                with open(f"/proc/{one}/task/{tid}/schedstat") as stat:
                    total_ns += int(stat.read().split()[1])
        except (OSError, IndexError, ValueError):
            if one == pid:
                return None  # a child or a thread that just exited only loses its share
    return total_ns / 1e9


def machine_busy_s() -> float:
    """CPU seconds all cores spent busy since boot (every process, ours or not)."""
    times = psutil.cpu_times()
    return float(sum(times) - times.idle - getattr(times, "iowait", 0.0))


def process_cpu(pid: int, *, children: bool, kids: Sequence[int] | None = None) -> float | None:
    """CPU seconds (user + system) process `pid` has used (with `children`: and its
    children, reaped and live: its live descendants, `kids` when the caller found them
    already); None when it is gone."""
    try:
        proc = psutil.Process(pid)
        times = proc.cpu_times()
        total = times.user + times.system
        if not children:
            return float(total)
        total += times.children_user + times.children_system
        for child in descendants(pid) if kids is None else kids:
            try:
                ct = psutil.Process(child).cpu_times()
                total += ct.user + ct.system
            except psutil.Error:
                continue
        return float(total)
    except psutil.Error:
        return None


def cpu_delta(
    before: dict[str, float], after: dict[str, float], checkpoints: int
) -> dict[str, Any]:
    """CPU seconds per process over a side's run, and per 1,000 checkpoints; beside them
    each process's run-queue wait over the run (`runqueue_wait_s`, Linux only) and the
    harness's time in its garbage collector (`gc_seconds`, part of its CPU)."""
    waited = {
        name[len(WAITED) :]: round(max(0.0, after[name] - before.get(name, after[name])), 3)
        for name in after
        if name.startswith(WAITED)
    }
    in_gc = {
        name[len(IN_GC) :]: round(max(0.0, after[name] - before.get(name, after[name])), 3)
        for name in after
        if name.startswith(IN_GC)
    }
    seconds = {
        name: round(after[name] - before.get(name, 0.0), 3)
        for name in after
        if not name.startswith((WAITED, IN_GC))
    }
    # Everything else the machine ran meanwhile (other users' jobs): a disturbance figure.
    seconds["other_processes"] = round(seconds.pop("machine_busy") - seconds["total"], 3)
    per_k = {
        name: round(value * 1000 / checkpoints, 4) if checkpoints else None
        for name, value in seconds.items()
    }
    return {
        "seconds": seconds,
        "seconds_per_1k_checkpoints": per_k,
        "runqueue_wait_seconds": waited,
        "gc_seconds": in_gc,
        "gc_seconds_per_1k_checkpoints": {
            name: round(value * 1000 / checkpoints, 4) if checkpoints else None
            for name, value in in_gc.items()
        },
    }
