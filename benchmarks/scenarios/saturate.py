"""`saturate`: the highest sustained checkpoint rate with N concurrent writers (closed
loop), direct Postgres against the buffered store with its flusher running."""

from __future__ import annotations

from ..harness import Bench
from ..report import fmt
from ..sides import SidePlan, run_side
from ..targets import ratio
from ..workload import Workload
from . import Outcome
from .common import api, judge_flush_lag, judge_round_trips, side_get

DESCRIPTION = (
    "N threads (default 64) each checkpoint as fast as they can (closed loop: the next "
    "call starts when the previous one returned) from a 200-message history growing by "
    "2 messages per step. Direct Postgres, then the buffered store with a flusher process. "
    "'Sustained' means the flusher keeps up: the WAL backlog must not grow."
)


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
    sides = {
        "direct": await run_side(bench, SidePlan("direct", "direct Postgres", "direct"), wl),
        "buffered": await run_side(
            bench, SidePlan("buffered", "buffered (flusher running)", "buffered"), wl
        ),
    }
    interval = bench.buffered_config(bench.nats_url, "x").flush_interval_s
    d = side_get(sides["direct"], "throughput_per_s")
    b = side_get(sides["buffered"], "throughput_per_s")
    section = (
        f"Sustained checkpoints/s with {wl.threads} writers: buffered {fmt(b, 'rate')}, "
        f"direct {fmt(d, 'rate')} (buffered/direct = {fmt(ratio(b, d))})."
    )
    return Outcome(
        sides=sides,
        targets=[
            judge_round_trips(sides["buffered"], "closed loop"),
            judge_flush_lag(sides["buffered"], interval, "closed loop"),
        ],
        parameters={"workload": wl.__dict__, "flush_interval_s": interval},
        sections={"Throughput": section},
    )
