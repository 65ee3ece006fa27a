"""`remote-db`: Postgres behind a TCP proxy that adds 2 ms round trip (1 ms each way);
direct Postgres against the buffered store, whose flusher goes through the same proxy."""

from __future__ import annotations

from ..harness import Bench
from ..link import open_link
from ..sides import SidePlan, run_side
from ..workload import Workload
from . import Outcome
from .common import api, judge_latency, judge_round_trips

DESCRIPTION = (
    "The hot-threads workload (64 threads x 20 checkpoints/s, 200-message history growing "
    "by 2 per step) with every connection of the stores and the flusher to Postgres going "
    "through a delaying TCP proxy on loopback (its own process, 1 ms each way). NATS stays "
    "local. The harness reads Postgres statistics directly, not through the proxy."
)

DELAY_MS_EACH_WAY = 1.0


def workload(bench: Bench) -> Workload:
    """The hot-threads shape (smaller in quick mode)."""
    o = bench.options
    if o.quick:
        return Workload(
            api=api(bench),
            threads=o.threads or 8,
            rate_per_thread=o.rate or 20.0,
            duration_s=o.duration_s or 3.0,
            seed_messages=20,
        )
    return Workload(
        api=api(bench),
        threads=o.threads or 64,
        rate_per_thread=o.rate or 20.0,
        duration_s=o.duration_s or 45.0,
    )


async def run(bench: Bench) -> Outcome:
    wl = workload(bench)
    count = 50 if bench.options.quick else 300
    link = await open_link(bench.admin_libpq_url, 2 * DELAY_MS_EACH_WAY, count=count)
    try:
        cpu = {"proxy": lambda: link.proxy.pid}
        plans = [
            SidePlan(
                "direct", "direct Postgres (+2 ms link)", "direct", route=link.route, extra_cpu=cpu
            ),
            SidePlan(
                "buffered",
                "buffered (+2 ms link to Postgres)",
                "buffered",
                route=link.route,
                extra_cpu=cpu,
            ),
        ]
        sides = {plan.key: await run_side(bench, plan, wl) for plan in plans}
    finally:
        await link.proxy.stop()
    measured = link.figures()
    return Outcome(
        sides=sides,
        targets=[
            judge_latency("remote_p50", "p50", sides["direct"], sides["buffered"]),
            judge_round_trips(sides["buffered"], "remote Postgres"),
        ],
        parameters={
            "workload": wl.__dict__,
            "delay_ms_each_way_target": DELAY_MS_EACH_WAY,
            "delay_ms_each_way_used": link.delay_ms_each_way,
            "calibration_first_try": measured["calibration_first_try"],
            "measured_rtt_ms": measured["measured_rtt_ms"],
        },
        sections={"The link": link.describe()},
    )
