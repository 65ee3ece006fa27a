"""The batch jobs: run statistics, and a consistent Parquet export.

Each job takes the read consistency mode. Run them with ``bufstore spark-job NAME``, with
``spark-submit buffered_store/spark/jobs.py NAME ...`` (see docs/how-to/spark.md), or call
`run_stats` / `export_tables` from your own Spark code.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from buffered_store.config import ReadConsistency
from buffered_store.spark.overlay import StoreSource, consistent_tables, read_tables

JOBS = ("run-stats", "export")
EXPORTED = ("threads", "messages", "runs")

RUN_STATS_COLUMNS = (
    "day",
    "agent_id",
    "status",
    "runs",
    "steps",
    "input_tokens",
    "output_tokens",
    "total_tokens",
    "total_duration_s",
    "avg_duration_s",
    "max_duration_s",
)
"""Columns of `run_stats`: one row per UTC day of `created_at`, agent and status."""


def elapsed_s(runs: DataFrame) -> Column:
    """Seconds a run has taken: to `finished_at`, or to its last update while unfinished."""
    end = F.coalesce(runs["finished_at"], runs["updated_at"])
    return (F.unix_micros(end) - F.unix_micros(runs["created_at"])) / F.lit(1_000_000.0)


def run_stats_of(runs: DataFrame) -> DataFrame:
    """Statistics of a runs DataFrame (any consistency mode); see `RUN_STATS_COLUMNS`."""
    # The UTC day from the epoch, independent of the session time zone.
    day = F.date_from_unix_date(F.floor(F.unix_seconds(runs["created_at"]) / 86_400).cast("int"))
    duration = elapsed_s(runs)
    return (
        runs.groupBy(day.alias("day"), "agent_id", "status")
        .agg(
            F.count(F.lit(1)).alias("runs"),
            F.sum("steps").alias("steps"),
            F.sum("input_tokens").alias("input_tokens"),
            F.sum("output_tokens").alias("output_tokens"),
            F.sum(F.col("input_tokens") + F.col("output_tokens")).alias("total_tokens"),
            F.sum(duration).alias("total_duration_s"),
            F.avg(duration).alias("avg_duration_s"),
            F.max(duration).alias("max_duration_s"),
        )
        .orderBy("day", "agent_id", "status")
    )


def run_stats(
    spark: SparkSession,
    source: StoreSource,
    mode: ReadConsistency | str = ReadConsistency.READ_YOUR_WRITES,
) -> DataFrame:
    """Runs, steps, tokens and durations per agent, status and UTC day.

    With ``READ_YOUR_WRITES`` the runs of checkpoints not yet flushed are counted.
    """
    return run_stats_of(read_tables(spark, source, mode).runs)


def format_run_stats(rows: Sequence[Any]) -> str:
    """A plain-text table of `run_stats` rows (collected), for terminals and logs."""
    header = list(RUN_STATS_COLUMNS)
    body = [[_cell(row[name]) for name in header] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in body)]) for i, h in enumerate(header)]
    numeric = {name for name in header if name not in ("day", "agent_id", "status")}

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if name in numeric else c.ljust(w)
            for c, w, name in zip(cells, widths, header, strict=True)
        ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    total = sum(int(row["runs"]) for row in rows)
    return "\n".join([line(header), rule, *(line(r) for r in body), f"({total} runs)"])


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


@dataclass(frozen=True)
class ExportResult:
    """Where `export_tables` wrote each table, and how many rows."""

    paths: dict[str, str]
    rows: dict[str, int]


def export_tables(
    spark: SparkSession,
    source: StoreSource,
    output: str,
    mode: ReadConsistency | str = ReadConsistency.READ_YOUR_WRITES,
) -> ExportResult:
    """Write threads, messages and runs as Parquet under `output` (overwritten).

    The three tables come from one Postgres snapshot (plus, in ``READ_YOUR_WRITES``,
    the WAL tail read just before it), so they agree: every message row belongs to an
    exported thread and each thread's `message_count` equals its number of rows.
    """
    paths = {name: f"{output.rstrip('/')}/{name}" for name in EXPORTED}
    with consistent_tables(spark, source, mode) as tables:
        tables.threads.orderBy("thread_id").write.mode("overwrite").parquet(paths["threads"])
        messages = tables.messages.repartition("thread_id").sortWithinPartitions(
            "thread_id", "position"
        )
        messages.write.mode("overwrite").parquet(paths["messages"])
        tables.runs.orderBy("run_id").write.mode("overwrite").parquet(paths["runs"])
    rows = {name: spark.read.parquet(path).count() for name, path in paths.items()}
    return ExportResult(paths, rows)


# -- command line (bufstore spark-job, spark-submit) ---------------------------------------


@dataclass(frozen=True, kw_only=True)
class JobOptions:
    """What a job run needs; built by ``bufstore spark-job`` and by `main`."""

    job: str
    mode: ReadConsistency = ReadConsistency.READ_YOUR_WRITES
    database_url: str
    nats_url: str | None = None
    schema: str = "public"
    jdbc_url: str | None = None
    partitions: int = 8
    output: str | None = None
    master: str | None = None

    def source(self) -> StoreSource:
        """The store the job reads."""
        return StoreSource.from_urls(
            self.database_url,
            self.nats_url,
            schema=self.schema,
            jdbc_url=self.jdbc_url,
            partitions=self.partitions,
        )


def run_job(
    options: JobOptions,
    *,
    spark: SparkSession | None = None,
    echo: Callable[[str], None] = print,
) -> None:
    """Run one job and print its results (run-stats) or output paths (export).

    Without `spark`, the active session is used, else one is started (and stopped after).
    """
    if options.job not in JOBS:
        raise ValueError(f"unknown job {options.job!r}; choose from {', '.join(JOBS)}")
    if spark is not None:
        _run(spark, options, echo)
        return
    started = SparkSession.getActiveSession() is None
    session = job_session(options)
    try:
        _run(session, options, echo)
    finally:
        if started:
            session.stop()


JOB_CONF = {"spark.ui.showConsoleProgress": "false"}
"""Settings of the session a job starts: the stage progress bars Spark draws on stderr
would bury the job's own output and error lines."""


