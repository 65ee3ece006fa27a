"""The `langgraph` scenario's report: its side-by-side rows, the ratios it reports (issue
11 sets no target, so none is judged), the correctness check and the methods."""

from __future__ import annotations

from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

from ..harness import SideDb
from ..measure import PG_WAL_METHOD, PG_XACT_METHOD
from ..report import Row, at, fmt
from ..targets import ratio, target
from .common import side_get

ROWS: list[Row] = [
    ("graph runs (ok)", at("runs"), "int"),
    ("failed runs", at("failed"), "int"),
    ("graph steps (ok)", at("steps"), "int"),
    ("checkpoints in Postgres after the run", at("checkpoints"), "int"),
    ("steps/s (closed loop)", at("throughput_per_s"), "rate"),
    ("step latency p50 ms", at("latency_ms", "p50"), "ms"),
    ("step latency p95 ms", at("latency_ms", "p95"), "ms"),
    ("step latency p99 ms", at("latency_ms", "p99"), "ms"),
    ("step latency max ms", at("latency_ms", "max"), "ms"),
    ("inner step latency p50 ms (not a run's first or last)", at("latency_inner_ms", "p50"), "ms"),
    ("inner step latency p99 ms", at("latency_inner_ms", "p99"), "ms"),
    ("run latency p50 ms", at("run_latency_ms", "p50"), "ms"),
    ("run latency p99 ms", at("run_latency_ms", "p99"), "ms"),
    ("PG transactions / step", at("pg", "transactions_per_step"), "ratio"),
    ("PG transactions / checkpoint", at("pg", "transactions_per_checkpoint"), "ratio"),
    ("PG tuple writes / step", at("pg", "tuple_writes_per_step"), "ratio"),
    ("PG WAL bytes / step", at("pg", "pg_wal_bytes_per_step"), "bytes"),
    ("NATS WAL bytes / step", at("nats", "wal_bytes_per_step"), "bytes"),
    ("WAL entries / step (put + put_writes)", at("nats", "entries_per_step"), "ratio"),
    ("drain after writes s", at("flush", "drain_s"), "s"),
    ("threads force_flush_all still flushed", at("flush", "force_flush_all_threads"), "int"),
    ("flusher entries / transaction", at("flush", "entries_per_transaction"), "ratio"),
    ("flusher CPU µs / flushed entry", at("flush", "cpu_us_per_entry"), "ratio"),
    ("CPU s total", at("cpu", "seconds", "total"), "s"),
    ("CPU s / 1k steps (all processes)", at("cpu", "seconds_per_1k_checkpoints", "total"), "s"),
    ("  this process (graphs)", at("cpu", "seconds_per_1k_checkpoints", "harness"), "s"),
    ("  flusher process", at("cpu", "seconds_per_1k_checkpoints", "flusher"), "s"),
    ("  nats-server", at("cpu", "seconds_per_1k_checkpoints", "nats_server"), "s"),
    ("  postgres", at("cpu", "seconds_per_1k_checkpoints", "postgres"), "s"),
    (
        "CPU s of other processes on the machine meanwhile",
        at("cpu", "seconds", "other_processes"),
        "s",
    ),
]


def thread_id(index: int) -> str:
    """The thread id of the `index`-th thread, the same on both sides (each side has a
    database of its own)."""
    return f"lg-{index:04d}"


