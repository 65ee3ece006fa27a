"""`list(None, ...)` of the LangGraph front-end: a search across every thread with the
unflushed entries of the pending threads folded on, without flushing them.

The saver finds the pending threads (`PendingIndex.scan`) and their unflushed entries;
then one statement reads, from one snapshot, each pending thread's watermark and its
newest matching rows, plus the newest matching rows of every other thread; one more
round reads the stored blobs and writes the pending checkpoints refer to. Each pending
thread's tail is folded on its rows as a read of that thread would (`overlay`), and the
threads' answers are merged newest first, as AsyncPostgresSaver's query orders them.

Query building and merging are pure; `read_rows` and `read_parts` only execute.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from langgraph.checkpoint.postgres.base import SELECT_SQL

from buffered_store.langgraph import overlay
from buffered_store.langgraph.entry import LgEntry, Put
from buffered_store.langgraph.flushplan import WATERMARKS
from buffered_store.langgraph.sink import LangGraphSink

Row = dict[str, Any]


def _and(where: str, predicate: str) -> str:
    """``where`` (a WHERE clause or nothing) with one more predicate."""
    return f"{where} AND {predicate}" if where.strip() else f"WHERE {predicate}"


def rows_query(
    where: str, params: Sequence[Any], pending: Mapping[str, int | None], limit: int | None
) -> tuple[str, list[Any]]:
    """One statement: for each pending thread its watermark (``_flushed_seq``) and its
    newest matching rows (up to its own limit: the page plus the rows its tail may
    replace), tagged ``_pending``; then the newest `limit` matching rows of the other
    threads (``_pending`` null)."""
    ids = list(pending)
    mine = _and(where, "checkpoints.thread_id = p.thread_id")
    others = _and(where, "NOT (thread_id = ANY(%s))")
    query = (
        "SELECT p.thread_id AS _pending, coalesce(w.flushed_seq, 0) AS _flushed_seq, c.* "
        "FROM unnest(%s::text[], %s::bigint[]) AS p(thread_id, lim) "
        f"LEFT JOIN {WATERMARKS} w ON w.thread_id = p.thread_id "
        f"LEFT JOIN LATERAL ({SELECT_SQL} {mine} ORDER BY checkpoint_id DESC LIMIT p.lim) c "
        "ON true "
        "UNION ALL "
        "SELECT NULL::text, NULL::bigint, o.* FROM "
        f"({SELECT_SQL} {others} ORDER BY checkpoint_id DESC LIMIT %s) o"
    )
    args = [ids, [pending[t] for t in ids], *params, *params, ids, limit]
    return query, args


@dataclass(slots=True)
class Found:
    """What the statement of `rows_query` returned."""

    flushed: dict[str, int] = field(default_factory=dict)
    """Pending thread -> its watermark in the statement's snapshot."""
    pending_rows: dict[str, list[Row]] = field(default_factory=dict)
    other_rows: list[Row] = field(default_factory=list)


def split(rows: Sequence[Row]) -> Found:
    """The rows of `rows_query`, by thread."""
    found = Found()
    for row in rows:
        thread_id = row.pop("_pending")
        flushed = row.pop("_flushed_seq")
        if thread_id is None:
            found.other_rows.append(row)
            continue
        found.flushed[thread_id] = flushed
        rows_of = found.pending_rows.setdefault(thread_id, [])
        if row["checkpoint_id"] is not None:
            rows_of.append(row)
    return found


def own_limit(chain: Sequence[LgEntry], limit: int | None) -> int | None:
    """Stored rows a pending thread needs for a page of `limit`: the page plus one per
    checkpoint its tail puts (each may replace a stored row with the same key)."""
    if limit is None:
        return None
    return limit + sum(isinstance(op, Put) for entry in chain for op in entry.ops)


@dataclass(frozen=True, slots=True)
class Chosen:
    """A row of the answer: its thread's tail (None: the thread has nothing pending)."""

    thread_id: str
    row: Row
    tail: overlay.Tail | None


def merge(
    found: Found,
    chains: Mapping[str, Sequence[LgEntry]],
    *,
    before_id: str | None,
    metadata_filter: Mapping[str, Any] | None,
    limit: int | None,
    order: overlay.Order = overlay.CODE_POINT,
) -> list[Chosen]:
    """The answer's rows, newest first in the database's `order` of checkpoint ids: each
    pending thread's entries above its watermark folded on its rows (`overlay.merge`),
    and the other threads' rows."""
    chosen: list[Chosen] = [Chosen(r["thread_id"], r, None) for r in found.other_rows]
    for thread_id, chain in chains.items():
        flushed = found.flushed.get(thread_id, 0)
        tail = overlay.fold([e for e in chain if e.seq > flushed])
        for row in overlay.merge(
            found.pending_rows.get(thread_id, []),
            tail,
            thread_id,
            ns=None,
            checkpoint_id=None,
            before_id=before_id,
            metadata_filter=metadata_filter,
            limit=limit,
            order=order,
        ):
            chosen.append(Chosen(thread_id, row, tail))
    chosen.sort(key=lambda c: order.key(c.row["checkpoint_id"]), reverse=True)
    return chosen if limit is None else chosen[:limit]


