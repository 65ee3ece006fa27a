"""`LangGraphSink`: the engine's `FlushSink` writing LangGraph's own Postgres tables
(``checkpoints``, ``checkpoint_blobs``, ``checkpoint_writes``, created by
``langgraph-checkpoint-postgres``'s ``setup()``) plus one table of ours holding each
thread's watermark, all in one transaction.

The SQL of put and put_writes is AsyncPostgresSaver's own (imported from
``langgraph.checkpoint.postgres.base``), run per entry in seq order, so after a flush the
three tables hold what AsyncPostgresSaver would have written for the same calls.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeAlias

import psycopg
import psycopg_pool
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from langgraph.checkpoint.postgres.base import (
    INSERT_CHECKPOINT_WRITES_SQL,
    PRUNE_DELTA_THREADS_SQL,
    PRUNE_SNAPSHOT_SQL,
    SELECT_SQL,
    UPSERT_CHECKPOINT_BLOBS_SQL,
    UPSERT_CHECKPOINT_WRITES_SQL,
    UPSERT_CHECKPOINTS_SQL,
    _keep_latest,
)
from psycopg.rows import DictRow, dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from buffered_store.engine.entries import chain_after
from buffered_store.engine.flushing import ApplyOutcome, ApplyStatus
from buffered_store.errors import DatabaseUnavailableError
from buffered_store.langgraph.entry import LgEntry, b64, unb64

Connection: TypeAlias = psycopg.AsyncConnection[DictRow]

WATERMARKS = "bufstore_lg_threads"

CREATE_WATERMARKS = f"""
CREATE TABLE IF NOT EXISTS {WATERMARKS} (
    thread_id TEXT PRIMARY KEY,
    flushed_seq BIGINT NOT NULL DEFAULT 0,
    owner TEXT
)"""

CREATE_ROWS = f"""
INSERT INTO {WATERMARKS} (thread_id)
SELECT t FROM unnest(%s::text[]) AS t ORDER BY t COLLATE "C"
ON CONFLICT DO NOTHING"""

LOCK_ROWS = f"""
SELECT thread_id, flushed_seq FROM {WATERMARKS}
WHERE thread_id = ANY(%s) ORDER BY thread_id COLLATE "C" FOR UPDATE"""

SET_WATERMARK = f"UPDATE {WATERMARKS} SET flushed_seq = %s WHERE thread_id = %s"

DELETE_THREAD_SQL = (
    "DELETE FROM checkpoints WHERE thread_id = %s",
    "DELETE FROM checkpoint_blobs WHERE thread_id = %s",
    "DELETE FROM checkpoint_writes WHERE thread_id = %s",
)

RUNS_CHECKPOINTS_SQL = """
DELETE FROM checkpoints WHERE thread_id = %s AND metadata ->> 'run_id' = ANY(%s)
RETURNING checkpoint_ns, checkpoint_id"""

RUNS_WRITES_SQL = """
DELETE FROM checkpoint_writes
WHERE thread_id = %s AND checkpoint_ns = %s AND checkpoint_id = ANY(%s)"""

GARBAGE_BLOBS_SQL = """
DELETE FROM checkpoint_blobs b
WHERE b.thread_id = %s AND b.checkpoint_ns = %s AND NOT EXISTS (
    SELECT 1 FROM checkpoints c
    WHERE c.thread_id = b.thread_id AND c.checkpoint_ns = b.checkpoint_ns
    AND c.checkpoint -> 'channel_versions' ->> b.channel = b.version)"""

COPY_CHECKPOINT_WRITES_SQL = UPSERT_CHECKPOINT_WRITES_SQL

COPY_CHECKPOINTS_SQL = """
SELECT checkpoint_ns, checkpoint_id, parent_checkpoint_id, checkpoint, metadata
FROM checkpoints WHERE thread_id = %s ORDER BY checkpoint_ns, checkpoint_id"""

COPY_BLOBS_SQL = """
SELECT checkpoint_ns, channel, version, type, blob FROM checkpoint_blobs
WHERE thread_id = %s ORDER BY checkpoint_ns, channel, version"""

COPY_WRITES_SQL = """
SELECT checkpoint_ns, checkpoint_id, task_id, task_path, idx, channel, type, blob
FROM checkpoint_writes WHERE thread_id = %s ORDER BY checkpoint_ns, checkpoint_id, task_id, idx"""


class LangGraphSink:
    """Watermark-checked writes of LangGraph entries into LangGraph's Postgres tables
    (the engine's `FlushSink`), and the reads the saver overlays its tail on. Every
    psycopg error that means "Postgres is not there" becomes `DatabaseUnavailableError`.
    """

    def __init__(self, pool: AsyncConnectionPool[Connection], *, timeout_s: float = 30.0) -> None:
        self.pool = pool
        self.timeout_s = timeout_s
        """Longest wait for a pooled connection (`DatabaseUnavailableError` after it)."""
        self.transactions = 0

    @classmethod
    async def open(
        cls, conninfo: str, *, min_size: int = 1, max_size: int = 8, timeout_s: float = 30.0
    ) -> LangGraphSink:
        """A sink on a new pool (closed by `close`)."""
        pool = AsyncConnectionPool(
            conninfo,
            min_size=min_size,
            max_size=max_size,
            open=False,
            connection_class=Connection,
            kwargs={"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row},
        )
        try:
            await pool.open(wait=min_size > 0, timeout=10.0)
        except psycopg_pool.PoolTimeout as exc:
            await pool.close()
            raise DatabaseUnavailableError(f"cannot connect to Postgres: {exc}") from exc
        return cls(pool, timeout_s=timeout_s)

    async def close(self) -> None:
        await self.pool.close()

    @asynccontextmanager
    async def connection(self, what: str) -> AsyncIterator[Connection]:
        """A pooled connection; connection failures raise `DatabaseUnavailableError`."""
        try:
            async with self.pool.connection(timeout=self.timeout_s) as conn:
                yield conn
        except (psycopg.OperationalError, psycopg_pool.PoolTimeout) as exc:
            raise DatabaseUnavailableError(f"{what}: {exc}") from exc

    async def setup(self) -> None:
        """LangGraph's own migrations (AsyncPostgresSaver.setup), then our watermarks."""
        async with self.connection("setup") as conn:
            await AsyncPostgresSaver(conn).setup()
            await conn.execute(CREATE_WATERMARKS)

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
        """One transaction for the batch: watermark rows created, then locked, in code
        point order (concurrent flushers cannot deadlock), each thread's chain applied in
        a savepoint after the entries at or below its watermark are dropped."""
        outcomes: list[ApplyOutcome] = []
        async with self.connection("flush") as conn, conn.transaction():
            self.transactions += 1
            ids = sorted({b[0].thread_id for b in batches if b})
            async with conn.cursor() as cur:
                await cur.execute(CREATE_ROWS, (ids,))
                await cur.execute(LOCK_ROWS, (ids,))
                marks = {r["thread_id"]: r["flushed_seq"] for r in await cur.fetchall()}
            for batch in batches:
                outcomes.append(await self._apply_thread(conn, batch, marks))
        return outcomes

    async def _apply_thread(
        self, conn: Connection, batch: Sequence[LgEntry], marks: dict[str, int]
    ) -> ApplyOutcome:
        if not batch:
            return ApplyOutcome("", ApplyStatus.FAILED, 0, error="empty batch", retriable=False)
        thread_id = batch[0].thread_id
        mark = marks.get(thread_id, 0)
        if not any(e.seq > mark for e in batch):
            return ApplyOutcome(thread_id, ApplyStatus.STALE, mark)
        chain = chain_after(batch, mark)
        if not chain:
            return ApplyOutcome(thread_id, ApplyStatus.GAP, mark, missing_from=mark + 1)
        try:
            # A savepoint: one bad thread fails alone.
            async with conn.transaction(), conn.cursor() as cur:
                for entry in chain:
                    await apply_entry(cur, entry)
                await cur.execute(SET_WATERMARK, (chain[-1].seq, thread_id))
        except (psycopg.DataError, psycopg.IntegrityError, NotImplementedError, ValueError) as exc:
            return ApplyOutcome(
                thread_id,
                ApplyStatus.FAILED,
                mark,
                error=f"{type(exc).__name__}: {exc}",
                retriable=False,
            )
        marks[thread_id] = chain[-1].seq
        return ApplyOutcome(thread_id, ApplyStatus.APPLIED, chain[-1].seq)

    # -- reads ------------------------------------------------------------------------------

    async def read(
        self, thread_id: str, where: str, params: list[Any], *, limit: int | None
    ) -> tuple[int, list[dict[str, Any]]]:
        """The thread's watermark and the rows of ``SELECT_SQL + where`` (newest first),
        read by one statement, so from one snapshot."""
        query = (
            "SELECT w.flushed_seq AS _flushed_seq, c.* FROM (SELECT coalesce((SELECT "
            f"flushed_seq FROM {WATERMARKS} WHERE thread_id = %s), 0) AS flushed_seq) w "
            f"LEFT JOIN LATERAL ({SELECT_SQL} {where} ORDER BY checkpoint_id DESC"
            + (" LIMIT %s" if limit is not None else "")
            + ") c ON true"
        )
        args = [thread_id, *params] + ([limit] if limit is not None else [])
        async with self.connection("read") as conn, conn.cursor(binary=True) as cur:
            await cur.execute(query, args)
            rows = await cur.fetchall()
        flushed = rows[0]["_flushed_seq"] if rows else 0
        return flushed, [r for r in rows if r["checkpoint_id"] is not None]

    async def blobs(
        self, thread_id: str, wanted: Sequence[tuple[str, str, str]]
    ) -> dict[tuple[str, str, str], tuple[str, bytes | None]]:
        """(ns, channel, version) -> (type, blob) of stored blobs."""
        if not wanted:
            return {}
        async with self.connection("read blobs") as conn, conn.cursor(binary=True) as cur:
            await cur.execute(
                "SELECT checkpoint_ns, channel, version, type, blob FROM checkpoint_blobs "
                "WHERE thread_id = %s AND (checkpoint_ns, channel, version) IN "
                "(SELECT * FROM unnest(%s::text[], %s::text[], %s::text[]))",
                (thread_id, *[list(col) for col in zip(*wanted, strict=True)]),
            )
            return {
                (r["checkpoint_ns"], r["channel"], r["version"]): (r["type"], r["blob"])
                for r in await cur.fetchall()
            }

    async def writes(
        self, thread_id: str, keys: Sequence[tuple[str, str]]
    ) -> dict[tuple[str, str], list[tuple[str, int, str, str, bytes | None, str]]]:
        """(ns, checkpoint id) -> [(task_id, idx, channel, type, blob, task_path)]."""
        if not keys:
            return {}
        out: dict[tuple[str, str], list[tuple[str, int, str, str, bytes | None, str]]] = {}
        async with self.connection("read writes") as conn, conn.cursor(binary=True) as cur:
            await cur.execute(
                "SELECT checkpoint_ns, checkpoint_id, task_id, idx, channel, type, blob, "
                "task_path FROM checkpoint_writes WHERE thread_id = %s AND "
                "(checkpoint_ns, checkpoint_id) IN "
                "(SELECT * FROM unnest(%s::text[], %s::text[]))",
                (thread_id, [k[0] for k in keys], [k[1] for k in keys]),
            )
            for r in await cur.fetchall():
                out.setdefault((r["checkpoint_ns"], r["checkpoint_id"]), []).append(
                    (r["task_id"], r["idx"], r["channel"], r["type"], r["blob"], r["task_path"])
                )
        return out

    async def search(self, where: str, params: list[Any], *, limit: int | None) -> list[DictRow]:
        """Rows of ``SELECT_SQL + where`` across threads, newest first (no overlay)."""
        query = SELECT_SQL + where + " ORDER BY checkpoint_id DESC"
        args = [*params]
        if limit is not None:
            query += " LIMIT %s"
            args.append(int(limit))
        async with self.connection("list") as conn, conn.cursor(binary=True) as cur:
            await cur.execute(query, args)
            return await cur.fetchall()

    async def threads_with_runs(self, run_ids: Sequence[str]) -> set[str]:
        """Threads holding a flushed checkpoint of one of the runs."""
        async with self.connection("find runs") as conn:
            cur = await conn.execute(
                "SELECT DISTINCT thread_id FROM checkpoints WHERE metadata ->> 'run_id' = ANY(%s)",
                (list(run_ids),),
            )
            return {r["thread_id"] for r in await cur.fetchall()}

    async def delta_threads(self, thread_ids: Sequence[str]) -> list[str]:
        """Those of the threads that use a DeltaChannel (keep_latest cannot prune them)."""
        ids = list(thread_ids)
        async with self.connection("check prune") as conn:
            cur = await conn.execute(PRUNE_DELTA_THREADS_SQL, (ids, ids))
            return sorted(r["thread_id"] for r in await cur.fetchall())

    async def copy_body(self, thread_id: str) -> dict[str, list[list[Any]]]:
        """Every stored row of the thread, as the body of a ``copy`` entry."""
        async with self.connection("read thread") as conn, conn.cursor(binary=True) as cur:
            await cur.execute(COPY_CHECKPOINTS_SQL, (thread_id,))
            cps = [
                [
                    r["checkpoint_ns"],
                    r["checkpoint_id"],
                    r["parent_checkpoint_id"],
                    r["checkpoint"],
                    r["metadata"],
                ]
                for r in await cur.fetchall()
            ]
            await cur.execute(COPY_BLOBS_SQL, (thread_id,))
            bl = [
                [r["checkpoint_ns"], r["channel"], r["version"], r["type"], b64(r["blob"])]
                for r in await cur.fetchall()
            ]
            await cur.execute(COPY_WRITES_SQL, (thread_id,))
            ws = [
                [
                    r["checkpoint_ns"],
                    r["checkpoint_id"],
                    r["task_id"],
                    r["task_path"],
                    r["idx"],
                    r["channel"],
                    r["type"],
                    b64(r["blob"]),
                ]
                for r in await cur.fetchall()
            ]
        return {"cps": cps, "bl": bl, "ws": ws}


async def apply_entry(cur: psycopg.AsyncCursor[DictRow], entry: LgEntry) -> None:
    """The SQL of one entry (inside the thread's transaction, after the ones before it)."""
    tid, body = entry.thread_id, entry.body
    if entry.kind == "put":
        ns = body["ns"]
        if body["b"]:
            await cur.executemany(
                UPSERT_CHECKPOINT_BLOBS_SQL,
                [(tid, ns, ch, ver, typ, unb64(blob)) for ch, ver, typ, blob in body["b"]],
            )
        await cur.execute(
            UPSERT_CHECKPOINTS_SQL,
            (tid, ns, body["id"], body["pid"], Jsonb(body["cp"]), Jsonb(body["md"])),
        )
    elif entry.kind == "w":
        sql = UPSERT_CHECKPOINT_WRITES_SQL if body["up"] else INSERT_CHECKPOINT_WRITES_SQL
        await cur.executemany(
            sql,
            [
                (tid, body["ns"], body["id"], body["task"], body["path"], idx, ch, typ, unb64(b))
                for idx, ch, typ, b in body["rows"]
            ],
        )
    elif entry.kind == "del":
        for sql in DELETE_THREAD_SQL:
            await cur.execute(sql, (tid,))
    elif entry.kind == "runs":
        await cur.execute(RUNS_CHECKPOINTS_SQL, (tid, body["runs"]))
        gone = await cur.fetchall()
        for ns, group in itertools.groupby(
            sorted((r["checkpoint_ns"], r["checkpoint_id"]) for r in gone), key=lambda r: r[0]
        ):
            await cur.execute(RUNS_WRITES_SQL, (tid, ns, [cid for _, cid in group]))
            await cur.execute(GARBAGE_BLOBS_SQL, (tid, ns))
    elif entry.kind == "prune":
        # AsyncPostgresSaver's own keep_latest statements, minus its isolation level (we
        # are inside the flush transaction, which holds the thread's watermark lock).
        statements = _keep_latest(tid)
        try:
            sql, params, fetch = next(statements)
            while True:
                rows: list[Any] = []
                if sql != PRUNE_SNAPSHOT_SQL:
                    await cur.execute(sql, params, prepare=False)
                    rows = await cur.fetchall() if fetch else []
                sql, params, fetch = statements.send(rows)
        except StopIteration:
            pass
    elif entry.kind == "copy":
        if body["bl"]:
            await cur.executemany(
                UPSERT_CHECKPOINT_BLOBS_SQL,
                [(tid, ns, ch, ver, typ, unb64(b)) for ns, ch, ver, typ, b in body["bl"]],
            )
        if body["cps"]:
            await cur.executemany(
                UPSERT_CHECKPOINTS_SQL,
                [(tid, ns, cid, pid, Jsonb(cp), Jsonb(md)) for ns, cid, pid, cp, md in body["cps"]],
            )
        if body["ws"]:
            await cur.executemany(
                COPY_CHECKPOINT_WRITES_SQL,
                [
                    (tid, ns, cid, task, path, idx, ch, typ, unb64(b))
                    for ns, cid, task, path, idx, ch, typ, b in body["ws"]
                ],
            )
    elif entry.kind == "claim":
        await cur.execute(
            f"UPDATE {WATERMARKS} SET owner = %s WHERE thread_id = %s", (body["owner"], tid)
        )
    else:
        raise ValueError(f"unknown entry kind {entry.kind!r}")
