"""The store's tables as Spark DataFrames, in the three read consistency modes.

* ``EVENTUAL``: the JDBC reads alone (what the flusher has written so far).
* ``STRONG``: ``force_flush_all`` first, then the JDBC reads.
* ``READ_YOUR_WRITES``: the WAL tail merged with the JDBC reads, so a job sees every
  checkpoint acknowledged before it started.

How the merge stays correct and cheap (DESIGN.md invariants 15 and 16):

1. The WAL tail is read **first**: its bounds from the flusher consumer, then its
   messages, received by the driver (a long tail: decoded on the executors by the
   ``threadlog`` source). Its cost is O(pending entries).
2. Then **one Postgres snapshot is pinned** (`jdbc.pin_snapshot`): exported by a
   transaction the read keeps open, and read once by the driver for each pending
   thread's watermark ``W`` (`threads.flushed_seq`) and stored message count. Every JDBC
   partition of every read of the `Tables` imports it, so ``W`` is the same everywhere
   and known before any row is scanned. Taken after the tail was received, it can only
   be newer: an entry flushed in between is in both (the tail was received before its
   ack, and the WAL is trimmed below the ack floor only), and one flushed later is in
   the tail only.
3. **Messages: a union.** Entries at or below ``W`` are dropped; what is left is newer
   than the snapshot and wins (`union.plan_union`). A thread whose remaining entries
   only append keeps its scanned rows as they are; a thread they rewrite (a truncation,
   a snapshot entry, a delete) is cut from the scan from the lowest position they write,
   by a pushed-down condition. The tail's rows are added by ``UNION ALL``: no join, no
   per-row watermark, and the scan fetches only the columns a query uses.
4. **Threads and runs** (small tables) merge as before: each statement returns, with the
   rows of a pending thread, ``W`` read in the same statement and placeholders for what
   the entries add, and the overlay (one row per pending thread, one per run id, condensed
   by `condense.condense_table`) is broadcast and joined; entries at or below ``W`` are
   ignored, the others win. This merge needs no pinned snapshot: with
   ``StoreSource(pin_snapshot=False)`` (or no `database_url`) messages merge the same way,
   every partition in its own transaction, and a flush between the tail read and the
   JDBC read only raises ``W``.

A delete entry above ``W`` hides the thread, its messages and its runs; so does a
tombstone row. A thread whose entries above ``W`` do not start at ``W + 1`` (an entry
neither flushed nor in the tail, e.g. quarantined) fails the job, as the store's own reads
fail for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from buffered_store.config import BufferedStoreConfig, EngineConfig, ReadConsistency
from buffered_store.errors import ConfigError
from buffered_store.spark.condense import CondensedTable, condense_table
from buffered_store.spark.datasource import (
    ENTRY_ARROW,
    SOURCE_NAME,
    TailRead,
    receive,
    run_sync,
    tail_bounds,
    tail_options,
)
from buffered_store.spark.jdbc import (
    RUN_COLUMNS,
    JdbcSource,
    PinnedSnapshot,
    column_names,
    overlay_messages_sql,
    overlay_runs_sql,
    overlay_threads_sql,
    pin_snapshot,
    read_messages,
    read_runs,
    read_sql,
    read_threads,
    shared_snapshot,
    union_messages_sql,
)
from buffered_store.spark.session import register_datasource
from buffered_store.spark.tail import ReceivedTail
from buffered_store.spark.union import Mark, plan_union

RUNS = column_names(RUN_COLUMNS)
DRIVER_TAIL_MAX_ENTRIES = 20_000
"""Default largest WAL tail read by the driver itself rather than by a Spark job.

