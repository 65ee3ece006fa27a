"""`PostgresThreadRunStore`: the Postgres inner store, and the "direct" baseline.

It implements `ThreadRunStore` and `FlushTarget`. A direct `checkpoint()` builds the same
`WalEntry` the buffered store would put on the WAL and writes it through the code path
`apply()` uses, so the direct and the flushed paths cannot drift apart.

Round trips (statements live in `postgres_sql`, parameters and rows in `postgres_codec`,
reads and plumbing in `postgres_reads`; this module decides what to execute):

- A checkpoint of a thread this process wrote last (the usual single-writer case) is one
  statement in autocommit mode: a watermark-gated write that appends only the new
  messages. When another writer moved the watermark meanwhile, the gate writes nothing
  and the checkpoint falls back to the locking path.
- Locking path: BEGIN, ``SELECT ... FOR UPDATE`` (plus an insert for a new thread), a read
  of the stored snapshot when this process does not have it, the gated write, COMMIT.
- `apply()`: one transaction for the whole call; one statement creates the rows of the
  threads the call may create (skipped when none), one locks every thread row of the call
  (the watermark gate, ``thread_id = ANY(...)``), then one write per thread. A deadlock
  or serialization failure runs the transaction again (`retry_in_place`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import Any

import orjson
from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from buffered_store.engine.flushing import ApplyOutcome, ApplyStatus
from buffered_store.engine.ids import utcnow
from buffered_store.errors import RunOwnershipError, StoreError
from buffered_store.stores import migrate as migrations
from buffered_store.stores import postgres_codec as codec
from buffered_store.stores import postgres_sql as sql
from buffered_store.stores.postgres_errors import DbFailure, retry_in_place, sqlstate_of
from buffered_store.stores.postgres_reads import PostgresReads, failure_of
from buffered_store.threadrun.checkpointing import (
    CheckpointInput,
    build_checkpoint_entry,
    build_delete_entry,
    run_owned_elsewhere,
    validate_checkpoint,
)
from buffered_store.threadrun.entry import WalEntry
from buffered_store.threadrun.planning import coalesce
from buffered_store.threadrun.records import CheckpointReceipt, Message, RunRecord, Thread

__all__ = ["PostgresThreadRunStore"]

_APPLY_ATTEMPTS = 5
"""Runs of one `apply()` transaction that a deadlock or serialization failure may take
(`retry_in_place`); the last failure is raised as `ConflictError`."""


def _is_data_error(error: BaseException) -> bool:
    """Whether the database rejected the data of the statement (by SQLSTATE, so also an
    index row too large, which psycopg raises as an OperationalError): inside `apply()`
    that thread FAILS, not retriable, and the others go on."""
    return isinstance(error, sa_exc.DBAPIError) and failure_of(error) is DbFailure.DATA


def _json_dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


@dataclass(frozen=True, slots=True)
class _Snapshot:
    """What this process last wrote or read for a thread at `seq`."""

    seq: int
    thread: Thread
    encoded: tuple[bytes, ...]


class _SnapshotCache:
    """Bounded LRU of thread snapshots; an entry is only trusted at its own seq."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._items: OrderedDict[str, _Snapshot] = OrderedDict()

    def get(self, thread_id: object) -> _Snapshot | None:
        if not isinstance(thread_id, str):
            return None
        item = self._items.get(thread_id)
        if item is not None:
            self._items.move_to_end(thread_id)
        return item

    def put(self, thread_id: str, item: _Snapshot) -> None:
        if self._capacity <= 0:
            return
        current = self._items.get(thread_id)
        # Concurrent calls on one thread may finish out of order: keep the newest.
        if current is None or current.seq < item.seq:
            self._items[thread_id] = item
        self._items.move_to_end(thread_id)
        while len(self._items) > self._capacity:
            self._items.popitem(last=False)

    def discard(self, thread_id: str) -> None:
        self._items.pop(thread_id, None)

    def clear(self) -> None:
        self._items.clear()


