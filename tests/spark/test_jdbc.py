"""Partitioned JDBC reads, custom predicates, and reads sharing one Postgres snapshot."""

from __future__ import annotations

import dataclasses

import pytest
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from buffered_store.spark.jdbc import read_messages, read_threads
from buffered_store.spark.overlay import consistent_tables, read_tables
from buffered_store.testing import make_messages, make_run
from tests.spark.conftest import StoreEnv

# The first Spark test of a run also starts the session and the Python workers.
pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

BULK_SQL = """
INSERT INTO threads (thread_id, metadata, created_at, updated_at, message_count, flushed_seq)
SELECT 'bulk-' || t, '{}', now(), now(), 100, 1 FROM generate_series(1, 1000) t;
INSERT INTO messages (thread_id, position, role, message, thread_seq)
SELECT 'bulk-' || t, p, 'user', jsonb_build_object('role', 'user', 'content', p), 1
FROM generate_series(1, 1000) t, generate_series(0, 99) p;
ANALYZE threads, messages;
"""


async def test_a_100k_row_read_uses_several_partitions_with_and_without_overlay(
    env: StoreEnv, spark: SparkSession
) -> None:
    env.sql(BULK_SQL)  # 100k message rows, written straight into this test's schema
    await env.store.checkpoint("pending", make_messages(3), make_run("pending"))

    plain = read_messages(spark, env.source.jdbc)
    assert plain.rdd.getNumPartitions() == env.source.jdbc.partitions == 4
    per_partition = plain.groupBy(F.spark_partition_id()).count().collect()
    assert len(per_partition) == 4
    assert sum(r["count"] for r in per_partition) == 100_000

    merged = read_tables(spark, env.source).messages
    # The four JDBC partitions, and one for the tail's rows (a union, not a join).
    assert merged.rdd.getNumPartitions() == 5
    assert merged.count() == 100_003


async def test_custom_predicates_replace_the_hash_buckets(
    env: StoreEnv, spark: SparkSession
) -> None:
    for thread_id in ("alpha", "beta", "gamma"):
        await env.store.checkpoint(thread_id, make_messages(1), make_run(thread_id))
        await env.store.force_flush(thread_id)
    jdbc = dataclasses.replace(env.source.jdbc, predicates=("thread_id < 'b'", "thread_id >= 'b'"))
    threads = read_threads(spark, jdbc)
    assert threads.rdd.getNumPartitions() == 2
    assert sorted(r.thread_id for r in threads.collect()) == ["alpha", "beta", "gamma"]


async def test_consistent_tables_read_one_snapshot(env: StoreEnv, spark: SparkSession) -> None:
    store = env.store
    await store.checkpoint("t", make_messages(2), make_run("t", "r"))
    await store.force_flush("t")

    with consistent_tables(spark, env.source, "eventual") as tables:
        # Flushed after the snapshot was exported: invisible to every read of the block.
        await store.checkpoint("t", make_messages(5), make_run("t", "r", steps=4))
        await store.checkpoint("u", make_messages(1), make_run("u"))
        await store.force_flush_all()
        assert [(r.thread_id, r.message_count) for r in tables.threads.collect()] == [("t", 2)]
        assert tables.messages.count() == 2
        assert [r.steps for r in tables.runs.collect()] == [0]

    after = read_tables(spark, env.source, "eventual")
    assert sorted(r.message_count for r in after.threads.collect()) == [1, 5]
