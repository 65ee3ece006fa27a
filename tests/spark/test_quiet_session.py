"""`spark_session(jvm_log=...)`: a program's console output stays its own (what `make demo`
relies on). Without it the JVM prints "WARNING: Using incubator modules", log4j's
NativeCodeLoader warning and Spark's log-profile banner to the caller's stderr.

Runs in a process of its own: this test process may already hold a Spark JVM, whose
output goes wherever it went when it started.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.timeout(180)]

SCRIPT = """
import sys
from buffered_store.spark.session import spark_session

spark = spark_session(
    "quiet-test",
    master="local[1]",
    conf={"spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false"},
    jvm_log=sys.argv[1],
)
try:
    # A Python worker runs too: its stderr is the JVM's, so it goes to the log as well.
    rows = spark.sparkContext.parallelize(range(4), 2).map(lambda x: x * 2).collect()
    print("result", sum(rows))
finally:
    spark.stop()
"""


def test_the_driver_jvm_prints_into_the_log_not_to_the_console(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "spark-jvm.log"
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(log)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, done.stderr[-6000:]
    assert done.stdout.splitlines() == ["result 12"]
    assert done.stderr == ""
    # The lines are kept, not lost: they are in the log for whoever needs them.
    jvm_output = log.read_text()
    assert "Using incubator modules" in jvm_output or "log4j" in jvm_output, jvm_output
