"""JDBC reads of the flushed tables: partitioned, typed, with jsonb made usable.

Every read is split into partitions by a list of predicates, because the keys are text
(Spark's `partitionColumn` must be numeric or a date): by default ``N`` hash buckets of
``thread_id``, so all rows of one thread fall in one partition. Each partition is one
query, hence one snapshot of Postgres; `shared_snapshot` makes every partition of every
read use the same snapshot instead.

jsonb columns: the run `record` is taken apart in SQL into typed columns (its shape is
known); documents of unknown shape (`threads.metadata`, `messages.message`,
`runs.output`/`metadata`) arrive as JSON text, to be parsed with ``from_json`` or
``parse_json`` where needed.

The SQL builders are pure. They also build the overlay queries of `overlay`: each adds
to the rows of a pending thread that thread's watermark, read *in the same statement*,
and placeholder rows for what the thread's unflushed entries add. Their pending-thread
lists are inlined (``NOT MATERIALIZED``), not materialised: a materialised CTE may only
be scanned by the leader of a parallel query, which put the join of every scanned row
to its thread's watermark in one process (``EXPLAIN ANALYZE`` of a partition's statement
on the benchmark's data shows it above the ``Gather``); inlined, each parallel worker
joins its own share. Every worker reads the statement's one snapshot, so the watermarks
stay those of the rows they are joined to.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import re
import weakref
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from pyspark.sql import DataFrame, SparkSession

from buffered_store.errors import ConfigError
from buffered_store.stores.urls import jdbc_url_from_url, to_libpq_url

POSTGRES_DRIVER_CLASS = "org.postgresql.Driver"
_SNAPSHOT_ID = re.compile(r"^[0-9A-Fa-f-]+$")

THREAD_COLUMNS = (
    "thread_id string, parent_thread_id string, metadata string, created_at timestamp, "
    "updated_at timestamp, latest_run_id string, message_count int, thread_seq bigint"
)
"""Columns of a threads DataFrame; `thread_seq` is the seq of the state shown."""
MESSAGE_COLUMNS = "thread_id string, position int, role string, message string, thread_seq bigint"
"""Columns of a messages DataFrame; `thread_seq` is the checkpoint that wrote the row."""
RUN_COLUMNS = (
    "run_id string, thread_id string, agent_id string, status string, parent_run_id string, "
    "parent_thread_id string, created_at timestamp, updated_at timestamp, "
    "finished_at timestamp, steps int, input_tokens bigint, output_tokens bigint, "
    "error string, output string, metadata string, thread_seq bigint"
)
"""Columns of a runs DataFrame; `output` (null for none) and `metadata` are JSON text."""


def _checked_id(snapshot_id: str) -> str:
    """`snapshot_id`, refused unless it looks like one (it goes into SQL text)."""
    if not _SNAPSHOT_ID.match(snapshot_id):
        raise ConfigError(f"not a snapshot id: {snapshot_id!r}")
    return snapshot_id


def column_names(ddl: str) -> list[str]:
    """Names of a ``name type, ...`` column list."""
    return [part.strip().split(" ", 1)[0] for part in ddl.split(",") if part.strip()]


def quote_ident(name: str) -> str:
    """A Postgres identifier, quoted."""
    if not name or "\x00" in name:
        raise ConfigError(f"invalid Postgres identifier {name!r}")
    return '"' + name.replace('"', '""') + '"'


@dataclass(frozen=True, kw_only=True)
class JdbcSource:
    """Where the flushed tables are and how to read them over JDBC."""

    url: str
    """``jdbc:postgresql://host:port/db?user=...`` (credentials may go in `properties`)."""
    schema: str = "public"
    properties: Mapping[str, str] = field(default_factory=dict)
    """More JDBC connection properties: ``user``, ``password``, ``ssl``..."""
    partitions: int = 8
    """Hash buckets of ``thread_id``: one Spark partition (and query) each."""
    fetchsize: int = 10_000
    """Rows per round trip; also makes the driver stream instead of buffering a result."""
    predicates: tuple[str, ...] | None = None
    """Replaces the hash buckets: one partition per SQL condition. They must cover every
    row exactly once and may only use ``thread_id`` (every read has it)."""
    session_init: str | None = None
    """SQL run by each partition before its query (set by `with_snapshot`)."""

    def __post_init__(self) -> None:
        if not self.url.startswith("jdbc:postgresql:"):
            raise ConfigError(f"not a PostgreSQL JDBC URL: {self.url.split('?')[0]!r}")
        quote_ident(self.schema)
        if self.partitions < 1 or self.fetchsize < 1:
            raise ConfigError("partitions and fetchsize must be >= 1")
        if self.predicates is not None and not self.predicates:
            raise ConfigError("predicates, when given, must not be empty")

    @classmethod
    def from_database_url(cls, database_url: str, **options: Any) -> JdbcSource:
        """From a ``postgresql://`` or SQLAlchemy URL (credentials become properties)."""
        return cls(url=jdbc_url_from_url(database_url), **options)

    def with_snapshot(self, snapshot_id: str) -> JdbcSource:
        """The same source, every partition reading the exported snapshot `snapshot_id`."""
        init = (
            "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ; "
            f"SET TRANSACTION SNAPSHOT '{_checked_id(snapshot_id)}'"
        )
        return dataclasses.replace(self, session_init=init)

    def table(self, name: str) -> str:
        """A table of the store, schema-qualified and quoted."""
        return f"{quote_ident(self.schema)}.{quote_ident(name)}"

    def partition_predicates(self) -> list[str]:
        """One condition per partition over ``thread_id``."""
        if self.predicates is not None:
            return list(self.predicates)
        n = self.partitions
        return [f"mod(abs(hashtext(thread_id)::bigint), {n}) = {i}" for i in range(n)]

    def connection_properties(self) -> dict[str, str]:
        """Properties handed to Spark's JDBC reader."""
        props = {"driver": POSTGRES_DRIVER_CLASS, "fetchsize": str(self.fetchsize)}
        if self.session_init:
            props["sessionInitStatement"] = self.session_init
        props.update(self.properties)
        return props


