"""`large-thread`: threads whose history grows past 1 MiB (the NATS max_payload): WAL
bytes, Postgres rows and latency per checkpoint must not grow with the history."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from buffered_store.config import BufferedStoreConfig
from buffered_store.stores.postgres import PostgresThreadRunStore
from buffered_store.threadrun.store import BufferedThreadRunStore

from ..harness import Bench
from ..measure import LatencyLog, Timeline, summarize
from ..report import fmt
from ..sides import OpenSide, SidePlan, run_side
from ..targets import ratio, target
from ..workload import ThreadState, Workload
from . import Outcome
from .common import api, side_get

DESCRIPTION = (
    "4 threads each start from a 256 KiB history (256 messages of 1 KiB) and checkpoint 20 "
    "times a second, appending 2 messages of 1 KiB per step, until each history passes "
    "1.25 MiB (larger than the NATS max_payload of 1 MiB). Per-checkpoint WAL bytes, "
    "Postgres tuple writes and latency are compared between the second and the last "
    "quarter of the checkpoints (the first quarter holds each thread's cold first "
    "checkpoint, a full snapshot). Afterwards a second store instance (cold: it never "
    "saw the thread) checkpoints one more step on a thread larger than 1 MiB."
)

MIB = 1024 * 1024
WINDOWS = {"early": "2nd quarter of the checkpoints", "late": "last quarter"}


def workload(bench: Bench) -> Workload:
    """Growing threads (quick mode: one thread, 8 KiB messages, closed loop)."""
    o = bench.options
    if o.quick:
        return Workload(
            api=api(bench),
            threads=1,
            rate_per_thread=None,
            duration_s=o.duration_s or 20.0,
            seed_messages=8,
            message_bytes=8192,
            stop_when_history_bytes=int(1.1 * MIB),
        )
    return Workload(
        api=api(bench),
        threads=o.threads or 4,
        rate_per_thread=20.0,
        duration_s=o.duration_s or 90.0,
        seed_messages=256,
        message_bytes=1024,
        stop_when_history_bytes=int(1.25 * MIB),
    )


def history_probe(states: list[ThreadState]) -> dict[str, float | None]:
    """Mean history size of the threads (bytes)."""
    return {"history_bytes": sum(s.history_bytes for s in states) / max(1, len(states))}


def growth_analysis(
    log: LatencyLog, timeline: Timeline, events: list[dict[str, Any]]
) -> dict[str, Any]:
    """Per-checkpoint figures early (2nd quarter of the checkpoints) and late (last)."""
    series = timeline.series
    t, n = timeline.t_s, series.get("checkpoints", [])
    total = log.count
    if total < 8:
        return {"error": "too few checkpoints"}
    # The first quarter holds each thread's cold first checkpoint (a full snapshot): the
    # early window is the second quarter, all of whose checkpoints are appends.
    q2_begin = _time_at(t, n, total / 4)
    q2_end = _time_at(t, n, total / 2)
    q4_begin = _time_at(t, n, 3 * total / 4)
    out: dict[str, Any] = {}
    for name, lo, hi in (("early", q2_begin, q2_end), ("late", q4_begin, 1e9)):
        window: dict[str, Any] = {
            "latency_ms": summarize(log.between(lo, hi)),
            "history_bytes": _value_at(
                t, series.get("history_bytes", []), (lo + min(hi, t[-1])) / 2
            ),
        }
        for counter in ("wal_bytes", "nats_requests", "pg_statements"):
            window[f"{counter}_per_checkpoint"] = _per(t, series.get(counter, []), n, lo, hi)
        out[name] = window
    for counter in ("wal_bytes", "pg_statements"):
        key = f"{counter}_per_checkpoint"
        out[f"{counter}_growth"] = ratio(out["late"][key], out["early"][key])
    out["latency_p50_growth"] = ratio(
        out["late"]["latency_ms"]["p50"], out["early"]["latency_ms"]["p50"]
    )
    points = []
    for i in range(1, len(t)):
        dn = (n[i] or 0) - (n[i - 1] or 0)
        wal = series.get("wal_bytes", [])
        if dn > 0 and wal and wal[i] is not None and wal[i - 1] is not None:
            points.append((series["history_bytes"][i], (wal[i] - wal[i - 1]) / dn))  # type: ignore[operator]
    out["wal_bytes_vs_history"] = points
    return out


def _time_at(t: list[float], counts: list[float | None], target_count: float) -> float:
    for ti, c in zip(t, counts, strict=False):
        if c is not None and c >= target_count:
            return ti
    return t[-1]


def _value_at(t: list[float], values: list[float | None], at: float) -> float | None:
    best = None
    for ti, v in zip(t, values, strict=False):
        if ti <= at and v is not None:
            best = v
    return best


def _per(
    t: list[float], numer: list[float | None], denom: list[float | None], lo: float, hi: float
) -> float | None:
    idx = [i for i, ti in enumerate(t) if lo <= ti <= hi]
    if len(idx) < 2 or not numer:
        return None
    a, b = idx[0], idx[-1]
    if None in (numer[a], numer[b], denom[a], denom[b]):
        return None
    dn = denom[b] - denom[a]  # type: ignore[operator]
    return (numer[b] - numer[a]) / dn if dn else None  # type: ignore[operator]


async def cold_writer(
    side: OpenSide, states: list[ThreadState], config: BufferedStoreConfig | None
) -> dict[str, Any]:
    """One more checkpoint on the largest thread from a store instance that never saw it."""
    state = max(states, key=lambda s: s.history_bytes)
    fresh: Any
    if config is None:
        # A new direct store instance has an empty snapshot cache, as a new process would.
        fresh = await PostgresThreadRunStore.connect(side.url, schema=side.schema)
    else:
        fresh = await BufferedThreadRunStore.connect(side.inner, config)
    try:
        state.advance(_cold_workload(state), time.time())
        began = time.perf_counter()
        try:
            await fresh.checkpoint(state.thread_id, state.history, state.run)
            error = None
        except Exception as exc:  # reported, not raised: it is the figure
            error = f"{type(exc).__name__}: {exc}"
        took = (time.perf_counter() - began) * 1000
        stats = dict(fresh.stats()) if hasattr(fresh, "stats") else {}
    finally:
        await fresh.close()
    return {
        "thread_history_bytes": state.history_bytes,
        "ok": error is None,
        "error": error,
        "latency_ms": took,
        "nats_requests": stats.get("nats_requests"),
        "wal_bytes": stats.get("wal_bytes"),
    }


def _cold_workload(state: ThreadState) -> Workload:
    size = state.history_bytes // max(1, len(state.history))
    return Workload(threads=1, messages_per_step=2, message_bytes=size)


async def run(bench: Bench) -> Outcome:
    wl = workload(bench)
    sides = {}
    for plan in (
        SidePlan("direct", "direct Postgres", "direct"),
        SidePlan("buffered", "buffered", "buffered"),
    ):
        sides[plan.key] = await run_side(
            bench, plan, wl, probe_extra=history_probe, analyse=growth_analysis, after=cold_writer
        )
    b, d = sides["buffered"], sides["direct"]
    growth = side_get(b, "analysis", "wal_bytes_growth")
    first = side_get(b, "analysis", "early", "wal_bytes_per_checkpoint")
    last = side_get(b, "analysis", "late", "wal_bytes_per_checkpoint")
    h1 = side_get(b, "analysis", "early", "history_bytes")
    h4 = side_get(b, "analysis", "late", "history_bytes")
    rows_b = side_get(b, "pg", "tuple_writes_per_checkpoint")
    rows_d = side_get(d, "pg", "tuple_writes_per_checkpoint")
    per_step = wl.messages_per_step
    cold_ok = all(side_get(s, "after", "ok") for s in sides.values())
    met = None
    if growth is not None and rows_b is not None:
        # O(new): per-checkpoint WAL bytes flat while the history grows, and Postgres rows
        # per checkpoint bounded by the appended messages plus the thread and run rows.
        met = growth <= 1.25 and rows_b <= per_step + 2 and cold_ok
    measured = (
        f"WAL bytes/checkpoint {fmt(first, 'bytes')} at {fmt((h1 or 0) / 1024, 'int')} KiB "
        f"history, {fmt(last, 'bytes')} at {fmt((h4 or 0) / 1024, 'int')} KiB (x{fmt(growth)}); "
        f"PG tuple writes/checkpoint buffered {fmt(rows_b)}, direct {fmt(rows_d)} "
        f"({per_step} new messages per step); cold writer on a >1 MiB thread: "
        + ", ".join(
            f"{s['label']} {'ok' if side_get(s, 'after', 'ok') else 'FAILED'} "
            f"in {fmt(side_get(s, 'after', 'latency_ms'), 'ms')} ms"
            for s in sides.values()
        )
    )
    lines = [
        "| side | window | history KiB | WAL bytes/ckpt | PG statements/ckpt | p50 ms | p99 ms |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for side in sides.values():
        for name in ("early", "late"):
            w = side_get(side, "analysis", name) or {}
            lines.append(
                f"| {side['label']} | {WINDOWS[name]} | "
                f"{fmt((w.get('history_bytes') or 0) / 1024, 'int')} | "
                f"{fmt(w.get('wal_bytes_per_checkpoint'), 'bytes')} | "
                f"{fmt(w.get('pg_statements_per_checkpoint'))} | "
                f"{fmt(side_get(w, 'latency_ms', 'p50'), 'ms')} | "
                f"{fmt(side_get(w, 'latency_ms', 'p99'), 'ms')} |"
            )
    return Outcome(
        sides=sides,
        targets=[target("o_new", measured, met=met, ratio=growth)],
        parameters={"workload": wl.__dict__},
        sections={"Per checkpoint, early against late": "\n".join(lines)},
        extra_plots=[lambda out: plot_growth(sides, out)],
    )


def plot_growth(sides: dict[str, dict[str, Any]], out: Path) -> str | None:
    """WAL bytes per checkpoint against the history size (buffered side)."""
    points = side_get(sides["buffered"], "analysis", "wal_bytes_vs_history") or []
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot([p[0] / 1024 for p in points], [p[1] for p in points], ".", label="buffered")
    ax.axvline(1024, color="grey", linestyle=":", label="1 MiB (NATS max_payload)")
    ax.set_xlabel("mean thread history (KiB)")
    ax.set_ylabel("WAL bytes per checkpoint")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.suptitle("large-thread: WAL bytes per checkpoint against history size")
    fig.tight_layout()
    fig.savefig(out / "wal_bytes_vs_history.png", dpi=110)
    plt.close(fig)
    return "wal_bytes_vs_history.png"