def wanted(
    chosen: Sequence[Chosen],
) -> tuple[list[tuple[str, str, str, str]], list[tuple[str, str, str]]]:
    """The stored blobs and writes the answer's pending rows need, keyed by thread."""
    blobs: set[tuple[str, str, str, str]] = set()
    writes: set[tuple[str, str, str]] = set()
    for c in chosen:
        if c.tail is None or c.tail.deleted or not c.row.get("_pending"):
            continue
        blob_keys, write_keys = overlay.wanted([c.row], c.tail)
        blobs.update((c.thread_id, *k) for k in blob_keys)
        writes.update((c.thread_id, *k) for k in write_keys)
    return sorted(blobs), sorted(writes)


# -- execution --------------------------------------------------------------------------------


async def read_rows(
    sink: LangGraphSink,
    where: str,
    params: Sequence[Any],
    pending: Mapping[str, int | None],
    limit: int | None,
) -> Found:
    """Run `rows_query` (one statement: one snapshot)."""
    query, args = rows_query(where, params, pending, limit)
    async with sink.connection("list") as conn, conn.cursor(binary=True) as cur:
        await cur.execute(query, args)
        return split(await cur.fetchall())


BLOBS_SQL = (
    "SELECT b.thread_id, b.checkpoint_ns, b.channel, b.version, b.type, b.blob "
    "FROM checkpoint_blobs b JOIN unnest(%s::text[], %s::text[], %s::text[], %s::text[]) "
    "AS k(thread_id, checkpoint_ns, channel, version) USING "
    "(thread_id, checkpoint_ns, channel, version)"
)
WRITES_SQL = (
    "SELECT w.thread_id, w.checkpoint_ns, w.checkpoint_id, w.task_id, w.idx, w.channel, "
    "w.type, w.blob, w.task_path FROM checkpoint_writes w "
    "JOIN unnest(%s::text[], %s::text[], %s::text[]) AS k(thread_id, checkpoint_ns, "
    "checkpoint_id) USING (thread_id, checkpoint_ns, checkpoint_id)"
)
PARENTS_SQL = (
    "SELECT c.thread_id, c.checkpoint_ns, c.checkpoint_id, c.parent_checkpoint_id "
    "FROM checkpoints c JOIN unnest(%s::text[], %s::text[], %s::text[]) AS k(thread_id, "
    "checkpoint_ns, checkpoint_id) USING (thread_id, checkpoint_ns, checkpoint_id)"
)


async def read_blobs(
    sink: LangGraphSink, keys: Sequence[tuple[str, str, str, str]]
) -> dict[str, dict[overlay.BlobKey, tuple[str, bytes | None]]]:
    """thread -> (ns, channel, version) -> (type, blob), for every thread at once."""
    out: dict[str, dict[overlay.BlobKey, tuple[str, bytes | None]]] = {}
    if not keys:
        return out
    async with sink.connection("list blobs") as conn, conn.cursor(binary=True) as cur:
        await cur.execute(BLOBS_SQL, [list(col) for col in zip(*keys, strict=True)])
        for r in await cur.fetchall():
            out.setdefault(r["thread_id"], {})[(r["checkpoint_ns"], r["channel"], r["version"])] = (
                r["type"],
                r["blob"],
            )
    return out


async def read_writes(
    sink: LangGraphSink, keys: Sequence[tuple[str, str, str]]
) -> tuple[
    dict[str, dict[overlay.WriteKey, list[overlay.StoredWrite]]],
    dict[str, dict[overlay.WriteKey, str | None]],
]:
    """For the checkpoints (thread, ns, id) of unflushed puts, every thread at once, in one
    round trip: thread -> (ns, id) -> their stored writes, and thread -> (ns, id) -> the
    parents of those already stored (a put again keeps its first parent)."""
    writes: dict[str, dict[overlay.WriteKey, list[overlay.StoredWrite]]] = {}
    parents: dict[str, dict[overlay.WriteKey, str | None]] = {}
    if not keys:
        return writes, parents
    args = [list(col) for col in zip(*keys, strict=True)]
    async with sink.connection("list writes") as conn:
        async with conn.pipeline():
            found = conn.cursor(binary=True)
            await found.execute(WRITES_SQL, args)
            stored = conn.cursor(binary=True)
            await stored.execute(PARENTS_SQL, args)
        for r in await found.fetchall():
            writes.setdefault(r["thread_id"], {}).setdefault(
                (r["checkpoint_ns"], r["checkpoint_id"]), []
            ).append((r["task_id"], r["idx"], r["channel"], r["type"], r["blob"], r["task_path"]))
        for r in await stored.fetchall():
            parents.setdefault(r["thread_id"], {})[(r["checkpoint_ns"], r["checkpoint_id"])] = r[
                "parent_checkpoint_id"
            ]
    return writes, parents