The job's fixed cost (planning, Python workers, one NATS connection per slice, the Arrow
trip back to the driver) outweighs its parallelism below this: on the 2-core benchmark
machine, before the driver decoded lazily, it read 10,000 entries in about 0.5 s, the job
in 0.6 to 0.8 s
(`local[2]`), and even a 96 MB tail of snapshot entries no faster (2.3 to 3.0 s against
1.9 to 2.4 s). With the flusher running, a tail is a flush interval's worth of entries."""
_SUMMARY = ["parent_thread_id", "metadata", "created_at", "updated_at", "latest_run_id"]


@dataclass(frozen=True, kw_only=True)
class StoreSource:
    """Everything a Spark read of the store needs: the tables, the WAL, the database."""

    jdbc: JdbcSource
    wal: EngineConfig | None = None
    """Where the WAL is; needed by ``READ_YOUR_WRITES`` and ``STRONG``."""
    database_url: str | None = None
    """``postgresql://`` URL for the driver itself: ``STRONG`` flushes through it and
    `consistent_tables` exports its snapshot through it."""
    wal_partitions: int | None = None
    """Spark partitions of the WAL-tail read (default: the default parallelism)."""
    driver_tail_max_entries: int = DRIVER_TAIL_MAX_ENTRIES
    """A WAL tail this short is read by the driver instead of a Spark job (0: never)."""
    broadcast: bool = True
    """Broadcast the overlay to the JDBC scans (turn off for a tail too large for it)."""
    flush_timeout_s: float = 300.0
    """Budget of the ``force_flush_all`` of ``STRONG`` reads."""
    pin_snapshot: bool = True
    """``READ_YOUR_WRITES`` with `database_url`: every JDBC partition reads one Postgres
    snapshot pinned after the WAL tail was read, and messages merge the tail by a union
    (`union`); off, or without `database_url`: per-partition transactions and a join."""

    @classmethod
    def from_urls(
        cls,
        database_url: str,
        nats_url: str | None = None,
        *,
        schema: str = "public",
        jdbc_url: str | None = None,
        wal: EngineConfig | None = None,
        partitions: int = 8,
        fetchsize: int = 10_000,
        **options: Any,
    ) -> StoreSource:
        """From the URLs the store itself uses; the other WAL settings from ``BUFSTORE_*``.

        `options` are the other fields (`wal_partitions`, `broadcast`, ...).
        """
        if wal is None:
            wal = EngineConfig.from_env(nats_url=nats_url) if nats_url else EngineConfig.from_env()
        elif nats_url:
            wal = wal.replace(nats_url=nats_url)
        if jdbc_url:
            jdbc = JdbcSource(
                url=jdbc_url, schema=schema, partitions=partitions, fetchsize=fetchsize
            )
        else:
            jdbc = JdbcSource.from_database_url(
                database_url, schema=schema, partitions=partitions, fetchsize=fetchsize
            )
        return cls(jdbc=jdbc, wal=wal, database_url=database_url, **options)

    def need_wal(self) -> EngineConfig:
        """The WAL settings, or a clear error when they were not given."""
        if self.wal is None:
            raise ConfigError("this read needs the WAL: give StoreSource(wal=EngineConfig(...))")
        return self.wal

    def need_database_url(self, what: str) -> str:
        """The database URL, or a clear error naming what needs it."""
        if not self.database_url:
            raise ConfigError(f"{what} needs StoreSource(database_url=...)")
        return self.database_url


