"""`force-flush`: latency of the `force_flush` admin call on threads with pending entries,
from the writing store instance and from another instance (as an admin process would)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from buffered_store.stores.postgres import PostgresThreadRunStore
from buffered_store.threadrun.store import BufferedThreadRunStore

from ..harness import Bench
from ..measure import PgStats, cdf_points, pg_delta, summarize
from ..report import fmt
from ..targets import target
from ..workload import ThreadState, Workload, make_threads, seed
from . import Outcome
from .common import api_ignored, side_get

DESCRIPTION = (
    "Threads with a 200-message history (already flushed) get 1, 4 or 16 more checkpoints "
    "(2 messages each) that stay pending (no flusher runs), then `force_flush(thread)` is "
    "timed, one call at a time: from the store instance that wrote them (its cursors are "
    "warm) and from a second instance that never saw the threads (an admin process). The "
    "direct store has no such call: its checkpoints are committed when they return."
)

LEVELS = (1, 4, 16)


def sizes(bench: Bench) -> tuple[int, Workload]:
    """Threads per pending level and side, and the workload shape."""
    if bench.options.quick:
        return 5, Workload(threads=5 * len(LEVELS) * 2, seed_messages=20)
    per = bench.options.threads or 100
    return per, Workload(threads=per * len(LEVELS) * 2, seed_messages=200)


async def run(bench: Bench) -> Outcome:
    api_ignored(bench, "force-flush times force_flush(); its checkpoints only set it up")
    per_level, wl = sizes(bench)
    db = await bench.new_database("buffered")
    config = bench.buffered_config(bench.nats_url, "ff")
    counters = PgStats(bench.admin_libpq_url, db.libpq_url, db.name, db.schema)
    states = make_threads("ff", wl)
    task = bench.task("force-flush: seed + flush histories", total=1)
    inner = await PostgresThreadRunStore.connect(db.url, schema=db.schema)
    async with BufferedThreadRunStore.connect(inner, config) as store:
        await seed(store, states)
        await store.force_flush_all(timeout=600)
    await inner.close()
    bench.progress.update(task, completed=1)

    sides: dict[str, dict[str, Any]] = {}
    groups = [states[i : i + per_level] for i in range(0, len(states), per_level)]
    plan = [("writer", "the writer's instance"), ("other", "another instance")]
    for index, (key, label) in enumerate(plan):
        mine = groups[index * len(LEVELS) : (index + 1) * len(LEVELS)]
        sides[key] = await _measure(bench, key, label, db.url, db.schema, config, mine, counters)
    targets = [
        target(
            "force_flush",
            f"p50 {fmt(side_get(s, 'latency_ms', 'p50'), 'ms')} ms "
            f"(p99 {fmt(side_get(s, 'latency_ms', 'p99'), 'ms')} ms) over "
            f"{side_get(s, 'latency_ms', 'count')} calls",
            met=None
            if side_get(s, "latency_ms", "p50") is None
            else side_get(s, "latency_ms", "p50") < 20,
            suffix=s["label"],
        )
        for s in sides.values()
    ]
    lines = [
        "| side | pending entries | calls | p50 ms | p95 ms | p99 ms | max ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s in sides.values():
        for level, summary in s["by_pending"].items():
            lines.append(
                f"| {s['label']} | {level} | {summary['count']} | {fmt(summary['p50'], 'ms')} | "
                f"{fmt(summary['p95'], 'ms')} | {fmt(summary['p99'], 'ms')} | "
                f"{fmt(summary['max'], 'ms')} |"
            )
    return Outcome(
        sides=sides,
        targets=targets,
        parameters={"levels": LEVELS, "threads_per_level": per_level, "workload": wl.__dict__},
        sections={"By number of pending entries": "\n".join(lines)},
    )


async def _measure(
    bench: Bench,
    key: str,
    label: str,
    url: str,
    schema: str,
    config: Any,
    groups: list[list[ThreadState]],
    counters: PgStats,
) -> dict[str, Any]:
    before, settled_before = await counters.settled()
    inner = await PostgresThreadRunStore.connect(url, schema=schema)
    other_inner = await PostgresThreadRunStore.connect(url, schema=schema)
    writer = await BufferedThreadRunStore.connect(inner, config)
    caller = (
        writer if key == "writer" else await BufferedThreadRunStore.connect(other_inner, config)
    )
    task = bench.task(f"force-flush: {label}", total=sum(len(g) for g in groups))
    latencies: list[float] = []
    by_level: dict[int, list[float]] = {}
    requests = 0.0
    try:
        for level, group in zip(LEVELS, groups, strict=True):
            for state in group:
                for _ in range(level):
                    state.advance(Workload(), time.time())
                    await writer.checkpoint(state.thread_id, state.history, state.run)
            for state in group:
                status = await caller.flush_status(state.thread_id)
                assert status.pending == level, f"{state.thread_id}: {status}"
                n0 = caller.stats()["nats_requests"]
                began = time.perf_counter()
                await caller.force_flush(state.thread_id)
                took = (time.perf_counter() - began) * 1000
                requests += caller.stats()["nats_requests"] - n0
                latencies.append(took)
                by_level.setdefault(level, []).append(took)
                bench.progress.advance(task)
                await asyncio.sleep(0)
    finally:
        if caller is not writer:
            await caller.close()
        await writer.close()
        await inner.close()
        await other_inner.close()
    after, settled_after = await counters.settled()
    calls = len(latencies)
    pg = pg_delta(before, after, calls)
    pg["settled"] = settled_before and settled_after
    pg["note"] = (
        "per force_flush call (the pending checkpoints only went to NATS); includes the "
        "schema check of opening the stores"
    )
    return {
        "key": key,
        "label": f"force_flush from {label}",
        "kind": "buffered",
        "checkpoints": calls,
        "latency_ms": summarize(latencies),
        "latency_cdf_ms": cdf_points(latencies),
        "by_pending": {str(k): summarize(v) for k, v in by_level.items()},
        "pg": pg,
        "nats": {
            "requests_per_checkpoint": requests / calls if calls else None,
            "method": "NATS requests of the calling instance per force_flush call",
        },
        "unavailable": {
            "direct": "the direct store has no force_flush: nothing is ever pending there",
        },
    }
