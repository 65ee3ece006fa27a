"""`langgraph`: M threads each run a LangGraph graph of N steps, R times in turn, with
LangGraph's own `AsyncPostgresSaver`, then with `BufferedCheckpointSaver` and its flusher
process: latency per graph step, steps/s, Postgres transactions and WAL bytes per step,
and after `force_flush_all` the checkpoints each thread holds on both sides."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any, TypedDict

from langchain_core.messages import AIMessage, AnyMessage, HumanMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.graph.state import CompiledStateGraph
from psycopg import AsyncConnection
from psycopg.rows import DictRow, dict_row
from psycopg_pool import AsyncConnectionPool

from buffered_store.langgraph import BufferedCheckpointSaver, LangGraphConfig, LangGraphSink

from ..flush import flusher_figures
from ..harness import Bench, SideDb
from ..measure import (
    CpuMeter,
    PgSnapshot,
    PgStats,
    Timeline,
    cdf_points,
    cpu_delta,
    pg_delta,
    rate_series,
    summarize,
    wait_or_stop,
)
from ..processes import FlusherProcess, WalMonitor
from . import Outcome
from .langgraph_report import ROWS, correctness, methods, targets_and_sections, thread_id

DESCRIPTION = (
    "M threads (default 64) each run a LangGraph `StateGraph` of N steps (default 20) R "
    "times in turn (default 5), all threads at once (closed loop). Each step is one node "
    "run that appends a ~200-byte AI message to the state's `messages` (add_messages), and "
    "LangGraph checkpoints it before the next step starts (durability='sync'); each run "
    "starts with a user message (N + 2 checkpoints a run: the input's, the input applied, "
    "one per step). The sides run back to back on the same machine and "
    "Postgres server, each on a database of its own: LangGraph's `AsyncPostgresSaver` on a "
    "pool of 10 connections, then `BufferedCheckpointSaver` with a flusher process "
    "(`--front-end langgraph`) draining its WAL into LangGraph's tables. After the runs the "
    "buffered side calls `force_flush_all`, and both databases must hold the same "
    "checkpoints per thread."
)

POOL_SIZE = 10
"""AsyncPostgresSaver's connections (the direct thread-run store's pool size here)."""
FILLER = "x" * 180


@dataclass(frozen=True)
class Sizes:
    """Threads, steps per run and runs per thread."""

    threads: int
    steps: int
    runs: int

    @property
    def total_steps(self) -> int:
        """Graph steps of a whole side."""
        return self.threads * self.steps * self.runs

    @property
    def checkpoints_per_thread(self) -> int:
        """Each run writes its input's checkpoint, one with the input applied (LangGraph's
        step 0) and one per step."""
        return self.runs * (self.steps + 2)


def sizes(bench: Bench) -> Sizes:
    """`--threads`, `--steps`, `--runs`, else the mode's defaults."""
    o = bench.options
    if o.duration_s is not None:
        bench.note("--duration-s ignored: langgraph runs a fixed number of graph steps")
    if o.api is not None:
        bench.note(f"--api {o.api} ignored: the graph calls the checkpointer")
    if o.quick:
        return Sizes(threads=o.threads or 4, steps=o.steps or 5, runs=o.runs or 2)
    return Sizes(threads=o.threads or 64, steps=o.steps or 20, runs=o.runs or 5)


# -- the graph -------------------------------------------------------------------------------


class State(TypedDict):
    """A chat thread: its messages, and the steps left in this run."""

    messages: Annotated[list[AnyMessage], add_messages]
    remaining: int


def build_graph(checkpointer: BaseCheckpointSaver[Any]) -> CompiledStateGraph[Any]:
    """One node that appends a message, looping until the run's steps are done."""

    def step(state: State) -> dict[str, Any]:
        n = len(state["messages"])
        return {
            "messages": [AIMessage(content=f"step {n}: {FILLER}")],
            "remaining": state["remaining"] - 1,
        }

    def route(state: State) -> str:
        return "step" if state["remaining"] > 0 else END

    graph = StateGraph(State)
    graph.add_node("step", step)
    graph.add_edge(START, "step")
    graph.add_conditional_edges("step", route, ["step", END])
    return graph.compile(checkpointer=checkpointer)


def thread_config(index: int) -> RunnableConfig:
    """The `index`-th thread's config."""
    return {"configurable": {"thread_id": thread_id(index)}}


