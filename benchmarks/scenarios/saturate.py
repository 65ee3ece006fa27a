"""`saturate`: the highest sustained checkpoint rate with N concurrent writers (closed
loop), direct Postgres against the buffered store with its flusher running; with
`--db-delay-ms`, every connection to Postgres (the direct store's and the flusher's) goes
through a delaying proxy, and the flusher's rate is judged against the direct maximum."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from buffered_store.config import BufferedStoreConfig

from ..flush import flusher_figures
from ..harness import Bench
from ..link import open_link
from ..processes import FlusherProcess
from ..report import fmt
from ..sides import OpenSide, SidePlan, run_side
from ..targets import ratio, target
from ..workload import Workload
from . import Outcome
from .common import api, judge_flush_lag, judge_round_trips, side_get

DESCRIPTION = (
    "N threads (default 64) each checkpoint as fast as they can (closed loop: the next "
    "call starts when the previous one returned) from a 200-message history growing by "
    "2 messages per step. Direct Postgres, then the buffered store with a flusher process. "
    "'Sustained' means the flusher keeps up: the WAL backlog must not grow. With "
    "--db-delay-ms D, Postgres sits behind a proxy adding D ms per round trip for both "
    "sides (NATS stays local) and the flush rate over that link is judged."
)

REMOTE_GOAL = 3.0
"""Issue 23: over the link, the flusher sustains at least 3x the direct store's maximum."""


def workload(bench: Bench) -> Workload:
    """Closed-loop workload (smaller in quick mode)."""
    o = bench.options
    if o.quick:
        return Workload(
            api=api(bench),
            threads=o.threads or 8,
            rate_per_thread=None,
            duration_s=o.duration_s or 2.0,
            seed_messages=20,
        )
    return Workload(
        api=api(bench),
        threads=o.threads or 64,
        rate_per_thread=None,
        duration_s=o.duration_s or 30.0,
    )


async def run(bench: Bench) -> Outcome:
    wl = workload(bench)
    delay = bench.options.db_delay_ms or 0.0
    link = None
    route = None
    extra_cpu: dict[str, Callable[[], int | None]] = {}
    if delay > 0:
        link = await open_link(
            bench.admin_libpq_url, delay, count=50 if bench.options.quick else 300
        )
        bench.say(f"link: {link.describe()}")
        route = link.route
        extra_cpu = {"proxy": lambda: link.proxy.pid}
    suffix = f" (+{delay:g} ms link)" if link else ""
    try:
        sides = {
            "direct": await run_side(
                bench,
                SidePlan(
                    "direct", "direct Postgres" + suffix, "direct", route=route, extra_cpu=extra_cpu
                ),
                wl,
            ),
            "buffered": await run_side(
                bench,
                SidePlan(
                    "buffered",
                    "buffered (flusher running)" + suffix,
                    "buffered",
                    route=route,
                    extra_cpu=extra_cpu,
                ),
                wl,
            ),
        }
        if link is not None:
            # The writers of one machine cap what a flusher running beside them can show:
            # the flusher's own rate over the link is that of a backlog drained at once.
            sides["backlog"] = await run_side(
                bench,
                SidePlan(
                    "backlog",
                    "buffered, flusher started after the writes" + suffix,
                    "buffered",
                    route=route,
                    extra_cpu=extra_cpu,
                    flusher=False,
                ),
                wl,
                after=lambda side, states, config: drain_backlog(bench, side, config),
            )
    finally:
        if link is not None:
            await link.proxy.stop()
    interval = bench.buffered_config(bench.nats_url, "x").flush_interval_s
    d = side_get(sides["direct"], "throughput_per_s")
    b = side_get(sides["buffered"], "throughput_per_s")
    flushed = side_get(sides.get("backlog", {}), "after", "drain_rate_per_s")
    section = (
        f"Sustained checkpoints/s with {wl.threads} writers{suffix}: buffered {fmt(b, 'rate')}, "
        f"direct {fmt(d, 'rate')} (buffered/direct = {fmt(ratio(b, d))}); the flusher "
        f"ran beside the writers at {fmt(flush_rate(sides['buffered']), 'rate')} "
        "checkpoints/s from the first write to the end of its drain"
        + (
            f"; started after the writes, it drained their backlog at {fmt(flushed, 'rate')} "
            f"checkpoints/s ({fmt(ratio(flushed, d))}x the direct maximum)."
            if link is not None
            else "."
        )
    )
    targets = [
        judge_round_trips(sides["buffered"], "closed loop"),
        judge_flush_lag(sides["buffered"], interval, "closed loop"),
    ]
    if link is not None:
        targets.append(judge_remote_flush(flushed, d, delay))
    return Outcome(
        sides=sides,
        targets=targets,
        parameters={
            "workload": wl.__dict__,
            "flush_interval_s": interval,
            "db_delay_ms": delay,
            **({"link": link.figures()} if link else {}),
        },
        sections={"Throughput": section, **({"The link": link.describe()} if link else {})},
    )


async def drain_backlog(
    bench: Bench, side: OpenSide, config: BufferedStoreConfig | None
) -> dict[str, Any]:
    """Start a flusher on the backlog the writes left and time its drain."""
    assert config is not None
    assert side.monitor is not None
    backlog = await side.monitor.backlog()
    flusher = await FlusherProcess.start(
        database_url=side.url,
        schema=side.schema,
        config=config,
        log_path=bench.output / "logs" / "flusher-backlog.log",
    )
    try:
        drained = await side.monitor.wait_drained(600.0)
    finally:
        final = await flusher.stop()
    return {
        "backlog_entries": backlog,
        "drain_s": drained,
        "drain_rate_per_s": backlog / drained if backlog and drained else None,
        "flusher_stats": final,
        **flusher_figures(final),
        "method": "the writes ran with no flusher; a flusher process was then started and "
        "the consumer's backlog (num_pending + num_ack_pending) polled every 0.1 s until 0: "
        "entries at the start over seconds to empty (its start-up included)",
    }


def flush_rate(side: dict[str, object]) -> float | None:
    """Checkpoints the flusher applied per second, from the first write to the end of its
    drain (a lower bound of its rate: it cannot apply what is not written yet)."""
    count = side_get(side, "checkpoints")
    writes = side_get(side, "write_seconds")
    drain = side_get(side, "flush", "drain_s")
    if not count or writes is None or drain is None:
        return None
    return float(count) / (float(writes) + float(drain))


def judge_remote_flush(
    flushed: float | None, direct: float | None, delay: float
) -> dict[str, object]:
    """The flush-over-the-link target of issue 23."""
    r = ratio(flushed, direct)
    return target(
        "flush_remote",
        f"flusher {fmt(flushed, 'rate')}/s (a backlog drained) vs direct maximum "
        f"{fmt(direct, 'rate')}/s, +{delay:g} ms per round trip",
        met=None if r is None else r >= REMOTE_GOAL,
        ratio=r,
    )
