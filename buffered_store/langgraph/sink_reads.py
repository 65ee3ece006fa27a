"""The reads of `LangGraphSink`: LangGraph's rows as AsyncPostgresSaver reads them (its
own SQL where it has one), which the saver lays its unflushed tail over, and the
database's text order the merges need. No writes: those are `langgraph.sink`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

import psycopg
from langgraph.checkpoint.postgres.base import (
    PRUNE_DELTA_THREADS_SQL,
    SELECT_PENDING_SENDS_SQL,
    SELECT_SQL,
)
from langgraph.checkpoint.serde.types import TASKS
from psycopg.rows import DictRow

from buffered_store.langgraph.entry import Copy
from buffered_store.langgraph.flushplan import WATERMARKS
from buffered_store.langgraph.overlay import BlobKey, ParentWrite, StoredWrite, WriteKey

Connection = psycopg.AsyncConnection[DictRow]

SENDS_COLUMN = f"""
CASE WHEN jsonb_typeof(c.checkpoint -> 'v') = 'number' AND (c.checkpoint -> 'v') < '4'::jsonb
    AND c.parent_checkpoint_id <> '' THEN (
    SELECT array_agg(array[s.type::bytea, s.blob] ORDER BY s.task_path, s.task_id, s.idx)
    FROM checkpoint_writes s
    WHERE s.thread_id = c.thread_id AND s.checkpoint_id = c.parent_checkpoint_id
        AND s.channel = '{TASKS}'
) END AS _sends"""
"""A stored row's pending sends, as AsyncPostgresSaver's ``SELECT_PENDING_SENDS_SQL``
finds them (its parent's ``__pregel_tasks`` writes in any namespace, in the database's
order), read with the row: only for checkpoints before format 4 that have a parent."""

PARENT_WRITES_SQL = f"""
SELECT checkpoint_ns, checkpoint_id, task_id, idx, channel, type, blob, task_path
FROM checkpoint_writes
WHERE thread_id = %s AND checkpoint_id = ANY(%s) AND (channel = '{TASKS}'
    OR (checkpoint_ns, checkpoint_id, task_id, idx) IN
        (SELECT * FROM unnest(%s::text[], %s::text[], %s::text[], %s::int[])))"""

CODE_POINT_LOCALES = frozenset({"C", "POSIX", "C.UTF-8", "C.utf8", "C.UTF8", "C.utf-8"})
"""Locales whose collation orders text by code point (byte order of UTF-8)."""

COLLATION_SQL = "SELECT to_jsonb(d) AS db FROM pg_database d WHERE datname = current_database()"
"""The database's default collation, through ``to_jsonb`` so that columns a version
lacks (``datlocprovider`` before 15, ``datlocale`` before 17) are just missing."""

BLOBS_SQL = """
SELECT checkpoint_ns, channel, version, type, blob FROM checkpoint_blobs
WHERE thread_id = %s AND (checkpoint_ns, channel, version) IN
    (SELECT * FROM unnest(%s::text[], %s::text[], %s::text[]))"""

WRITES_SQL = """
SELECT checkpoint_ns, checkpoint_id, task_id, idx, channel, type, blob, task_path
FROM checkpoint_writes WHERE thread_id = %s AND (checkpoint_ns, checkpoint_id) IN
    (SELECT * FROM unnest(%s::text[], %s::text[]))"""

STORED_PARENTS_SQL = """
SELECT checkpoint_ns, checkpoint_id, parent_checkpoint_id FROM checkpoints
WHERE thread_id = %s AND (checkpoint_ns, checkpoint_id) IN
    (SELECT * FROM unnest(%s::text[], %s::text[]))"""


WRITE_COLUMNS = ("task_id", "idx", "channel", "type", "blob", "task_path")
STORED_WRITE = itemgetter(*WRITE_COLUMNS)
"""A checkpoint_writes row as a `StoredWrite`."""
PARENT_WRITE = itemgetter("checkpoint_ns", "checkpoint_id", *WRITE_COLUMNS)
"""A checkpoint_writes row as a `ParentWrite`."""
HISTORY_WRITE = itemgetter("checkpoint_id", *WRITE_COLUMNS)
"""A checkpoint_writes row as `history_writes` gives it."""


@dataclass(slots=True)
class TailRows:
    """The stored rows an overlay read needs besides the checkpoints (`tail_rows`)."""

    blobs: dict[BlobKey, tuple[str, bytes | None]] = field(default_factory=dict)
    """(ns, channel, version) -> (type, blob)."""
    writes: dict[WriteKey, list[StoredWrite]] = field(default_factory=dict)
    """(ns, checkpoint id) -> its stored writes."""
    parents: dict[WriteKey, str | None] = field(default_factory=dict)
    """(ns, checkpoint id) -> parent id, of the checkpoints asked for that are stored."""
    at_parents: list[ParentWrite] = field(default_factory=list)
    """The writes at the parents asked for (`parent_writes`)."""


HISTORY_WRITES_SQL = """
SELECT checkpoint_id, task_id, idx, channel, type, blob, task_path FROM checkpoint_writes
WHERE thread_id = %s AND checkpoint_ns = %s AND (
    (channel, checkpoint_id) IN (SELECT * FROM unnest(%s::text[], %s::text[]))
    OR (checkpoint_id, task_id, idx) IN
        (SELECT * FROM unnest(%s::text[], %s::text[], %s::int[])))"""

RANKS_SQL = "SELECT array_agg(t ORDER BY t) AS ranked FROM unnest(%s::text[]) AS t"

COPY_CHECKPOINTS_SQL = """
SELECT checkpoint_ns, checkpoint_id, parent_checkpoint_id,
    checkpoint::text AS checkpoint, metadata::text AS metadata
