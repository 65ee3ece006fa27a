"""What one flush transaction of the LangGraph sink executes: the statements of a batch
of threads, built from their entries and locked watermarks. Pure: no I/O.

The sink (`langgraph.sink`) runs a batch in two round trips: it locks the watermark rows
(reading the stored bases of delta blobs in the same pipeline), then pipelines every
statement this module plans plus ``COMMIT``. Rows are LangGraph's own, exactly what
AsyncPostgresSaver's per-call statements (``langgraph.checkpoint.postgres.base``) leave
behind for the same calls:

- *Merged* (the default): the threads whose entries only put and write, with no key
  written twice, share one statement per table (``unnest`` of column arrays, sent in
  binary): with no key repeated, applying the rows at once equals applying them call by
  call. The watermarks of all threads are raised by one statement.
- *Isolated*: every thread gets statements of its own, operation by operation in seq
  order (and its own watermark statement), so a statement the database rejects names
  its thread. The sink switches to it when a merged statement fails, finds the culprit,
  and applies the others without it.

Threads whose entries prune (``keep_latest``) run after the pipeline, statement by
statement (`PruneWork`): that operation reads rows to decide what to delete.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from buffered_store.engine.entries import chain_after
from buffered_store.engine.flushing import ApplyOutcome, ApplyStatus
from buffered_store.errors import CorruptEntryError
from buffered_store.langgraph.entry import (
    BlobRow,
    Claim,
    Copy,
    Delete,
    LgEntry,
    Op,
    Prune,
    Put,
    Runs,
    Writes,
    delta_blob,
)
from buffered_store.stores.pipelining import chunks, payload_bytes

WATERMARKS = "bufstore_lg_threads"

BlobKey = tuple[str, str, str]
"""(checkpoint_ns, channel, version) of a blob of one thread."""

CREATE_ROWS = f"""
INSERT INTO {WATERMARKS} (thread_id)
SELECT t FROM unnest(%b::text[]) AS t ORDER BY t COLLATE "C"
ON CONFLICT DO NOTHING"""

LOCK_ROWS = f"""
SELECT thread_id, flushed_seq FROM {WATERMARKS}
WHERE thread_id = ANY(%b::text[]) ORDER BY thread_id COLLATE "C" FOR UPDATE"""

SELECT_BASES = """
SELECT b.thread_id, b.checkpoint_ns, b.channel, b.version, b.blob
FROM unnest(%b::text[], %b::text[], %b::text[], %b::text[]) AS k(t, ns, ch, ver)
JOIN checkpoint_blobs b
  ON b.thread_id = k.t AND b.checkpoint_ns = k.ns AND b.channel = k.ch AND b.version = k.ver"""

INSERT_BLOBS = """
INSERT INTO checkpoint_blobs (thread_id, checkpoint_ns, channel, version, type, blob)
SELECT * FROM unnest(%b::text[], %b::text[], %b::text[], %b::text[], %b::text[], %b::bytea[])
ON CONFLICT (thread_id, checkpoint_ns, channel, version) DO NOTHING"""

INSERT_CHECKPOINTS = """
INSERT INTO checkpoints
    (thread_id, checkpoint_ns, checkpoint_id, parent_checkpoint_id, checkpoint, metadata)
SELECT t, ns, id, pid, cp::jsonb, md::jsonb
FROM unnest(%b::text[], %b::text[], %b::text[], %b::text[], %b::text[], %b::text[])
    AS r(t, ns, id, pid, cp, md)
ON CONFLICT (thread_id, checkpoint_ns, checkpoint_id)
DO UPDATE SET checkpoint = EXCLUDED.checkpoint, metadata = EXCLUDED.metadata"""

_WRITES_SOURCE = """
INSERT INTO checkpoint_writes
    (thread_id, checkpoint_ns, checkpoint_id, task_id, task_path, idx, channel, type, blob)
SELECT * FROM unnest(%b::text[], %b::text[], %b::text[], %b::text[], %b::text[],
    %b::int[], %b::text[], %b::text[], %b::bytea[])