@dataclass(frozen=True)
class Tables:
    """The three tables as one consistency mode shows them (columns: see `jdbc`).

    Each DataFrame is built on first access; its JDBC reads run at each action. With a
    `pin` (``READ_YOUR_WRITES`` by default) they all read one Postgres snapshot, held
    open until `close` (or the end of a ``with`` block, or until neither this object nor
    a DataFrame it returned is referenced any more).
    """

    spark: SparkSession
    jdbc: JdbcSource
    mode: ReadConsistency
    tail: WalTail | None = None
    """The WAL tail merged in (``READ_YOUR_WRITES`` only)."""
    pin: PinnedSnapshot | None = None
    """The snapshot every JDBC read uses, pinned after the tail was read."""

    @cached_property
    def threads(self) -> DataFrame:
        """Live threads (`THREAD_COLUMNS`)."""
        if self.tail is not None:
            return self._held(self.tail.threads(self.jdbc))
        return self._held(read_threads(self.spark, self.jdbc))

    @cached_property
    def messages(self) -> DataFrame:
        """Messages of live threads (`MESSAGE_COLUMNS`)."""
        if self.tail is not None and self.pin is not None:
            return self._held(self.tail.union_messages(self.jdbc, self.pin.marks))
        if self.tail is not None:
            return self._held(self.tail.messages(self.jdbc))
        return self._held(read_messages(self.spark, self.jdbc))

    @cached_property
    def runs(self) -> DataFrame:
        """Runs of live threads (`RUN_COLUMNS`)."""
        if self.tail is not None:
            return self._held(self.tail.runs(self.jdbc))
        return self._held(read_runs(self.spark, self.jdbc))

    def close(self) -> None:
        """Release the pinned snapshot, if any; actions on these DataFrames then fail."""
        if self.pin is not None:
            self.pin.close()

    def __enter__(self) -> Tables:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _held(self, frame: DataFrame) -> DataFrame:
        # The DataFrame keeps the snapshot alive as long as the caller holds it, even
        # once this object is gone (``read_tables(...).messages``).
        if self.pin is not None:
            setattr(frame, "_bufstore_pin", self.pin)  # noqa: B010
        return frame