@dataclass
class StepLog:
    """Durations of every graph step and run (ms), and failed runs."""

    steps_ms: list[float] = field(default_factory=list)
    inner_ms: list[float] = field(default_factory=list)
    """Steps other than a run's first and last: one node run and one checkpoint each."""
    runs_ms: list[float] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)
    streamed: int = 0
    """Step updates streamed so far (the timeline's steps: runs finish in bursts)."""

    def run(self, began: float, marks: list[float], end: float) -> None:
        """A run that started at `began`, streamed a step's update at each of `marks` and
        returned at `end`. Step i lasts from update i-1 (the call, for the first) to update
        i, the last one to the run's end: the steps add up to the run, and each includes
        a checkpoint write (the first one the thread's read and the input's checkpoint,
        the last one the final checkpoint)."""
        # The input and step 0 are not streamed as updates: N updates for N steps.
        bounds = [began, *marks[:-1], end]
        durations = [(b - a) * 1000 for a, b in itertools.pairwise(bounds)]
        self.steps_ms += durations
        self.inner_ms += durations[1:-1]
        self.runs_ms.append((end - began) * 1000)

    def fail(self, error: BaseException) -> None:
        """Record a failed run."""
        kind = type(error).__name__
        self.failures[kind] = self.failures.get(kind, 0) + 1


async def drive(graph: CompiledStateGraph[Any], size: Sizes, log: StepLog) -> float:
    """Every thread runs the graph `size.runs` times in turn, all threads at once;
    returns the seconds until the last run returned."""

    async def thread(index: int) -> None:
        config = thread_config(index)
        for run in range(size.runs):
            inputs = {
                "messages": [HumanMessage(content=f"run {run}: {FILLER}")],
                "remaining": size.steps,
            }
            marks: list[float] = []
            began = time.perf_counter()
            try:
                async for _ in graph.astream(
                    inputs, config, stream_mode="updates", durability="sync"
                ):
                    marks.append(time.perf_counter())
                    log.streamed += 1
            except Exception as exc:
                log.fail(exc)
                continue
            log.run(began, marks, time.perf_counter())

    started = time.perf_counter()
    await asyncio.gather(*(thread(i) for i in range(size.threads)))
    return time.perf_counter() - started


# -- one side ----------------------------------------------------------------------------


@dataclass
class OpenSaver:
    """A side's checkpointer while it is open, with its flusher process and WAL monitor."""

    saver: BaseCheckpointSaver[Any]
    flusher: FlusherProcess | None = None
    monitor: WalMonitor | None = None
    flusher_final: dict[str, Any] = field(default_factory=dict)
    flusher_cpu_at_start: float = 0.0


def lg_config(bench: Bench, db: SideDb, key: str) -> LangGraphConfig:
    """The buffered saver's config: WAL names of its own, LangGraph's tables in `db`."""
    names = bench.buffered_config(bench.nats_url, key)
    return LangGraphConfig(
        nats_url=names.nats_url,
        stream_name=names.stream_name,
        hot_bucket=names.hot_bucket,
        quarantine_bucket=names.quarantine_bucket,
        consumer_name=names.consumer_name,
        database_url=db.libpq_url,
        drain_on_close=False,
    )


async def setup_tables(db: SideDb, buffered: bool) -> None:
    """LangGraph's tables (and for the buffered side its watermark table), unmeasured."""
    if buffered:
        sink = await LangGraphSink.open(db.libpq_url)
        try:
            await sink.setup()
        finally:
            await sink.close()
        return
    async with AsyncPostgresSaver.from_conn_string(db.libpq_url) as saver:
        await saver.setup()