ON CONFLICT (thread_id, checkpoint_ns, checkpoint_id, task_id, idx)"""
INSERT_WRITES = _WRITES_SOURCE + " DO NOTHING"
UPSERT_WRITES = (
    _WRITES_SOURCE
    + " DO UPDATE SET channel = EXCLUDED.channel, type = EXCLUDED.type, blob = EXCLUDED.blob"
)

DELETE_THREAD = (
    "DELETE FROM checkpoints WHERE thread_id = %b",
    "DELETE FROM checkpoint_blobs WHERE thread_id = %b",
    "DELETE FROM checkpoint_writes WHERE thread_id = %b",
)

DELETE_RUNS = """
WITH gone AS (
    DELETE FROM checkpoints WHERE thread_id = %(t)b AND metadata ->> 'run_id' = ANY(%(runs)b)
    RETURNING checkpoint_ns, checkpoint_id
), writes AS (
    DELETE FROM checkpoint_writes w USING gone g
    WHERE w.thread_id = %(t)b AND w.checkpoint_ns = g.checkpoint_ns
      AND w.checkpoint_id = g.checkpoint_id
)
DELETE FROM checkpoint_blobs b
WHERE b.thread_id = %(t)b AND b.checkpoint_ns IN (SELECT checkpoint_ns FROM gone)
  AND NOT EXISTS (
    SELECT 1 FROM checkpoints c
    WHERE c.thread_id = b.thread_id AND c.checkpoint_ns = b.checkpoint_ns
      AND c.checkpoint -> 'channel_versions' ->> b.channel = b.version
      AND (c.checkpoint_ns, c.checkpoint_id) NOT IN (SELECT * FROM gone))"""
"""`Runs`: the checkpoints of the runs, their writes, and in the namespaces that lost a
checkpoint the blobs no remaining checkpoint refers to. Data-modifying CTEs all read the
statement's snapshot, so the remaining checkpoints are those not in ``gone``."""

RAISE_WATERMARKS = f"""
UPDATE {WATERMARKS} w
SET flushed_seq = u.seq, owner = CASE WHEN u.claims THEN u.owner ELSE w.owner END
FROM unnest(%b::text[], %b::bigint[], %b::bool[], %b::text[]) AS u(t, seq, claims, owner)
WHERE w.thread_id = u.t"""


@dataclass(frozen=True, slots=True)
class Statement:
    """One statement of the pipeline and the batches (threads) it writes for."""

    sql: str
    params: Sequence[Any] | Mapping[str, Any]
    batches: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PruneWork:
    """A thread whose entries prune: its operations, run one statement at a time after
    the pipeline (the pruning ones through AsyncPostgresSaver's own ``_keep_latest``)."""

    batch: int
    thread_id: str
    ops: tuple[Op, ...]


@dataclass
class Plan:
    """The statements of one transaction and the outcome of every thread in it."""

    outcomes: dict[int, ApplyOutcome] = field(default_factory=dict)
    statements: list[Statement] = field(default_factory=list)
    pruning: list[PruneWork] = field(default_factory=list)
    entries: dict[int, int] = field(default_factory=dict)
    """Entries each APPLIED batch writes."""


def thread_of(batch: Sequence[LgEntry]) -> str:
    return batch[0].thread_id


def wanted_bases(batches: Sequence[Sequence[LgEntry]]) -> list[tuple[str, str, str, str]]:
    """(thread, ns, channel, version) of every delta base a batch does not carry itself:
    read from Postgres in the locking round trip (a few may turn out not to be needed)."""
    wanted: set[tuple[str, str, str, str]] = set()
    for batch in batches:
        if not batch:
            continue
        carried: set[BlobKey] = set()
        for entry in sorted(batch, key=lambda e: e.seq):
            for op in entry.ops:
                if isinstance(op, Put):
                    for blob in op.blobs:
                        if (
                            blob.base is not None
                            and (op.ns, blob.channel, blob.base) not in carried
                        ):
                            wanted.add((entry.thread_id, op.ns, blob.channel, blob.base))
                        carried.add((op.ns, blob.channel, blob.version))
    return sorted(wanted)


def plan(
    batches: Sequence[Sequence[LgEntry]],
    live: Sequence[int],
    marks: Mapping[str, int],
    bases: Mapping[tuple[str, str, str, str], bytes | None],
    *,
    isolated: bool,
) -> Plan:
    """The transaction for the batches at the indices `live`, against their locked
    watermarks `marks` and the stored delta `bases`."""
    result = Plan()
    merged = _Columns()
    raised: list[tuple[int, str, int, str | None]] = []
    for index in live:
        batch = batches[index]
        thread_id = thread_of(batch)
        mark = marks.get(thread_id, 0)
        if not any(e.seq > mark for e in batch):
            result.outcomes[index] = ApplyOutcome(thread_id, ApplyStatus.STALE, mark)
            continue
        chain = chain_after(batch, mark)
        if not chain:
            result.outcomes[index] = ApplyOutcome(
                thread_id, ApplyStatus.GAP, mark, missing_from=mark + 1
            )
            continue
        ops = tuple(op for entry in chain for op in entry.ops)
        try:
            resolved = _resolve_deltas(thread_id, ops, bases)
        except CorruptEntryError as exc:
            result.outcomes[index] = ApplyOutcome(
                thread_id, ApplyStatus.FAILED, mark, error=str(exc), retriable=False
            )
            continue
        owner = next((op.owner for op in reversed(ops) if isinstance(op, Claim)), None)
        seq = chain[-1].seq
        result.outcomes[index] = ApplyOutcome(thread_id, ApplyStatus.APPLIED, seq)
        result.entries[index] = len(chain)
        if any(isinstance(op, Prune) for op in resolved):
            result.pruning.append(PruneWork(index, thread_id, resolved))
        elif not isolated and _mergeable(resolved):
            merged.add(thread_id, index, resolved)
        else:
            for op in resolved:
                for sql, params in op_statements(thread_id, op):
                    result.statements.append(Statement(sql, params, (index,)))
        if isolated:
            result.statements.append(
                Statement(RAISE_WATERMARKS, _watermark_params([(thread_id, seq, owner)]), (index,))
            )
        else:
            raised.append((index, thread_id, seq, owner))
    result.statements[:0] = merged.statements()
    if raised:
        params = _watermark_params([(t, s, o) for _, t, s, o in raised])
        result.statements.append(
            Statement(RAISE_WATERMARKS, params, tuple(i for i, _, _, _ in raised))
        )
    return result


