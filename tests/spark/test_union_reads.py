"""The messages of a READ_YOUR_WRITES read as a union over one pinned snapshot, against
real NATS and Postgres: the interleavings with a concurrent flush, the threads that need a
cut, the join path as the reference, and the snapshot's lifetime."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
from typing import Any

import nats
import psycopg
import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from buffered_store.spark import jdbc, overlay
from buffered_store.spark.jdbc import PinnedSnapshot
from buffered_store.spark.overlay import read_tables
from buffered_store.spark.union import Mark, plan_union
from buffered_store.stores.urls import to_libpq_url
from buffered_store.testing import make_messages, make_run
from buffered_store.threadrun.store import BufferedThreadRunStore
from tests.spark.conftest import StoreEnv, spark_view, store_view

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]


def rows(frame: DataFrame) -> list[tuple[Any, ...]]:
    """Message rows, sorted, with the message parsed (WAL and jsonb text differ)."""
    return sorted(
        (r.thread_id, r.position, r.role, json.loads(r.message), r.thread_seq)
        for r in frame.collect()
    )


def pins(monkeypatch: pytest.MonkeyPatch, before: Any) -> list[PinnedSnapshot]:
    """Run `before()` right before each snapshot is pinned; returns the pins made."""
    made: list[PinnedSnapshot] = []
    pin = jdbc.pin_snapshot

    def pinning(*args: Any) -> PinnedSnapshot:
        before()
        made.append(pin(*args))
        return made[-1]

    monkeypatch.setattr(overlay, "pin_snapshot", pinning)
    return made


async def test_an_entry_flushed_acked_and_trimmed_between_the_tail_read_and_the_pin(
    env: StoreEnv, spark: SparkSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tail is received first, the snapshot pinned after: an entry flushed (and even
    purged from the stream) in between is in the snapshot, and dropped from the tail by
    its watermark: its rows appear once, from Postgres."""
    store = env.store
    await store.checkpoint("t", make_messages(2), make_run("t", "r"))
    await store.force_flush("t")
    await store.checkpoint("t", make_messages(4), make_run("t", "r", steps=2))  # seq 2
    await store.checkpoint("u", make_messages(1), make_run("u", "ru"))
    loop = asyncio.get_running_loop()

    def flush_and_trim() -> None:
        async def go() -> None:
            await store.force_flush("t")
            nc = await nats.connect(env.config.nats_url)
            try:
                js = nc.jetstream()
                last = (await js.stream_info(env.config.stream_name)).state.last_seq
                await js.purge_stream(env.config.stream_name, seq=last)  # keeps "u" only
            finally:
                await nc.close()

        asyncio.run_coroutine_threadsafe(go(), loop).result(60)

    made = pins(monkeypatch, flush_and_trim)
    tables = await asyncio.to_thread(read_tables, spark, env.source)
    assert made
    assert made[0].marks["t"] == (2, 4)
    assert tables.tail is not None
    assert set(tables.tail.pending) == {"t", "u"}
    plan = plan_union(tables.tail.received.message_entries, {"t": Mark(2, 4), "u": Mark(0, 0)})
    assert "t" not in plan.cuts
    assert plan.rows.column("thread_id").to_pylist() == ["u"]
    got = rows(tables.messages)
    assert [(t, p, s) for t, p, _, _, s in got] == [
        ("t", 0, 1),
        ("t", 1, 1),
        ("t", 2, 2),
        ("t", 3, 2),
        ("u", 0, 1),
    ]
    assert spark_view(tables) == await store_view(store)


async def test_a_flush_after_the_pin_is_not_seen_and_never_shadowed(
    env: StoreEnv, spark: SparkSession
) -> None:
    """Flushes after the pin, even of entries newer than the tail, change nothing the
    read shows: every partition reads the pinned snapshot, the tail holds the rest."""
    store = env.store
    run = make_run("t", "r")
    await store.checkpoint("t", make_messages(3), run)
    await store.force_flush("t")
    await store.checkpoint("t", make_messages(5), run.replace(steps=1))  # pending, seq 2
    tables = read_tables(spark, env.source)
    before = rows(tables.messages)
    assert [p for _, p, _, _, _ in before] == [0, 1, 2, 3, 4]

    await store.checkpoint("t", [{"role": "system", "content": "new"}], run.replace(steps=2))
    await store.force_flush("t")  # seq 2 and 3 now in Postgres, seq 3 newer than the tail
    assert rows(tables.messages) == before
    assert [r.message_count for r in tables.threads.collect()] == [5]


