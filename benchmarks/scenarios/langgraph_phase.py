"""One measured phase of one side of the `langgraph` scenario: its threads' graph runs,
sampled while they run, and every figure of the phase (latencies, rates, CPU per step,
Postgres counters, the buffered side's WAL, drain and backlog)."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import asdict
from typing import Any

from langgraph.checkpoint.memory import InMemorySaver

from buffered_store.langgraph import BufferedCheckpointSaver

from ..flush import backlog_figures, flusher_figures
from ..harness import Bench
from ..link import Link
from ..measure import (
    CpuMeter,
    PgSnapshot,
    Timeline,
    cdf_points,
    pg_delta,
    rate_series,
    settle_harness_heap,
    wait_or_stop,
)
from ..sides import flusher_waited
from .common import backlog_growing, backlog_trend
from .langgraph_graph import Shape, Thinker, build_graph, drive, thread_id
from .langgraph_onetrip import OnePublishSaver, one_publish_figures
from .langgraph_pacing import StepLog, phase_cpu, thread_slots
from .langgraph_report import read_threads
from .langgraph_sides import OpenSaver, Side, cpu_sources, open_saver, phase_label


async def run_phase(
    bench: Bench, side: Side, phase: str, shape: Shape, link: Link | None
) -> dict[str, Any]:
    """One measured phase of a side: counters read with no backend connected, the saver
    opened afresh, every thread's runs, the buffered side drained and `force_flush_all`
    called, the saver closed and the counters read again."""
    label = f"{side.label}: {phase_label(phase)}"
    short = f"{side.label}: {'closed loop' if phase == 'max' else phase + '%'}"
    pg_before: tuple[PgSnapshot, bool] | None = None
    if side.counters is not None:
        pg_before = side.snapshot or await side.counters.settled()
    meter = CpuMeter(cpu_sources(bench, side, link))
    slots = None
    if shape.rate_per_s is not None:
        # Seeded by the phase: every side meets the same slots.
        every = thread_slots(shape.threads, shape.rate_per_s, random.Random(f"slots-{phase}"))
        slots = {thread_id(phase, i): s for i, s in enumerate(every)}
    thinker = Thinker(slots)
    log = StepLog()
    timeline = Timeline()
    task = bench.task(short, total=shape.total_steps)
    flush: dict[str, Any] = {}
    settle_harness_heap()  # before the saver opens: its objects are walked as usual
    async with open_saver(bench, side, phase, link) as opened:
        graph = build_graph(opened.saver, thinker)
        flusher_at_start = (opened.flusher.cpu_s or 0.0) if opened.flusher else 0.0
        cpu_before = meter.sample()
        flusher_wait_at_start = flusher_waited(opened.flusher)
        clock_zero = time.perf_counter()
        stop = asyncio.Event()
        sampler = asyncio.create_task(
            sample(bench, task, short, opened, log, timeline, clock_zero, stop)
        )
        try:
            write_s = await drive(graph, shape, phase, thinker, log)
            writes_end_s = time.perf_counter() - clock_zero
            if opened.monitor is not None:
                flush["drain_s"] = await opened.monitor.wait_drained(180)
        finally:
            stop.set()
            await sampler
        last = await sample_once(opened, log, timeline, clock_zero)
        show(bench, task, writes_end_s, last)
        cpu_after = meter.sample()
        flusher_wait_at_end = flusher_waited(opened.flusher)
        if isinstance(opened.saver, BufferedCheckpointSaver):
            flush["force_flush_all_threads"] = await opened.saver.force_flush_all(timeout=120)
            flush["saver_stats"] = opened.saver.stats()
        if isinstance(opened.saver, InMemorySaver):
            ids = [thread_id(phase, i) for i in range(shape.threads)]
            side.found.update(await read_threads(opened.saver, ids))
    flusher_s = None
    if opened.flusher is not None and opened.flusher.cpu_s is not None:
        flusher_s = opened.flusher.cpu_s - flusher_at_start
    steps = log.nodes
    figures: dict[str, Any] = {
        "key": f"{side.key}_{phase}",
        "label": label,
        "kind": side.key,
        "phase": phase,
        "closed_loop": shape.rate_per_s is None,
        "shape": asdict(shape),
        "database": side.db.name if side.db else None,
        "steps": steps,
        "runs": len(log.runs_ms),
        "failed": sum(log.failures.values()),
        "failure_kinds": log.failures,
        "offered_per_s": shape.rate_per_s,
        "late_slots": thinker.late_slots,
        "write_seconds": round(write_s, 3),
        "writes_end_s": round(writes_end_s, 3),
        "throughput_per_s": steps / write_s if write_s else None,
        **log.figures(),
        "latency_cdf_ms": cdf_points(log.steps_ms),
        "cpu": phase_cpu(
            cpu_before,
            cpu_after,
            steps,
            flusher_s=flusher_s,
            flusher_wait_s=(
                flusher_wait_at_end - flusher_wait_at_start
                if flusher_wait_at_start is not None and flusher_wait_at_end is not None
                else None
            ),
            outside_total=("proxy",) if link else (),
        ),
        "timeline": {
            **timeline.as_dict(),
            "checkpoints_per_s": rate_series(timeline.t_s, timeline.series.get("steps", [])),
        },
        "unavailable": {},
    }
    if side.counters is not None and pg_before is not None:
        side.snapshot = pg_after = await side.counters.settled()
        figures["pg"] = per_step_pg(pg_before, pg_after, steps)
    else:
        figures["unavailable"]["pg"] = "InMemorySaver writes nothing to Postgres"
    if side.key == "buffered":
        figures.update(buffered_figures(flush, opened.flusher_final, flusher_s, timeline, figures))
    elif isinstance(opened.saver, OnePublishSaver):
        figures["one_publish"] = one_publish_figures(opened.saver, steps)
    else:
        figures["unavailable"]["nats"] = f"{side.label} makes no NATS requests"
    offered, achieved = shape.rate_per_s, figures["throughput_per_s"]
    if offered and achieved is not None and achieved < 0.9 * offered:
        bench.note(
            f"{label}: offered {offered:,.0f} steps/s but achieved {achieved:,.0f}/s "
            f"({thinker.late_slots:,} slots skipped): the side fell behind the offered load"
        )
    return figures


def per_step_pg(
    before: tuple[PgSnapshot, bool], after: tuple[PgSnapshot, bool], steps: int
) -> dict[str, Any]:
    """Postgres figures of a phase, per graph step."""
    pg = pg_delta(before[0], after[0], steps)
    for name in ("transactions", "tuple_writes", "pg_wal_bytes"):
        old = "pg_wal_bytes_per_checkpoint" if name == "pg_wal_bytes" else f"{name}_per_checkpoint"
        pg[f"{name}_per_step"] = pg.pop(old)
    pg["settled"] = before[1] and after[1]
    return pg


def buffered_figures(
    flush: dict[str, Any],
    final: dict[str, Any],
    flusher_s: float | None,
    timeline: Timeline,
    figures: dict[str, Any],
) -> dict[str, Any]:
    """NATS and flush figures of a buffered phase: WAL bytes, drain time, the backlog's
    trend while writing, the flusher's CPU per flushed entry."""
    steps = figures["steps"]
    stats = flush.get("saver_stats", {})
    wal_bytes = stats.get("wal_bytes")
    writes_end_s = figures["writes_end_s"]
    backlog = backlog_figures(
        timeline.t_s, timeline.series.get("backlog", []), writes_end_s, min(2.0, writes_end_s / 5)
    )
    out: dict[str, Any] = {
        **flush,
        "backlog": backlog,
        "flusher_stats": final,
        **flusher_figures(final),
    }
    slope = backlog_trend({"flush": out})
    # The backlog counts WAL entries (a put and a put_writes per step, and more): its
    # trend is flat within 1% of the entries' rate, not of the steps'.
    per_step = stats.get("entries", 0) / steps if steps else 0.0
    rate = (figures["throughput_per_s"] or 0.0) * per_step
    out["backlog_trend_per_s"] = slope
    out["backlog_flat"] = None if slope is None else not backlog_growing(slope, rate)
    entries = final.get("entries_applied") or 0
    out["process_cpu_us_per_entry"] = (
        flusher_s * 1e6 / entries if flusher_s is not None and entries else None
    )
    return {
        "nats": {
            "wal_bytes": wal_bytes,
            "wal_bytes_per_step": wal_bytes / steps if wal_bytes is not None and steps else None,
            "entries_per_step": stats.get("entries", 0) / steps if steps else None,
        },
        "flush": out,
    }


