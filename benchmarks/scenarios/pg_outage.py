"""`pg-outage`: Postgres is stopped for 10 s in the middle of the run; direct Postgres
against the buffered store (whose flusher must catch up afterwards)."""

from __future__ import annotations

import asyncio
from typing import Any

from ..harness import Bench
from ..measure import LatencyLog, Timeline, summarize
from ..report import fmt
from ..sides import SidePlan, TimedEvent, run_side
from ..targets import target
from ..workload import Workload
from . import Outcome
from .common import api, side_get

DESCRIPTION = (
    "The hot-threads workload (64 threads x 20 checkpoints/s) for 40 s; 15 s in, Postgres "
    "is stopped (`pg_ctl stop -m fast`) and 10 s later started again. Each side has its own "
    "outage. Counted: checkpoints attempted and accepted while Postgres was down (from the "
    "end of the stop to the start of the restart), failures while it stopped, while it "
    "started and after it was back, and how long the buffered side's flusher needs to work "
    "off the backlog."
)


def workload(bench: Bench) -> tuple[Workload, float, float]:
    """Workload, outage start (s) and outage length (s)."""
    o = bench.options
    if o.quick:
        wl = Workload(
            api=api(bench),
            threads=o.threads or 8,
            rate_per_thread=o.rate or 20.0,
            duration_s=o.duration_s or 6.0,
            seed_messages=20,
        )
        return wl, 2.0, 2.0
    wl = Workload(
        api=api(bench),
        threads=o.threads or 64,
        rate_per_thread=o.rate or 20.0,
        duration_s=o.duration_s or 40.0,
    )
    return wl, 15.0, 10.0


def outage_analysis(
    log: LatencyLog, timeline: Timeline, events: list[dict[str, Any]]
) -> dict[str, Any]:
    """Checkpoints during the outage window and after it; time to recover."""
    stop = next((e for e in events if e["label"] == "postgres stop"), None)
    start = next((e for e in events if e["label"] == "postgres start"), None)
    if stop is None or start is None:
        return {"error": "the outage did not happen"}
    # "During" is while Postgres was certainly down: from the end of the stop to the
    # start of the restart. Calls in the transitions are counted apart.
    begin, end = stop["done_s"], start["began_s"]
    ok_during = log.between(begin, end)
    failed_during = [f for f in log.failures if begin <= f[0] < end]
    up = start["done_s"]
    stopping = (stop["began_s"], stop["done_s"])
    failed_stopping = [f for f in log.failures if stopping[0] <= f[0] < stopping[1]]
    failed_starting = [f for f in log.failures if end <= f[0] < up]
    failed_after = [f for f in log.failures if f[0] >= up]
    after = [s for s in log.starts_s if s >= up]
    first_ok_after = (min(after) - up) if after else None
    backlog = timeline.series.get("backlog", [])
    peak = max((b for b in backlog if b is not None), default=None)
    recovered = None
    if peak:
        # Recovered: the backlog is back under 5% of its peak, after the restart.
        for t, b in zip(timeline.t_s, backlog, strict=False):
            if t >= up and b is not None and b <= 0.05 * peak:
                recovered = t - up
                break
    return {
        "outage_window_s": [begin, end],
        "postgres_down_s": round(end - begin, 3),
        "stop_took_s": round(stopping[1] - stopping[0], 3),
        "start_took_s": round(up - end, 3),
        "failed_while_stopping": len(failed_stopping),
        "failed_while_starting": len(failed_starting),
        "attempted_during": len(ok_during) + len(failed_during),
        "accepted_during": len(ok_during),
        "failed_during": len(failed_during),
        "latency_during_ms": summarize(ok_during),
        "latency_outside_ms": summarize(log.between(0, begin) + log.between(end, 1e9)),
        "failed_after_restart": len(failed_after),
        "first_success_after_restart_s": first_ok_after,
        "backlog_peak": peak,
        "backlog_recovered_after_restart_s": recovered,
    }


async def run(bench: Bench) -> Outcome:
    wl, at_s, down_s = workload(bench)
    pg = bench.svc.postgres
    if pg is None or not getattr(pg, "managed", False):
        bench.note("pg-outage needs a Postgres this harness started (not --database-url)")
        return Outcome(sides={}, targets=[], parameters={})
    server: Any = pg

    async def stop() -> None:
        await asyncio.to_thread(server.stop)

    async def start() -> None:
        await asyncio.to_thread(server.start)

    events = [
        TimedEvent(at_s, "postgres stop", stop),
        TimedEvent(at_s + down_s, "postgres start", start),
    ]
    sides = {}
    for plan in (
        SidePlan("direct", "direct Postgres", "direct", events=events),
        SidePlan("buffered", "buffered", "buffered", events=events),
    ):
        sides[plan.key] = await run_side(bench, plan, wl, analyse=outage_analysis)
    b = sides["buffered"]["analysis"]
    d = sides["direct"]["analysis"]
    attempted, accepted = b.get("attempted_during"), b.get("accepted_during")
    transitions = (b.get("failed_while_stopping") or 0) + (b.get("failed_while_starting") or 0)
    met = None if not attempted else accepted == attempted and transitions == 0
    lines = []
    for side in sides.values():
        a = side["analysis"]
        lines.append(
            f"| {side['label']} | {a.get('attempted_during')} | {a.get('accepted_during')} | "
            f"{a.get('failed_during')} | {fmt(side_get(a, 'latency_during_ms', 'p99'), 'ms')} | "
            f"{a.get('failed_while_stopping')} / {a.get('failed_while_starting')} | "
            f"{a.get('failed_after_restart')} | {fmt(a.get('first_success_after_restart_s'), 's')} "
            f"| {fmt(a.get('backlog_peak'), 'int')} | "
            f"{fmt(a.get('backlog_recovered_after_restart_s'), 's')} |"
        )
    table = "\n".join(
        [
            "| side | attempted while down | accepted | failed | p99 ms while down | "
            "failed while stopping / starting | failed after restart | "
            "first success after restart s | backlog peak | "
            "backlog recovered after restart s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            *lines,
        ]
    )
    return Outcome(
        sides=sides,
        targets=[
            target(
                "outage",
                f"while down: buffered accepted {accepted} of {attempted} (and failed "
                f"{transitions} while Postgres stopped or started); direct accepted "
                f"{d.get('accepted_during')} of {d.get('attempted_during')}",
                met=met,
            )
        ],
        parameters={"workload": wl.__dict__, "outage_at_s": at_s, "outage_s": down_s},
        sections={"The outage": table},
    )