def _watermark_params(rows: Sequence[tuple[str, int, str | None]]) -> list[Any]:
    return [
        [t for t, _, _ in rows],
        [s for _, s, _ in rows],
        [o is not None for _, _, o in rows],
        [o for _, _, o in rows],
    ]


def _resolve_deltas(
    thread_id: str, ops: Sequence[Op], bases: Mapping[tuple[str, str, str, str], bytes | None]
) -> tuple[Op, ...]:
    """The operations with every delta blob made whole, from a blob of an earlier
    operation of the chain or from the stored base."""
    known: dict[BlobKey, bytes | None] = {}
    out: list[Op] = []
    for op in ops:
        if isinstance(op, Delete):
            known.clear()  # a delta across a delete would refer to nothing
        if not isinstance(op, Put) or not any(b.base is not None for b in op.blobs):
            if isinstance(op, Put):
                known.update(((op.ns, b.channel, b.version), b.data) for b in op.blobs)
            out.append(op)
            continue
        blobs: list[BlobRow] = []
        for blob in op.blobs:
            if blob.base is not None:
                key = (op.ns, blob.channel, blob.base)
                base = known[key] if key in known else bases.get((thread_id, *key))
                if base is None or blob.data is None:
                    raise CorruptEntryError(
                        f"the base {blob.base!r} of channel {blob.channel!r} in namespace "
                        f"{op.ns!r} is not stored: the delta cannot be applied"
                    )
                blob = BlobRow(
                    blob.channel,
                    blob.version,
                    blob.type,
                    delta_blob(base, blob.count, blob.data),
                )
            known.setdefault((op.ns, blob.channel, blob.version), blob.data)
            blobs.append(blob)
        out.append(
            Put(op.ns, op.checkpoint_id, op.parent_id, op.checkpoint, op.metadata, tuple(blobs))
        )
    return tuple(out)


def _mergeable(ops: Sequence[Op]) -> bool:
    """Only puts, writes and claims, and no key written twice."""
    checkpoints: set[tuple[str, str]] = set()
    blobs: set[BlobKey] = set()
    writes: set[tuple[str, str, str, int]] = set()
    for op in ops:
        if isinstance(op, Put):
            key = (op.ns, op.checkpoint_id)
            if key in checkpoints:
                return False
            checkpoints.add(key)
            for b in op.blobs:
                if (op.ns, b.channel, b.version) in blobs:
                    return False
                blobs.add((op.ns, b.channel, b.version))
        elif isinstance(op, Writes):
            for r in op.rows:
                wkey = (op.ns, op.checkpoint_id, op.task_id, r.idx)
                if wkey in writes:
                    return False
                writes.add(wkey)
        elif not isinstance(op, Claim):
            return False
    return True