FROM checkpoints WHERE thread_id = %s ORDER BY checkpoint_ns, checkpoint_id"""

COPY_BLOBS_SQL = """
SELECT checkpoint_ns, channel, version, type, blob FROM checkpoint_blobs
WHERE thread_id = %s ORDER BY checkpoint_ns, channel, version"""

COPY_WRITES_SQL = """
SELECT checkpoint_ns, checkpoint_id, task_id, task_path, idx, channel, type, blob
FROM checkpoint_writes WHERE thread_id = %s ORDER BY checkpoint_ns, checkpoint_id, task_id, idx"""


def orders_by_code_point(db: dict[str, Any]) -> bool:
    """Whether a database's default collation (its ``pg_database`` row) orders text by
    code point, as Python compares strings."""
    provider = db.get("datlocprovider") or "c"
    if provider == "b":  # the builtin provider (17+): C, C.UTF-8, PG_UNICODE_FAST
        return True
    return provider == "c" and db.get("datcollate") in CODE_POINT_LOCALES


class SinkReads:
    """Reads over the sink's pooled connections (`connection`, the sink's)."""

    code_point_order: bool | None
    """Whether the database orders text by code point (`collation`); None until known."""

    def connection(self, what: str) -> AbstractAsyncContextManager[Connection]:
        raise NotImplementedError

    async def read(
        self, thread_id: str, where: str, params: list[Any], *, limit: int | None
    ) -> tuple[int, list[dict[str, Any]]]:
        """The thread's watermark and the rows of ``SELECT_SQL + where`` (newest first),
        read by one statement, so from one snapshot."""
        query = (
            f"SELECT w.flushed_seq AS _flushed_seq, c.*, {SENDS_COLUMN} "
            "FROM (SELECT coalesce((SELECT "
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
        return (await self.tail_rows(thread_id, blob_keys=wanted)).blobs

    async def parent_writes(
        self, thread_id: str, parents: Sequence[str], touched: Sequence[tuple[str, str, str, int]]
    ) -> list[ParentWrite]:
        """Writes at the checkpoint ids `parents` (any namespace): the ``__pregel_tasks``
        ones and those at the (ns, id, task, idx) keys `touched` by unflushed writes, as
        (ns, checkpoint id, task, idx, channel, type, blob, task_path)."""
        return (await self.tail_rows(thread_id, parents=parents, touched=touched)).at_parents

    async def tail_rows(
        self,
        thread_id: str,
        *,
        blob_keys: Sequence[tuple[str, str, str]] = (),
        write_keys: Sequence[tuple[str, str]] = (),
        parents: Sequence[str] = (),
        touched: Sequence[tuple[str, str, str, int]] = (),
    ) -> TailRows:
        """What an overlay read takes from Postgres besides the checkpoint rows, in one
        round trip on one connection, in a pipeline of the statements with something to
        ask (none: no connection): the stored blobs of `blob_keys`; the stored writes of
        the checkpoints `write_keys` and the parents of those already stored (a put again
        keeps its first parent); the writes at `parents` (`parent_writes`)."""
        out = TailRows()
        if not (blob_keys or write_keys or parents):
            return out
        async with self.connection("read the tail's rows") as conn:
            async with conn.pipeline():
                blobs = writes = stored = at_parents = None
                if blob_keys:
                    blobs = conn.cursor(binary=True)
                    columns = [list(col) for col in zip(*blob_keys, strict=True)]
                    await blobs.execute(BLOBS_SQL, (thread_id, *columns))
                if write_keys:
                    keyed = (thread_id, [k[0] for k in write_keys], [k[1] for k in write_keys])
                    writes, stored = conn.cursor(binary=True), conn.cursor(binary=True)
                    await writes.execute(WRITES_SQL, keyed)
                    await stored.execute(STORED_PARENTS_SQL, keyed)
                if parents:
                    at_parents = conn.cursor(binary=True)
                    columns = (
                        [list(col) for col in zip(*touched, strict=True)] if touched else [[]] * 4
                    )
                    await at_parents.execute(
                        PARENT_WRITES_SQL, (thread_id, list(parents), *columns)
                    )
            if blobs is not None:
                for r in await blobs.fetchall():
                    out.blobs[(r["checkpoint_ns"], r["channel"], r["version"])] = (
                        r["type"],
                        r["blob"],
                    )
            if writes is not None and stored is not None:
                for r in await writes.fetchall():
                    out.writes.setdefault((r["checkpoint_ns"], r["checkpoint_id"]), []).append(
                        STORED_WRITE(r)
                    )
                for r in await stored.fetchall():
                    out.parents[(r["checkpoint_ns"], r["checkpoint_id"])] = r[
                        "parent_checkpoint_id"
                    ]
            if at_parents is not None:
                out.at_parents = [PARENT_WRITE(r) for r in await at_parents.fetchall()]
        return out

    async def pending_sends(
        self, thread_id: str, parents: Sequence[str]
    ) -> dict[str, list[tuple[bytes, bytes]]]:
        """AsyncPostgresSaver's own lookup of pending sends (``SELECT_PENDING_SENDS_SQL``):
        parent checkpoint id -> [(type, blob)], in the database's order."""
        async with self.connection("read sends") as conn, conn.cursor(binary=True) as cur:
            await cur.execute(SELECT_PENDING_SENDS_SQL, (thread_id, list(parents)))
            return {r["checkpoint_id"]: r["sends"] for r in await cur.fetchall()}

    async def history_walk(self, sql: str, params: dict[str, Any]) -> list[DictRow]:
        """The rows of a delta-history walk (`langgraph.history.walk_sql`)."""
        async with self.connection("read history") as conn, conn.cursor(binary=True) as cur:
            await cur.execute(sql, params)
            return await cur.fetchall()

    async def history_writes(
        self,
        thread_id: str,
        ns: str,
        pairs: Sequence[tuple[str, str]],
        touched: Sequence[tuple[str, str, int]],
    ) -> list[tuple[str, str, int, str, str, bytes, str]]:
        """Writes of the namespace with a (channel, checkpoint id) of `pairs` or a
        (checkpoint id, task, idx) of `touched`, as (checkpoint id, task, idx, channel,
        type, blob, task_path)."""
        if not pairs and not touched:
            return []
        by_pair = [list(col) for col in zip(*pairs, strict=True)] if pairs else [[], []]
        by_key = [list(col) for col in zip(*touched, strict=True)] if touched else [[], [], []]
        async with self.connection("read history") as conn, conn.cursor(binary=True) as cur:
            await cur.execute(HISTORY_WRITES_SQL, (thread_id, ns, *by_pair, *by_key))
            return [HISTORY_WRITE(r) for r in await cur.fetchall()]

    async def collation(self) -> bool:
        """Whether the database orders text by code point (read once, then cached)."""
        if self.code_point_order is None:
            async with self.connection("read collation") as conn:
                row = await (await conn.execute(COLLATION_SQL)).fetchone()
            self.code_point_order = row is not None and orders_by_code_point(row["db"])
        return self.code_point_order

    async def collation_ranks(self, texts: Sequence[str]) -> dict[str, int]:
        """Each text's position among `texts` sorted by the database's collation."""
        async with self.connection("order ids") as conn:
            row = await (await conn.execute(RANKS_SQL, (sorted(set(texts)),))).fetchone()
        ranked = (row["ranked"] if row is not None else None) or []
        return {text: rank for rank, text in enumerate(ranked)}

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

    async def copy_rows(self, thread_id: str) -> Copy:
        """Every stored row of the thread, as a `Copy` operation (JSON as stored)."""
        async with self.connection("read thread") as conn, conn.cursor(binary=True) as cur:
            await cur.execute(COPY_CHECKPOINTS_SQL, (thread_id,))
            cps = tuple(
                (
                    r["checkpoint_ns"],
                    r["checkpoint_id"],
                    r["parent_checkpoint_id"],
                    r["checkpoint"].encode(),
                    r["metadata"].encode(),
                )
                for r in await cur.fetchall()
            )
            await cur.execute(COPY_BLOBS_SQL, (thread_id,))
            blobs = tuple(
                (r["checkpoint_ns"], r["channel"], r["version"], r["type"], r["blob"])
                for r in await cur.fetchall()
            )
            await cur.execute(COPY_WRITES_SQL, (thread_id,))
            writes = tuple(
                (
                    r["checkpoint_ns"],
                    r["checkpoint_id"],
                    r["task_id"],
                    r["task_path"],
                    r["idx"],
                    r["channel"],
                    r["type"],
                    r["blob"],
                )
                for r in await cur.fetchall()
            )
        return Copy(cps, blobs, writes)