# -- SQL ---------------------------------------------------------------------------------

_THREAD_SELECT = (
    "t.thread_id, t.parent_thread_id, t.metadata::text AS metadata, t.created_at, "
    "t.updated_at, t.latest_run_id, t.message_count, t.flushed_seq AS thread_seq"
)
_MESSAGE_SELECT = "m.thread_id, m.position, m.role, m.message::text AS message, m.thread_seq"
_RUN_SELECT = (
    "r.run_id, r.thread_id, r.agent_id, r.status, r.parent_run_id, "
    "r.record->>'parent_thread_id' AS parent_thread_id, r.created_at, r.updated_at, "
    "r.finished_at, r.steps, r.input_tokens, r.output_tokens, r.record->>'error' AS error, "
    "NULLIF((r.record->'output')::text, 'null') AS output, "
    "(r.record->'metadata')::text AS metadata, r.thread_seq"
)
_LIVE = "t.deleted_at IS NULL AND t.created_at IS NOT NULL"
"""A thread row that is neither a tombstone nor a row created by a flush not yet done."""


def threads_sql(source: JdbcSource) -> str:
    """Live threads."""
    return f"SELECT {_THREAD_SELECT} FROM {source.table('threads')} t WHERE {_LIVE}"


def messages_sql(source: JdbcSource) -> str:
    """Every message row."""
    return f"SELECT {_MESSAGE_SELECT} FROM {source.table('messages')} m"


def runs_sql(source: JdbcSource) -> str:
    """Every run."""
    return f"SELECT {_RUN_SELECT} FROM {source.table('runs')} r"


def json_sql(value: Any) -> str:
    """A JSON value as a SQL ``jsonb`` expression, injection-proof.

    The JSON travels base64-encoded: whatever the ids in it contain, the SQL text only
    holds ``[A-Za-z0-9+/=]``.
    """
    payload = base64.b64encode(orjson.dumps(value)).decode("ascii")
    return f"convert_from(decode('{payload}', 'base64'), 'UTF8')::jsonb"


def id_set_sql(ids: Iterable[str]) -> str:
    """A set of ids as a SQL row source (column ``thread_id``)."""
    return (
        "SELECT DISTINCT value AS thread_id FROM "
        f"jsonb_array_elements_text({json_sql(sorted(set(ids)))})"
    )


def overlay_threads_sql(source: JdbcSource, pending: Iterable[str]) -> str:
    """Threads with tombstones and a `live` flag, plus a placeholder row (watermark 0)
    for each pending thread the table does not hold, all in one statement."""
    threads = source.table("threads")
    return (
        f"WITH pending AS MATERIALIZED ({id_set_sql(pending)}) "
        f"SELECT {_THREAD_SELECT}, ({_LIVE}) AS live FROM {threads} t "
        "UNION ALL SELECT p.thread_id, NULL, NULL, NULL, NULL, NULL, 0, 0, false "
        f"FROM pending p WHERE NOT EXISTS (SELECT 1 FROM {threads} t "
        "WHERE t.thread_id = p.thread_id)"
    )


