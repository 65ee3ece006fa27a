"""`spark-overlay`: a Spark job reading 1M flushed message rows plus 10k pending WAL
entries through the read-your-writes overlay, against a plain JDBC read of the table."""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from buffered_store.buffered import BufferedThreadRunStore
from buffered_store.postgres import PostgresThreadRunStore

from ..harness import Bench
from ..measure import cdf_points, summarize
from ..processes import FlusherProcess, WalMonitor
from ..targets import ratio, target
from ..workload import ThreadState, Workload, make_threads, seed
from . import Outcome
from .common import api_ignored

DESCRIPTION = (
    "2,000 threads of 500 messages (1M message rows, ~120-byte messages) are written "
    "through the buffered store and flushed by a flusher process; then, with no flusher "
    "running, 10,000 more checkpoints (5 per thread, 2 new messages each) stay pending in "
    "the WAL. A local Spark session (local[2]) then reads the messages table: plainly over "
    "JDBC (EVENTUAL), and through the overlay (READ_YOUR_WRITES: WAL tail read and merged). "
    "Both reads use the same JDBC partitioning and end in the same aggregation over every "
    "column; after one unmeasured warm-up of each, they alternate."
)


def sizes(bench: Bench) -> dict[str, int]:
    """Threads, messages per thread, pending checkpoints per thread, repetitions."""
    if bench.options.quick:
        return {"threads": 100, "messages": 40, "pending_per_thread": 2, "repeats": 1}
    threads = bench.options.threads or 2000
    return {"threads": threads, "messages": 500, "pending_per_thread": 5, "repeats": 3}


