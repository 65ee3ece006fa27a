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
    "decode_s": "WAL tail: decode what the messages read needs (`tail.message_entries`: "
    "JSON, checks, Arrow columns; no run records)",
    "pin_s": "pin a Postgres snapshot, read the pending threads' watermarks in it",
    "plan_s": "drop the entries it holds, condense, find the threads to cut (`plan_union`)",
    "frames_s": "the merged DataFrame: the plan again, the tail's rows to Spark, the union",
    "plain_scan_s": "plain JDBC scan + aggregation",
    "union_scan_s": "the same scan reading the pinned snapshot, the tail's rows unioned in "
    "(the merged read's action)",
}
"""Each step measured by `split_once`, as the report names it."""


def cost_split(split: list[dict[str, Any]], plain: float) -> dict[str, Any]:
    """Medians of the steps, and the floor: the plain read plus what no implementation
    on this stack avoids (the tail's bounds, receiving and parsing it). Ratios are over
    `plain`, the judged plain median, as the target's is; the union's cost is the median
    of the split's own pairs of scans."""
    if not split:
        return {}
    medians = {step: float(statistics.median(x[step] for x in split)) for step in SPLIT_STEPS}
    union = float(statistics.median(x["union_scan_s"] - x["plain_scan_s"] for x in split))
    tail = medians["bounds_s"] + medians["receive_s"] + medians["parse_json_s"]
    return {
        "repeats": len(split),
        "entries": split[0]["entries"],
        "median_s": medians,
        "union_cost_s": union,
        "floor_over_plain_s": tail,
        "tail_floor_ratio": ratio(plain + tail, plain),
    }


def floor_why(split: dict[str, Any]) -> str | None:
    if not split or split["tail_floor_ratio"] is None:
        return None
    steps = split["median_s"]
    driver = sum(steps[s] for s in ("decode_s", "pin_s", "plan_s", "frames_s"))
    return (
        f"reading the tail ({steps['bounds_s'] + steps['receive_s']:.2f} s) and parsing its "
        f"JSON ({steps['parse_json_s']:.2f} s) alone make {split['tail_floor_ratio']:.2f}x "
        f"the plain read; decoding, pinning, planning and the tail's DataFrame "
        f"{driver:.2f} s, the union's scan {split['union_cost_s']:+.2f} s over the plain "
        "one; see *Where the overlay read's time goes*"
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
        f"| the union alone (pairwise difference of the two scans) | "
        f"{split['union_cost_s']:+.3f} |",
        "",
        f"Measured overlay read: {warm['median_s']:.2f} s, of which read_tables() "
        f"{warm['median_read_tables_s']:.2f} s and the merged scan {warm['median_scan_s']:.2f} "
        f"s. Floor of any read on nats-py (the tail's bounds, receiving and parsing it, "
        f"nothing else): {_x(split['tail_floor_ratio'])} the plain read (ratio over the "
        "plain read's median above, as the target's).",
    ]
    return "\n".join(lines)


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def split_once(spark: Any, source: Any, aggregate: Callable[[Any], Any]) -> dict[str, Any]:
    """One measurement of where a warm-tail overlay read's time goes, step by step.

    The steps `read_tables(...).messages` takes on the driver: the tail's bounds (a NATS
    connection of their own), receiving the entries (another) with the garbage collector
    paused, decoding what the messages read needs, pinning the snapshot, planning the
    union, the tail's DataFrame. Two of them are floors no implementation in this stack
    goes below: the bounds and receiving the messages through nats-py without looking at
    them; a third, parsing their JSON without any check, stands for the least any
    decoding does. Then, on the Spark side, the plain scan and the merged read's action
    (the same scan reading the pinned snapshot, the tail's rows unioned in), pair by pair.
    """
    import orjson
    from pyspark.sql import DataFrame

    from buffered_store.spark.datasource import gc_paused, open_wal, run_sync, tail_bounds
    from buffered_store.spark.jdbc import pin_snapshot, read_messages
    from buffered_store.spark.overlay import WalTail
    from buffered_store.spark.tail import ReceivedTail, message_entries
    from buffered_store.spark.union import Mark, plan_union

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

    with gc_paused():  # as `read_wal_tail` receives and `ReceivedTail` decodes
        messages = run_sync(receive)
        laps.mark("receive_s")
        for message in messages:
            orjson.loads(message.data)
        laps.mark("parse_json_s")
        entries = message_entries(wal_config.stream_name, messages)
        laps.mark("decode_s")
    tail = WalTail(spark, (first, last), ReceivedTail(wal_config, decoded=entries))
    pinned = pin_snapshot(source.need_database_url("the split"), source.jdbc, tail.pending)
    try:
        laps.mark("pin_s")
        plan_union(entries, {t: Mark(w, n) for t, (w, n) in pinned.marks.items()})
        laps.mark("plan_s")
        jdbc = source.jdbc.with_snapshot(pinned.snapshot_id)
        union = tail.union_messages(jdbc, pinned.marks)  # plans again: counted in frames_s
        laps.mark("frames_s")

        def scan(frame: DataFrame) -> float:
            start = time.perf_counter()
            aggregate(frame)
            return time.perf_counter() - start

        return {
            "entries": entries.num_rows,
            **laps.seconds,
            "plain_scan_s": scan(read_messages(spark, source.jdbc)),
            "union_scan_s": scan(union),
        }
    finally:
        pinned.close()