def overlay_messages_sql(
    source: JdbcSource,
    counts: Mapping[str, int],
    replaced: Mapping[str, tuple[int, int]] | None = None,
) -> str:
    """Messages, with the watermark of their thread when it is pending, plus placeholder
    rows for the positions a pending thread's entries add beyond its stored count, all
    in one statement (one snapshot).

    `counts`: the newest message count of each pending thread. `replaced`: per pending
    thread, ``(position, seq)`` such that, when the thread's watermark is below ``seq``,
    the merge replaces or hides every row from ``position`` on: those rows come without
    their text (`role` and `message` null), which then never leaves Postgres.
    """
    replaced = replaced or {}
    rows = [
        {"thread_id": t, "n": n, "s": replaced.get(t, (n, 0))[0], "w": replaced.get(t, (n, 0))[1]}
        for t, n in sorted(counts.items())
    ]
    unused = "m.position >= k.s AND k.watermark < k.w"
    return (
        "WITH pending AS NOT MATERIALIZED (SELECT thread_id, n, s, w FROM "
        f"jsonb_to_recordset({json_sql(rows)}) AS p(thread_id text, n int, s int, w bigint)), "
        "marks AS NOT MATERIALIZED (SELECT p.thread_id, p.n, p.s, p.w, "
        "COALESCE(t.flushed_seq, 0) AS watermark, "
        f"CASE WHEN {_LIVE} THEN t.message_count ELSE 0 END AS stored "
        f"FROM pending p LEFT JOIN {source.table('threads')} t ON t.thread_id = p.thread_id) "
        f"SELECT m.thread_id, m.position, CASE WHEN {unused} THEN NULL ELSE m.role END AS role, "
        f"CASE WHEN {unused} THEN NULL ELSE m.message::text END AS message, m.thread_seq, "
        "k.watermark, false AS placeholder "
        f"FROM {source.table('messages')} m LEFT JOIN marks k ON k.thread_id = m.thread_id "
        "UNION ALL SELECT k.thread_id, g.position, NULL, NULL, NULL, k.watermark, true "
        "FROM marks k CROSS JOIN LATERAL generate_series(k.stored, k.n - 1) AS g(position)"
    )


def union_messages_sql(source: JdbcSource, cuts: Mapping[str, int]) -> str:
    """Messages minus the rows the WAL tail rewrites: per thread of `cuts`, every row at
    its position and beyond (see `union.UnionPlan`). With no cuts, the plain read."""
    if not cuts:
        return messages_sql(source)
    rows = [[thread_id, position] for thread_id, position in sorted(cuts.items())]
    return (
        "WITH cuts AS NOT MATERIALIZED (SELECT c->>0 AS thread_id, (c->>1)::int AS position "
        f"FROM jsonb_array_elements({json_sql(rows)}) AS c) "
        f"SELECT {_MESSAGE_SELECT} FROM {source.table('messages')} m WHERE NOT EXISTS "
        "(SELECT 1 FROM cuts k WHERE k.thread_id = m.thread_id AND m.position >= k.position)"
    )


def overlay_runs_sql(source: JdbcSource, runs_by_thread: Mapping[str, Sequence[str]]) -> str:
    """Runs, with the watermark of their thread when it is pending, plus a placeholder
    row for each run a pending thread's entries hold that the table does not hold under
    that thread, all in one statement (one snapshot).

    `runs_by_thread`: every pending thread, with the run ids whose newest version it holds.
    """
    rows = [{"thread_id": t, "runs": list(r)} for t, r in sorted(runs_by_thread.items())]
    runs = source.table("runs")
    nulls = ", ".join(["NULL"] * 14)  # the run columns after run_id and thread_id
    return (
        "WITH pending AS NOT MATERIALIZED (SELECT thread_id, runs FROM "
        f"jsonb_to_recordset({json_sql(rows)}) AS p(thread_id text, runs jsonb)), "
        "marks AS NOT MATERIALIZED (SELECT p.thread_id, p.runs, "
        "COALESCE(t.flushed_seq, 0) AS watermark "
        f"FROM pending p LEFT JOIN {source.table('threads')} t ON t.thread_id = p.thread_id) "
        f"SELECT {_RUN_SELECT}, k.watermark, false AS placeholder "
        f"FROM {runs} r LEFT JOIN marks k ON k.thread_id = r.thread_id "
        f"UNION ALL SELECT x.run_id, k.thread_id, {nulls}, k.watermark, true "
        "FROM marks k CROSS JOIN LATERAL jsonb_array_elements_text(k.runs) AS x(run_id) "
        f"WHERE NOT EXISTS (SELECT 1 FROM {runs} r "
        "WHERE r.run_id = x.run_id AND r.thread_id = k.thread_id)"
    )


# -- readers ------------------------------------------------------------------------------