class PostgresThreadRunStore(PostgresReads):
    """A `ThreadRunStore` and `FlushTarget` on PostgreSQL (SQLAlchemy 2 async + psycopg 3).

    Build it with `connect`; use it as an async context manager or call `close`.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        schema: str = "public",
        clock: Callable[[], datetime] | None = None,
        cache_threads: int = 1024,
    ) -> None:
        super().__init__(engine, schema=schema)
        self._clock = clock or utcnow
        self._cache = _SnapshotCache(cache_threads)

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        schema: str = "public",
        migrate: bool = False,
        clock: Callable[[], datetime] | None = None,
        cache_threads: int = 1024,
        **pool_options: Any,
    ) -> PostgresThreadRunStore:
        """Open a store on `url` (``postgresql://``, ``postgres://`` or a SQLAlchemy URL).

        Args:
            schema: the Postgres schema holding the tables.
            migrate: run the Alembic upgrade first; otherwise the schema must already be
                at the head revision (`SchemaError` tells to run ``bufstore db upgrade``).
            clock: returns the current time (timezone-aware), for `created_at`/`updated_at`.
            cache_threads: how many threads' latest snapshots to remember, so checkpoints
                of recently written threads need neither a lock nor a read.
            pool_options: passed to `sqlalchemy.ext.asyncio.create_async_engine`.
        """
        url = migrations.normalize_url(url)
        migrations.check_schema_name(schema)
        if migrate:
            await asyncio.to_thread(migrations.upgrade, url, schema=schema)
        pool_options.setdefault("pool_size", 10)
        # hide_parameters: SQLAlchemy error texts would otherwise quote bound values, which
        # carry message payloads, into our exceptions and logs.
        pool_options.setdefault("hide_parameters", True)
        engine = create_async_engine(
            url, json_serializer=_json_dumps, json_deserializer=orjson.loads, **pool_options
        )
        store = cls(engine, schema=schema, clock=clock, cache_threads=cache_threads)
        try:
            await store._check_schema()
        except BaseException:
            await engine.dispose()
            raise
        return store

    async def close(self) -> None:
        """Close the connection pool; later calls raise `StoreClosedError`. Idempotent."""
        self._cache.clear()
        await super().close()

    async def __aenter__(self) -> PostgresThreadRunStore:
        self._check_open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- locking and writing -----------------------------------------------------------

    async def _lock_existing(self, conn: AsyncConnection, thread_id: str) -> codec.ThreadRow | None:
        row = (await self._execute(conn, sql.LOCK_THREAD, sql.bind(thread_id=thread_id))).first()
        return codec.thread_row(row) if row is not None else None

    async def _ensure(self, conn: AsyncConnection, thread_id: str) -> codec.ThreadRow:
        """Insert and lock the row of a thread found missing (or lock a racer's row)."""
        row = (await self._execute(conn, sql.ENSURE_THREAD, sql.bind(thread_id=thread_id))).one()
        return codec.thread_row(row)

    async def _lock(self, conn: AsyncConnection, thread_id: str) -> codec.ThreadRow:
        row = await self._lock_existing(conn, thread_id)
        return row if row is not None else await self._ensure(conn, thread_id)

    async def _write(self, conn: AsyncConnection, write: codec.Write) -> bool:
        """Execute a prepared write; False when its gate found another watermark."""
        if write.reset:
            await self._execute(conn, sql.RESET_THREAD, sql.bind(thread_id=write.thread_id))
        applied = (await self._execute(conn, write.statement, write.params)).first() is not None
        if applied:
            self._stats["messages_written"] += write.messages
            self._stats["runs_written"] += write.runs
        return applied

    async def _write_locked(self, conn: AsyncConnection, write: codec.Write) -> None:
        """Execute a write under the thread's lock: its watermark cannot have moved, so a
        failed gate means another thread owns one of its runs (`RunOwnershipError`)."""
        if await self._write(conn, write):
            return
        if write.run_ids:
            params = sql.bind(thread_id=write.thread_id, run_ids=list(write.run_ids))
            owned = (await self._execute(conn, sql.SELECT_RUN_OWNERS, params)).first()
            if owned is not None:
                raise run_owned_elsewhere(owned.run_id, owned.thread_id, write.thread_id)
        raise StoreError(  # pragma: no cover - we hold the row lock
            f"thread {write.thread_id!r} changed under its lock"
        )

    # -- ThreadRunStore: writes ------------------------------------------------------

    async def checkpoint(
        self,
        thread_id: str,
        messages: Sequence[Message],
        run: RunRecord,
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> CheckpointReceipt:
        """Store the snapshot of a thread after one step and upsert its run.

        Only the messages that differ from the stored snapshot are written.
        """
        self._check_open()
        cached = self._cache.get(thread_id)
        call = validate_checkpoint(
            thread_id,
            messages,
            run,
            metadata,
            previous=cached.encoded if cached else None,
        )
        return await self._checkpoint(call, cached)

    async def append(
        self,
        thread_id: str,
        messages: Sequence[Message],
        run: RunRecord,
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> CheckpointReceipt:
        """Append `messages` to the thread's snapshot and upsert its run.

        Writes the new message rows only, without reading or comparing the history.
        """
        self._check_open()
        call = validate_checkpoint(thread_id, messages, run, metadata, append=True)
        return await self._checkpoint(call, self._cache.get(thread_id))

    async def _checkpoint(
        self, call: CheckpointInput, cached: _Snapshot | None
    ) -> CheckpointReceipt:
        codec.check_key(call.thread_id, "thread_id")
        with self._guard():
            entry = await self._checkpoint_cached(call, cached) if cached else None
            if entry is None:
                entry = await self._checkpoint_locked(call)
        assert entry.thread is not None
        encoded = _snapshot_after(call, entry, cached)
        if encoded is None:
            self._cache.discard(call.thread_id)
        else:
            self._cache.put(call.thread_id, _Snapshot(entry.seq, entry.thread, encoded))
        self._stats["checkpoints"] += 1
        return CheckpointReceipt(thread_id=call.thread_id, thread_seq=entry.seq)

    async def _checkpoint_cached(self, call: CheckpointInput, cached: _Snapshot) -> WalEntry | None:
        """One autocommit statement, gated on the cached seq still being the latest."""
        entry = build_checkpoint_entry(
            call,
            previous=cached.thread,
            previous_messages=cached.encoded,
            seq=cached.seq + 1,
            now=self._clock(),
        )
        count = cached.thread.message_count
        write = codec.build_write(
            coalesce([entry], stored_count=count),
            expected_seq=cached.seq,
            stored_count=count,
            at=entry.at,
        )
        async with self._auto.connect() as conn:
            applied = await self._write(conn, write)
        self._stats["transactions"] += 1
        if not applied:
            self._cache.discard(call.thread_id)
            return None
        self._stats["fast_checkpoints"] += 1
        return entry

    async def _checkpoint_locked(self, call: CheckpointInput) -> WalEntry:
        async with self._transaction() as conn:
            row = await self._lock(conn, call.thread_id)
            entry = build_checkpoint_entry(
                call,
                previous=row.thread,
                # An append keeps the stored messages without reading them.
                previous_messages=None if call.append else await self._stored_snapshot(conn, row),
                seq=row.flushed_seq + 1,
                now=self._clock(),
            )
            write = codec.build_write(
                coalesce([entry], stored_count=row.message_count),
                expected_seq=row.flushed_seq,
                stored_count=row.message_count,
                at=entry.at,
            )
            await self._write_locked(conn, write)
        return entry

    async def _stored_snapshot(
        self, conn: AsyncConnection, row: codec.ThreadRow
    ) -> list[bytes] | None:
        """The locked thread's snapshot: from the cache at the same seq, else read."""
        if row.thread is None:
            return None
        cached = self._cache.get(row.thread_id)
        if cached is not None and cached.seq == row.flushed_seq:
            return list(cached.encoded)
        if row.message_count == 0:
            return []
        self._stats["snapshot_reads"] += 1
        params = sql.bind(thread_id=row.thread_id, count=row.message_count)
        return codec.canonical(
            (await self._execute(conn, sql.SELECT_STORED_MESSAGES, params)).scalar()
        )

    async def delete_thread(self, thread_id: str) -> None:
        """Delete a thread (a tombstone keeps its seq); unknown threads are ignored."""
        self._check_open()
        codec.check_key(thread_id, "thread_id")
        self._cache.discard(thread_id)
        with self._guard():
            async with self._transaction() as conn:
                row = await self._lock_existing(conn, thread_id)
                if row is None or row.thread is None:
                    return
                entry = build_delete_entry(thread_id, seq=row.flushed_seq + 1, now=self._clock())
                write = codec.build_write(
                    coalesce([entry], stored_count=row.message_count),
                    expected_seq=row.flushed_seq,
                    stored_count=row.message_count,
                    at=entry.at,
                )
                await self._write_locked(conn, write)
        self._stats["deletes"] += 1

    # -- FlushTarget: apply ----------------------------------------------------------

    async def apply(self, batches: Sequence[Sequence[WalEntry]]) -> list[ApplyOutcome]:
        """Apply each thread's entries with its watermark, in one transaction.

        Missing thread rows are created, then all rows locked, in sorted id order, so
        concurrent flushers cannot deadlock; should the database still abort the
        transaction as a deadlock victim, it runs again (up to `_APPLY_ATTEMPTS` runs).
        A thread whose data the database rejects is rolled back alone and reported
        FAILED; losing the database raises `DatabaseUnavailableError` (nothing committed).
        """
        self._check_open()
        outcomes: list[ApplyOutcome | None] = [None] * len(batches)
        order: list[int] = []
        for index, batch in enumerate(batches):
            if batch:
                order.append(index)
            else:
                outcomes[index] = ApplyOutcome(
                    "", ApplyStatus.FAILED, 0, error="empty batch: no entries", retriable=False
                )
        order.sort(key=lambda index: batches[index][0].thread_id)
        self._stats["apply_calls"] += 1
        with self._guard():
            for attempt in itertools.count(1):
                try:
                    done = await self._apply_isolating(batches, order)
                    break
                except sa_exc.DBAPIError as error:
                    code = sqlstate_of(error)
                    if not retry_in_place(code, attempt, attempts=_APPLY_ATTEMPTS):
                        raise
                    self._stats["conflict_retries"] += 1
        for index, (outcome, entries) in done.items():
            outcomes[index] = outcome
            self._count(outcome, entries)
        return [outcome for outcome in outcomes if outcome is not None]

    def _count(self, outcome: ApplyOutcome, entries: int) -> None:
        if outcome.status is ApplyStatus.APPLIED:
            self._cache.discard(outcome.thread_id)
            self._stats["thread_applications"] += 1
            self._stats["applied_entries"] += entries
        else:
            key = {"stale": "stale", "gap": "gaps", "failed": "failed"}[outcome.status.value]
            self._stats[key] += 1

    async def _apply_isolating(
        self, batches: Sequence[Sequence[WalEntry]], order: list[int]
    ) -> dict[int, tuple[ApplyOutcome, int]]:
        try:
            return await self._apply_all(batches, order, savepoints=False)
        except sa_exc.DBAPIError as error:
            if not _is_data_error(error):
                raise
            # Savepoints cost two round trips per thread, so they are only paid for
            # once a thread's data was rejected: redo the call isolating each thread.
            return await self._apply_all(batches, order, savepoints=True)

    async def _apply_all(
        self, batches: Sequence[Sequence[WalEntry]], order: list[int], *, savepoints: bool
    ) -> dict[int, tuple[ApplyOutcome, int]]:
        done: dict[int, tuple[ApplyOutcome, int]] = {}
        async with self._transaction() as conn:
            # Rows first, then locks, each in code point order: see `sql.CREATE_THREADS`.
            created = await self._create_missing(conn, [batches[index] for index in order])
            rows = await self._lock_many(conn, [batches[index][0].thread_id for index in order])
            for index in order:
                done[index] = await self._apply_thread(
                    conn, batches[index], savepoints, rows, created
                )
        return done

    async def _create_missing(
        self, conn: AsyncConnection, batches: Sequence[Sequence[WalEntry]]
    ) -> set[str]:
        """Insert the rows of the threads that may be new, before any lock is taken;
        returns the ids this transaction inserted (their rows are empty until written).

        Only a batch holding its thread's first entry (seq 1) can create the thread: any
        other batch of a thread without a row is a gap, which writes nothing. Once the
        threads exist, a call inserts nothing and this costs no round trip."""
        ids: set[str] = set()
        for batch in batches:
            if any(entry.seq == 1 for entry in batch):
                with contextlib.suppress(StoreError):
                    ids.add(codec.check_key(batch[0].thread_id, "thread_id"))
        if not ids:
            return set()
        # Python orders str by code point, as the "C" collation orders UTF-8.
        params = sql.bind(thread_ids=sorted(ids))
        return set((await self._execute(conn, sql.CREATE_THREADS, params)).scalars())

    async def _drop_created(self, conn: AsyncConnection, thread_id: str, created: set[str]) -> None:
        """Remove the empty row inserted for a thread whose batch was then not written."""
        if thread_id in created:
            created.discard(thread_id)
            await self._execute(conn, sql.DROP_EMPTY_THREAD, sql.bind(thread_id=thread_id))

    async def _lock_many(
        self, conn: AsyncConnection, thread_ids: Sequence[str]
    ) -> dict[str, codec.ThreadRow | None]:
        """Lock the rows of the threads that exist, in one statement; None for the others
        (invalid ids are left out: their batch fails on its own)."""
        ids: list[str] = []
        for thread_id in dict.fromkeys(thread_ids):
            with contextlib.suppress(StoreError):
                ids.append(codec.check_key(thread_id, "thread_id"))
        if not ids:
            return {}
        result = await self._execute(conn, sql.LOCK_THREADS, sql.bind(thread_ids=ids))
        rows: dict[str, codec.ThreadRow | None] = dict.fromkeys(ids)
        for row in result.all():
            locked = codec.thread_row(row)
            rows[locked.thread_id] = locked
        return rows

    async def _apply_thread(
        self,
        conn: AsyncConnection,
        entries: Sequence[WalEntry],
        savepoints: bool,
        locked: dict[str, codec.ThreadRow | None],
        created: set[str],
    ) -> tuple[ApplyOutcome, int]:
        thread_id = entries[0].thread_id
        try:
            codec.check_key(thread_id, "thread_id")
        except StoreError as error:
            return codec.failed(thread_id, 0, error), 0
        # The row as `_lock_many` locked it; a thread given twice in one call is read
        # again the second time (the first batch may have moved it).
        if thread_id in locked:
            row = locked.pop(thread_id)
        else:
            row = await self._lock_existing(conn, thread_id)
        # Plan against "absent" before inserting a row for a new thread, so a batch that
        # is not applied never leaves an empty row behind (a row `_create_missing`
        # inserted is as empty as an absent one, and is dropped again).
        base = row or codec.ThreadRow(thread_id, 0, 0, None)
        planned = codec.plan_batch(entries, base)
        if isinstance(planned, ApplyOutcome):
            await self._drop_created(conn, thread_id, created)
            return planned, 0
        isolate = conn.begin_nested() if savepoints else contextlib.nullcontext()
        inserted = False
        try:
            async with isolate:
                if row is None:
                    # Normally only a thread given twice in one call, whose first batch did not
                    # create it, gets here: its row is inserted after other locks.
                    row = await self._ensure(conn, thread_id)
                    inserted = row.flushed_seq == 0
                    if row.flushed_seq != 0:  # another flusher created it meanwhile
                        planned = codec.plan_batch(entries, row)
                        if isinstance(planned, ApplyOutcome):
                            return planned, 0
                await self._write_locked(conn, planned.write)
        except sa_exc.DBAPIError as error:
            if not savepoints or not _is_data_error(error):
                raise
            # The savepoint undid the write; a row inserted before it has to go.
            await self._drop_created(conn, thread_id, created)
            return codec.failed(thread_id, base.flushed_seq, error), 0
        except RunOwnershipError as error:
            # The gate wrote nothing; only the empty row inserted above has to go.
            if inserted:
                await self._execute(conn, sql.DROP_EMPTY_THREAD, sql.bind(thread_id=thread_id))
            await self._drop_created(conn, thread_id, created)
            return codec.failed(thread_id, base.flushed_seq, error), 0
        return ApplyOutcome(thread_id, ApplyStatus.APPLIED, planned.last_seq), planned.entries


def _snapshot_after(
    call: CheckpointInput, entry: WalEntry, cached: _Snapshot | None
) -> tuple[bytes, ...] | None:
    """The thread's snapshot after `entry`, when known (None: forget the cached one)."""
    if not call.append or entry.keep == 0:
        return tuple(call.encoded)
    if cached is not None and cached.seq + 1 == entry.seq and len(cached.encoded) == entry.keep:
        return cached.encoded + tuple(call.encoded)
    return None