async def correctness(dbs: dict[str, SideDb], threads: int, expected: int) -> dict[str, Any]:
    """Checkpoints and final messages per thread on each side, read by AsyncPostgresSaver
    from each side's tables (the buffered side's after `force_flush_all`)."""
    found: dict[str, dict[str, tuple[int, int]]] = {}
    for key, db in dbs.items():
        async with AsyncPostgresSaver.from_conn_string(db.libpq_url) as saver:
            per_thread: dict[str, tuple[int, int]] = {}
            for index in range(threads):
                config: RunnableConfig = {"configurable": {"thread_id": thread_id(index)}}
                count = len([t async for t in saver.alist(config)])
                latest = await saver.aget_tuple(config)
                messages = (
                    len(latest.checkpoint["channel_values"].get("messages", []))
                    if latest is not None
                    else 0
                )
                per_thread[thread_id(index)] = (count, messages)
            found[key] = per_thread
    direct, buffered = found["direct"], found["buffered"]
    differ = sorted(t for t in direct if direct[t] != buffered.get(t))
    short = sorted(t for t in direct if direct[t][0] != expected)
    counts = {key: sorted({c for c, _ in v.values()}) for key, v in found.items()}
    ok = not differ and not short
    summary = (
        f"checkpoints per thread: AsyncPostgresSaver {counts['direct']}, buffered "
        f"{counts['buffered']} (expected {expected} for each of {threads} threads); "
        f"threads whose checkpoints or final messages differ between the sides: {len(differ)}"
    )
    return {
        "ok": ok,
        "summary": summary,
        "expected_checkpoints_per_thread": expected,
        "checkpoints": {key: sum(c for c, _ in v.values()) for key, v in found.items()},
        "threads_differing": differ,
        "threads_not_as_expected": short,
        "per_thread": {key: {t: list(v) for t, v in found[key].items()} for key in found},
        "method": "after the runs (buffered: flusher drained, then force_flush_all), "
        "AsyncPostgresSaver reads each side's database: alist() of every thread counts its "
        "checkpoints, aget_tuple() gives its latest state's messages",
    }


def targets_and_sections(
    sides: dict[str, dict[str, Any]], check: dict[str, Any]
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The ratios as unjudged target rows, and the report's own sections."""
    d, b = sides["direct"], sides["buffered"]
    d_tx = side_get(d, "pg", "transactions_per_step")
    b_tx = side_get(b, "pg", "transactions_per_step")
    d_p99, b_p99 = side_get(d, "latency_ms", "p99"), side_get(b, "latency_ms", "p99")
    d_rate, b_rate = d.get("throughput_per_s"), b.get("throughput_per_s")
    targets = [
        target(
            "lg_pg_tx",
            f"AsyncPostgresSaver {fmt(d_tx)} vs buffered {fmt(b_tx)} per step",
            ratio=ratio(d_tx, b_tx),
            met=None,
        ),
        target(
            "lg_p99",
            f"p99: AsyncPostgresSaver {fmt(d_p99, 'ms')} ms vs buffered {fmt(b_p99, 'ms')} ms",
            ratio=ratio(d_p99, b_p99),
            met=None,
        ),
        target(
            "lg_rate",
            f"buffered {fmt(b_rate, 'rate')}/s vs AsyncPostgresSaver {fmt(d_rate, 'rate')}/s",
            ratio=ratio(b_rate, d_rate),
            met=None,
        ),
    ]
    verdict = "as expected" if check["ok"] else "**NOT as expected**"
    sections = {
        "Correctness after force_flush_all": f"{check['summary']}: {verdict}.",
    }
    return targets, sections


def methods() -> dict[str, str]:
    """How this scenario's figures are measured."""
    return {
        "step latency": "each run is `graph.astream(..., stream_mode='updates', "
        "durability='sync')`; a step lasts from the previous step's update (the call, for "
        "a run's first step) to its own update, and the last step to the run's return, so "
        "the steps add up to the run. With durability='sync' LangGraph writes a step's "
        "checkpoint before the next step starts: every step includes one checkpoint write "
        "(put) and its node's writes (put_writes); a run's first also the thread's read and "
        "the input's checkpoint, its last also the final checkpoint. 'inner' leaves those "
        "two out",
        "steps/s": "graph steps of all threads / seconds from the first run's start to the "
        "last run's return (closed loop: each thread starts its next run when one returns)",
        "PG transactions / step": PG_XACT_METHOD + "; divided by the graph steps. The "
        "buffered side's figure includes the flusher's transactions and force_flush_all",
        "PG WAL bytes / step": PG_WAL_METHOD + ", divided by the graph steps",
        "NATS WAL bytes / step": "BufferedCheckpointSaver.stats()['wal_bytes'] after the "
        "run, divided by the graph steps",
        "flusher": "a separate process (python -m buffered_store.benchmarks.flusher_worker "
        "--front-end langgraph: a Flusher on LangGraphSink with LG_FORMAT, as `bufstore "
        "flusher --front-end langgraph` runs it), flush_interval_s 0.5; the writes end when "
        "its consumer's backlog is 0, then force_flush_all runs",
    }