async def test_a_rewriting_thread_is_cut_from_the_scan_and_folds_like_the_store(
    env: StoreEnv, spark: SparkSession
) -> None:
    store = env.store
    run = make_run("w", "rw")
    await store.checkpoint("w", make_messages(6), run)
    await store.checkpoint("a", make_messages(2), make_run("a", "ra"))
    await store.force_flush_all()
    # "w" keeps 2 messages and rewrites the rest; "a" only appends.
    rewritten = [*make_messages(2), {"role": "system", "content": "edited"}]
    await store.checkpoint("w", rewritten, run.replace(steps=1))
    await store.checkpoint("a", make_messages(3), make_run("a", "ra", steps=1))

    tables = read_tables(spark, env.source)
    assert tables.pin is not None
    assert tables.tail is not None
    marks = {t: Mark(*m) for t, m in tables.pin.marks.items()}
    plan = plan_union(tables.tail.received.message_entries, marks)
    assert plan.cuts == {"w": 2}
    assert plan.appending == 1
    got = rows(tables.messages)
    rewritten_rows = [(t, p, s) for t, p, _, _, s in got if t == "w"]
    assert rewritten_rows == [("w", 0, 1), ("w", 1, 1), ("w", 2, 2)]
    assert spark_view(tables) == await store_view(store)


async def mixed(env: StoreEnv) -> None:
    """Flushed threads with every kind of pending entry on top, and fresh threads."""
    store = env.store
    for name in ("append", "rewrite", "snap", "proven", "gone", "reborn", "quiet"):
        await store.checkpoint(name, make_messages(5), make_run(name, f"r-{name}"))
    await store.force_flush_all()
    await store.checkpoint("append", make_messages(7), make_run("append", "r-append"))
    await store.checkpoint("append", make_messages(8), make_run("append", "r-append"))
    await store.checkpoint("rewrite", make_messages(2), make_run("rewrite", "r-rewrite"))
    await store.checkpoint("rewrite", make_messages(3, start=4), make_run("rewrite", "r-rw"))
    await store.delete_thread("gone")
    await store.delete_thread("reborn")
    await store.checkpoint("reborn", make_messages(2, start=3), make_run("reborn", "r-new"))
    await store.checkpoint("fresh", make_messages(3), make_run("fresh", "r-fresh"))
    # A restarted writer (cold cursors): a history that extends the stored one is proven
    # by its digest and only appends; an edited one is a whole snapshot.
    edited = [{"role": "user", "content": "edited"}, *make_messages(5)[1:]]
    async with BufferedThreadRunStore.connect(env.inner, env.config) as restarted:
        await restarted.checkpoint("proven", make_messages(6), make_run("proven", "r-proven"))
        await restarted.checkpoint(
            "snap", [*edited, *make_messages(1, start=5)], make_run("snap", "r-snap")
        )
        await restarted.checkpoint(
            "snap", [*edited, *make_messages(2, start=5)], make_run("snap", "r-snap")
        )


async def test_the_union_equals_the_join_on_a_mixed_data_set(
    env: StoreEnv, spark: SparkSession
) -> None:
    await mixed(env)
    union = read_tables(spark, env.source)
    join = read_tables(spark, dataclasses.replace(env.source, pin_snapshot=False))
    assert union.pin is not None
    assert join.pin is None
    marks = {t: Mark(*m) for t, m in union.pin.marks.items()}
    assert union.tail is not None
    plan = plan_union(union.tail.received.message_entries, marks)
    assert set(plan.cuts) == {"rewrite", "snap", "gone", "reborn"}
    assert plan.cuts["snap"] == 0
    assert rows(union.messages) == rows(join.messages)
    assert spark_view(union) == spark_view(join) == await store_view(env.store)
    # The same rows once flushed, read with the driver reading the tail itself (a flush
    # coalesces entries: their rows then carry the newest seq of the batch).
    await env.store.force_flush_all()
    by_driver = dataclasses.replace(env.source, driver_tail_max_entries=10_000)
    flushed = rows(read_tables(spark, by_driver).messages)
    assert [r[:4] for r in flushed] == [r[:4] for r in rows(union.messages)]


async def test_a_chained_read_keeps_its_snapshot_and_close_releases_it(
    env: StoreEnv, spark: SparkSession
) -> None:
    store = env.store
    await store.checkpoint("t", make_messages(2), make_run("t", "r"))
    await store.force_flush("t")
    await store.checkpoint("t", make_messages(3), make_run("t", "r"))
    # No reference to the Tables or its DataFrame survives the chain.
    counts = read_tables(spark, env.source).messages.groupBy("thread_id").count()
    gc.collect()
    assert [(r.thread_id, r["count"]) for r in counts.collect()] == [("t", 3)]

    tables = read_tables(spark, env.source)
    assert tables.pin is not None
    messages = tables.messages
    tables.close()
    assert tables.pin.closed
    with pytest.raises(Exception, match="invalid snapshot identifier"):
        messages.count()


async def test_a_pinned_snapshot_holds_no_table_lock(env: StoreEnv, spark: SparkSession) -> None:
    """DDL (a migration) is not blocked by a pinned read."""
    await env.store.checkpoint("t", make_messages(2), make_run("t", "r"))
    with read_tables(spark, env.source) as tables:
        assert tables.pin is not None
        assert tables.pin.marks == {}
        with psycopg.connect(to_libpq_url(env.database_url), autocommit=True) as conn:
            conn.execute("SET lock_timeout = '5s'")
            conn.execute(f'ALTER TABLE "{env.schema}".threads ADD COLUMN probe int')
        assert tables.messages.agg(F.count(F.lit(1))).collect()[0][0] == 2
