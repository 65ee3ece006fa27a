"""The jobs on a standalone Spark cluster started from the installed pyspark, and the
first contact with one (`--master spark://...`): what a user sees on the console.

One master and one worker run on loopback for this module (stopped by PID at its end);
every cluster case shares one Spark application, driven from a child process, since this
test process already holds the suite's local session. If the cluster cannot start, the
tests fail (never skip).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pyspark.sql import SparkSession

from buffered_store.dev.services import DevServiceError, pick_free_port
from buffered_store.dev.spark_standalone import SparkStandalone
from buffered_store.spark.jobs import EXPORTED, JobOptions, run_job
from tests.spark.conftest import StoreEnv, spark_view, store_view
from tests.spark.test_jobs import write_workload

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]

BUFSTORE = Path(sys.executable).with_name("bufstore")

CLUSTER_JOBS = """
import json, sys, time
from buffered_store.spark.jobs import JobOptions, format_run_stats, job_session, run_job, run_stats
from buffered_store.spark.overlay import StoreSource

args = json.loads(sys.argv[1])
common = {k: args[k] for k in ("database_url", "nats_url", "schema", "master")}
stats = JobOptions(job="run-stats", partitions=4, **common)
export = JobOptions(job="export", partitions=4, output=args["export"], **common)
began = time.perf_counter()
spark = job_session(stats)  # the session `bufstore spark-job` starts
try:
    timings = {"session": time.perf_counter() - began}
    lines = []
    run_job(stats, spark=spark, echo=lines.append)
    timings["run-stats"] = time.perf_counter() - began - sum(timings.values())
    run_job(export, spark=spark, echo=lines.append)
    timings["export"] = time.perf_counter() - began - sum(timings.values())
    # The WAL tail read on the executors (the threadlog data source), not by the driver.
    source = StoreSource.from_urls(
        args["database_url"], args["nats_url"], schema=args["schema"], partitions=4,
        driver_tail_max_entries=0,
    )
    on_executors = format_run_stats(run_stats(spark, source).collect())
    timings["run-stats, tail on executors"] = time.perf_counter() - began - sum(timings.values())
    tracker = spark.sparkContext._jsc.sc().statusTracker()
    print(json.dumps({
        "output": lines,
        "on_executors": on_executors,
        "master": spark.sparkContext.master,
        "driver_host": spark.conf.get("spark.driver.host"),
        "block_managers": [f"{e.host()}:{e.port()}" for e in tracker.getExecutorInfos()],
        "timings_s": {k: round(v, 1) for k, v in timings.items()},  # for whoever reads logs
    }))
finally:
    spark.stop()
"""


@pytest.fixture(scope="module")
def standalone() -> Iterator[SparkStandalone]:
    """A master and one worker (2 cores, 1 GiB: one executor of Spark's default size)."""
    try:
        cluster = SparkStandalone(worker_cores=2, worker_memory_mb=1024)
        cluster.start()
    except DevServiceError as exc:
        raise RuntimeError(f"the standalone Spark cluster could not start: {exc}") from exc
    try:
        yield cluster
    finally:
        cluster.close()


def wal_names(env: StoreEnv) -> dict[str, str]:
    """The WAL names of `env`'s store, as a deployment sets them for the jobs."""
    return {
        "BUFSTORE_STREAM_NAME": env.config.stream_name,
        "BUFSTORE_CONSUMER_NAME": env.config.consumer_name,
        "BUFSTORE_HOT_BUCKET": env.config.hot_bucket,
        "BUFSTORE_QUARANTINE_BUCKET": env.config.quarantine_bucket,
    }


def user_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment as a fresh shell would have it: without what the
    suite's own Spark session put there (SPARK_LOCAL_IP would hide the driver's address
    choice)."""
    out = {
        k: v
        for k, v in os.environ.items()
        if k != "SPARK_LOCAL_IP" and not k.startswith("PYSPARK_GATEWAY")
    }
    out["PYSPARK_PYTHON"] = out["PYSPARK_DRIVER_PYTHON"] = sys.executable
    return {**out, **(extra or {})}


@pytest.mark.long
async def test_jobs_on_a_standalone_cluster_equal_local_mode(
    env: StoreEnv,
    spark: SparkSession,
    standalone: SparkStandalone,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await write_workload(env)
    await env.store.delete_thread("thread-2")
    args = {
        "database_url": env.database_url,
        "nats_url": env.config.nats_url,
        "schema": env.schema,
        "master": standalone.master_url,
        "export": str(tmp_path / "cluster"),
    }
    # The cluster application runs in a child process; local mode meanwhile here.
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CLUSTER_JOBS,
        json.dumps(args),
        env=user_env(wal_names(env)),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    for name, value in wal_names(env).items():
        monkeypatch.setenv(name, value)
    stats = JobOptions(
        job="run-stats",
        database_url=env.database_url,
        nats_url=env.config.nats_url,
        schema=env.schema,
        partitions=4,
    )
    local_export = str(tmp_path / "local")
    local_lines: list[str] = []

    def local_mode() -> None:
        run_job(stats, spark=spark, echo=local_lines.append)
        export = dataclasses.replace(stats, job="export", output=local_export)
        run_job(export, spark=spark, echo=local_lines.append)

    try:
        (out, err), _ = await asyncio.wait_for(
            asyncio.gather(child.communicate(), asyncio.to_thread(local_mode)), timeout=540
        )
    finally:
        if child.returncode is None:  # timed out or local mode failed: stop it by its PID
            child.kill()
            await child.wait()
    stderr = err.decode(errors="replace")
    assert child.returncode == 0, stderr[-6000:]
    cluster: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    assert cluster["output"] == [line.replace(local_export, args["export"]) for line in local_lines]
    assert cluster["output"][1].endswith("(9 runs)")  # thread-2 and its run are deleted
    assert cluster["on_executors"] == cluster["output"][1]

    exported = SimpleNamespace(**{t: spark.read.parquet(f"{args['export']}/{t}") for t in EXPORTED})
    assert spark_view(exported) == await store_view(env.store)

    # It ran on the cluster, all of it on loopback, and the console stayed readable.
    assert cluster["master"] == standalone.master_url
    assert [a["name"] for a in standalone.applications()] == ["bufstore-run-stats"]
    assert cluster["driver_host"] == "127.0.0.1"
    hosts = {address.rsplit(":", 1)[0] for address in cluster["block_managers"]}
    assert len(cluster["block_managers"]) >= 2, cluster  # the driver and an executor
    assert hosts == {"127.0.0.1"}, cluster
    print("cluster application phases (s):", cluster["timings_s"])
    assert "SPARK_LOCAL_IP" not in stderr  # Spark's "hostname resolves to..." warning
    assert "[Stage" not in stderr  # no progress bars


def test_a_wrong_master_url_fails_at_once_with_one_line() -> None:
    url = f"spark://127.0.0.1:{pick_free_port()}"  # nothing listens there
    done = subprocess.run(
        [str(BUFSTORE), "spark-job", "run-stats", "--master", url, "--database-url", "x://h/d"],
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"Error: SparkSetupError: no Spark master at {url} ")
    assert "Connection refused" in lines[0]
