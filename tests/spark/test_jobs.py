"""The batch jobs: run statistics and the Parquet export, also through the CLI."""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner
from pyspark.sql import SparkSession

from buffered_store.cli import main as cli
from buffered_store.config import ReadConsistency
from buffered_store.spark.jobs import (
    RUN_STATS_COLUMNS,
    export_tables,
    format_run_stats,
    parse_args,
    run_stats,
)
from buffered_store.testing import make_messages, make_run
from buffered_store.threadrun.records import RunRecord, RunStatus
from tests.spark.conftest import StoreEnv, spark_view, store_view

# The first Spark test of a run also starts the session and the Python workers.
pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

DAY = datetime(2026, 3, 1, 9, 30, tzinfo=UTC)


async def write_workload(env: StoreEnv) -> None:
    """Runs of three agents over two days; some flushed, the rest only in the WAL."""
    store = env.store
    for i in range(9):
        thread_id = f"thread-{i}"
        created = DAY + timedelta(days=i % 2, minutes=i)
        run = make_run(
            thread_id,
            f"run-{i}",
            agent_id=("planner", "coder", "critic")[i % 3],
            created_at=created,
            updated_at=created + timedelta(seconds=5),
            steps=1,
            input_tokens=100 + i,
            output_tokens=10 * i,
        )
        await store.checkpoint(thread_id, make_messages(2), run)
        if i % 3 == 0:
            await store.force_flush(thread_id)
        done = run.replace(
            status=RunStatus.DONE if i % 2 else RunStatus.FAILED,
            steps=3,
            output_tokens=20 * i,
            updated_at=created + timedelta(seconds=30 + i),
            finished_at=created + timedelta(seconds=30 + i),
        )
        await store.checkpoint(thread_id, make_messages(4), done)
        if i == 4:
            await store.force_flush(thread_id)
    # A second run on one thread, still running, only in the WAL.
    extra = make_run("thread-1", "run-extra", agent_id="planner", created_at=DAY, updated_at=DAY)
    await store.checkpoint("thread-1", make_messages(5), extra.replace(steps=2, input_tokens=7))


def reference_stats(runs: list[RunRecord]) -> list[tuple[Any, ...]]:
    """The job's figures computed in Python from the store's own API."""
    groups: dict[tuple[Any, ...], list[RunRecord]] = defaultdict(list)
    for run in runs:
        groups[(run.created_at.astimezone(UTC).date(), run.agent_id, run.status.value)].append(run)
    out = []
    for key in sorted(groups):
        items = groups[key]
        durations = [
            ((r.finished_at or r.updated_at) - r.created_at).total_seconds() for r in items
        ]
        out.append(
            (
                *key,
                len(items),
                sum(r.steps for r in items),
                sum(r.input_tokens for r in items),
                sum(r.output_tokens for r in items),
                sum(r.input_tokens + r.output_tokens for r in items),
                round(sum(durations), 6),
                round(sum(durations) / len(durations), 6),
                round(max(durations), 6),
            )
        )
    return out


def figures(rows: list[Any]) -> list[tuple[Any, ...]]:
    return [
        tuple(
            round(v, 6) if isinstance(v, float) else v for v in (row[c] for c in RUN_STATS_COLUMNS)
        )
        for row in rows
    ]


async def test_run_stats_equal_the_store_api_and_count_unflushed_runs(
    env: StoreEnv, spark: SparkSession
) -> None:
    await write_workload(env)
    expected = reference_stats(await env.store.list_runs(limit=1000))

    rows = run_stats(spark, env.source, ReadConsistency.READ_YOUR_WRITES).collect()
    assert figures(rows) == expected
    assert sum(r["runs"] for r in rows) == 10

    eventual = run_stats(spark, env.source, "eventual").collect()
    assert sum(r["runs"] for r in eventual) == 4  # only the flushed threads 0, 3, 4, 6
    assert figures(eventual) != expected

    text = format_run_stats(rows)
    assert text.splitlines()[0].split() == list(RUN_STATS_COLUMNS)
    assert "planner" in text
    assert text.endswith("(10 runs)")


async def test_export_round_trips_to_the_store_view(
    env: StoreEnv, spark: SparkSession, tmp_path: Path
) -> None:
    await write_workload(env)
    await env.store.delete_thread("thread-2")
    expected = await store_view(env.store)

    result = export_tables(spark, env.source, str(tmp_path / "export"))
    read_back = SimpleNamespace(
        **{name: spark.read.parquet(path) for name, path in result.paths.items()}
    )
    assert spark_view(read_back) == expected
    assert result.rows == {"threads": 8, "messages": 33, "runs": 9}
    counts = {r.thread_id: r.message_count for r in read_back.threads.collect()}
    assert counts == {t: len(m) for t, m in expected.messages.items()}


async def test_cli_runs_the_jobs(env: StoreEnv, spark: SparkSession, tmp_path: Path) -> None:
    await write_workload(env)
    common = [
        "--database-url",
        env.database_url,
        "--nats-url",
        env.config.nats_url,
        "--schema",
        env.schema,
    ]
    # The WAL names of this test's store, as a deployment would set them.
    names = {
        "BUFSTORE_STREAM_NAME": env.config.stream_name,
        "BUFSTORE_CONSUMER_NAME": env.config.consumer_name,
        "BUFSTORE_HOT_BUCKET": env.config.hot_bucket,
        "BUFSTORE_QUARANTINE_BUCKET": env.config.quarantine_bucket,
    }
    runner = CliRunner()
    stats = runner.invoke(cli, ["spark-job", "run-stats", *common], env=names)
    assert stats.exit_code == 0, stats.output
    assert "(10 runs)" in stats.output

    out = tmp_path / "cli-export"
    export = runner.invoke(
        cli, ["spark-job", "export", "--mode", "strong", "--output", str(out), *common], env=names
    )
    assert export.exit_code == 0, export.output
    assert str(out / "messages") in export.output
    assert (await env.store.flush_status("thread-1")).pending == 0
    assert spark.read.parquet(str(out / "runs")).count() == 10


def test_job_arguments_for_spark_submit() -> None:
    options = parse_args(
        ["export", "--mode", "eventual", "--database-url", "postgresql://h/db", "--output", "x"]
    )
    assert (options.job, options.mode, options.output) == ("export", ReadConsistency.EVENTUAL, "x")
    assert options.source().jdbc.url == "jdbc:postgresql://h:5432/db"
    with pytest.raises(SystemExit):
        parse_args(["export", "--database-url", "postgresql://h/db"])
    assert format_run_stats([]).endswith("(0 runs)")