@dataclass(frozen=True)
class WalTail:
    """The unflushed WAL tail, read before any JDBC read and condensed into overlays.

    `threads`, `messages` and `runs` merge it with JDBC reads that run lazily, when an
    action needs them; they hold every checkpoint acknowledged before `read_wal_tail`.
    """

    spark: SparkSession
    bounds: tuple[int, int]
    """The stream seqs read, ``[first, last]`` (empty when last < first)."""
    received: ReceivedTail
    """The tail's stored messages (or entries decoded on the executors)."""
    broadcast: bool = True

    @property
    def entries(self) -> pa.Table:
        """The tail's entries (`datasource.ENTRY_ARROW`), in stream order."""
        return self.received.entries

    @property
    def entry_count(self) -> int:
        """Entries read (decodable thread entries)."""
        return int(self.received.message_entries.num_rows)

    @cached_property
    def condensed(self) -> CondensedTable:
        """The overlay of the join path (`condense.condense_table`), made on first use."""
        return condense_table(self.entries)

    @cached_property
    def overlay(self) -> DataFrame:
        """One row per pending thread (`OVERLAY_SCHEMA`), made on first use."""
        return _frame(self.spark, self.condensed.threads)

    @cached_property
    def run_versions(self) -> DataFrame:
        """Newest version of each run id of the tail (`RUN_VERSION_SCHEMA`), made on
        first use: only the runs read needs it."""
        return _frame(self.spark, self.condensed.runs)

    @cached_property
    def pending(self) -> tuple[str, ...]:
        """Threads with entries in the tail, sorted."""
        ids = pc.unique(self.received.message_entries.column("thread_id")).to_pylist()
        return tuple(sorted(ids))

    def union_messages(self, jdbc: JdbcSource, marks: Mapping[str, tuple[int, int]]) -> DataFrame:
        """Message rows of live threads at their newest seq: the scan of the snapshot
        `marks` were read in, minus the rows the tail rewrites, plus the tail's rows
        above each watermark (`union.plan_union`). `jdbc` must read that snapshot."""
        marked = {t: Mark(w, n) for t, (w, n) in marks.items()}
        plan = plan_union(self.received.message_entries, marked)
        scan = read_sql(self.spark, jdbc, union_messages_sql(jdbc, plan.cuts))
        if not plan.cells.num_rows:
            return scan
        cells = _frame(self.spark, plan.cells).select(
            "thread_id", "ov_base", F.posexplode("ov_messages").alias("index", "cell")
        )
        rows = cells.select(
            "thread_id",
            (F.col("ov_base") + F.col("index")).alias("position"),
            "cell.role",
            "cell.message",
            "cell.thread_seq",
        )
        return scan.unionByName(rows)

    def threads(self, jdbc: JdbcSource) -> DataFrame:
        """Live threads: JDBC rows, replaced by the newest entry's summary when newer."""
        if not self.pending:
            return read_threads(self.spark, jdbc)
        scan = read_sql(self.spark, jdbc, overlay_threads_sql(jdbc, self.pending))
        # A thread row's seq is its watermark (0 for a thread the table does not hold).
        rows = scan.join(self._small(self.overlay), "thread_id", "left").withColumn(
            "watermark", F.col("thread_seq")
        )
        newer = _newer()
        visible = F.when(newer, ~F.col("ov_deleted")).otherwise(F.col("live"))
        picked = [
            F.when(newer, F.col(f"ov_{name}")).otherwise(F.col(name)).alias(name)
            for name in [*_SUMMARY, "message_count"]
        ]
        thread_seq = F.when(newer, F.col("ov_seq")).otherwise(F.col("thread_seq"))
        return rows.where(_check_gap(visible)).select(
            "thread_id", *picked, thread_seq.alias("thread_seq")
        )

    def messages(self, jdbc: JdbcSource) -> DataFrame:
        """Message rows of live threads at their newest seq, entries folded in."""
        if not self.pending:
            return read_messages(self.spark, jdbc)
        sql = overlay_messages_sql(jdbc, self.condensed.counts(), self.condensed.replaced())
        overlay = self.overlay.select(
            "thread_id",
            "ov_seq",
            "ov_first_seq",
            "ov_deleted",
            "ov_count",
            "ov_base",
            "ov_messages",
        )
        rows = read_sql(self.spark, jdbc, sql).join(self._small(overlay), "thread_id", "left")
        w, newer = F.col("watermark"), _newer()
        # The newest entry that wrote this position, if any (ov_messages starts at ov_base).
        index = F.col("position") - F.col("ov_base") + 1
        entry = F.when(newer & (index >= 1), F.try_element_at(F.col("ov_messages"), index))
        use = _true(entry["thread_seq"] > w)
        # Placeholders stand for positions the entries add: shown only when filled.
        visible = (use | ~F.col("placeholder")) & (
            ~newer | (~F.col("ov_deleted") & (F.col("position") < F.col("ov_count")))
        )
        picked = [
            F.when(use, entry[name]).otherwise(F.col(name)).alias(name)
            for name in ("role", "message", "thread_seq")
        ]
        return rows.where(_check_gap(visible)).select("thread_id", "position", *picked)

    def runs(self, jdbc: JdbcSource) -> DataFrame:
        """Runs at their newest version; runs of deleted threads are gone."""
        if not self.pending:
            return read_runs(self.spark, jdbc)
        sql = overlay_runs_sql(jdbc, self.condensed.runs_by_thread())
        overlay = self.overlay.select("thread_id", "ov_seq", "ov_first_seq", "ov_del_seq")
        rows = (
            read_sql(self.spark, jdbc, sql)
            .join(self._small(overlay), "thread_id", "left")
            .join(self._small(self.run_versions), "run_id", "left")
        )
        w, newer = F.col("watermark"), _newer()
        # A run id whose newest version is in another pending thread's entries moved there.
        moved = _true(F.col("ov_owner") != F.col("thread_id"))
        mine = newer & _true(F.col("ov_owner") == F.col("thread_id"))
        superseded = mine & (F.col("ov_run_seq") > w)
        deleted = newer & (F.col("ov_del_seq") > w)
        use = superseded & (F.col("ov_run_seq") > F.col("ov_del_seq"))
        visible = ~moved & (use | (~F.col("placeholder") & ~deleted & ~superseded))
        picked = [
            F.when(use, F.col(f"ov_run.{name}")).otherwise(F.col(name)).alias(name)
            for name in RUNS
            if name not in ("run_id", "thread_id", "thread_seq")
        ]
        thread_seq = F.when(use, F.col("ov_run_seq")).otherwise(F.col("thread_seq"))
        return rows.where(_check_gap(visible)).select(
            "run_id", "thread_id", *picked, thread_seq.alias("thread_seq")
        )

    def _small(self, frame: DataFrame) -> DataFrame:
        return F.broadcast(frame) if self.broadcast else frame


