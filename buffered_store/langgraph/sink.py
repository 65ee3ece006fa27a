"""`LangGraphSink`: the engine's `FlushSink` writing LangGraph's own Postgres tables
(``checkpoints``, ``checkpoint_blobs``, ``checkpoint_writes``, created by
``langgraph-checkpoint-postgres``'s ``setup()``) plus one table of ours holding each
thread's watermark, all in one transaction.

A flush of any number of threads costs two round trips: the watermark rows are created
and locked (with the stored bases of delta blobs read in the same pipeline), then every
statement `langgraph.flushplan` plans for the batch is pipelined with ``COMMIT``. After
it the three tables hold what AsyncPostgresSaver would have written for the same calls.
A statement Postgres rejects fails only its thread (found by isolating the threads'
statements), and errors are told apart by SQLSTATE (`stores.postgres_errors`), not by
the driver's exception class.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeAlias

import psycopg
import psycopg_pool
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from langgraph.checkpoint.postgres.base import (
    PRUNE_SNAPSHOT_SQL,
    _keep_latest,
)
from psycopg.rows import DictRow, dict_row
from psycopg_pool import AsyncConnectionPool

from buffered_store.engine.flushing import ApplyOutcome, ApplyStatus
from buffered_store.errors import (
    BackendUnavailableError,
    ConflictError,
    DatabaseRefusedError,
    DatabaseUnavailableError,
    SchemaError,
    StoreError,
)
from buffered_store.langgraph import flushplan
from buffered_store.langgraph.entry import LgEntry, Prune
from buffered_store.langgraph.flushplan import (
    CREATE_ROWS,
    LOCK_ROWS,
    SELECT_BASES,
    WATERMARKS,
    PruneWork,
    Statement,
)
from buffered_store.langgraph.sink_reads import SinkReads
from buffered_store.stores.pipelining import fits_pipeline
from buffered_store.stores.postgres_errors import (
    DbFailure,
    classify_sqlstate,
    retry_in_place,
    schema_missing,
    sqlstate_of,
)

Connection: TypeAlias = psycopg.AsyncConnection[DictRow]

SETUP_HINT = "call `await saver.setup()` (or `LangGraphSink.setup()`) once per database"

CREATE_WATERMARKS = f"""
CREATE TABLE IF NOT EXISTS {WATERMARKS} (
    thread_id TEXT PRIMARY KEY,
    flushed_seq BIGINT NOT NULL DEFAULT 0,
    owner TEXT
)"""

SETUP_LOCK_NAMESPACE = 0x42554C47
"""First key ("BULG") of the advisory lock `LangGraphSink.setup` holds; the second is a
hash of the schema it sets up."""
SETUP_LOCK_POLL_S = 0.05
"""Pause between two tries for that lock."""
SETUP_TURN_S = 60.0
"""How long `LangGraphSink.setup` waits for its turn by default."""

APPLY_ATTEMPTS = 5
"""Runs of one flush transaction a deadlock or serialization failure may take."""


def failure_of(error: BaseException) -> DbFailure:
    """What a psycopg error means, by its SQLSTATE (a rejected index row is raised as an
    OperationalError, like a lost connection); without one, by its class."""
    found = classify_sqlstate(getattr(error, "sqlstate", None))
    if found is not None:
        return found
    if isinstance(error, psycopg.OperationalError | psycopg.InterfaceError | OSError):
        return DbFailure.UNAVAILABLE
    return DbFailure.OTHER


def translate(error: BaseException, what: str) -> StoreError:
    """Our error for a psycopg error met while doing `what` (raise it ``from`` it)."""
    failure = failure_of(error)
    if failure is DbFailure.UNAVAILABLE:
        return DatabaseUnavailableError(f"{what}: {error}")
    if failure is DbFailure.CONFLICT:
        return ConflictError(f"{what}: {error}")
    if schema_missing(sqlstate_of(error)):
        return SchemaError(f"{what}: {error} (LangGraph's tables are not set up: {SETUP_HINT})")
    return DatabaseRefusedError(f"{what}: {error}")


class _Rejected(Exception):
    """A statement of a flush failed: the batches (threads) it wrote for, what the
    failure means, and the message to report."""

    def __init__(
        self, batches: tuple[int, ...], failure: DbFailure, message: str, sqlstate: str | None
    ) -> None:
        super().__init__(message)
        self.batches = batches
        self.failure = failure
        self.message = message
        self.sqlstate = sqlstate

    @classmethod
    def of(cls, statement: Statement | None, error: psycopg.Error) -> _Rejected:
        message = f"Postgres rejected the data ({error.sqlstate}): {error}"
        batches = statement.batches if statement is not None else ()
        return cls(batches, failure_of(error), message, error.sqlstate)

    def translated(self) -> StoreError:
        if self.failure is DbFailure.UNAVAILABLE:
            return DatabaseUnavailableError(f"flush: {self}")
        if self.failure is DbFailure.CONFLICT:
            return ConflictError(f"flush: {self}")
        if schema_missing(self.sqlstate):
            return SchemaError(f"flush: {self} (LangGraph's tables are not set up: {SETUP_HINT})")
        return DatabaseRefusedError(f"flush: {self}")


class SinkMetrics:
    """A `LangGraphSink`'s counters under the names of the inner store's metrics
    (``bufstore_inner_*``, labelled ``front_end="langgraph"``): what ``bufstore flusher
    --front-end langgraph --metrics-port`` exports, and what an application embedding
    the flusher adds to its `StatsCollector` (``collector.add(saver.sink.metrics)``)."""

    front_end = "langgraph"

    def __init__(self, sink: LangGraphSink) -> None:
        self._sink = sink

    def stats(self) -> dict[str, int]:
        """Transactions, statements, round trips, conflict retries and apply outcomes."""
        sink = self._sink
        return {
            "transactions": sink.transactions,
            "statements": sink.stats["statements"],
            "round_trips": sink.stats["round_trips"],
            "conflict_retries": sink.stats["conflict_retries"],
            **sink.outcomes,
        }


class LangGraphSink(SinkReads):
    """Watermark-checked writes of LangGraph entries into LangGraph's Postgres tables
        (the engine's `FlushSink`), and the reads the saver overlays its tail on
    (`langgraph.sink_reads`). Every
        psycopg error that means "Postgres is not there" becomes `DatabaseUnavailableError`.
    """

    def __init__(self, pool: AsyncConnectionPool[Connection], *, timeout_s: float = 30.0) -> None:
        self.pool = pool
        self.timeout_s = timeout_s
        """Longest wait for a pooled connection (`DatabaseUnavailableError` after it)."""
        self.transactions = 0
        self.code_point_order: bool | None = None
        """Whether the database orders text by code point (`collation`); None until
        known."""
        self._marks: dict[str, int] = {}
        """Watermarks the last flush transaction locked (a rejected thread's outcome
        reports its own)."""
        self.stats = dict.fromkeys(
            (
                "round_trips",
                "statements",
                "isolated_runs",
                "conflict_retries",
                "rejected",
                "unpipelined",
            ),
            0,
        )
        """Counters: pipeline syncs and single statements of flushes (``round_trips``),
        statements pipelined, transactions run again with every thread isolated after a
        statement was rejected, after a deadlock or serialization failure, and threads
        whose data Postgres rejected."""
        self.outcomes = dict.fromkeys(
            ("apply_calls", "thread_applications", "stale", "gaps", "failed", "applied_entries"),
            0,
        )
        """Counters of `apply` calls and their per-thread outcomes, under the names of the
        thread-run stores' (``applied_entries``: entries of applied batches)."""
        self.metrics = SinkMetrics(self)
        """The sink as a source of `buffered_store.metrics.StatsCollector`."""

    @classmethod
    async def open(
        cls, conninfo: str, *, min_size: int = 1, max_size: int = 8, timeout_s: float = 30.0
    ) -> LangGraphSink:
        """A sink on a new pool (closed by `close`).

        It opens without waiting for Postgres: the pool connects in the background (and
        logs each failed attempt), so a process restarted during an outage starts, and
        its operations give up on Postgres after `timeout_s` each, as they do when
        Postgres goes away later."""
        pool = AsyncConnectionPool(
            conninfo,
            min_size=min_size,
            max_size=max_size,
            open=False,
            name="bufstore-langgraph",
            connection_class=Connection,
            kwargs={"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row},
        )
        await pool.open(wait=False)
        sink = cls(pool, timeout_s=timeout_s)
        # Known from the start, reads during a later outage know how ids are ordered
        # (while Postgres is down it is learnt later, by the first read that needs it).
        with contextlib.suppress(BackendUnavailableError, TimeoutError):
            async with asyncio.timeout(min(timeout_s, 5.0)):
                await sink.collation()
        return sink

    async def close(self) -> None:
        await self.pool.close()

    @asynccontextmanager
    async def connection(self, what: str) -> AsyncIterator[Connection]:
        """A pooled connection; failures meaning Postgres is not there (by SQLSTATE, or
        by class when there is none) raise `DatabaseUnavailableError`, any other psycopg
        error our translated `StoreError`."""
        try:
            async with self.pool.connection(timeout=self.timeout_s) as conn:
                yield conn
        except psycopg_pool.PoolTimeout as exc:
            raise DatabaseUnavailableError(f"{what}: {exc}") from exc
        except psycopg.Error as exc:
            raise translate(exc, what) from exc

    async def setup(self, *, turn_timeout_s: float = SETUP_TURN_S) -> None:
        """LangGraph's own migrations (AsyncPostgresSaver.setup), then our watermarks.

        Processes setting up one schema at once (an application and its flusher deployed
        together) take turns: LangGraph's migrations alone are not safe to run side by
        side (two sessions creating the same table race in the catalog and one fails).
        The turn is a session advisory lock on the schema, taken by trying it every
        `SETUP_LOCK_POLL_S`, not by waiting in ``pg_advisory_lock``: a session waiting
        there holds a snapshot, which the migrations' ``CREATE INDEX CONCURRENTLY`` in the
        session holding the lock would wait for in turn. A turn that does not come within
        `turn_timeout_s` raises `DatabaseUnavailableError`."""
        async with self.connection("setup") as conn:
            await self._setup_turn(conn, turn_timeout_s)
            try:
                await AsyncPostgresSaver(conn).setup()
                await conn.execute(CREATE_WATERMARKS)
            finally:
                # A lost connection released the lock with its session; the error that
                # ended the setup is the one to raise.
                with contextlib.suppress(psycopg.OperationalError):
                    await conn.execute(
                        "SELECT pg_advisory_unlock(%s, hashtext(current_schema()))",
                        (SETUP_LOCK_NAMESPACE,),
                    )

    async def _setup_turn(self, conn: Connection, timeout_s: float) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            cur = await conn.execute(
                "SELECT pg_try_advisory_lock(%s, hashtext(current_schema())) AS taken",
                (SETUP_LOCK_NAMESPACE,),
            )
            row = await cur.fetchone()
            if row is not None and row["taken"]:
                return
            if asyncio.get_running_loop().time() >= deadline:
                raise DatabaseUnavailableError(
                    f"setup: another session has been setting up this schema for more "
                    f"than {timeout_s:g} s (advisory lock {SETUP_LOCK_NAMESPACE:#x})"
                )
            await asyncio.sleep(SETUP_LOCK_POLL_S)

    # -- FlushSink ------------------------------------------------------------------------

    async def flushed_seqs(self, thread_ids: Sequence[str]) -> dict[str, int]:
        out = dict.fromkeys(thread_ids, 0)
        if not thread_ids:
            return out
        async with self.connection("read watermarks") as conn:
            cur = await conn.execute(
                f"SELECT thread_id, flushed_seq FROM {WATERMARKS} WHERE thread_id = ANY(%s)",
                (list(thread_ids),),
            )
            for row in await cur.fetchall():
                out[row["thread_id"]] = row["flushed_seq"]
        return out

    async def apply(self, batches: Sequence[Sequence[LgEntry]]) -> list[ApplyOutcome]:
        """One transaction for all the batches, in two round trips (see the module doc).

        Watermark rows are created, then locked, in code point order, so concurrent
        flushers cannot deadlock (a deadlock or serialization failure still runs the
        transaction again, up to `APPLY_ATTEMPTS` runs). A thread whose statement
        Postgres rejects is FAILED (not retriable) and the others are applied without
        it; losing Postgres raises `DatabaseUnavailableError` (nothing committed).
        """
        outcomes: dict[int, ApplyOutcome] = {}
        live: list[int] = []
        for index, batch in enumerate(batches):
            if batch:
                live.append(index)
            else:
                outcomes[index] = ApplyOutcome(
                    "", ApplyStatus.FAILED, 0, error="empty batch", retriable=False
                )
        isolated = False
        conflicts = 0
        async with self.connection("flush") as conn:
            while live:
                try:
                    outcomes.update(await self._transaction(conn, batches, live, isolated=isolated))
                    break
                except _Rejected as rejected:
                    await _rollback(conn)
                    if rejected.failure is DbFailure.CONFLICT and retry_in_place(
                        rejected.sqlstate, conflicts + 1, attempts=APPLY_ATTEMPTS
                    ):
                        conflicts += 1
                        self.stats["conflict_retries"] += 1
                        continue
                    culprits = rejected.batches
                    if rejected.failure is not DbFailure.DATA or not culprits:
                        raise rejected.translated() from rejected.__cause__
                    if len(culprits) > 1:
                        # A statement of several threads: run again with every thread's
                        # statements apart, to learn whose rows it was.
                        self.stats["isolated_runs"] += 1
                        isolated = True
                        continue
                    [culprit] = culprits
                    self.stats["rejected"] += 1
                    thread_id = batches[culprit][0].thread_id
                    outcomes[culprit] = ApplyOutcome(
                        thread_id,
                        ApplyStatus.FAILED,
                        self._marks.get(thread_id, 0),
                        error=rejected.message,
                        retriable=False,
                    )
                    live.remove(culprit)
                    isolated = False
        result = [outcomes[index] for index in range(len(batches))]
        self._count(batches, result)
        return result

    def _count(self, batches: Sequence[Sequence[LgEntry]], result: list[ApplyOutcome]) -> None:
        counts = self.outcomes
        counts["apply_calls"] += 1
        for batch, outcome in zip(batches, result, strict=True):
            if outcome.status is ApplyStatus.APPLIED:
                counts["thread_applications"] += 1
                counts["applied_entries"] += sum(1 for e in batch if e.seq <= outcome.flushed_seq)
            elif outcome.status is ApplyStatus.STALE:
                counts["stale"] += 1
            elif outcome.status is ApplyStatus.GAP:
                counts["gaps"] += 1
            else:
                counts["failed"] += 1

    async def _transaction(
        self,
        conn: Connection,
        batches: Sequence[Sequence[LgEntry]],
        live: list[int],
        *,
        isolated: bool,
    ) -> dict[int, ApplyOutcome]:
        ids = sorted({flushplan.thread_of(batches[i]) for i in live})
        wanted = flushplan.wanted_bases([batches[i] for i in live])
        first: list[Statement] = [
            Statement("BEGIN", (), ()),
            Statement(CREATE_ROWS, (ids,), ()),
            Statement(LOCK_ROWS, (ids,), ()),
        ]
        if wanted:
            first.append(Statement(SELECT_BASES, [list(c) for c in zip(*wanted, strict=True)], ()))
        cursors = await self._pipeline(conn, first)
        marks = {r["thread_id"]: r["flushed_seq"] for r in await cursors[2].fetchall()}
        self._marks = marks
        bases: dict[tuple[str, str, str, str], bytes | None] = {}
        if wanted:
            for r in await cursors[3].fetchall():
                bases[(r["thread_id"], r["checkpoint_ns"], r["channel"], r["version"])] = r["blob"]
        planned = flushplan.plan(batches, live, marks, bases, isolated=isolated)
        statements = list(planned.statements)
        if not planned.pruning:
            statements.append(Statement("COMMIT", (), ()))
        await self._pipeline(conn, statements)
        if planned.pruning:
            for work in planned.pruning:
                await self._prune(conn, work)
            await self._pipeline(conn, [Statement("COMMIT", (), ())])
        self.transactions += 1
        return planned.outcomes

    async def _pipeline(
        self, conn: Connection, statements: Sequence[Statement]
    ) -> list[psycopg.AsyncCursor[DictRow]]:
        """Run the statements in one round trip; their cursors, in order. A statement
        that fails raises `_Rejected` naming it (found as the first without a result)."""
        if not fits_pipeline(statement.params for statement in statements):
            return await self._one_by_one(conn, statements)
        cursors: list[psycopg.AsyncCursor[DictRow]] = []
        self.stats["round_trips"] += 1
        self.stats["statements"] += len(statements)
        sending: Statement | None = None
        error: psycopg.Error | None = None
        try:
            async with conn.pipeline() as pipeline:
                try:
                    for statement in statements:
                        sending = statement
                        cur = conn.cursor()
                        await cur.execute(statement.sql, statement.params or None)
                        cursors.append(cur)
                    sending = None
                    await pipeline.sync()
                except psycopg.Error as exc:
                    error = exc
        except psycopg.Error as exc:
            # Leaving an aborted pipeline fails again ("pipeline aborted"): the first
            # error is the one that tells what happened.
            error = error or exc
        if error is not None:
            raise _Rejected.of(culprit(statements, cursors, sending, error), error) from error
        return cursors

    async def _one_by_one(
        self, conn: Connection, statements: Sequence[Statement]
    ) -> list[psycopg.AsyncCursor[DictRow]]:
        """The statements outside pipeline mode, a round trip each: for a statement too
        large to be pipelined (see `buffered_store.stores.pipelining`)."""
        self.stats["unpipelined"] += 1
        cursors: list[psycopg.AsyncCursor[DictRow]] = []
        for statement in statements:
            self.stats["round_trips"] += 1
            self.stats["statements"] += 1
            cur = conn.cursor()
            try:
                await cur.execute(statement.sql, statement.params or None)
            except psycopg.Error as error:
                raise _Rejected.of(statement, error) from error
            cursors.append(cur)
        return cursors

    async def _prune(self, conn: Connection, work: PruneWork) -> None:
        """A pruning thread's operations, one statement at a time (inside the flush
        transaction, which holds the thread's watermark lock)."""
        for op in work.ops:
            if not isinstance(op, Prune):
                statements = [
                    Statement(sql, params, (work.batch,))
                    for sql, params in flushplan.op_statements(work.thread_id, op)
                ]
                if statements:
                    await self._pipeline(conn, statements)
                continue
            # AsyncPostgresSaver's own keep_latest statements, minus its isolation level.
            steps = _keep_latest(work.thread_id)
            try:
                sql, params, fetch = next(steps)
                while True:
                    rows: list[Any] = []
                    if sql != PRUNE_SNAPSHOT_SQL:
                        [cur] = await self._pipeline(conn, [Statement(sql, params, (work.batch,))])
                        rows = await cur.fetchall() if fetch else []
                    sql, params, fetch = steps.send(rows)
            except StopIteration:
                pass
            except NotImplementedError as exc:  # the thread started using a DeltaChannel
                raise _Rejected((work.batch,), DbFailure.DATA, str(exc), None) from exc


def culprit(
    statements: Sequence[Statement],
    cursors: Sequence[psycopg.AsyncCursor[DictRow]],
    sending: Statement | None,
    error: psycopg.Error,
) -> Statement | None:
    """The statement a failed pipeline failed on.

    The server answers in order, so the statements before it have their results and it
    is the first without one. psycopg reads results as they arrive, also while later
    statements are being queued, so the error may surface while sending another one:
    that one is to blame only for an error of the client's own (no SQLSTATE), such as
    parameters it cannot send.
    """
    if error.sqlstate is None and sending is not None:
        return sending
    for statement, cur in zip(statements, cursors, strict=False):
        if cur.pgresult is None:
            return statement
    return sending


async def _rollback(conn: Connection) -> None:
    """End the failed transaction (the connection stays in the pool)."""
    await conn.execute("ROLLBACK")
