"""The three consistency modes of the Spark reads, against real NATS and Postgres."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import random
from typing import Any

import nats
import pytest
from pyspark.sql import SparkSession

from buffered_store.config import ReadConsistency
from buffered_store.errors import RunOwnershipError
from buffered_store.spark import datasource, overlay
from buffered_store.spark import tail as tail_module
from buffered_store.spark.jdbc import read_messages, read_runs, read_threads
from buffered_store.spark.overlay import read_tables, read_wal_tail
from buffered_store.testing import make_messages, make_run
from buffered_store.threadrun.records import RunRecord, RunStatus
from buffered_store.threadrun.store import BufferedThreadRunStore
from tests.spark.conftest import StoreEnv, spark_view, store_view
from tests.spark.test_jdbc import BULK_SQL

# The first Spark test of a run also starts the session and the Python workers.
pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]


async def test_read_your_writes_shows_unflushed_checkpoints_and_eventual_does_not(
    env: StoreEnv, spark: SparkSession
) -> None:
    store = env.store
    planner = make_run("flushed", "run-1", agent_id="planner", metadata={"k": [1, 2]})
    await store.checkpoint("flushed", make_messages(3), planner, metadata={"team": "a"})
    await store.force_flush("flushed")
    # Pending on top of a flushed thread: an append and a new version of its run...
    await store.checkpoint(
        "flushed",
        make_messages(5),
        planner.replace(status=RunStatus.DONE, steps=2, output={"answer": 42}),
    )
    # ...and a thread that never reached Postgres, with two runs.
    await store.checkpoint("fresh", make_messages(1), make_run("fresh", "run-2", steps=1))
    await store.checkpoint("fresh", make_messages(2), make_run("fresh", "run-3", error="boom"))

    ryw = read_tables(spark, env.source, ReadConsistency.READ_YOUR_WRITES)
    assert ryw.tail is not None
    assert set(ryw.tail.pending) == {"flushed", "fresh"}
    assert spark_view(ryw) == await store_view(store)
    seqs = {r.thread_id: r.thread_seq for r in ryw.threads.collect()}
    assert seqs == {"flushed": 2, "fresh": 2}

    eventual = spark_view(read_tables(spark, env.source, ReadConsistency.EVENTUAL))
    assert set(eventual.threads) == {"flushed"}
    assert len(eventual.messages["flushed"]) == 3
    assert eventual.runs["run-1"][2] == "running"
    assert "run-2" not in eventual.runs

    strong = read_tables(spark, env.source, "strong")
    assert spark_view(strong) == await store_view(store)
    assert (await store.flush_status("fresh")).pending == 0


async def test_a_flush_between_the_wal_read_and_the_jdbc_read_never_goes_backwards(
    env: StoreEnv, spark: SparkSession
) -> None:
    store = env.store
    run = make_run("t", "run-1", agent_id="coder")
    await store.checkpoint("t", make_messages(2), run)
    await store.checkpoint("t", make_messages(3), run.replace(steps=1))

    tail = read_wal_tail(spark, env.config, driver_max_entries=0)  # the overlay first...
    assert tail.pending == ("t",)

    # ...then a newer checkpoint is acknowledged and flushed before the JDBC read.
    newer = [{"role": "system", "content": "rewritten"}, *make_messages(1, start=7)]
    await store.checkpoint("t", newer, run.replace(steps=9, status=RunStatus.WAITING))
    await store.force_flush("t")

    [thread] = tail.threads(env.source.jdbc).collect()
    assert (thread.thread_seq, thread.message_count) == (3, 2)
    messages = sorted(tail.messages(env.source.jdbc).collect(), key=lambda r: r.position)
    assert [(m.position, m.role, m.thread_seq) for m in messages] == [
        (0, "system", 3),
        (1, "assistant", 3),
    ]
    [run_row] = tail.runs(env.source.jdbc).collect()
    assert (run_row.steps, run_row.status, run_row.thread_seq) == (9, "waiting", 3)


async def test_deleted_threads_never_appear(env: StoreEnv, spark: SparkSession) -> None:
    store = env.store
    # Flushed, then deleted in the WAL only.
    await store.checkpoint("gone-later", make_messages(2), make_run("gone-later", "r-gl"))
    await store.force_flush("gone-later")
    # Entries published, then deleted, none of it flushed.
    await store.checkpoint("never-flushed", make_messages(2), make_run("never-flushed", "r-nf"))
    await store.checkpoint("never-flushed", make_messages(3), make_run("never-flushed", "r-nf2"))
    # Deleted and flushed while older entries are still in the tail.
    await store.checkpoint("tombstone", make_messages(1), make_run("tombstone", "r-ts"))
    # Deleted, then recreated with a new run: only the new life shows.
    await store.checkpoint("reborn", make_messages(4), make_run("reborn", "r-old"))
    await store.force_flush("reborn")
    # A survivor next to them.
    await store.checkpoint("kept", make_messages(1), make_run("kept", "r-kept"))
    for thread_id in ("gone-later", "never-flushed", "tombstone", "reborn"):
        await store.delete_thread(thread_id)
    await store.force_flush("tombstone")
    await store.checkpoint("reborn", make_messages(1, start=9), make_run("reborn", "r-new"))

    tables = read_tables(spark, env.source)
    view = spark_view(tables)
    assert set(view.threads) == {"kept", "reborn"}
    assert set(view.messages) == {"kept", "reborn"}
    assert view.messages["reborn"] == make_messages(1, start=9)
    assert set(view.runs) == {"r-kept", "r-new"}
    assert view == await store_view(store)

    # The same after everything is flushed (tombstones in Postgres).
    await store.force_flush_all()
    assert spark_view(read_tables(spark, env.source)) == view


async def test_message_rewrites_and_truncations_fold_like_the_store(
    env: StoreEnv, spark: SparkSession
) -> None:
    store = env.store
    run = make_run("t", "r")
    await store.checkpoint("t", make_messages(6), run)
    await store.force_flush("t")
    history = [
        make_messages(8),  # append
        make_messages(4),  # truncate below the flushed count
        [*make_messages(2), {"role": "tool", "content": {"nested": [1, "x"]}}],  # rewrite
        [*make_messages(2), {"role": "tool", "content": {"nested": [1, "x"]}}, *make_messages(2)],
    ]
    for messages in history:
        await store.checkpoint("t", messages, run)
    # A second thread entirely in the WAL, and a flushed one untouched by the tail.
    await store.checkpoint("u", make_messages(3), make_run("u"))
    await store.checkpoint("v", make_messages(2), make_run("v"))
    await store.force_flush("v")

    view = spark_view(read_tables(spark, env.source))
    assert view.messages["t"] == history[-1]
    assert view == await store_view(store)


async def test_plain_readers_type_the_columns(env: StoreEnv, spark: SparkSession) -> None:
    run = make_run("t", "r", output="plain text", metadata={"a": {"b": None}}, input_tokens=7)
    await env.store.checkpoint("t", make_messages(1), run, metadata={"x": 1})
    await env.store.force_flush("t")
    jdbc = env.source.jdbc
    assert dict(read_threads(spark, jdbc).dtypes)["created_at"] == "timestamp"
    assert dict(read_messages(spark, jdbc).dtypes)["position"] == "int"
    [row] = read_runs(spark, jdbc).collect()
    assert (row.output, row.metadata, row.input_tokens) == ('"plain text"', '{"a": {"b": null}}', 7)


async def test_random_histories_match_the_store_and_then_the_flushed_tables(
    env: StoreEnv, spark: SparkSession
) -> None:
    """Appends, rewrites, truncations, deletes and flushes in random order, on thread ids
    that would break naive SQL or subject handling."""
    store, rng = env.store, random.Random(20261122)
    thread_ids = ["plain", "it's", "dots.and*stars>", "ünï cødé 🚀", "x'); DROP TABLE threads;--"]
    snapshots: dict[str, list[dict[str, object]]] = {}
    runs: dict[str, RunRecord] = {}
    for step in range(60):
        thread_id = rng.choice(thread_ids)
        roll = rng.random()
        if roll < 0.08 and thread_id in snapshots:
            await store.delete_thread(thread_id)
            snapshots.pop(thread_id)
            runs.pop(thread_id, None)
            continue
        if roll < 0.25:
            await store.force_flush(thread_id)
            continue
        current = snapshots.get(thread_id, [])
        keep = len(current) if rng.random() < 0.6 else rng.randint(0, len(current))
        fresh: list[dict[str, object]] = [
            {"role": rng.choice(["user", "assistant", "tool"]), "content": f"{step}.{i}"}
            for i in range(rng.randint(0 if keep else 1, 3))
        ]
        snapshots[thread_id] = [*current[:keep], *fresh]
        run = runs.get(thread_id)
        if run is None or rng.random() < 0.3:
            run = make_run(thread_id, f"run-{step}", agent_id=rng.choice(["a", "b"]))
        runs[thread_id] = run.replace(steps=run.steps + 1, input_tokens=run.input_tokens + step)
        await store.checkpoint(thread_id, snapshots[thread_id], runs[thread_id])

    ryw = spark_view(read_tables(spark, env.source))
    assert ryw.messages == {t: m for t, m in snapshots.items() if m}
    assert ryw == await store_view(store)

    await store.force_flush_all()
    assert spark_view(read_tables(spark, env.source, ReadConsistency.EVENTUAL)) == ryw


async def test_a_run_id_reused_on_another_thread_stays_where_it_is(
    env: StoreEnv, spark: SparkSession
) -> None:
    """The store refuses a run id already used by another thread (nothing is written), so
    Spark, read-your-writes or after a flush, shows the run on its owner."""
    store = env.store
    await store.checkpoint("a", make_messages(1), make_run("a", "shared", steps=5))
    await store.force_flush("a")
    with pytest.raises(RunOwnershipError):
        await store.checkpoint("b", make_messages(2), make_run("b", "shared", steps=1))

    before = spark_view(read_tables(spark, env.source))
    assert before.runs["shared"][:2] == ("a", "agent")
    await store.force_flush_all()
    assert spark_view(read_tables(spark, env.source, ReadConsistency.EVENTUAL)) == before


async def test_a_short_tail_read_by_the_driver_equals_the_data_source_read(
    env: StoreEnv, spark: SparkSession
) -> None:
    store = env.store
    for i in range(5):
        await store.checkpoint(f"t{i}", make_messages(i + 1), make_run(f"t{i}", f"r{i}"))
    await store.delete_thread("t0")
    by_executors = read_wal_tail(spark, env.config, driver_max_entries=0)
    by_driver = read_wal_tail(spark, env.config)
    assert by_driver.condensed == by_executors.condensed
    assert by_driver.entry_count == by_executors.entry_count == 6


async def checkpoint_threads(store: BufferedThreadRunStore, threads: int) -> None:
    """One pending checkpoint (2 messages, a run) on each of ``t0``, ``t1``..."""
    for i in range(threads):
        await store.checkpoint(f"t{i}", make_messages(2), make_run(f"t{i}", f"r{i}"))


def collector_at_decode(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether the garbage collector was on at each call of `decode_messages` (the full
    decode) and `tail.message_entries` (the light one), from now."""
    collector_on: list[bool] = []
    for module, name in ((datasource, "decode_messages"), (tail_module, "message_entries")):
        decode = getattr(module, name)

        def recording(*args: Any, decode: Any = decode) -> Any:
            collector_on.append(gc.isenabled())
            return decode(*args)

        monkeypatch.setattr(module, name, recording)
    return collector_on