def _true(condition: Column) -> Column:
    """A condition where null (no overlay for the row) counts as false."""
    return F.coalesce(condition, F.lit(False))


def _newer() -> Column:
    """The row's thread has entries above the watermark the row was read with."""
    return _true(F.col("ov_seq") > F.col("watermark"))


def _check_gap(visible: Column) -> Column:
    """`visible`, failing the job when the entries above the row's watermark do not start
    right after it (an entry neither flushed nor in the tail, e.g. quarantined)."""
    gap = _newer() & (F.col("ov_first_seq") > F.col("watermark") + 1)
    message = F.concat(
        F.lit("thread "),
        F.col("thread_id"),
        F.lit(": entries after seq "),
        F.col("watermark").cast("string"),
        F.lit(" are neither flushed nor in the WAL tail"),
    )
    return F.when(gap, F.raise_error(message)).otherwise(visible)


def read_wal_tail(
    spark: SparkSession,
    wal: EngineConfig,
    *,
    partitions: int | None = None,
    broadcast: bool = True,
    driver_max_entries: int = DRIVER_TAIL_MAX_ENTRIES,
) -> WalTail:
    """Read the unflushed WAL tail now and condense it into the overlay.

    The entries are read on the executors (``threadlog`` source, one NATS connection per
    slice of the tail), collected as one Arrow table and condensed on the driver with
    column operations; the result, broadcast to the scans, holds O(pending entries). A
    tail of at most `driver_max_entries` entries (`DRIVER_TAIL_MAX_ENTRIES`; the usual
    case with a flusher running) is read by the driver itself, which saves a Spark job
    and its Python workers.
    """
    bounds = tail_bounds(wal)
    first, last = bounds
    received = ReceivedTail(wal, decoded=ENTRY_ARROW.empty_table())
    if 0 <= last - first < driver_max_entries:
        # Received now, decoded when a read needs it (the messages read lightly).
        read = TailRead.from_options(tail_options(wal, bounds, 1))
        received = ReceivedTail(wal, receive(read, first, last))
    elif last >= first:
        register_datasource(spark)
        if partitions is None:
            partitions = max(1, spark.sparkContext.defaultParallelism)
        frame = spark.read.format(SOURCE_NAME).options(**tail_options(wal, bounds, partitions))
        received = ReceivedTail(wal, decoded=frame.load().toArrow())
    return WalTail(spark, bounds, received, broadcast)


LOCAL_OVERLAY_MAX_BYTES = 8 << 20
"""A larger overlay table is stored once in Spark's block manager (`localCheckpoint`), by
the first action that reads it."""


