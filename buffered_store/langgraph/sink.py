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
from collections.abc import Sequence
from typing import Any

import psycopg
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from langgraph.checkpoint.postgres.base import (
    INSERT_CHECKPOINT_WRITES_SQL,
    PRUNE_SNAPSHOT_SQL,
    SELECT_SQL,
    UPSERT_CHECKPOINT_BLOBS_SQL,
    UPSERT_CHECKPOINT_WRITES_SQL,
    UPSERT_CHECKPOINTS_SQL,
    _keep_latest,
)
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from buffered_store.engine.entries import chain_after
from buffered_store.engine.flushing import ApplyOutcome, ApplyStatus
from buffered_store.errors import DatabaseUnavailableError
from buffered_store.langgraph.entry import LgEntry, unb64

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


class LangGraphSink:
    """Watermark-checked writes of LangGraph entries into LangGraph's Postgres tables."""

    def __init__(self, pool: AsyncConnectionPool) -> None:
        self.pool = pool
        self.transactions = 0

    @classmethod
    async def open(cls, conninfo: str, *, min_size: int = 1, max_size: int = 8) -> LangGraphSink:
        pool = AsyncConnectionPool(
            conninfo,
            min_size=min_size,
            max_size=max_size,
            open=False,
            kwargs={"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row},
        )
        await pool.open()
        return cls(pool)

    async def close(self) -> None:
        await self.pool.close()

    async def setup(self) -> None:
        """LangGraph's own migrations (AsyncPostgresSaver.setup), then our watermarks."""
        async with self.pool.connection() as conn:
            await AsyncPostgresSaver(conn).setup()  # type: ignore[arg-type]
            await conn.execute(CREATE_WATERMARKS)

    # -- FlushSink ------------------------------------------------------------------------

    async def flushed_seqs(self, thread_ids: Sequence[str]) -> dict[str, int]:
        out = dict.fromkeys(thread_ids, 0)
        if not thread_ids:
            return out
        try:
            async with self.pool.connection() as conn:
                cur = await conn.execute(
                    f"SELECT thread_id, flushed_seq FROM {WATERMARKS} WHERE thread_id = ANY(%s)",
                    (list(thread_ids),),
                )
                for row in await cur.fetchall():
                    out[row["thread_id"]] = row["flushed_seq"]
        except psycopg.OperationalError as exc:
            raise DatabaseUnavailableError(str(exc)) from exc
        return out

    async def apply(self, batches: Sequence[Sequence[LgEntry]]) -> list[ApplyOutcome]:
        outcomes: list[ApplyOutcome] = []
        try:
            async with self.pool.connection() as conn, conn.transaction():
                self.transactions += 1
                ids = sorted({b[0].thread_id for b in batches if b})
                async with conn.cursor() as cur:
                    await cur.execute(CREATE_ROWS, (ids,))
                    await cur.execute(LOCK_ROWS, (ids,))
                    marks = {r["thread_id"]: r["flushed_seq"] for r in await cur.fetchall()}
                for batch in batches:
                    outcomes.append(await self._apply_thread(conn, batch, marks))
        except psycopg.OperationalError as exc:
            raise DatabaseUnavailableError(str(exc)) from exc
        return outcomes

    async def _apply_thread(
        self, conn: psycopg.AsyncConnection[Any], batch: Sequence[LgEntry], marks: dict[str, int]
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
            async with conn.transaction():  # a savepoint: one bad thread fails alone
                async with conn.cursor() as cur:
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
        try:
            async with self.pool.connection() as conn, conn.cursor(binary=True) as cur:
                await cur.execute(query, args)
                rows = await cur.fetchall()
        except psycopg.OperationalError as exc:
            raise DatabaseUnavailableError(str(exc)) from exc
        flushed = rows[0]["_flushed_seq"] if rows else 0
        return flushed, [r for r in rows if r["checkpoint_id"] is not None]

    async def blobs(
        self, thread_id: str, wanted: Sequence[tuple[str, str, str]]
    ) -> dict[tuple[str, str, str], tuple[str, bytes | None]]:
        """(ns, channel, version) -> (type, blob) of stored blobs."""
        if not wanted:
            return {}
        async with self.pool.connection() as conn, conn.cursor(binary=True) as cur:
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
    ) -> dict[tuple[str, str], list[tuple[str, int, str, str, bytes, str]]]:
        """(ns, checkpoint id) -> [(task_id, idx, channel, type, blob, task_path)]."""
        if not keys:
            return {}
        out: dict[tuple[str, str], list[tuple[str, int, str, str, bytes, str]]] = {}
        async with self.pool.connection() as conn, conn.cursor(binary=True) as cur:
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


async def apply_entry(cur: psycopg.AsyncCursor[Any], entry: LgEntry) -> None:
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