async def test_the_driver_decodes_the_tail_with_the_garbage_collector_paused(
    env: StoreEnv, spark: SparkSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    await checkpoint_threads(env.store, 3)
    collector_on = collector_at_decode(monkeypatch)
    assert gc.isenabled()
    tail = read_wal_tail(spark, env.config)
    assert tail.entry_count == 3  # the light decode of the messages read
    assert tail.entries.num_rows == 3  # the full decode
    assert collector_on == [False, False]
    assert gc.isenabled()  # on again afterwards
    # A collector the caller turned off stays off.
    gc.disable()
    try:
        assert read_wal_tail(spark, env.config).condensed == tail.condensed
        assert not gc.isenabled()
    finally:
        gc.enable()
    assert collector_on == [False, False, False]


async def test_an_executor_slice_pauses_the_collector_per_chunk_never_across_a_yield(
    env: StoreEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    await checkpoint_threads(env.store, 5)
    collector_on = collector_at_decode(monkeypatch)
    first, last = datasource.tail_bounds(env.config)
    options = datasource.tail_options(env.config, (first, last), 1)
    read = dataclasses.replace(datasource.TailRead.from_options(options), chunk_entries=2)

    def consume() -> list[tuple[int, bool]]:
        # As a Spark task does, in a thread with no event loop running.
        return [(b.num_rows, gc.isenabled()) for b in datasource.read_slice(read, first, last)]

    # Spark works on each batch with the collector on.
    assert await asyncio.to_thread(consume) == [(2, True), (2, True), (1, True)]
    assert collector_on == [False, False, False]  # chunks of 2, 2 and 1 entries
    assert gc.isenabled()


async def test_the_run_versions_frame_is_made_only_by_the_runs_read(
    env: StoreEnv, spark: SparkSession
) -> None:
    store = env.store
    await store.checkpoint("t", make_messages(2), make_run("t", "r", steps=1))
    await store.checkpoint("t", make_messages(3), make_run("t", "r", steps=2))
    tables = read_tables(spark, env.source)
    assert tables.tail is not None
    assert [m.position for m in tables.messages.collect()] == [0, 1, 2]
    assert tables.threads.count() == 1
    # Threads and messages read the overlay only: no DataFrame of run versions yet.
    assert "overlay" in vars(tables.tail)
    assert "run_versions" not in vars(tables.tail)
    [run] = tables.runs.collect()
    assert (run.run_id, run.steps, run.thread_seq) == ("r", 2, 2)
    assert "run_versions" in vars(tables.tail)


async def pending_and_flushed(store: BufferedThreadRunStore, threads: int) -> None:
    """Threads ``t0``.. with pending checkpoints; ``t1`` flushed, then checkpointed again."""
    for i in range(threads):
        await store.checkpoint(f"t{i}", make_messages(i + 2), make_run(f"t{i}", f"r{i}"))
    await store.force_flush("t1")
    await store.checkpoint("t1", make_messages(1), make_run("t1", "r1", steps=2))


async def test_a_large_overlay_stored_on_the_executors_reads_the_same(
    env: StoreEnv, spark: SparkSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An overlay past `LOCAL_OVERLAY_MAX_BYTES` is materialised by `localCheckpoint`
    instead of staying a driver-local relation; the tables read are the same."""
    await pending_and_flushed(env.store, 4)
    local = spark_view(read_tables(spark, env.source))
    monkeypatch.setattr(overlay, "LOCAL_OVERLAY_MAX_BYTES", 0)
    assert spark_view(read_tables(spark, env.source)) == local


async def test_custom_predicates_read_the_same_tables(env: StoreEnv, spark: SparkSession) -> None:
    """Predicates of the caller's own split the reads, the overlay's included: the same
    tables as with the default hash buckets."""
    store = env.store
    await pending_and_flushed(store, 6)
    by_hash = spark_view(read_tables(spark, env.source))
    ranges = ("thread_id < 't2'", "thread_id >= 't2' AND thread_id < 't4'", "thread_id >= 't4'")
    custom = dataclasses.replace(
        env.source, jdbc=dataclasses.replace(env.source.jdbc, predicates=ranges)
    )
    assert spark_view(read_tables(spark, custom)) == by_hash == await store_view(store)


async def test_messages_that_look_like_sql_or_quoting_pass_through_unchanged(
    env: StoreEnv, spark: SparkSession
) -> None:
    """Message text that looks like SQL, JDBC placeholders or quoting reaches Spark
    unchanged, from the WAL tail as from Postgres."""
    tricky: list[dict[str, object]] = [
        {"role": "user", "content": "$bufstore$'; DROP TABLE messages; --"},
        {"role": "assistant", "content": "what? ?? {? } $$ $1 \\ \" '' \u00e9 🚀"},
        {"role": "tool", "content": {"nested": ["$bufstore_0$", None, 1.5, True]}},
    ]
    await env.store.checkpoint("q", tricky, make_run("q", "rq", output={"sql": "';--"}))
    view = spark_view(read_tables(spark, env.source))
    assert view.messages["q"] == tricky
    assert view == await store_view(env.store)


async def test_entries_missing_from_the_tail_fail_the_job_naming_the_thread(
    env: StoreEnv, spark: SparkSession
) -> None:
    """An entry neither flushed nor in the tail (here removed from the stream, as a
    quarantine would) must fail the read, never show the thread without it."""
    store = env.store
    await store.checkpoint("gap", make_messages(2), make_run("gap", "rg"))
    await store.force_flush("gap")
    await store.checkpoint("gap", make_messages(3), make_run("gap", "rg"))
    await store.checkpoint("gap", make_messages(4), make_run("gap", "rg"))
    await store.checkpoint("fine", make_messages(1), make_run("fine", "rf"))
    nc = await nats.connect(env.config.nats_url)
    try:
        js = nc.jetstream()
        last = (await js.stream_info(env.config.stream_name)).state.last_seq
        await js.delete_msg(env.config.stream_name, last - 2)  # "gap" seq 2
    finally:
        await nc.close()
    tables = read_tables(spark, env.source)
    for table in ("threads", "messages", "runs"):
        # The messages read of a pinned snapshot knows it when it is made; the others
        # (and the join path) when they run.
        with pytest.raises(Exception, match="thread gap: entries after seq 1 are neither"):
            getattr(tables, table).collect()


FORCE_PARALLEL = (
    "SET parallel_setup_cost = 0; SET parallel_tuple_cost = 0; "
    "SET min_parallel_table_scan_size = 0; SET max_parallel_workers_per_gather = 2"
)
"""Session settings under which Postgres plans even a small table's scan in parallel, as
it does by itself for big tables."""


async def test_overlay_reads_fold_like_the_store_when_postgres_plans_them_in_parallel(
    env: StoreEnv, spark: SparkSession
) -> None:
    """With parallel plans, the pending threads' list is evaluated in each worker and the
    rows are joined to their watermarks there: every worker reads the statement's one
    snapshot, so the merge still folds as the store does."""
    env.sql(BULK_SQL)  # 100k flushed message rows next to the threads below
    store = env.store
    for thread_id in ("append", "rewrite", "delete", "kept"):
        await store.checkpoint(thread_id, make_messages(4), make_run(thread_id, f"r-{thread_id}"))
    await store.force_flush_all()
    await store.checkpoint("append", make_messages(6), make_run("append", "r-append", steps=2))
    await store.checkpoint("rewrite", make_messages(2, start=7), make_run("rewrite", "r-new"))
    await store.delete_thread("delete")
    await store.checkpoint("fresh", make_messages(3), make_run("fresh", "r-fresh"))

    jdbc = dataclasses.replace(env.source.jdbc, session_init=FORCE_PARALLEL)
    view = spark_view(read_tables(spark, dataclasses.replace(env.source, jdbc=jdbc)))
    assert view == await store_view(store)
    assert len(view.messages) == 1004  # the bulk threads, append, rewrite, kept, fresh
