"""`remote-db`: Postgres behind a TCP proxy that adds 2 ms round trip (1 ms each way);
direct Postgres against the buffered store, whose flusher goes through the same proxy."""

from __future__ import annotations

import asyncio
import statistics
import time
from urllib.parse import urlsplit

import psycopg

from ..harness import Bench, with_host
from ..proxy import start_proxy
from ..report import fmt
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


def _ping_ms(url: str, count: int) -> float:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT 1")
        samples = []
        for _ in range(count):
            began = time.perf_counter()
            conn.execute("SELECT 1")
            samples.append((time.perf_counter() - began) * 1000)
    return statistics.median(samples)


async def run(bench: Bench) -> Outcome:
    wl = workload(bench)
    target_url = urlsplit(bench.admin_libpq_url)
    host, port = target_url.hostname or "127.0.0.1", target_url.port or 5432
    count = 50 if bench.options.quick else 300
    plain = await asyncio.to_thread(_ping_ms, bench.admin_libpq_url, count)
    # The proxy's sleeps overshoot a little: calibrate the per-direction delay once so the
    # link adds 2 ms per round trip, not more (a slower link would flatter the buffered side).
    delay_ms = DELAY_MS_EACH_WAY
    proxy = await start_proxy(host, port, delay_ms=delay_ms, max_seconds=4 * 3600)
    via = with_host(bench.admin_libpq_url, "127.0.0.1", proxy.port)
    proxied = await asyncio.to_thread(_ping_ms, via, count)
    first_try = {"delay_ms_each_way": delay_ms, "added_ms": proxied - plain}
    excess = (proxied - plain) - 2 * DELAY_MS_EACH_WAY
    if excess > 0.05:
        await proxy.stop()
        delay_ms = max(0.0, DELAY_MS_EACH_WAY - excess / 2)
        proxy = await start_proxy(host, port, delay_ms=delay_ms, max_seconds=4 * 3600)
        via = with_host(bench.admin_libpq_url, "127.0.0.1", proxy.port)
        proxied = await asyncio.to_thread(_ping_ms, via, count)
    try:
        route = ("127.0.0.1", proxy.port)
        cpu = {"proxy": lambda: proxy.pid}
        plans = [
            SidePlan(
                "direct", "direct Postgres (+2 ms link)", "direct", route=route, extra_cpu=cpu
            ),
            SidePlan(
                "buffered",
                "buffered (+2 ms link to Postgres)",
                "buffered",
                route=route,
                extra_cpu=cpu,
            ),
        ]
        sides = {plan.key: await run_side(bench, plan, wl) for plan in plans}
    finally:
        await proxy.stop()
    link = (
        f"`SELECT 1` round trip, median of {count}: {plain:.3f} ms direct, {proxied:.3f} ms "
        f"through the proxy: the link adds {proxied - plain:.3f} ms per round trip."
    )
    return Outcome(
        sides=sides,
        targets=[
            judge_latency("remote_p50", "p50", sides["direct"], sides["buffered"]),
            judge_round_trips(sides["buffered"], "remote Postgres"),
        ],
        parameters={
            "workload": wl.__dict__,
            "delay_ms_each_way_target": DELAY_MS_EACH_WAY,
            "delay_ms_each_way_used": delay_ms,
            "calibration_first_try": first_try,
            "measured_rtt_ms": {"plain": plain, "proxied": proxied, "added": proxied - plain},
        },
        sections={
            "The link": link
            + f" Target added round trip: {fmt(2 * DELAY_MS_EACH_WAY)} ms; the proxy sleeps "
            f"{delay_ms:.3f} ms each way after calibration (first try with "
            f"{DELAY_MS_EACH_WAY} ms added {first_try['added_ms']:.3f} ms)."
        },
    )
