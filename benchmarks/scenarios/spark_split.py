"""Where a `spark-overlay` overlay read's time goes: each step of a warm read timed on
its own, and the floor no implementation on this stack goes below."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import psutil

from ..measure import Laps
from ..targets import ratio

CPU_PARTS = {
    "spark_s": "this process with its children: the Spark driver, its JVM, the Python workers",
    "postgres_s": "the Postgres server started by the run, its backends included",
    "nats_s": "the nats-server started by the run",
}
"""Where a read's CPU seconds are counted (`cpu_meter`)."""


def _tree_cpu(pid: int, reaped: bool) -> float:
    """CPU seconds of a process and its live descendants; with `reaped`, also of its
    children that exited and were waited for (Postgres's finished backends)."""
    try:
        proc = psutil.Process(pid)
        times = proc.cpu_times()
        total = float(times.user + times.system)
        if reaped:
            total += times.children_user + times.children_system
        for child in proc.children(recursive=True):
            try:
                child_times = child.cpu_times()
                total += child_times.user + child_times.system
            except psutil.Error:
                continue
        return total
    except psutil.Error:
        return float("nan")


def cpu_meter(pids: Mapping[str, int | None]) -> Callable[[], dict[str, float | None]]:
    """A function giving the CPU seconds used so far by each of `CPU_PARTS` (None when the
    run did not start that server): differences of two calls are a read's CPU. About
    right only: a backend that exited but was not yet waited for is missed."""

    def sample() -> dict[str, float | None]:
        nats, postgres = pids.get("nats_server"), pids.get("postgres")
        return {
            "spark_s": _tree_cpu(os.getpid(), False),
            "postgres_s": None if postgres is None else _tree_cpu(postgres, True),
            "nats_s": None if nats is None else _tree_cpu(nats, False),
        }

    return sample


def cpu_used(
    before: Mapping[str, float | None], after: Mapping[str, float | None]
) -> dict[str, float | None]:
    """The CPU seconds between two `cpu_meter` samples, per part."""
    out: dict[str, float | None] = {}
    for part in CPU_PARTS:
        a, b = before.get(part), after.get(part)
        out[part] = None if a is None or b is None else b - a
    return out


def cpu_medians(reads: list[dict[str, Any]]) -> dict[str, float | None]:
    """Median CPU seconds per part over `reads` (each with a ``cpu`` from `cpu_used`), and
    their sum (``total_s``, None unless every part was measured)."""
    out: dict[str, float | None] = {}
    for part in CPU_PARTS:
        values = [r["cpu"][part] for r in reads if r.get("cpu", {}).get(part) is not None]
        out[part] = float(statistics.median(values)) if values else None
    parts = [out[p] for p in CPU_PARTS]
    out["total_s"] = None if any(v is None for v in parts) else sum(v for v in parts if v)
    return out


SPLIT_STEPS = {
    "bounds_s": "WAL tail: its bounds from the flusher consumer, a connection of their own (floor)",
    "receive_s": "WAL tail: connect, receive the entries through nats-py, close; nothing "
    "else (floor)",
    "parse_json_s": "WAL tail: parse their JSON, no checks (floor)",
    "decode_s": "WAL tail: decode the entries as the flusher does (JSON, checks, records)",
    "arrow_s": "WAL tail: Arrow columns",
    "condense_s": "WAL tail: condense into the overlay",
    "frames_s": "the overlay DataFrame a messages read builds",
    "plain_scan_s": "plain JDBC scan + aggregation",
    "joined_scan_s": "the same scan broadcast-joined to a one-row table (it also fetches "
    "thread_id, the join key, as the overlay must)",
}
"""Each step measured by `_split_once`, as the report names it."""


def cost_split(split: list[dict[str, Any]], plain: float) -> dict[str, Any]:
    """Medians of the steps, and the floor: the plain read plus what no implementation
    on this stack avoids (the tail's bounds, receiving and parsing it) plus a join over
    every row (what a merge on the Spark side costs before any expression). Ratios are
    over `plain`, the judged plain median, as the target's is; the join cost is the
    median of the split's own pairs of scans."""
    if not split:
        return {}
    medians = {step: float(statistics.median(x[step] for x in split)) for step in SPLIT_STEPS}
    join = float(statistics.median(x["joined_scan_s"] - x["plain_scan_s"] for x in split))
    tail = medians["bounds_s"] + medians["receive_s"] + medians["parse_json_s"]
    floor = tail + max(0.0, join)
    return {
        "repeats": len(split),
        "entries": split[0]["entries"],
        "median_s": medians,
        "join_cost_s": join,
        "floor_over_plain_s": floor,
        "floor_ratio": ratio(plain + floor, plain),
        "tail_floor_ratio": ratio(plain + tail, plain),
    }