def job_session(options: JobOptions) -> SparkSession:
    """The session `run_job` starts when none is active (or the active one)."""
    from buffered_store.spark.session import spark_session

    session: SparkSession = spark_session(
        f"bufstore-{options.job}", master=options.master, conf=JOB_CONF
    )
    return session


def _run(spark: SparkSession, options: JobOptions, echo: Callable[[str], None]) -> None:
    source = options.source()
    if options.job == "run-stats":
        stats = run_stats(spark, source, options.mode)
        if options.output:
            stats.write.mode("overwrite").parquet(options.output)
            stats = spark.read.parquet(options.output).orderBy("day", "agent_id", "status")
        echo(f"run statistics ({options.mode.value}):")
        echo(format_run_stats(stats.collect()))
        if options.output:
            echo(f"written to {options.output}")
        return
    if not options.output:
        raise ValueError("the export job needs an output path (--output)")
    result = export_tables(spark, source, options.output, options.mode)
    echo(f"export ({options.mode.value}):")
    for name in EXPORTED:
        echo(f"  {name:<9} {result.rows[name]:>10} rows  {result.paths[name]}")


def parse_args(argv: Sequence[str] | None = None) -> JobOptions:
    """Options of ``spark-submit buffered_store/spark/jobs.py NAME ...``."""
    parser = argparse.ArgumentParser(
        prog="jobs.py", description="Spark batch jobs over the buffered store's tables."
    )
    parser.add_argument("job", choices=JOBS)
    parser.add_argument(
        "--mode",
        choices=[m.value for m in ReadConsistency],
        default=ReadConsistency.READ_YOUR_WRITES.value,
    )
    parser.add_argument(
        "--database-url",
        default=os.environ.get("BUFSTORE_DATABASE_URL") or os.environ.get("DATABASE_URL"),
    )
    parser.add_argument(
        "--nats-url", default=os.environ.get("BUFSTORE_NATS_URL") or os.environ.get("NATS_URL")
    )
    parser.add_argument("--schema", default=os.environ.get("BUFSTORE_SCHEMA", "public"))
    parser.add_argument("--jdbc-url", help="JDBC URL if it differs from --database-url")
    parser.add_argument("--partitions", type=int, default=8, help="JDBC partitions per table")
    parser.add_argument("--output", help="output path (required by export)")
    parser.add_argument("--master", help="Spark master (default: local[*], or spark-submit's)")
    args = parser.parse_args(argv)
    if not args.database_url:
        parser.error("--database-url (or $DATABASE_URL) is required")
    if args.job == "export" and not args.output:
        parser.error("export needs --output")
    return JobOptions(
        job=args.job,
        mode=ReadConsistency(args.mode),
        database_url=args.database_url,
        nats_url=args.nats_url,
        schema=args.schema,
        jdbc_url=args.jdbc_url,
        partitions=args.partitions,
        output=args.output,
        master=args.master,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``spark-submit .../jobs.py`` and ``python -m buffered_store.spark.jobs``."""
    run_job(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
