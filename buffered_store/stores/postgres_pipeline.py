"""Sends the steps of `postgres_apply` on a raw psycopg connection, in pipeline mode.

The thin awaiting layer of `apply()`: it decides nothing. One `send` is one pipeline,
ended by one ``Sync``: one round trip, however many statements it holds. Should the
database reject a statement, psycopg raises the error when the pipeline ends; the
statements before it have results and the one that failed (and those after it, which
the server skipped) have none, which tells `failed_batch` whose data it was.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Any

import psycopg
from psycopg import AsyncCursor
from psycopg.pq import TransactionStatus
from psycopg.rows import namedtuple_row

from buffered_store.stores.pipelining import fits_pipeline
from buffered_store.stores.postgres_apply import ROLLBACK, Step, StepResult

__all__ = ["PipelineConnection"]

_IN_TRANSACTION = (TransactionStatus.INTRANS, TransactionStatus.INERROR)


class PipelineConnection:
    """A pooled psycopg connection in autocommit mode, driven by `apply()`: it sends its
    own ``BEGIN``/``COMMIT``/``ROLLBACK``. Counts ``round_trips`` and ``statements``."""

    def __init__(self, pg: psycopg.AsyncConnection[Any], stats: MutableMapping[str, int]) -> None:
        self._pg = pg
        self._stats = stats
        self._failed: tuple[Sequence[Step], int] | None = None

    @property
    def in_transaction(self) -> bool:
        """Whether a transaction is open (possibly aborted by an error)."""
        return self._pg.info.transaction_status in _IN_TRANSACTION

    async def send(self, steps: Sequence[Step]) -> list[StepResult]:
        """Execute `steps` in one pipeline (one round trip); their results, in order.

        Errors are raised as psycopg raises them; `failed_batch` then names the batch
        whose statement failed.
        """
        self._failed = None
        if not fits_pipeline(step.params for step in steps):
            return await self._one_by_one(steps)
        cursors: list[AsyncCursor[Any]] = []
        failure: psycopg.Error | None = None
        try:
            async with self._pg.pipeline():
                for step in steps:
                    cursor = self._pg.cursor(row_factory=namedtuple_row)
                    cursors.append(cursor)
                    try:
                        await cursor.execute(step.sql, step.params)
                    except psycopg.Error as error:
                        # psycopg raises a statement's error as soon as it reads it, here
                        # from a later statement: stop there and let the pipeline end
                        # normally (ending it with an error in flight logs a warning).
                        failure = error
                        break
        except psycopg.Error as error:
            failure = failure or error  # the first error; then "pipeline aborted"
        finally:
            self._stats["round_trips"] += 1
            # BEGIN, COMMIT and ROLLBACK (the steps without parameters) are not counted.
            self._stats["statements"] += sum(step.params is not None for step in steps)
        if failure is not None:
            failed = next((i for i, c in enumerate(cursors) if c.pgresult is None), None)
            if failed is not None:
                self._failed = (steps, failed)
            self._forget_prepared()
            raise failure
        return [
            StepResult(cursor.rowcount, await cursor.fetchall() if step.rows else [])
            for step, cursor in zip(steps, cursors, strict=True)
        ]

    async def _one_by_one(self, steps: Sequence[Step]) -> list[StepResult]:
        """`send` outside pipeline mode, a round trip per statement: for a statement too
        large to be pipelined (see `buffered_store.stores.pipelining`)."""
        self._stats["unpipelined"] += 1
        results: list[StepResult] = []
        for index, step in enumerate(steps):
            self._stats["round_trips"] += 1
            self._stats["statements"] += step.params is not None
            cursor = self._pg.cursor(row_factory=namedtuple_row)
            try:
                await cursor.execute(step.sql, step.params)
            except psycopg.Error:
                self._failed = (steps, index)
                raise
            results.append(
                StepResult(cursor.rowcount, await cursor.fetchall() if step.rows else [])
            )
        return results

    def _forget_prepared(self) -> None:
        """After a pipeline the server aborted: forget which statements psycopg prepared,
        and have it deallocate them all before its next statement.

        psycopg (3.3) counts a statement as prepared once it has queued its ``Parse`` in
        a pipeline, and does not take that back when the server skips the ``Parse``
        because an earlier statement of the pipeline failed: the statement's next use
        would then name a prepared statement that does not exist. Its own remedy, which
        it applies when a ``ROLLBACK`` it tracks comes back, is to clear its cache
        (``DEALLOCATE ALL`` goes out with the next statement); the same is done here. The
        cache is psycopg's private ``_prepared``: without it (another psycopg), nothing
        is done."""
        prepared = getattr(self._pg, "_prepared", None)
        clear = getattr(prepared, "clear", None)
        if callable(clear):
            clear()

    def failed_batch(self) -> int | None:
        """The batch whose statement failed in the last `send` (None: none did, or the
        statement was the transaction's own, or several batches')."""
        if self._failed is None:
            return None
        steps, index = self._failed
        return steps[index].batch

    def failed_step(self) -> int | None:
        """Index of the statement that failed in the last `send` (None: none did)."""
        return None if self._failed is None else self._failed[1]

    async def execute(self, step: Step) -> None:
        """Execute one statement on its own (one round trip)."""
        self._stats["round_trips"] += 1
        await self._pg.execute(step.sql, step.params)

    async def release(self) -> bool:
        """End an open transaction with ``ROLLBACK``; whether the connection is clean
        (idle, outside a transaction) and can go back to the pool."""
        if self._pg.closed or self._pg.broken:
            return False
        status = self._pg.info.transaction_status
        if status in _IN_TRANSACTION:
            try:
                await self.execute(ROLLBACK)
            except psycopg.Error:
                return False
            status = self._pg.info.transaction_status
        return status == TransactionStatus.IDLE