class _Columns:
    """Column arrays of the merged statements, with the batch (thread) of each row.

    A statement carries the rows of many threads; `statements` splits each one's rows
    into chunks of at most `pipelining.CHUNK_BYTES` of parameters, so that no pipelined
    statement grows past what psycopg sends in pipeline mode (see `pipelining`)."""

    def __init__(self) -> None:
        self.blobs: list[list[Any]] = [[] for _ in range(6)]
        self.checkpoints: list[list[Any]] = [[] for _ in range(6)]
        self.inserts: list[list[Any]] = [[] for _ in range(9)]
        self.upserts: list[list[Any]] = [[] for _ in range(9)]
        self.rows: dict[str, list[int]] = {"b": [], "c": [], "i": [], "u": []}
        """Per statement, the batch index of each of its rows."""

    def add(self, thread_id: str, index: int, ops: Sequence[Op]) -> None:
        for op in ops:
            if isinstance(op, Put):
                if op.blobs:
                    _blob_columns(self.blobs, thread_id, op.ns, op.blobs)
                    self.rows["b"] += [index] * len(op.blobs)
                _checkpoint_columns(self.checkpoints, thread_id, op)
                self.rows["c"].append(index)
            elif isinstance(op, Writes) and op.rows:
                target, key = (self.upserts, "u") if op.upsert else (self.inserts, "i")
                _write_columns(target, thread_id, op)
                self.rows[key] += [index] * len(op.rows)

    def statements(self) -> list[Statement]:
        out: list[Statement] = []
        for key, sql, columns in (
            ("b", INSERT_BLOBS, self.blobs),
            ("c", INSERT_CHECKPOINTS, self.checkpoints),
            ("i", INSERT_WRITES, self.inserts),
            ("u", UPSERT_WRITES, self.upserts),
        ):
            if not columns[0]:
                continue
            owners = self.rows[key]
            sizes = [payload_bytes(row) for row in zip(*columns, strict=True)]
            for part in chunks(sizes):
                params = [column[part.start : part.stop] for column in columns]
                batches = tuple(dict.fromkeys(owners[part.start : part.stop]))
                out.append(Statement(sql, params, batches))
        return out


def _blob_columns(
    columns: list[list[Any]], thread_id: str, ns: str, blobs: Sequence[BlobRow]
) -> None:
    for b in blobs:
        columns[0].append(thread_id)
        columns[1].append(ns)
        columns[2].append(b.channel)
        columns[3].append(b.version)
        columns[4].append(b.type)
        columns[5].append(b.data)


def _checkpoint_columns(columns: list[list[Any]], thread_id: str, op: Put) -> None:
    columns[0].append(thread_id)
    columns[1].append(op.ns)
    columns[2].append(op.checkpoint_id)
    columns[3].append(op.parent_id)
    columns[4].append(op.checkpoint.decode())
    columns[5].append(op.metadata.decode())


def _write_columns(columns: list[list[Any]], thread_id: str, op: Writes) -> None:
    for r in op.rows:
        for i, value in enumerate(
            (
                thread_id,
                op.ns,
                op.checkpoint_id,
                op.task_id,
                op.task_path,
                r.idx,
                r.channel,
                r.type,
                r.data,
            )
        ):
            columns[i].append(value)


def op_statements(thread_id: str, op: Op) -> list[tuple[str, Sequence[Any] | Mapping[str, Any]]]:
    """The statements of one operation of a thread, in order (a prune has none here:
    see `PruneWork`; a claim only changes the watermark row)."""
    if isinstance(op, Put):
        out: list[tuple[str, Sequence[Any] | Mapping[str, Any]]] = []
        if op.blobs:
            blobs: list[list[Any]] = [[] for _ in range(6)]
            _blob_columns(blobs, thread_id, op.ns, op.blobs)
            out.append((INSERT_BLOBS, blobs))
        checkpoints: list[list[Any]] = [[] for _ in range(6)]
        _checkpoint_columns(checkpoints, thread_id, op)
        out.append((INSERT_CHECKPOINTS, checkpoints))
        return out
    if isinstance(op, Writes):
        if not op.rows:
            return []
        writes: list[list[Any]] = [[] for _ in range(9)]
        _write_columns(writes, thread_id, op)
        return [(UPSERT_WRITES if op.upsert else INSERT_WRITES, writes)]
    if isinstance(op, Delete):
        return [(sql, (thread_id,)) for sql in DELETE_THREAD]
    if isinstance(op, Runs):
        return [(DELETE_RUNS, {"t": thread_id, "runs": list(op.run_ids)})]
    if isinstance(op, Copy):
        return _copy_statements(thread_id, op)
    return []


def _copy_statements(
    thread_id: str, op: Copy
) -> list[tuple[str, Sequence[Any] | Mapping[str, Any]]]:
    out: list[tuple[str, Sequence[Any] | Mapping[str, Any]]] = []
    if op.blobs:
        blobs: list[list[Any]] = [[] for _ in range(6)]
        for ns, ch, ver, typ, data in op.blobs:
            for i, value in enumerate((thread_id, ns, ch, ver, typ, data)):
                blobs[i].append(value)
        out.append((INSERT_BLOBS, blobs))
    if op.checkpoints:
        cps: list[list[Any]] = [[] for _ in range(6)]
        for ns, cid, pid, cp, md in op.checkpoints:
            for i, value in enumerate((thread_id, ns, cid, pid, cp.decode(), md.decode())):
                cps[i].append(value)
        out.append((INSERT_CHECKPOINTS, cps))
    if op.writes:
        ws: list[list[Any]] = [[] for _ in range(9)]
        for row in op.writes:
            for i, cell in enumerate((thread_id, *row)):
                ws[i].append(cell)
        out.append((UPSERT_WRITES, ws))
    return out