def read_sql(spark: SparkSession, source: JdbcSource, sql: str) -> DataFrame:
    """A query over the store's tables, one partition per predicate over ``thread_id``."""
    return spark.read.jdbc(
        source.url,
        f"({sql}) AS q",
        predicates=source.partition_predicates(),
        properties=source.connection_properties(),
    )


def read_threads(spark: SparkSession, source: JdbcSource) -> DataFrame:
    """Live threads as flushed (columns `THREAD_COLUMNS`)."""
    return read_sql(spark, source, threads_sql(source))


def read_messages(spark: SparkSession, source: JdbcSource) -> DataFrame:
    """Message rows as flushed (columns `MESSAGE_COLUMNS`)."""
    return read_sql(spark, source, messages_sql(source))


def read_runs(spark: SparkSession, source: JdbcSource) -> DataFrame:
    """Runs as flushed (columns `RUN_COLUMNS`)."""
    return read_sql(spark, source, runs_sql(source))


RECENT_PINS = 4
"""Pinned snapshots kept open by `pin_snapshot` itself, newest first, whether or not
anything else references them."""
_recent_pins: deque[PinnedSnapshot] = deque(maxlen=RECENT_PINS)


class PinnedSnapshot:
    """An exported Postgres snapshot, kept alive with what the driver read in it: each
    pending thread's watermark and stored message count.

    Every JDBC partition of a source made by ``source.with_snapshot(pinned.snapshot_id)``
    reads this one database state; once closed, such partitions fail to start
    (``invalid snapshot identifier``) instead of reading another state. It closes on
    `close`, or once no object references it and it is not among the `RECENT_PINS` last
    pinned: a DataFrame derived from a read (``read_tables(...).runs.groupBy(...)``)
    keeps no Python reference to it, so the last few stay open for such chains.
    """

    def __init__(self, conn: Any, snapshot_id: str, marks: dict[str, tuple[int, int]]) -> None:
        self.snapshot_id = snapshot_id
        self.marks = marks
        """Per pending thread in the snapshot: ``(watermark, stored message count)``."""
        self._finalizer = weakref.finalize(self, _end_snapshot, conn)

    @property
    def closed(self) -> bool:
        """Whether the snapshot was released."""
        return not self._finalizer.alive

    def close(self) -> None:
        """Release the snapshot (idempotent)."""
        self._finalizer()


def _end_snapshot(conn: Any) -> None:
    with contextlib.suppress(Exception):
        conn.rollback()
    with contextlib.suppress(Exception):
        conn.close()


def marks_sql(source: JdbcSource, pending: Iterable[str]) -> str:
    """Watermark and stored message count of each pending thread the table holds."""
    return (
        f"SELECT t.thread_id, t.flushed_seq, CASE WHEN {_LIVE} THEN t.message_count ELSE 0 END "
        f"FROM {source.table('threads')} t WHERE t.thread_id IN ({id_set_sql(pending)})"
    )


def pin_snapshot(database_url: str, source: JdbcSource, pending: Iterable[str]) -> PinnedSnapshot:
    """Export a snapshot, read the pending threads' watermarks in it, keep it open.

    Needs a direct connection (not a transaction-mode pooler); the open snapshot holds
    back vacuum until it is closed.
    """
    import psycopg

    pending = list(pending)
    conn = psycopg.connect(to_libpq_url(database_url))
    try:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.read_only = True
        row = conn.execute("SELECT pg_export_snapshot()").fetchone()
        assert row is not None
        snapshot_id = str(row[0])
        marks: dict[str, tuple[int, int]] = {}
        if pending:
            # In a subtransaction rolled back after: its lock on the threads table goes
            # with it (a lock held while pinned would block DDL, e.g. migrations), the
            # transaction's snapshot stays.
            conn.execute("SAVEPOINT marks")
            for thread_id, watermark, stored in conn.execute(marks_sql(source, pending)):
                marks[str(thread_id)] = (int(watermark), int(stored))
            conn.execute("ROLLBACK TO SAVEPOINT marks")
    except BaseException:
        _end_snapshot(conn)
        raise
    pinned = PinnedSnapshot(conn, snapshot_id, marks)
    _recent_pins.append(pinned)
    return pinned


@contextlib.contextmanager
def shared_snapshot(database_url: str) -> Iterator[str]:
    """Export a Postgres snapshot and keep it alive for the ``with`` block.

    Use ``source.with_snapshot(snapshot_id)`` so that every partition of every read sees
    the same database state. Needs a direct connection (not a transaction-mode pooler);
    the snapshot holds back vacuum while the block runs.
    """
    import psycopg

    with psycopg.connect(to_libpq_url(database_url)) as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.read_only = True
        row = conn.execute("SELECT pg_export_snapshot()").fetchone()
        assert row is not None
        try:
            yield str(row[0])
        finally:
            conn.rollback()
