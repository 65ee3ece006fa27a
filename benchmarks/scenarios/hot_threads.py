"""`hot-threads`: 64 threads, each checkpointing 20 times a second, with a 200-message
history growing by 2 messages per step; direct Postgres against the buffered store, the
latter twice: on a default nats-server and on one with ``sync_interval: always``, where
the write path alone (no flusher) and the raw publish + KV CAS loop run too, unjudged."""

from __future__ import annotations

import statistics
from typing import Any

from ..harness import Bench
from ..report import fmt
from ..sides import SidePlan, run_side
from ..targets import ratio
from ..workload import Workload
from . import Outcome
from .common import (
    api,
    judge_flush_lag,
    judge_latency,
    judge_pg_tx,
    judge_round_trips,
    side_get,
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
    "on that durable nats-server: the latency floor of two fsynced round trips at this load. "
    "With `--floor-rounds N` the write path alone and the raw loop run N times in turn "
    "(ABBA order), reported round by round: the fsync floor's own spread."
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
    sides["raw_durable"] = await raw_durable(bench, wl, "raw_durable")
    rounds: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
        ("alone", sides["raw_durable"], sides["buffered_durable_alone"])
    ]
    for n in range(2, (bench.options.floor_rounds or 1) + 1):
        # ABBA: the first of the pair alternates, so a drift of the disk over the run
        # falls on both alike.
        first = "raw" if n % 2 == 0 else "alone"
        alone_plan = SidePlan(
            f"buffered_durable_alone_{n}",
            f"buffered, no flusher (sync_interval: always), round {n}",
            "buffered",
            durable_url,
            flusher=False,
        )
        if first == "raw":
            raw = await raw_durable(bench, wl, f"raw_durable_{n}")
            alone = await run_side(bench, alone_plan, wl)
        else:
            alone = await run_side(bench, alone_plan, wl)
            raw = await raw_durable(bench, wl, f"raw_durable_{n}")
        rounds.append((first, raw, alone))
    floor = floor_rounds(rounds)
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
        parameters={
            "workload": wl.__dict__,
            "flush_interval_s": interval,
            "floor_rounds": len(rounds),
        },
        figures={"durable_floor_rounds": floor},
        sections={
            "The durable write path alone against the raw loop, round by round": (
                floor_rounds_table(floor)
            )
        },
    )


async def raw_durable(bench: Bench, wl: Workload, key: str) -> dict[str, Any]:
    """The raw publish + KV CAS loop paced like the sides, on the fsyncing nats-server."""
    return await run_raw(
        bench, wl, key=key, label="raw publish + KV CAS (sync_interval: always)", durable=True
    )


def _cpu_ms(side: dict[str, Any], process: str) -> float | None:
    per_1k = side_get(side, "cpu", "seconds_per_1k_checkpoints", process)
    return None if per_1k is None else float(per_1k)


def floor_rounds(rounds: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """Per round (which ran first, the raw loop's side, the write path alone's): both
    p50s and p99s, alone over raw, and the CPU per checkpoint of the writers' process and
    of the nats-server on each; then the spread of the p99s over the rounds and the
    median of alone/raw. Pure: the sides are results dicts."""
    rows = []
    for n, (first, raw, alone) in enumerate(rounds, start=1):
        raw_p99 = side_get(raw, "latency_ms", "p99")
        alone_p99 = side_get(alone, "latency_ms", "p99")
        rows.append(
            {
                "round": n,
                "first": first,
                "raw_p50_ms": side_get(raw, "latency_ms", "p50"),
                "alone_p50_ms": side_get(alone, "latency_ms", "p50"),
                "raw_p99_ms": raw_p99,
                "alone_p99_ms": alone_p99,
                "alone_over_raw_p99": ratio(alone_p99, raw_p99),
                "raw_cpu_ms": {p: _cpu_ms(raw, p) for p in ("harness", "nats_server")},
                "alone_cpu_ms": {p: _cpu_ms(alone, p) for p in ("harness", "nats_server")},
            }
        )

    def spread(key: str) -> list[float] | None:
        values = [r[key] for r in rows if r[key] is not None]
        return [min(values), max(values)] if values else None

    ratios = [r["alone_over_raw_p99"] for r in rows if r["alone_over_raw_p99"] is not None]
    return {
        "rounds": rows,
        "raw_p99_ms_range": spread("raw_p99_ms"),
        "alone_p99_ms_range": spread("alone_p99_ms"),
        "median_alone_over_raw_p99": statistics.median(ratios) if ratios else None,
    }


def floor_rounds_table(floor: dict[str, Any]) -> str:
    """The report's table of `floor_rounds` (CPU: ms per checkpoint, writers' process +
    nats-server)."""
    lines = [
        "The raw publish + KV CAS loop and the buffered write path alone (no flusher), "
        "paced alike on the `sync_interval: always` nats-server, in turn. Both make two "
        "fsynced round trips per call: their p99s move with the disk's fsync tail.",
        "",
        "| round | first | raw p50 / p99 (ms) | alone p50 / p99 (ms) | alone/raw p99 "
        "| CPU ms per call, raw: writers + server | alone: writers + server |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in floor["rounds"]:
        raw_cpu, alone_cpu = r["raw_cpu_ms"], r["alone_cpu_ms"]
        lines.append(
            f"| {r['round']} | {r['first']} "
            f"| {fmt(r['raw_p50_ms'], 'ms')} / {fmt(r['raw_p99_ms'], 'ms')} "
            f"| {fmt(r['alone_p50_ms'], 'ms')} / {fmt(r['alone_p99_ms'], 'ms')} "
            f"| {fmt(r['alone_over_raw_p99'])} "
            f"| {fmt(raw_cpu['harness'], 'ms')} + {fmt(raw_cpu['nats_server'], 'ms')} "
            f"| {fmt(alone_cpu['harness'], 'ms')} + {fmt(alone_cpu['nats_server'], 'ms')} |"
        )
    raw_range, alone_range = floor["raw_p99_ms_range"], floor["alone_p99_ms_range"]
    if raw_range and alone_range and len(floor["rounds"]) > 1:
        lines += [
            "",
            f"Over {len(floor['rounds'])} rounds the raw loop's p99 ranged "
            f"{fmt(raw_range[0], 'ms')} to {fmt(raw_range[1], 'ms')} ms, the write path "
            f"alone's {fmt(alone_range[0], 'ms')} to {fmt(alone_range[1], 'ms')} ms; "
            f"median alone/raw {fmt(floor['median_alone_over_raw_p99'])}.",
        ]
    return "\n".join(lines)
