"""Spark batch jobs over the flushed tables, read through the store's overlays.

The optional ``spark`` extra (``pip install 'buffered-thread-store[spark]'``); the only
part of the project that imports pyspark. See docs/how-to/spark.md.

```python
from buffered_store.spark import StoreSource, read_tables, run_stats, spark_session

spark = spark_session()
source = StoreSource.from_urls("postgresql://db/app", "nats://nats:4222")
tables = read_tables(spark, source, "read_your_writes")   # every acknowledged checkpoint
run_stats(spark, source).show()
```
"""

from __future__ import annotations

from buffered_store.spark.datasource import ENTRY_SCHEMA, SOURCE_NAME, ThreadLogDataSource
from buffered_store.spark.jdbc import (
    MESSAGE_COLUMNS,
    RUN_COLUMNS,
    THREAD_COLUMNS,
    JdbcSource,
    read_messages,
    read_runs,
    read_threads,
    shared_snapshot,
)
from buffered_store.spark.jobs import (
    ExportResult,
    JobOptions,
    export_tables,
    format_run_stats,
    run_job,
    run_stats,
)
from buffered_store.spark.overlay import (
    StoreSource,
    Tables,
    WalTail,
    consistent_tables,
    flush_all,
    read_tables,
    read_wal_tail,
)
from buffered_store.spark.session import (
    SparkSetupError,
    find_java,
    find_jdbc_driver,
    register_datasource,
    spark_session,
)

__all__ = [
    "ENTRY_SCHEMA",
    "MESSAGE_COLUMNS",
    "RUN_COLUMNS",
    "SOURCE_NAME",
    "THREAD_COLUMNS",
    "ExportResult",
    "JdbcSource",
    "JobOptions",
    "SparkSetupError",
    "StoreSource",
    "Tables",
    "ThreadLogDataSource",
    "WalTail",
    "consistent_tables",
    "export_tables",
    "find_java",
    "find_jdbc_driver",
    "flush_all",
    "format_run_stats",
    "read_messages",
    "read_runs",
    "read_tables",
    "read_threads",
    "read_wal_tail",
    "register_datasource",
    "run_job",
    "run_stats",
    "shared_snapshot",
    "spark_session",
]