def floor_why(split: dict[str, Any]) -> str | None:
    if not split or split["floor_ratio"] is None:
        return None
    steps = split["median_s"]
    return (
        f"reading the tail ({steps['bounds_s'] + steps['receive_s']:.2f} s), parsing its JSON "
        f"({steps['parse_json_s']:.2f} s) and a join over every scanned row "
        f"({split['join_cost_s']:+.2f} s) alone make {split['floor_ratio']:.2f}x the plain "
        "read; see *Where the overlay read's time goes*"
    )


def split_section(split: dict[str, Any], warm: dict[str, Any]) -> str:
    if not split:
        return "Not measured."
    lines = [
        f"Each step timed on its own, {split['repeats']} times after the reads above, on the "
        f"warm-writer data set ({split['entries']:,} pending entries); medians.",
        "",
        "| step | median s |",
        "|---|---:|",
        *(f"| {label} | {split['median_s'][step]:.3f} |" for step, label in SPLIT_STEPS.items()),
        f"| the join alone (pairwise difference of the two scans) | {split['join_cost_s']:+.3f} |",
        "",
        f"Measured overlay read: {warm['median_s']:.2f} s, of which read_tables() "
        f"{warm['median_read_tables_s']:.2f} s and the merged scan {warm['median_scan_s']:.2f} "
        f"s. Floor of any read on nats-py (the tail's bounds, receiving and parsing it, "
        f"nothing else): {_x(split['tail_floor_ratio'])} the plain read; with a join over "
        f"every row, the least a merge on the Spark side does: {_x(split['floor_ratio'])} "
        "(ratios over the plain read's median above, as the target's).",
    ]
    return "\n".join(lines)


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def split_once(spark: Any, source: Any, aggregate: Callable[[Any], Any]) -> dict[str, Any]:
    """One measurement of where a warm-tail overlay read's time goes, step by step.

    The steps `read_tables(...).messages` takes on the driver: the tail's bounds (a NATS
    connection of their own), receiving the entries (another), decoding them and
    building Arrow columns with the garbage collector paused, condensing, the overlay
    DataFrame a messages read builds. Two of them are floors no implementation in this
    stack goes below: the bounds and receiving the messages through nats-py without
    looking at them; a third, parsing their JSON without any check, stands for the least
    any decoding does. Then, on the Spark side, the plain scan and the same scan
    broadcast-joined to a one-row table: the cost of joining every row to anything at
    all, before any merge expression, including fetching each row's thread_id (the join
    key), which the plain scan's column pruning leaves out and the overlay cannot.
    """
    import orjson
    import pyarrow as pa
    from pyspark.sql import functions as F

    from buffered_store.spark.condense import condense_table
    from buffered_store.spark.datasource import (
        decode_messages,
        entry_batch,
        gc_paused,
        open_wal,
        run_sync,
        tail_bounds,
    )
    from buffered_store.spark.jdbc import read_messages
    from buffered_store.spark.overlay import WalTail

    wal_config = source.need_wal()
    laps = Laps()
    first, last = tail_bounds(wal_config)
    laps.mark("bounds_s")

    async def receive() -> list[Any]:
        wal = await open_wal(wal_config)
        try:
            return list(await wal.read_range(first, last))
        finally:
            await wal.close()

    with gc_paused():  # as `read_table` reads, decodes and builds the columns
        messages = run_sync(receive)
        laps.mark("receive_s")
        for message in messages:
            orjson.loads(message.data)
        laps.mark("parse_json_s")
        items = decode_messages(wal_config, messages)
        laps.mark("decode_s")
        batch = entry_batch(items)
        laps.mark("arrow_s")
    condensed = condense_table(pa.Table.from_batches([batch]))
    laps.mark("condense_s")
    assert WalTail(spark, (first, last), batch.num_rows, condensed).overlay is not None
    laps.mark("frames_s")

    one = spark.createDataFrame([("-", 1)], "thread_id string, one int")

    def scan(join: bool) -> float:
        frame = read_messages(spark, source.jdbc)
        if join:
            joined = frame.join(F.broadcast(one), "thread_id", "left")
            frame = joined.where(F.coalesce(F.col("one") > 0, F.lit(True))).drop("one")
        start = time.perf_counter()
        aggregate(frame)
        return time.perf_counter() - start

    return {
        "entries": len(items),
        **laps.seconds,
        "plain_scan_s": scan(False),
        "joined_scan_s": scan(True),
    }
