"""Connection plumbing, error translation and the reads of the Postgres store.

`PostgresReads` is the base of `PostgresThreadRunStore`: it owns the engine, executes the
statements of `buffered_store.stores.postgres_sql` (which builds them and converts rows) and
translates every SQLAlchemy/psycopg error in one place. Each read is one statement in
autocommit mode: one round trip, one snapshot, so a watermark and the data read with it
are always consistent.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import psycopg
from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from buffered_store.errors import (
    ConflictError,
    DatabaseRefusedError,
    DatabaseUnavailableError,
    SchemaError,
    StoreClosedError,
    StoreError,
    ValidationError,
)
from buffered_store.model.checkpointing import check_page
from buffered_store.model.records import Message, RunRecord, RunStatus, Thread
from buffered_store.model.target import StoredThread, VersionedRun
from buffered_store.stores import migrate as migrations
from buffered_store.stores import postgres_codec as codec
from buffered_store.stores import postgres_sql as sql
from buffered_store.stores.postgres_errors import (
    DbFailure,
    classify_sqlstate,
    schema_missing,
    sqlstate_of,
)

__all__ = ["PostgresReads", "failure_of", "translate_error"]

_UNAVAILABLE = (
    sa_exc.OperationalError,
    sa_exc.InterfaceError,
    sa_exc.TimeoutError,
    sa_exc.DisconnectionError,
    psycopg.OperationalError,
    psycopg.InterfaceError,
    OSError,
)
"""Errors meaning the database (or the way to it) is gone, when no SQLSTATE says otherwise."""
_FOREIGN = (sa_exc.SQLAlchemyError, psycopg.Error, OSError)


def failure_of(error: BaseException) -> DbFailure:
    """What a SQLAlchemy/psycopg/socket error means: by its SQLSTATE when it has one
    (the exception class alone does not tell an outage from rejected data), else by
    its class."""
    if isinstance(error, sa_exc.DBAPIError) and error.connection_invalidated:
        return DbFailure.UNAVAILABLE
    found = classify_sqlstate(sqlstate_of(error))
    if found is not None:
        return found
    return DbFailure.UNAVAILABLE if isinstance(error, _UNAVAILABLE) else DbFailure.OTHER


def translate_error(error: BaseException) -> StoreError:
    """Our error for a SQLAlchemy/psycopg/socket error (raise it ``from`` the original)."""
    failure = failure_of(error)
    if failure is DbFailure.UNAVAILABLE:
        return DatabaseUnavailableError(f"database unavailable: {error}")
    if failure is DbFailure.CONFLICT:
        return ConflictError(f"database conflict, retry: {error}")
    if failure is DbFailure.DATA:
        # The statement failed as a whole (one statement or one transaction): nothing
        # was written, and the same data would fail again.
        return ValidationError(f"the database rejected the data: {error}")
    if schema_missing(sqlstate_of(error)):
        return SchemaError(
            f"the store's schema is not set up: {error} (run `bufstore db upgrade`, or "
            "connect with migrate=True)"
        )
    return DatabaseRefusedError(f"database error: {error}")


class PostgresReads:
    """Engine, counters and reads shared by the Postgres store (see the module doc)."""

    def __init__(self, engine: AsyncEngine, *, schema: str = "public") -> None:
        self._engine = engine
        self._tx = engine.execution_options(schema_translate_map={None: schema})
        # Single statements run in autocommit: no BEGIN/COMMIT round trips.
        self._auto = self._tx.execution_options(isolation_level="AUTOCOMMIT")
        self._schema = schema
        self._closed = False
        self._stats = dict.fromkeys(
            (
                "transactions",
                "statements",
                "round_trips",
                "checkpoints",
                "fast_checkpoints",
                "snapshot_reads",
                "deletes",
                "apply_calls",
                "conflict_retries",
                "thread_applications",
                "applied_entries",
                "stale",
                "gaps",
                "failed",
                "messages_written",
                "runs_written",
                "unpipelined",
            ),
            0,
        )

    def stats(self) -> dict[str, int]:
        """Counters since `connect`: transactions committed and statements executed,
        ``round_trips`` to Postgres (a statement on its own, and the BEGIN and the COMMIT
        of a transaction, one each; a pipeline of `apply()`, however many statements it
        holds, one), checkpoints (``fast_checkpoints``: one-statement ones),
        ``snapshot_reads`` (cache misses), apply calls and their outcomes
        (``conflict_retries``: transactions run again after a deadlock or serialization
        failure), message and run rows written, and ``unpipelined``: `apply()` steps sent
        one statement at a time because one was too large for a pipeline."""
        return dict(self._stats)

    async def close(self) -> None:
        """Close the connection pool; later calls raise `StoreClosedError`. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._engine.dispose()

    async def _check_schema(self) -> None:
        expected = migrations.head_revision()
        hint = f"run `bufstore db upgrade --schema {self._schema}` first"
        with self._guard():
            try:
                async with self._auto.connect() as conn:
                    found = (await conn.execute(sql.SELECT_SCHEMA_VERSION)).scalar()
            except sa_exc.ProgrammingError as error:
                raise SchemaError(f"schema {self._schema!r} has no store tables; {hint}") from error
        if found != expected:
            raise SchemaError(
                f"schema {self._schema!r} is at revision {found!r}, expected {expected!r}; {hint}"
            )

    # -- plumbing --------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the Postgres store is closed")

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """Check the store is open; translate foreign errors, in this one place."""
        self._check_open()
        try:
            yield
        except StoreError:
            raise
        except _FOREIGN as error:
            raise translate_error(error) from error

    @contextlib.asynccontextmanager
    async def _transaction(self) -> AsyncIterator[AsyncConnection]:
        try:
            async with self._tx.begin() as conn:
                yield conn
        finally:
            # psycopg sends BEGIN on its own before the first statement, then COMMIT (or
            # ROLLBACK): a round trip each.
            self._stats["round_trips"] += 2
        self._stats["transactions"] += 1

    async def _execute(
        self, conn: AsyncConnection, statement: Any, params: Mapping[str, Any] | None = None
    ) -> Any:
        self._stats["statements"] += 1
        self._stats["round_trips"] += 1
        return await conn.execute(statement, dict(params or {}))

    async def _read(self, statement: Any, params: Mapping[str, Any]) -> list[Any]:
        async with self._auto.connect() as conn:
            return list((await self._execute(conn, statement, params)).all())

    # -- reads -----------------------------------------------------------------------

    async def load_thread(self, thread_id: str) -> Thread | None:
        """The thread summary, or None if unknown or deleted."""
        return (await self.read_thread(thread_id, with_messages=False)).thread

    async def load_messages(self, thread_id: str) -> list[Message] | None:
        """The latest message snapshot, or None if the thread is unknown or deleted."""
        codec.check_key(thread_id, "thread_id")
        with self._guard():
            rows = await self._read(sql.SELECT_THREAD_WITH_MESSAGES, sql.bind(thread_id=thread_id))
        if not rows or codec.thread_row(rows[0]).thread is None:
            return None
        return list(rows[0].messages or [])

    async def load_run(self, run_id: str) -> RunRecord | None:
        """A run by id, or None."""
        found = await self.read_run(run_id)
        return found.run if found else None

    async def latest_run(self, thread_id: str) -> RunRecord | None:
        """The run of the thread's latest checkpoint, or None."""
        codec.check_key(thread_id, "thread_id")
        with self._guard():
            rows = await self._read(sql.SELECT_LATEST_RUN, sql.bind(thread_id=thread_id))
        return codec.run_from_record(rows[0].record) if rows else None

    async def list_runs(
        self,
        thread_id: str | None = None,
        *,
        status: RunStatus | None = None,
        limit: int = 50,
        offset: int = 0,
    ) -> list[RunRecord]:
        """Runs, newest `created_at` first, optionally of one thread and/or one status."""
        found = await self.read_runs(thread_id, status=status, limit=limit, offset=offset)
        return [item.run for item in found]

    async def list_threads(self, *, limit: int = 50, offset: int = 0) -> list[Thread]:
        """Live threads, newest `updated_at` first (then `thread_id` descending)."""
        found = await self.read_threads(limit=limit, offset=offset)
        return [item.thread for item in found if item.thread is not None]

    # -- FlushTarget: versioned reads ------------------------------------------------

    async def read_thread(self, thread_id: str, *, with_messages: bool) -> StoredThread:
        """The stored thread and its watermark from one statement (one snapshot).

        Messages, when requested, are [] for an absent or deleted thread.
        """
        codec.check_key(thread_id, "thread_id")
        statement = sql.SELECT_THREAD_WITH_MESSAGES if with_messages else sql.SELECT_THREAD
        with self._guard():
            rows = await self._read(statement, sql.bind(thread_id=thread_id))
        if not rows:
            empty: list[bytes] | None = [] if with_messages else None
            return StoredThread(thread_id=thread_id, flushed_seq=0, thread=None, messages=empty)
        row = codec.thread_row(rows[0])
        messages = None
        if with_messages:
            messages = codec.canonical(rows[0].messages) if row.thread is not None else []
        return StoredThread(
            thread_id=thread_id, flushed_seq=row.flushed_seq, thread=row.thread, messages=messages
        )

    async def read_run(self, run_id: str) -> VersionedRun | None:
        """A stored run with the seq of the checkpoint that wrote it."""
        codec.check_key(run_id, "run_id")
        with self._guard():
            rows = await self._read(sql.SELECT_RUN, sql.bind(run_id=run_id))
        return (
            VersionedRun(codec.run_from_record(rows[0].record), rows[0].thread_seq)
            if rows
            else None
        )

    async def read_runs(
        self, thread_id: str | None, *, status: RunStatus | None, limit: int, offset: int
    ) -> list[VersionedRun]:
        """Stored runs in `list_runs` order, with their versions."""
        if thread_id is not None:
            codec.check_key(thread_id, "thread_id")
        if status is not None:
            try:
                status = RunStatus(status)
            except ValueError:
                raise ValidationError(f"unknown run status {status!r}") from None
        check_page(limit, offset)
        statement = sql.select_runs(by_thread=thread_id is not None, by_status=status is not None)
        params = sql.bind(
            thread_id=thread_id,
            status=status.value if status is not None else None,
            limit=limit,
            offset=offset,
        )
        with self._guard():
            rows = await self._read(statement, params)
        return [VersionedRun(codec.run_from_record(row.record), row.thread_seq) for row in rows]

    async def read_threads(self, *, limit: int, offset: int) -> list[StoredThread]:
        """Stored live threads in `list_threads` order, with their watermarks."""
        check_page(limit, offset)
        with self._guard():
            rows = await self._read(sql.SELECT_LIVE_THREADS, sql.bind(limit=limit, offset=offset))
        result = []
        for item in map(codec.thread_row, rows):
            result.append(
                StoredThread(
                    thread_id=item.thread_id, flushed_seq=item.flushed_seq, thread=item.thread
                )
            )
        return result

    async def flushed_seqs(self, thread_ids: Sequence[str]) -> dict[str, int]:
        """Watermarks of several threads (0 for unknown ones; tombstones keep theirs)."""
        ids = [codec.check_key(thread_id, "thread_id") for thread_id in thread_ids]
        with self._guard():
            rows = (
                await self._read(sql.SELECT_FLUSHED_SEQS, sql.bind(thread_ids=ids)) if ids else []
            )
        found = {row.thread_id: row.flushed_seq for row in rows}
        return {thread_id: found.get(thread_id, 0) for thread_id in ids}