async def sample_once(
    opened: OpenSaver, log: StepLog, timeline: Timeline, clock_zero: float
) -> dict[str, float | None]:
    """One sample of the timeline: updates streamed, failed runs, WAL backlog. (No CPU:
    reading Postgres's processes costs milliseconds of this process's CPU, which would
    count in every step's at low rates; the CPU is read at the phase's start and end.)"""
    values: dict[str, float | None] = {
        "steps": float(log.streamed),
        "failed": float(sum(log.failures.values())),
        "backlog": await opened.monitor.backlog() if opened.monitor else None,
    }
    timeline.add(time.perf_counter() - clock_zero, **values)
    return values


async def sample(
    bench: Bench,
    task: Any,
    label: str,
    opened: OpenSaver,
    log: StepLog,
    timeline: Timeline,
    clock_zero: float,
    stop: asyncio.Event,
) -> None:
    """Sample every 0.25 s and refresh the progress line (a plain line every 10 s when
    the output is not a terminal) until `stop` is set (see `wait_or_stop`)."""
    last_said = 0.0
    while True:
        values = await sample_once(opened, log, timeline, clock_zero)
        t = timeline.t_s[-1]
        info = show(bench, task, t, values)
        if not bench.console.is_terminal and t - last_said >= 10:
            last_said = t
            bench.say(f"  {label} t={t:5.0f}s {info}")
        if await wait_or_stop(stop, 0.2 if bench.options.quick else 0.25):
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
