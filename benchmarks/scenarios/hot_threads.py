"""`hot-threads`: 64 threads, each checkpointing 20 times a second, with a 200-message
history growing by 2 messages per step; direct Postgres against the buffered store, the
latter twice: on a default nats-server and on one with ``sync_interval: always``, where
the write path alone (no flusher) and the raw publish + KV CAS loop run too, unjudged."""

from __future__ import annotations

from ..harness import Bench
from ..sides import SidePlan, run_side
from ..workload import Workload
from . import Outcome
from .common import (
    api,
    judge_flush_lag,
    judge_latency,
    judge_pg_tx,
    judge_round_trips,
)
from .raw import run_raw

DESCRIPTION = (
    "64 threads each checkpoint 20 times a second (open loop, paced), starting from a "
    "200-message history that grows by 2 messages (~300 bytes each) per checkpoint. The "
    "sides run back to back on the same machine and servers, each on a database of its "
    "own: direct `PostgresThreadRunStore`, then the buffered store with a flusher process "
    "on the default nats-server, then on a nats-server with `sync_interval: always` (the "
    "durable mode: every WAL write is fsynced), and there again without a flusher (the write "
    "path alone); last, the raw publish + KV CAS loop of the `raw` scenario paced the same "
    "on that durable nats-server: the latency floor of two fsynced round trips at this load."
)


def workload(bench: Bench) -> Workload:
    """The hot-threads workload (smaller in quick mode)."""
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
        duration_s=o.duration_s or 60.0,
    )


async def run(bench: Bench) -> Outcome:
    wl = workload(bench)
    durable_url = await bench.durable_nats_url()
    plans = [
        SidePlan("direct", "direct Postgres", "direct"),
        SidePlan("buffered", "buffered (NATS default)", "buffered"),
        SidePlan("buffered_durable", "buffered (sync_interval: always)", "buffered", durable_url),
        SidePlan(
            "buffered_durable_alone",
            "buffered, no flusher (sync_interval: always)",
            "buffered",
            durable_url,
            flusher=False,
        ),
    ]
    sides = {plan.key: await run_side(bench, plan, wl) for plan in plans}
    # The floor of the durable side: the two round trips alone, each fsynced, at this load.
    sides["raw_durable"] = await run_raw(
        bench,
        wl,
        key="raw_durable",
        label="raw publish + KV CAS (sync_interval: always)",
        durable=True,
    )
    interval = bench.buffered_config(bench.nats_url, "x").flush_interval_s
    direct = sides["direct"]
    targets = []
    durable_beside = {"floor": sides["raw_durable"], "alone": sides["buffered_durable_alone"]}
    for key, suffix, beside in (
        ("buffered", "", {}),
        ("buffered_durable", "sync_interval: always", durable_beside),
    ):
        targets += [
            judge_pg_tx(direct, sides[key], suffix),
            judge_latency("p99", "p99", direct, sides[key], suffix, **beside),
            judge_round_trips(sides[key], suffix),
            judge_flush_lag(sides[key], interval, suffix),
        ]
    return Outcome(
        sides=sides,
        targets=targets,
        parameters={"workload": wl.__dict__, "flush_interval_s": interval},
    )