async def run(bench: Bench) -> Outcome:
    api_ignored(bench, "spark-overlay times reads; its checkpoints only set them up")
    n = sizes(bench)
    wl = Workload(threads=n["threads"], seed_messages=n["messages"], message_bytes=120)
    db = await bench.new_database("spark")
    config = bench.buffered_config(bench.nats_url, "spark")
    states = make_threads("sp", wl)
    await _write(bench, db.url, db.schema, config, states, n["pending_per_thread"], wl)
    flushed_rows = n["threads"] * n["messages"]
    pending_entries = n["threads"] * n["pending_per_thread"]
    expected_overlay_rows = flushed_rows + pending_entries * wl.messages_per_step
    timings = await asyncio.to_thread(_spark_reads, bench, db.url, db.schema, config, n["repeats"])

    sides: dict[str, dict[str, Any]] = {}
    for key, label in (("plain", "plain JDBC read"), ("overlay", "overlay read (RYW)")):
        durations = [t["seconds"] * 1000 for t in timings[key]]
        sides[key] = {
            "key": key,
            "label": label,
            "kind": key,
            "checkpoints": len(durations),
            "latency_ms": summarize(durations),
            "latency_cdf_ms": cdf_points(durations),
            "runs": timings[key],
            "warmup": timings[f"{key}_warmup"],
            "unavailable": {"pg/nats/flush": "a read: no checkpoints are written"},
        }
    plain = statistics.median(t["seconds"] for t in timings["plain"])
    overlay = statistics.median(t["seconds"] for t in timings["overlay"])
    r = ratio(overlay, plain)
    rows_ok = all(t["rows"] == expected_overlay_rows for t in timings["overlay"]) and all(
        t["rows"] == flushed_rows for t in timings["plain"]
    )
    lines = [
        "| read | run | seconds | of which read_tables() (WAL tail for RYW) | of which the "
        "JDBC scan + aggregation | rows |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for key in ("plain", "overlay"):
        for i, t in enumerate(timings[key], 1):
            lines.append(
                f"| {sides[key]['label']} | {i} | {t['seconds']:.2f} | "
                f"{t['prepare_seconds']:.2f} | {t['action_seconds']:.2f} | {t['rows']:,} |"
            )
    lines.append("")
    lines.append(
        f"Rows expected: plain {flushed_rows:,} (flushed), overlay {expected_overlay_rows:,} "
        f"(flushed + {pending_entries:,} pending entries x {wl.messages_per_step} new messages)"
        f": {'as expected' if rows_ok else 'MISMATCH'}. The overlay time includes reading "
        "the WAL tail on the executors."
    )
    return Outcome(
        sides=sides,
        targets=[
            target(
                "spark",
                f"median overlay {overlay:.2f} s vs plain {plain:.2f} s "
                f"({flushed_rows:,} rows + {pending_entries:,} pending entries)",
                ratio=r,
                met=None if r is None else (r <= 1.3 and rows_ok),
            )
        ],
        parameters={**n, "message_bytes": wl.message_bytes, "rows_as_expected": rows_ok},
        sections={"Reads": "\n".join(lines)},
        extra_plots=[lambda out: plot_reads(timings, out)],
    )


async def _write(
    bench: Bench,
    url: str,
    schema: str,
    config: Any,
    states: list[ThreadState],
    pending_per_thread: int,
    wl: Workload,
) -> None:
    task = bench.task("spark-overlay: write + flush rows", total=2)
    inner = await PostgresThreadRunStore.connect(url, schema=schema)
    monitor = await WalMonitor.connect(config)
    try:
        flusher = await FlusherProcess.start(
            database_url=url,
            schema=schema,
            config=config,
            log_path=bench.output / "logs" / "flusher-spark.log",
        )
        try:
            async with BufferedThreadRunStore.connect(inner, config) as store:
                await seed(store, states, parallel=32)
                drained = await monitor.wait_drained(600)
                if drained is None:
                    raise RuntimeError("the flusher did not drain the seed rows in 600 s")
        finally:
            await flusher.stop()
        bench.progress.update(task, completed=1, info="flushed; writing pending entries")
        async with BufferedThreadRunStore.connect(inner, config) as store:
            gate = asyncio.Semaphore(64)

            async def more(state: ThreadState) -> None:
                async with gate:
                    for _ in range(pending_per_thread):
                        state.advance(wl, time.time())
                        await store.checkpoint(state.thread_id, state.history, state.run)

            await asyncio.gather(*(more(s) for s in states))
        backlog = await monitor.backlog()
        bench.progress.update(task, completed=2, info=f"{backlog:,} pending entries")
    finally:
        await monitor.close()
        await inner.close()


def _spark_reads(
    bench: Bench, url: str, schema: str, config: Any, repeats: int
) -> dict[str, list[dict[str, Any]]]:
    from pyspark.sql import functions as F

    from buffered_store.spark.overlay import StoreSource, read_tables
    from buffered_store.spark.session import spark_session

    began = time.perf_counter()
    spark = spark_session(
        "bufstore-bench",
        master="local[2]",
        conf={
            "spark.ui.enabled": "false",
            "spark.sql.shuffle.partitions": "4",
            "spark.default.parallelism": "2",
            "spark.ui.showConsoleProgress": "false",
        },
    )
    bench.say(f"spark session ready in {time.perf_counter() - began:.1f} s")
    source = StoreSource.from_urls(url, schema=schema, wal=config, partitions=4)

    def once(mode: str) -> dict[str, Any]:
        start = time.perf_counter()
        messages = read_tables(spark, source, mode).messages
        prepared = time.perf_counter()  # the WAL tail is read here (RYW); JDBC runs below
        row = messages.agg(
            F.count(F.lit(1)).alias("rows"),
            F.sum(F.length("message")).alias("chars"),
            F.sum("position").alias("positions"),
            F.max("thread_seq").alias("max_seq"),
        ).collect()[0]
        done = time.perf_counter()
        return {
            "seconds": done - start,
            "prepare_seconds": prepared - start,
            "action_seconds": done - prepared,
            "rows": int(row["rows"]),
            "chars": row["chars"],
        }

    out: dict[str, list[dict[str, Any]]] = {"plain": [], "overlay": []}
    try:
        out["plain_warmup"] = [once("eventual")]
        out["overlay_warmup"] = [once("read_your_writes")]
        for i in range(repeats):
            out["plain"].append(once("eventual"))
            out["overlay"].append(once("read_your_writes"))
            bench.say(
                f"  spark run {i + 1}/{repeats}: plain {out['plain'][-1]['seconds']:.2f} s, "
                f"overlay {out['overlay'][-1]['seconds']:.2f} s"
            )
    finally:
        spark.stop()
    return out


def plot_reads(timings: dict[str, list[dict[str, Any]]], out: Path) -> str | None:
    """Seconds of every measured read, plain against overlay."""
    if not timings.get("plain"):
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    runs = range(1, len(timings["plain"]) + 1)
    width = 0.38
    ax.bar(
        [r - width / 2 for r in runs],
        [t["seconds"] for t in timings["plain"]],
        width,
        label="plain JDBC",
    )
    ax.bar(
        [r + width / 2 for r in runs],
        [t["seconds"] for t in timings["overlay"]],
        width,
        label="overlay (RYW)",
    )
    ax.set_xlabel("run")
    ax.set_ylabel("seconds")
    ax.set_xticks(list(runs))
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("spark-overlay: read time per run")
    fig.tight_layout()
    fig.savefig(out / "spark_reads.png", dpi=110)
    plt.close(fig)
    return "spark_reads.png"
