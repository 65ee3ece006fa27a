"""`soak`: sustained writes with a flusher for several minutes; does the WAL stay bounded?

One side only, the buffered store with its flusher process (trimming on). Every second
the stream's messages and bytes are sampled from the server, with the consumer's backlog
and the flusher's counters. Judged: the stream's bytes stay flat once the first
retention window is over (the stream holds the unflushed backlog plus about
`retain_flushed_s` of writes, never everything written), and trimming costs under 2% of
the flusher's CPU.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from buffered_store import BufferedThreadRunStore
from buffered_store.stores.postgres import PostgresThreadRunStore
from buffered_store.testing import make_run

from ..harness import Bench
from ..measure import LatencyLog, Timeline, cdf_points, rate_series, summarize
from ..processes import FlusherProcess, WalMonitor
from ..report import fmt
from ..targets import target
from . import Outcome

DESCRIPTION = (
    "Sustained append-only checkpoints (default 32 threads x 10/s, 240 s; --threads, --rate, "
    "--duration-s) with a flusher process whose trimming runs every 5 s and keeps flushed "
    "entries 30 s (retain_flushed_s; quick mode 2 s, every 0.5 s). The stream's messages and "
    "bytes are sampled every second. Judged: stream bytes flat after the first window "
    "(growth over the rest of the run under 10% of its median, and no sample above 1.5x "
    "it), and trimming under 2% of the flusher's CPU."
)

SAMPLE_S = 1.0


def settings(bench: Bench) -> dict[str, Any]:
    """The run's parameters (quick mode: seconds, not minutes)."""
    o = bench.options
    quick = o.quick
    return {
        "threads": o.threads or (8 if quick else 32),
        "rate_per_thread": o.rate or 10.0,
        "duration_s": o.duration_s or (15.0 if quick else 240.0),
        "retain_flushed_s": 2.0 if quick else 30.0,
        "trim_interval_s": 0.5 if quick else 5.0,
        "message_bytes": 300,
    }


async def writer(
    store: BufferedThreadRunStore,
    thread_id: str,
    rate: float,
    until: float,
    log: LatencyLog,
    zero: float,
    size: int,
) -> None:
    """Append one message at `rate` per second until `until` (perf_counter)."""
    run = make_run(thread_id)
    step = 0
    next_at = time.perf_counter()
    while True:
        now = time.perf_counter()
        if now >= until:
            return
        if next_at > now:
            await asyncio.sleep(next_at - now)
        next_at += 1.0 / rate
        started = time.perf_counter()
        message = {"role": "assistant", "content": f"{step}:" + "x" * size}
        try:
            await store.append(thread_id, [message], run)
        except Exception as exc:
            log.fail(started - zero, exc)
            continue
        log.ok(started - zero, (time.perf_counter() - started) * 1000.0, cold=step == 0)
        step += 1


async def run(bench: Bench) -> Outcome:
    s = settings(bench)
    db = await bench.new_database("buffered")
    config = bench.buffered_config(
        bench.nats_url, "soak", retain_flushed_s=s["retain_flushed_s"], flush_interval_s=0.25
    )
    flusher = await FlusherProcess.start(
        database_url=db.url,
        schema=db.schema,
        config=config,
        log_path=bench.output / "flusher.log",
        interval_s=SAMPLE_S / 2,
        extra_env={"BUFSTORE_TRIM_INTERVAL_S": str(s["trim_interval_s"])},
    )
    monitor = await WalMonitor.connect(config)
    inner = await PostgresThreadRunStore.connect(db.url, schema=db.schema)
    store = await BufferedThreadRunStore.connect(inner, config)
    log = LatencyLog()
    timeline = Timeline()
    threads = [f"soak-{uuid.uuid4().hex[:8]}-{i}" for i in range(s["threads"])]
    task = bench.task("soak", s["duration_s"])
    zero = time.perf_counter()
    until = zero + s["duration_s"]
    try:
        writers = [
            asyncio.create_task(
                writer(store, t, s["rate_per_thread"], until, log, zero, s["message_bytes"])
            )
            for t in threads
        ]
        while time.perf_counter() < until:
            await asyncio.sleep(SAMPLE_S)
            elapsed = time.perf_counter() - zero
            await sample(monitor, flusher, store, timeline, elapsed, log)
            bench.progress.update(
                task, completed=elapsed, info=f"stream {fmt(timeline.series['bytes'][-1], 'int')} B"
            )
        await asyncio.gather(*writers)
        drained_s = await monitor.wait_drained(60)
        await sample(monitor, flusher, store, timeline, time.perf_counter() - zero, log)
    finally:
        await store.close()
        await inner.close()
        final = await flusher.stop()
        await monitor.delete_objects()
        await monitor.close()
    return outcome(s, timeline, log, final, flusher.cpu_s, drained_s, store.stats())