def _frame(spark: SparkSession, table: pa.Table) -> DataFrame:
    """`table` as a DataFrame. A small one stays a local relation; a large one would
    otherwise travel inside the tasks of every action that reads it (Spark warns of
    tasks of 100 MB, and a 1 GiB driver runs out of heap after a few actions), so it is
    cut into batches and materialised once, in parallel, on the executors, by the first
    action (not by a job of its own first: a restarted-writer tail's union read took
    3.5 to 4.4 s that way against 3.9 to 4.6 s, four alternating pairs on a busy machine)."""
    if table.nbytes <= LOCAL_OVERLAY_MAX_BYTES:
        return spark.createDataFrame(table)
    rows = max(1, table.num_rows * (1 << 20) // max(1, table.nbytes))  # ~1 MiB batches
    batches = table.to_batches(max_chunksize=rows)
    return spark.createDataFrame(pa.Table.from_batches(batches)).localCheckpoint(eager=False)


def flush_all(source: StoreSource) -> int:
    """``force_flush_all`` through the store (the ``STRONG`` mode); returns threads flushed."""
    url = source.need_database_url("STRONG")
    wal = source.need_wal()
    if isinstance(wal, BufferedStoreConfig):
        config = wal.replace(drain_on_close=False)
    else:
        shared = {f.name: getattr(wal, f.name) for f in dataclasses.fields(EngineConfig)}
        config = BufferedStoreConfig(**shared, drain_on_close=False)

    async def flush() -> int:
        from buffered_store.stores.postgres import PostgresThreadRunStore
        from buffered_store.threadrun.store import BufferedThreadRunStore

        inner = await PostgresThreadRunStore.connect(url, schema=source.jdbc.schema)
        try:
            async with BufferedThreadRunStore.connect(inner, config) as store:
                return await store.force_flush_all(timeout=source.flush_timeout_s)
        finally:
            await inner.close()

    return run_sync(flush)


def _tail(spark: SparkSession, source: StoreSource, mode: ReadConsistency) -> WalTail | None:
    if mode is not ReadConsistency.READ_YOUR_WRITES:
        return None
    return read_wal_tail(
        spark,
        source.need_wal(),
        partitions=source.wal_partitions,
        broadcast=source.broadcast,
        driver_max_entries=source.driver_tail_max_entries,
    )


def read_tables(
    spark: SparkSession,
    source: StoreSource,
    mode: ReadConsistency | str = ReadConsistency.READ_YOUR_WRITES,
) -> Tables:
    """The three tables in a consistency mode.

    ``STRONG`` flushes now and ``READ_YOUR_WRITES`` reads the WAL tail now; the JDBC
    reads run at each action, every partition in its own transaction. Use
    `consistent_tables` when the tables must agree with each other (an export).
    """
    mode = ReadConsistency(mode)
    if mode is ReadConsistency.STRONG:
        flush_all(source)
    tail = _tail(spark, source, mode)
    url = source.database_url
    if tail is None or tail.bounds[1] < tail.bounds[0] or not source.pin_snapshot or not url:
        return Tables(spark, source.jdbc, mode, tail)
    return _pinned(spark, source, mode, tail, url)


def _pinned(
    spark: SparkSession, source: StoreSource, mode: ReadConsistency, tail: WalTail | None, url: str
) -> Tables:
    """Tables reading one snapshot pinned now: after the tail was read, so an entry
    flushed after it is still in the tail (it was not acked, hence not trimmed, when the
    tail was read), and is dropped only when the snapshot holds it already."""
    pin = pin_snapshot(url, source.jdbc, tail.pending if tail is not None else ())
    return Tables(spark, source.jdbc.with_snapshot(pin.snapshot_id), mode, tail, pin)


@contextlib.contextmanager
def consistent_tables(
    spark: SparkSession,
    source: StoreSource,
    mode: ReadConsistency | str = ReadConsistency.READ_YOUR_WRITES,
) -> Iterator[Tables]:
    """Like `read_tables`, but every JDBC partition of every action inside the ``with``
    block reads one Postgres snapshot, exported after the WAL tail was read.

    Threads, messages and runs then agree exactly (a thread's `message_count` is the
    number of its message rows). Run the actions inside the block: the snapshot ends
    with it.
    """
    mode = ReadConsistency(mode)
    url = source.need_database_url("a consistent read")
    if mode is ReadConsistency.STRONG:
        flush_all(source)
    tail = _tail(spark, source, mode)
    if tail is not None and source.pin_snapshot:
        with _pinned(spark, source, mode, tail, url) as tables:
            yield tables
        return
    with shared_snapshot(url) as snapshot:
        yield Tables(spark, source.jdbc.with_snapshot(snapshot), mode, tail)