@contextlib.asynccontextmanager
async def open_saver(
    bench: Bench, key: str, db: SideDb, config: LangGraphConfig | None
) -> AsyncIterator[OpenSaver]:
    """The side's checkpointer opened afresh (and the flusher process); closed on exit."""
    if config is None:
        pool: AsyncConnectionPool[AsyncConnection[DictRow]] = AsyncConnectionPool(
            db.libpq_url,
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
    monitor = await WalMonitor.connect(config)
    flusher: FlusherProcess | None = None
    opened: OpenSaver | None = None
    try:
        profile = bench.output / f"profile-flusher-{key}.pstats" if bench.options.profile else None
        flusher = await FlusherProcess.start(
            database_url=db.libpq_url,
            schema="public",
            config=config,
            log_path=bench.output / "logs" / f"flusher-{key}.log",
            profile_path=profile,
            front_end="langgraph",
        )
        saver = await BufferedCheckpointSaver.connect(config)
        opened = OpenSaver(saver, flusher, monitor, flusher_cpu_at_start=flusher.cpu_s or 0.0)
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


async def run_side(
    bench: Bench, key: str, label: str, size: Sizes
) -> tuple[dict[str, Any], SideDb]:
    """Set up a database, run every thread's graph runs, and return the side's figures."""
    buffered = key == "buffered"
    db = await bench.new_database(key, migrate=False)
    config = lg_config(bench, db, key) if buffered else None
    await setup_tables(db, buffered)
    counters = PgStats(bench.admin_libpq_url, db.libpq_url, db.name, "public")
    pg_before, settled_before = await counters.settled()
    sources = {"harness": os.getpid, "postgres": lambda: bench.pids()["postgres"]}
    if buffered:
        sources["nats_server"] = lambda: bench.pids()["nats_server"]
    meter = CpuMeter(sources)
    cpu_before = meter.sample()
    log = StepLog()
    timeline = Timeline()
    task = bench.task(f"{label}: run", total=size.total_steps)
    flush: dict[str, Any] = {}
    async with open_saver(bench, key, db, config) as side:
        graph = build_graph(side.saver)
        clock_zero = time.perf_counter()
        stop_sampling = asyncio.Event()
        sampler = asyncio.create_task(
            sample(bench, task, side, log, timeline, clock_zero, meter, stop_sampling)
        )
        try:
            write_s = await drive(graph, size, log)
            writes_end_s = time.perf_counter() - clock_zero
            if side.monitor is not None and isinstance(side.saver, BufferedCheckpointSaver):
                flush["drain_s"] = await side.monitor.wait_drained(180)
                flush["force_flush_all_threads"] = await side.saver.force_flush_all(timeout=120)
                flush["saver_stats"] = side.saver.stats()
        finally:
            stop_sampling.set()
            await sampler
        last = await sample_once(side, log, timeline, clock_zero, meter)
        show(bench, task, writes_end_s, last)
        cpu_after = meter.sample()
    pg_after, settled_after = await counters.settled()
    steps = len(log.steps_ms)
    cpu = cpu_delta(cpu_before, cpu_after, steps)
    if side.flusher is not None and side.flusher.cpu_s is not None:
        flusher_s = round(side.flusher.cpu_s - side.flusher_cpu_at_start, 3)
        cpu["seconds"]["flusher"] = flusher_s
        cpu["seconds"]["total"] = round(cpu["seconds"]["total"] + flusher_s, 3)
        cpu["seconds"]["other_processes"] = round(cpu["seconds"]["other_processes"] - flusher_s, 3)
        for name in ("flusher", "total"):
            cpu["seconds_per_1k_checkpoints"][name] = (
                round(cpu["seconds"][name] * 1000 / steps, 4) if steps else None
            )
    cpu["per_1k"] = "graph steps"
    figures: dict[str, Any] = {
        "key": key,
        "label": label,
        "kind": "buffered" if buffered else "direct",
        "sizes": asdict(size),
        "database": db.name,
        "steps": steps,
        "runs": len(log.runs_ms),
        "failed": sum(log.failures.values()),
        "failure_kinds": log.failures,
        "write_seconds": round(write_s, 3),
        "writes_end_s": round(writes_end_s, 3),
        "throughput_per_s": steps / write_s if write_s else None,
        "latency_ms": summarize(log.steps_ms),
        "latency_inner_ms": summarize(log.inner_ms),
        "run_latency_ms": summarize(log.runs_ms),
        "latency_cdf_ms": cdf_points(log.steps_ms),
        "pg": per_step_pg(pg_before, pg_after, steps, settled_before and settled_after),
        "cpu": cpu,
        "timeline": {
            **timeline.as_dict(),
            "checkpoints_per_s": rate_series(timeline.t_s, timeline.series.get("steps", [])),
        },
        "unavailable": {
            "flush_lag": "not measured here (see hot-threads and curve for the engine's)",
        },
    }
    if buffered:
        wal_bytes = flush.get("saver_stats", {}).get("wal_bytes")
        figures["nats"] = {
            "wal_bytes": wal_bytes,
            "wal_bytes_per_step": wal_bytes / steps if wal_bytes is not None and steps else None,
            "entries_per_step": flush.get("saver_stats", {}).get("entries", 0) / steps
            if steps
            else None,
        }
        figures["flush"] = {
            **flush,
            "flusher_stats": side.flusher_final,
            **flusher_figures(side.flusher_final),
        }
    else:
        figures["unavailable"]["nats"] = "AsyncPostgresSaver makes no NATS requests"
    return figures, db


def per_step_pg(before: PgSnapshot, after: PgSnapshot, steps: int, settled: bool) -> dict[str, Any]:
    """Postgres figures of a side, per graph step."""
    pg = pg_delta(before, after, steps)
    for name in ("transactions", "tuple_writes", "pg_wal_bytes"):
        old = "pg_wal_bytes_per_checkpoint" if name == "pg_wal_bytes" else f"{name}_per_checkpoint"
        pg[f"{name}_per_step"] = pg.pop(old)
    pg["settled"] = settled
    return pg


async def sample_once(
    side: OpenSaver, log: StepLog, timeline: Timeline, clock_zero: float, meter: CpuMeter
) -> dict[str, float | None]:
    """One sample of the timeline: steps done, failed runs, WAL backlog, CPU."""
    values: dict[str, float | None] = {
        "steps": float(log.streamed),
        "failed": float(sum(log.failures.values())),
        "backlog": await side.monitor.backlog() if side.monitor else None,
        "cpu_s": meter.sample()["total"],
    }
    timeline.add(time.perf_counter() - clock_zero, **values)
    return values


async def sample(
    bench: Bench,
    task: Any,
    side: OpenSaver,
    log: StepLog,
    timeline: Timeline,
    clock_zero: float,
    meter: CpuMeter,
    stop: asyncio.Event,
) -> None:
    """Sample every 0.25 s and refresh the progress line (a plain line every 10 s when
    the output is not a terminal) until `stop` is set (see `wait_or_stop`)."""
    last_said = 0.0
    while True:
        values = await sample_once(side, log, timeline, clock_zero, meter)
        info = show(bench, task, timeline.t_s[-1], values)
        t = timeline.t_s[-1]
        if not bench.console.is_terminal and t - last_said >= 10:
            last_said = t
            bench.say(f"  langgraph t={t:5.0f}s {info}")
        if await wait_or_stop(stop, 0.25):
            return


def show(bench: Bench, task: Any, t: float, values: dict[str, float | None]) -> str:
    """Refresh the progress line from a sample; the line's text."""
    steps = values["steps"] or 0.0
    info = f"{int(steps):>7,} steps  {steps / t if t else 0:>6,.0f}/s"
    if values["failed"]:
        info += f"  {int(values['failed'] or 0):,} runs failed"
    if values["backlog"] is not None:
        info += f"  backlog {int(values['backlog'] or 0):,}"
    bench.progress.update(task, completed=steps, info=info)
    return info


# -- the scenario --------------------------------------------------------------------------


async def run(bench: Bench) -> Outcome:
    size = sizes(bench)
    sides: dict[str, dict[str, Any]] = {}
    dbs: dict[str, SideDb] = {}
    for key, label in (
        ("direct", "AsyncPostgresSaver"),
        ("buffered", "BufferedCheckpointSaver (flusher process)"),
    ):
        sides[key], dbs[key] = await run_side(bench, key, label, size)
    check = await correctness(dbs, size.threads, size.checkpoints_per_thread)
    for key, side in sides.items():
        side["checkpoints"] = check["checkpoints"][key]
        side["pg"]["transactions_per_checkpoint"] = (
            side["pg"]["transactions"] / side["checkpoints"] if side["checkpoints"] else None
        )
    bench.say(("[green]" if check["ok"] else "[red]") + f"correctness:[/] {check['summary']}")
    if not check["ok"]:
        bench.note(f"correctness check failed: {check['summary']}")
    targets, sections = targets_and_sections(sides, check)
    return Outcome(
        sides=sides,
        targets=targets,
        parameters={**asdict(size), "pool_size_direct": POOL_SIZE, "durability": "sync"},
        sections=sections,
        methods=methods(),
        figures={"correctness": check},
        side_rows=ROWS,
        latency_of="graph step",
    )