async def sample(
    monitor: WalMonitor,
    flusher: FlusherProcess,
    store: BufferedThreadRunStore,
    timeline: Timeline,
    elapsed: float,
    log: LatencyLog,
) -> None:
    """One sample of the stream, the consumer and the flusher."""
    cfg = monitor.config
    try:
        info = await monitor.js.stream_info(cfg.stream_name)
        messages, size = int(info.state.messages), int(info.state.bytes)
    except Exception:
        messages, size = None, None
    stats = flusher.latest
    timeline.add(
        elapsed,
        messages=messages,
        bytes=size,
        backlog=await monitor.backlog(),
        checkpoints=log.count,
        wal_bytes_written=store.stats().get("wal_bytes"),
        flusher_cpu_s=flusher.cpu_s,
        trim_cpu_s=stats.get("trim_cpu_s"),
        trims=stats.get("trims"),
    )


def flatness(t_s: list[float], values: list[float | None], from_s: float) -> dict[str, Any]:
    """Growth (least-squares slope x span) and peak of `values` after `from_s`, against
    their median."""
    points = [(t, v) for t, v in zip(t_s, values, strict=False) if t >= from_s and v is not None]
    if len(points) < 5:
        return {"samples": len(points)}
    xs = [p[0] for p in points]
    ys = [float(p[1]) for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    median = sorted(ys)[len(ys) // 2]
    growth = slope * (xs[-1] - xs[0])
    return {
        "samples": len(points),
        "from_s": from_s,
        "median": median,
        "max": max(ys),
        "slope_per_s": slope,
        "growth": growth,
        "growth_ratio": growth / median if median else math.inf,
        "peak_ratio": max(ys) / median if median else math.inf,
    }


def outcome(
    s: dict[str, Any],
    timeline: Timeline,
    log: LatencyLog,
    final: dict[str, Any],
    flusher_cpu_s: float | None,
    drained_s: float | None,
    store_stats: dict[str, float],
) -> Outcome:
    t_s = timeline.t_s
    # The first window: the retention window plus three trim intervals and two seconds
    # for the first trims to land; the stream grows until then by design.
    first_window_s = s["retain_flushed_s"] + 3 * s["trim_interval_s"] + 2.0
    in_run = [t for t in t_s if t <= s["duration_s"]]
    flat = flatness(in_run, timeline.series["bytes"][: len(in_run)], first_window_s)
    flat_msgs = flatness(in_run, timeline.series["messages"][: len(in_run)], first_window_s)
    growth_ratio = flat.get("growth_ratio")
    peak_ratio = flat.get("peak_ratio")
    flat_met = (
        None
        if growth_ratio is None or peak_ratio is None
        else bool(abs(growth_ratio) <= 0.10 and peak_ratio <= 1.5)
    )
    trim_cpu = float(final.get("trim_cpu_s") or 0.0)
    cpu = flusher_cpu_s or 0.0
    trim_share = trim_cpu / cpu if cpu else None
    written = store_stats.get("wal_bytes", 0)
    checkpoints = log.count
    side = {
        "label": "buffered (soak)",
        "checkpoints": checkpoints,
        "latency_ms": summarize(log.durations_ms),
        "latency_cdf_ms": cdf_points(log.durations_ms),
        "failures": log.failure_kinds(),
        "timeline": {
            **timeline.as_dict(),
            "checkpoints_per_s": rate_series(t_s, timeline.series["checkpoints"]),
        },
        "flusher": {
            k: final.get(k)
            for k in (
                "trims",
                "trim_runs",
                "trim_cpu_s",
                "trimmed_messages",
                "entries_applied",
                "cpu_s",
            )
        },
        "flusher_process_cpu_s": flusher_cpu_s,
        "drained_after_run_s": drained_s,
        "unavailable": {},
    }
    targets = [
        target(
            "soak_flat",
            f"after the first {first_window_s:.0f} s: stream bytes median "
            f"{fmt(flat.get('median'), 'int')}, growth {fmt(growth_ratio, 'ratio')} of it over "
            f"the rest of the run, peak {fmt(peak_ratio, 'ratio')}x it; messages median "
            f"{fmt(flat_msgs.get('median'), 'int')}; {fmt(written, 'int')} bytes of entries "
            "written in all",
            met=flat_met,
        ),
        target(
            "soak_trim_cpu",
            f"trimming {trim_cpu * 1000:.1f} ms CPU of the flusher process's "
            f"{cpu:.2f} s ({fmt(100 * trim_share if trim_share is not None else None, 'ratio')}%), "
            f"{final.get('trims')} purges in {final.get('trim_runs')} runs",
            met=None if trim_share is None else trim_share < 0.02,
        ),
    ]
    section = "\n".join(
        [
            "| t (s) | stream messages | stream bytes | backlog | checkpoints |",
            "|---:|---:|---:|---:|---:|",
            *(
                f"| {t:.0f} | {fmt(m, 'int')} | {fmt(b, 'int')} | {fmt(q, 'int')} "
                f"| {fmt(c, 'int')} |"
                for i, (t, m, b, q, c) in enumerate(
                    zip(
                        t_s,
                        timeline.series["messages"],
                        timeline.series["bytes"],
                        timeline.series["backlog"],
                        timeline.series["checkpoints"],
                        strict=False,
                    )
                )
                if i % max(1, len(t_s) // 20) == 0 or i == len(t_s) - 1
            ),
        ]
    )

    def plot(out: Path) -> str | None:
        return plot_wal_size(timeline, out / "wal_size.png", first_window_s)

    return Outcome(
        sides={"buffered": side},
        targets=targets,
        parameters=s,
        sections={"Stream size over time": section},
        methods={
            "stream size": "`stream_info` of the WAL stream every second, on a connection of "
            "its own (the server's own count of messages and bytes)",
            "flat": "least-squares slope of the bytes samples after the first window, times "
            "its span, against their median; and the largest sample against the median",
            "trimming CPU": "the flusher's `trim_cpu_s`: process CPU during each trim run, "
            "other tasks running during its awaits included (an upper bound), against the "
            "flusher process's CPU over the whole run",
        },
        extra_plots=[plot],
        figures={"flat_bytes": flat, "flat_messages": flat_msgs, "trim_cpu_share": trim_share},
    )


def plot_wal_size(timeline: Timeline, path: Path, first_window_s: float) -> str | None:
    """Stream messages (top) and bytes (bottom) over time, with the first window marked."""
    if not timeline.t_s:
        return None
    fig, (top, low) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    nan = [math.nan if v is None else float(v) for v in timeline.series["messages"]]
    top.plot(timeline.t_s, nan, label="stream messages")
    backlog = [math.nan if v is None else float(v) for v in timeline.series["backlog"]]
    top.plot(timeline.t_s, backlog, label="unflushed backlog", linestyle="--")
    size = [math.nan if v is None else float(v) / 1e6 for v in timeline.series["bytes"]]
    low.plot(timeline.t_s, size, label="stream bytes (MB)", color="C2")
    written = [
        math.nan if v is None else float(v) / 1e6 for v in timeline.series["wal_bytes_written"]
    ]
    low.plot(timeline.t_s, written, label="entry bytes written in all (MB)", color="C3")
    for ax in (top, low):
        ax.axvline(first_window_s, color="grey", linestyle=":", linewidth=1)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    top.set_ylabel("messages")
    low.set_ylabel("MB")
    low.set_xlabel("time since the writes started (s)")
    fig.suptitle("soak: WAL stream size over time (dotted: end of the first window)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name
