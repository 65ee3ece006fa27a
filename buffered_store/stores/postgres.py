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
- `apply()`: one transaction for the whole call in two round trips, whatever the number
  of threads, on the pooled psycopg connection in pipeline mode (`postgres_apply` plans,
  `postgres_pipeline` sends): BEGIN, the insert of the rows of new threads (when any) and
  the lock of every thread row of the call (the watermark gate, ``thread_id = ANY(...)``);
  then, planned on the locked rows, every thread's gated write (one statement for all
  the threads whose write is one plain change) and COMMIT. A deadlock or serialization
  failure runs the transaction again (`retry_in_place`); a thread whose data the
  database rejects fails alone, and the transaction runs again without it.
"""

from __future__ import annotations

import asyncio
import enum
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import Any

import orjson
import psycopg
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from buffered_store.engine.flushing import ApplyOutcome, ApplyStatus
from buffered_store.engine.ids import utcnow
from buffered_store.errors import ConfigError, ConflictError, StoreError
from buffered_store.model.changes import (
    WalEntry,
)
from buffered_store.model.checkpointing import (
    CheckpointInput,
    build_checkpoint_entry,
    build_delete_entry,
    run_owned_elsewhere,
    validate_checkpoint,
)
from buffered_store.model.planning import coalesce
from buffered_store.model.records import CheckpointReceipt, Message, RunRecord, Thread
from buffered_store.stores import migrate as migrations
from buffered_store.stores import postgres_apply as plan
from buffered_store.stores import postgres_codec as codec
from buffered_store.stores import postgres_sql as sql
from buffered_store.stores.postgres_compiled import StatementCompiler
from buffered_store.stores.postgres_errors import DbFailure, retry_in_place, sqlstate_of
from buffered_store.stores.postgres_pipeline import PipelineConnection
from buffered_store.stores.postgres_reads import PostgresReads, failure_of

__all__ = ["PostgresThreadRunStore"]

_APPLY_ATTEMPTS = 5
"""Runs of one `apply()` transaction that a deadlock or serialization failure may take
(`retry_in_place`); the last failure is raised as `ConflictError`."""
_RACED_WRITES = 3
"""Runs of a refused write under a thread's lock whose run was let go before the owner
could be named (each run reads what other transactions committed since)."""


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
        self._compiler = StatementCompiler(engine.dialect, schema)

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
        failed gate means another thread owns one of its runs (`RunOwnershipError`). When
        none does by the time the owner is looked up (the owner's delete committed after
        the gate read the run: the lock is on this thread's row, not on the run's), the
        write runs again."""
        for _ in range(_RACED_WRITES):
            if await self._write(conn, write):
                return
            if not write.run_ids:
                raise StoreError(  # pragma: no cover - we hold the row lock
                    f"thread {write.thread_id!r} changed under its lock"
                )
            params = sql.bind(thread_id=write.thread_id, run_ids=list(write.run_ids))
            owned = (await self._execute(conn, sql.SELECT_RUN_OWNERS, params)).first()
            if owned is not None:
                raise run_owned_elsewhere(owned.run_id, owned.thread_id, write.thread_id)
        raise ConflictError(
            f"thread {write.thread_id!r}: the runs it names kept changing owner while it "
            "was written"
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
        """Apply each thread's entries with its watermark: one transaction in two round
        trips to Postgres, whatever the number of threads (see `postgres_apply`).

        The first round trip creates the rows of new threads, then locks every thread row
        of the call, both in sorted id order, so concurrent flushers cannot deadlock;
        should the database still abort the transaction as a deadlock victim (or with a
        serialization failure), it runs again (up to `_APPLY_ATTEMPTS` runs). The second
        writes every thread planned on its locked row, and commits. A thread whose data
        the database rejects is reported FAILED and the transaction runs again without
        it; losing the database raises `DatabaseUnavailableError` (nothing committed).
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
            done = await self._apply_call(plan.ApplyCall(batches, order))
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

    async def _apply_call(self, call: plan.ApplyCall) -> plan.Done:
        # psycopg's pipeline mode on the pooled connection: SQLAlchemy does not offer it.
        async with self._auto.connect() as conn:
            raw = (await conn.get_raw_connection()).driver_connection
            if not isinstance(raw, psycopg.AsyncConnection):
                raise ConfigError(f"apply() needs the psycopg 3 driver, not {type(raw).__name__}")
            link = PipelineConnection(raw, self._stats)
            try:
                return await self._transact(link, call)
            except BaseException as error:
                # The connection goes back to the pool clean (rolled back), or not at all:
                # after a cancellation it may be in the middle of a pipeline.
                if not isinstance(error, Exception) or not await link.release():
                    await conn.invalidate()
                raise

    async def _transact(self, link: PipelineConnection, call: plan.ApplyCall) -> plan.Done:
        """Run the call's transaction until it commits: again after a deadlock or a
        serialization failure (`retry_in_place`), and again without a batch the database
        rejected or refused."""
        conflicts = 0
        while True:
            try:
                result = await self._attempt(link, call)
            except psycopg.Error as error:
                conflicts += 1
                if not retry_in_place(sqlstate_of(error), conflicts, attempts=_APPLY_ATTEMPTS):
                    raise
                self._stats["conflict_retries"] += 1
                continue
            if result is _Rerun.CONFLICT:
                conflicts += 1
                if conflicts >= _APPLY_ATTEMPTS:
                    raise ConflictError("thread rows kept vanishing between insert and lock")
                self._stats["conflict_retries"] += 1
            elif result is not _Rerun.ISOLATED:
                return result

    async def _attempt(self, link: PipelineConnection, call: plan.ApplyCall) -> plan.Done | _Rerun:
        """One run of the transaction. A run that does not commit leaves its transaction
        open (or aborted): the next run's first pipeline starts with its ``ROLLBACK``."""
        opening = plan.opening(call, self._compiler, rollback=link.in_transaction)
        if opening is None:  # no batch left names a valid thread: nothing to write
            if link.in_transaction:
                await link.execute(plan.ROLLBACK)
            decided = plan.writing(call, {}, set(), self._compiler).decided
            return await self._after_commit(link, call, decided, plan.Settled(), set())
        results = await link.send(opening.steps)
        created = plan.created_ids(opening, results)
        writing = plan.writing(call, plan.locked_rows(opening, results), created, self._compiler)
        if writing.vanished:
            return _Rerun.CONFLICT
        try:
            results = await link.send(writing.steps)
        except psycopg.Error as error:
            if failure_of(error) is not DbFailure.DATA:
                raise
            if writing.combined_at is not None and link.failed_step() == writing.combined_at:
                # Some thread's data among those written together: run again with each
                # thread in its own statement, which names it.
                call.combine = False
                return _Rerun.ISOLATED
            index = link.failed_batch()
            if index is None:
                raise
            call.rejected[index] = (plan.rejected_outcome(call, writing, index, error), 0)
            return _Rerun.ISOLATED
        settled = plan.settle(writing, results)
        if not writing.commit:
            if settled.refused:
                left_out = plan.to_leave_out(settled.refused)
                call.refused.update((refusal.index, refusal) for refusal in left_out)
                return _Rerun.ISOLATED
            await link.execute(plan.COMMIT)
        self._stats["transactions"] += 1
        self._stats["messages_written"] += settled.messages
        self._stats["runs_written"] += settled.runs
        return await self._after_commit(link, call, writing.decided, settled, created)

    async def _after_commit(
        self,
        link: PipelineConnection,
        call: plan.ApplyCall,
        decided: plan.Done,
        settled: plan.Settled,
        created: set[str],
    ) -> plan.Done:
        """Every batch's outcome. Refused batches (now or in a run rolled back) get the
        owner of their run read, and the rows created for them removed while still
        empty, in one more round trip in autocommit (an empty row reads as absent, so
        another transaction seeing it in between sees no thread)."""
        done = {**decided, **settled.applied, **call.rejected}
        refusals = [*call.refused.values(), *settled.refused]
        if refusals:
            steps = plan.after_commit(refusals, created, self._compiler)
            done.update(plan.refused_outcomes(refusals, await link.send(steps)))
        return done


class _Rerun(enum.Enum):
    """Why `_attempt` did not commit: the transaction runs again."""

    ISOLATED = "isolated"
    """A batch was rejected or refused: it is left out of the next run."""
    CONFLICT = "conflict"
    """A thread row to write vanished (another flusher removed it as empty): like a
    deadlock victim, the next run sees the current rows."""


def _snapshot_after(
    call: CheckpointInput, entry: WalEntry, cached: _Snapshot | None
) -> tuple[bytes, ...] | None:
    """The thread's snapshot after `entry`, when known (None: forget the cached one)."""
    if not call.append or entry.keep == 0:
        return tuple(call.encoded)
    if cached is not None and cached.seq + 1 == entry.seq and len(cached.encoded) == entry.keep:
        return cached.encoded + tuple(call.encoded)
    return None
