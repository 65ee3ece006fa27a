"""SQL of `PostgresThreadRunStore`: the statements, built with SQLAlchemy Core.

Pure: nothing here awaits or opens a connection, so the statements can be rendered and
tested without a database (parameters and rows: `buffered_store.stores.postgres_codec`).
Statements are built once per shape and cached; the schema is applied at execution time
(``schema_translate_map``), so one set of statements serves every schema.

The write of one thread is a single statement: a ``gate`` CTE locks the thread row only if
its watermark still equals the expected seq, and every data-modifying CTE (messages,
runs) and the final ``UPDATE threads`` is conditional on that gate. It returns the new
watermark, or no row when the gate failed, in which case nothing was written. The direct
store therefore commits an append-only checkpoint in one round trip when its cache is
current, and falls back to explicit locking otherwise.
"""

from __future__ import annotations

import functools
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Delete,
    Exists,
    Integer,
    MetaData,
    Select,
    String,
    Table,
    Text,
    Update,
    and_,
    any_,
    bindparam,
    cast,
    column,
    delete,
    func,
    literal_column,
    null,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, aggregate_order_by
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.sql.elements import Grouping

from buffered_store.stores.schema import TSTZ, messages, runs, threads

alembic_version = Table("alembic_version", MetaData(), Column("version_num", String(32)))
"""Alembic's version table, for the schema check at connect time."""

THREAD_COLUMNS = (
    threads.c.thread_id,
    threads.c.parent_thread_id,
    threads.c.metadata,
    threads.c.created_at,
    threads.c.updated_at,
    threads.c.latest_run_id,
    threads.c.message_count,
    threads.c.flushed_seq,
    threads.c.deleted_at,
)

_TEXT_ARRAY = ARRAY(Text)


def _p(name: str, type_: Any = Text) -> Any:
    # Prefixed: SQLAlchemy reserves bind names equal to column names in INSERT/UPDATE.
    return bindparam(f"p_{name}", type_=type_)


def bind(**values: Any) -> dict[str, Any]:
    """Execution parameters for the statements of this module."""
    return {f"p_{name}": value for name, value in values.items()}


# -- reads -------------------------------------------------------------------------------

_messages_agg = (
    select(func.json_agg(aggregate_order_by(messages.c.message, messages.c.position)))
    .where(
        messages.c.thread_id == threads.c.thread_id,
        messages.c.position < threads.c.message_count,
    )
    .scalar_subquery()
    .label("messages")
)

SELECT_THREAD = select(*THREAD_COLUMNS).where(threads.c.thread_id == _p("thread_id"))
"""One thread row (tombstones included)."""

SELECT_THREAD_WITH_MESSAGES = select(*THREAD_COLUMNS, _messages_agg).where(
    threads.c.thread_id == _p("thread_id")
)
"""One thread row and its messages as a JSON array, in one statement (one snapshot)."""

LOCK_THREAD = SELECT_THREAD.with_for_update()
"""Lock an existing thread row."""

LOCK_THREADS = (
    select(*THREAD_COLUMNS)
    .where(threads.c.thread_id == any_(_p("thread_ids", _TEXT_ARRAY)))
    .order_by(threads.c.thread_id.collate("C"))
    .with_for_update()
)
"""Lock the existing rows of many threads in one statement: the watermark gate of a whole
`apply()` batch. Rows are locked in the order they are returned, code point order (the
"C" collation of UTF-8), the order `apply()` sorts its threads in, so concurrent flushers
take the locks in one global order."""

_new_thread_ids = (
    func.unnest(_p("thread_ids", _TEXT_ARRAY))
    .table_valued(column("thread_id", Text))
    .render_derived(name="new_threads")
)
CREATE_THREADS = (
    pg_insert(threads)
    .from_select(
        ["thread_id"],
        select(_new_thread_ids.c.thread_id).order_by(_new_thread_ids.c.thread_id.collate("C")),
    )
    .on_conflict_do_nothing(index_elements=[threads.c.thread_id])
    .returning(threads.c.thread_id)
)
"""Insert an empty row for each of many threads that has none, in code point order;
returns the ids inserted. It runs before `LOCK_THREADS`, so a transaction never inserts a
row after locking others: an insert waits for a concurrent uncommitted insert of the same
id, and rows are inserted in the same global order as they are locked, so concurrent
flushers creating overlapping sets of threads cannot deadlock. Existing rows are neither
written nor locked (no tuple, no WAL record)."""

_ensure = pg_insert(threads).values(thread_id=_p("thread_id"))
ENSURE_THREAD = _ensure.on_conflict_do_update(
    index_elements=[threads.c.thread_id],
    # A no-op update: it locks and returns the row a concurrent writer may have inserted.
    set_={"flushed_seq": threads.c.flushed_seq},
).returning(*THREAD_COLUMNS)
"""Insert an empty row for a new thread, or lock the existing one; returns it either way."""

SELECT_STORED_MESSAGES = select(
    func.json_agg(aggregate_order_by(messages.c.message, messages.c.position))
).where(messages.c.thread_id == _p("thread_id"), messages.c.position < _p("count", Integer))
"""The stored snapshot of a thread (read under its lock when the cache misses)."""

SELECT_RUN = select(runs.c.record, runs.c.thread_seq).where(runs.c.run_id == _p("run_id"))
"""One run with the seq that wrote it."""

SELECT_LATEST_RUN = (
    select(runs.c.record)
    .select_from(
        threads.join(
            runs,
            and_(runs.c.run_id == threads.c.latest_run_id, runs.c.thread_id == threads.c.thread_id),
        )
    )
    .where(threads.c.thread_id == _p("thread_id"), threads.c.deleted_at.is_(None))
)
"""The run named by a live thread's `latest_run_id` (if it still belongs to the thread)."""

SELECT_LIVE_THREADS = (
    select(*THREAD_COLUMNS)
    .where(threads.c.deleted_at.is_(None))
    .order_by(threads.c.updated_at.desc(), threads.c.thread_id.desc())
    .limit(_p("limit", Integer))
    .offset(_p("offset", Integer))
)
"""Live threads in `list_threads` order (served by ``threads_live_updated_idx``)."""

SELECT_FLUSHED_SEQS = select(threads.c.thread_id, threads.c.flushed_seq).where(
    threads.c.thread_id == any_(_p("thread_ids", _TEXT_ARRAY))
)
"""Watermarks of many threads in one statement (equality only: ids are never patterns)."""

SELECT_SCHEMA_VERSION = select(alembic_version.c.version_num)
"""The schema's Alembic revision."""


@functools.cache
def select_runs(*, by_thread: bool, by_status: bool) -> Select[Any]:
    """Runs in `list_runs` order; each filter combination has a matching index."""
    stmt = select(runs.c.record, runs.c.thread_seq)
    if by_thread:
        stmt = stmt.where(runs.c.thread_id == _p("thread_id"))
    if by_status:
        stmt = stmt.where(runs.c.status == _p("status"))
    return (
        stmt.order_by(runs.c.created_at.desc(), runs.c.run_id.desc())
        .limit(_p("limit", Integer))
        .offset(_p("offset", Integer))
    )


# -- writes ------------------------------------------------------------------------------

DROP_EMPTY_THREAD: Delete = delete(threads).where(
    threads.c.thread_id == _p("thread_id"),
    threads.c.flushed_seq == 0,
    threads.c.created_at.is_(None),
    threads.c.deleted_at.is_(None),
)
"""Remove the empty row `ENSURE_THREAD` inserted for a write that was then refused."""

RESET_THREAD: Delete = (
    delete(messages)
    .where(messages.c.thread_id == _p("thread_id"))
    .add_cte(delete(runs).where(runs.c.thread_id == _p("thread_id")).cte("reset_runs"))
)
"""Drop a thread's messages and runs before a change that re-creates it after a delete."""


_runs_owned_elsewhere = select(runs.c.run_id).where(
    runs.c.run_id == any_(_p("run_ids", _TEXT_ARRAY)), runs.c.thread_id != _p("thread_id")
)

SELECT_RUN_OWNERS = select(runs.c.run_id, runs.c.thread_id).where(
    runs.c.run_id == any_(_p("run_ids", _TEXT_ARRAY)), runs.c.thread_id != _p("thread_id")
)
"""Runs among `run_ids` that another thread owns (read when a write's gate failed under
the thread's lock, to name the owner)."""


def _gate(*, claims_runs: bool) -> tuple[Any, Exists]:
    conditions = [
        threads.c.thread_id == _p("thread_id"),
        threads.c.flushed_seq == _p("expected_seq", BigInteger),
    ]
    if claims_runs:
        # Runs are keyed by id alone: a run id another thread owns must not move here, so
        # the whole write is refused (the caller finds the owner and reports it).
        conditions.append(~_runs_owned_elsewhere.exists())
    gate = select(threads.c.thread_id).where(*conditions).with_for_update().cte("gate")
    return gate, select(gate.c.thread_id).exists()


def _upsert_messages(gated: Exists) -> Any:
    # One parameter, a JSON array of the pre-encoded messages, expanded server-side: the
    # statement text is the same for any number of rows, so psycopg prepares it once per
    # connection, and a text parameter is sent as is (a text[] one would be escaped by
    # psycopg element by element: a backslash before each of the many quotes of JSON).
    rows = (
        func.jsonb_array_elements(cast(_p("messages"), JSONB))
        .table_valued(column("message", JSONB), with_ordinality="ordinal")
        .render_derived(name="new_messages")
    )
    source = select(
        _p("thread_id"),
        cast(_p("keep", Integer) + rows.c.ordinal - 1, Integer),
        rows.c.message["role"].astext,
        rows.c.message,
        _p("seq", BigInteger),
    ).where(gated)
    return _write_messages(source)


def _write_messages(source: Select[Any]) -> Any:
    """Upsert the message rows `source` selects (thread id, position, role, message,
    seq), as the ``written_messages`` CTE."""
    stmt = pg_insert(messages).from_select(
        ["thread_id", "position", "role", "message", "thread_seq"], source
    )
    return stmt.on_conflict_do_update(
        constraint="messages_pkey",
        set_={
            "role": stmt.excluded.role,
            "message": stmt.excluded.message,
            "thread_seq": stmt.excluded.thread_seq,
        },
        # An unchanged message costs no new tuple.
        where=messages.c.message.is_distinct_from(stmt.excluded.message),
    ).cte("written_messages")


def _upsert_runs(gated: Exists) -> Any:
    # Like the messages: one JSON array of the records, each with its seq at the same
    # (1-based) position of a bigint[] parameter.
    rows = (
        func.jsonb_array_elements(cast(_p("run_records"), JSONB))
        .table_valued(column("record", JSONB), with_ordinality="ordinal")
        .render_derived(name="new_runs")
    )
    seq = Grouping(_p("run_seqs", ARRAY(BigInteger)))[rows.c.ordinal]
    return _write_runs(select(*_run_columns(rows.c.record, seq)).where(gated))


def _run_columns(record: Any, seq: Any) -> list[Any]:
    """The columns of a `runs` row, in table order, from its JSON `record` and `seq`."""

    def field(name: str, type_: Any = None) -> Any:
        value = record[name].astext
        return value if type_ is None else cast(value, type_)

    return [
        field("run_id"),
        field("thread_id"),
        field("agent_id"),
        field("status"),
        field("parent_run_id"),
        field("created_at", TSTZ),
        field("updated_at", TSTZ),
        field("finished_at", TSTZ),
        field("steps", Integer),
        field("input_tokens", BigInteger),
        field("output_tokens", BigInteger),
        record,
        seq,
    ]


def _write_runs(source: Select[Any]) -> Any:
    """Upsert the run rows `source` selects (`_run_columns`), as the ``written_runs``
    CTE."""
    names = [c.name for c in runs.columns]
    stmt = pg_insert(runs).from_select(names, source)
    return stmt.on_conflict_do_update(
        index_elements=[runs.c.run_id],
        set_={name: stmt.excluded[name] for name in names if name != "run_id"},
        # Never replace a run by an older version of itself, and never move a run to
        # another thread (the gate refuses such writes; this also holds against a
        # concurrent claim that the gate's snapshot could not see).
        where=and_(
            runs.c.thread_id == stmt.excluded.thread_id,
            runs.c.thread_seq <= stmt.excluded.thread_seq,
        ),
    ).cte("written_runs")


@functools.cache
def write_statement(*, live: bool, messages_: bool, truncate: bool, runs_: bool) -> Update:
    """The single statement writing one thread change, gated on its expected watermark
    (and, when it writes runs, on no other thread owning one of them)."""
    gate, gated = _gate(claims_runs=live and runs_)
    ctes: list[Any] = []
    if live:
        if messages_:
            ctes.append(_upsert_messages(gated))
        if truncate:
            ctes.append(
                delete(messages)
                .where(
                    messages.c.thread_id == _p("thread_id"),
                    messages.c.position >= _p("message_count", Integer),
                    gated,
                )
                .cte("dropped_messages")
            )
        if runs_:
            ctes.append(_upsert_runs(gated))
        values: dict[str, Any] = {
            "parent_thread_id": _p("parent_thread_id"),
            "metadata": cast(_p("metadata"), JSONB),
            "created_at": _p("created_at", TSTZ),
            "updated_at": _p("updated_at", TSTZ),
            "latest_run_id": _p("latest_run_id"),
            "message_count": _p("message_count", Integer),
            "deleted_at": null(),
        }
    else:
        for table, name in ((messages, "dropped_messages"), (runs, "dropped_runs")):
            ctes.append(delete(table).where(table.c.thread_id == _p("thread_id"), gated).cte(name))
        # A tombstone keeps only what late entries need: the id and the watermark.
        values = {
            "parent_thread_id": null(),
            "metadata": literal_column("'{}'::jsonb", JSONB),
            "created_at": null(),
            "updated_at": _p("at", TSTZ),
            "latest_run_id": null(),
            "message_count": 0,
            "deleted_at": _p("at", TSTZ),
        }
    stmt = (
        update(threads)
        .where(threads.c.thread_id == gate.c.thread_id)
        .values(flushed_seq=_p("seq", BigInteger), **values)
        .returning(threads.c.flushed_seq)
    )
    return stmt.add_cte(*ctes) if ctes else stmt


# -- the writes of many threads in one statement -------------------------------------------

_COMBINED_INPUT = (
    func.unnest(
        _p("thread_ids", _TEXT_ARRAY),
        _p("expected_seqs", ARRAY(BigInteger)),
        _p("seqs", ARRAY(BigInteger)),
        _p("parent_thread_ids", _TEXT_ARRAY),
        _p("created_ats", ARRAY(TSTZ)),
        _p("updated_ats", ARRAY(TSTZ)),
        _p("latest_run_ids", _TEXT_ARRAY),
        _p("message_counts", ARRAY(Integer)),
        _p("keeps", ARRAY(Integer)),
    )
    .table_valued(
        column("thread_id", Text),
        column("expected_seq", BigInteger),
        column("seq", BigInteger),
        column("parent_thread_id", Text),
        column("created_at", TSTZ),
        column("updated_at", TSTZ),
        column("latest_run_id", Text),
        column("message_count", Integer),
        column("keep", Integer),
        with_ordinality="ordinal",
    )
    .render_derived(name="given")
)


@functools.cache
def combined_write_statement() -> Update:
    """The writes of many threads in one statement: what `write_statement` does for one
    live thread that neither truncates nor is reset, for every thread of the arrays at
    once (the arrays line up: one element per thread; `metadatas` and `messages` are one
    JSON array each, a thread's metadata object and its array of new messages at the
    thread's position; `run_records` and `run_seqs` the runs of all of them, each
    record naming its thread). Each thread is gated on its own expected watermark and on
    no other thread owning one of its runs; it returns the id of every thread it wrote
    (a thread it does not return wrote nothing). A thread may appear once, and a run id
    once."""
    # Each JSON parameter is parsed once, in a CTE; a cast in a correlated subquery would
    # parse the whole text again for every thread.
    per_thread = [
        func.jsonb_array_elements(cast(_p(name), JSONB))
        .table_valued(column("value", JSONB), with_ordinality="ordinal")
        .render_derived(name=f"given_{name}")
        for name in ("messages", "metadatas")
    ]
    given = (
        select(
            *_COMBINED_INPUT.c,
            per_thread[0].c.value.label("messages"),
            per_thread[1].c.value.label("metadata"),
        )
        .select_from(
            _COMBINED_INPUT.join(
                per_thread[0], per_thread[0].c.ordinal == _COMBINED_INPUT.c.ordinal
            ).join(per_thread[1], per_thread[1].c.ordinal == _COMBINED_INPUT.c.ordinal)
        )
        .cte("given")
    )
    run_rows = (
        func.jsonb_array_elements(cast(_p("run_records"), JSONB))
        .table_valued(column("record", JSONB), with_ordinality="ordinal")
        .render_derived(name="run_rows")
    )
    new_runs = select(run_rows.c.record, run_rows.c.ordinal).cte("new_runs")
    owned_elsewhere = (
        select(runs.c.run_id)
        .select_from(new_runs.join(runs, runs.c.run_id == new_runs.c.record["run_id"].astext))
        .where(
            new_runs.c.record["thread_id"].astext == given.c.thread_id,
            runs.c.thread_id != given.c.thread_id,
        )
    )
    gate = (
        select(given.c.thread_id)
        .select_from(given.join(threads, threads.c.thread_id == given.c.thread_id))
        .where(threads.c.flushed_seq == given.c.expected_seq, ~owned_elsewhere.exists())
        .with_for_update(of=threads)
        .cte("gate")
    )
    gated = given.c.thread_id.in_(select(gate.c.thread_id))

    rows = (
        func.jsonb_array_elements(given.c.messages)
        .table_valued(column("message", JSONB), with_ordinality="position")
        .render_derived(name="new_messages")
    )
    message_source = (
        select(
            given.c.thread_id,
            cast(given.c.keep + rows.c.position - 1, Integer),
            rows.c.message["role"].astext,
            rows.c.message,
            given.c.seq,
        )
        .select_from(given)
        .join(rows, literal_column("true"))
        .where(gated)
    )
    written_messages = _write_messages(message_source)
    seq = Grouping(_p("run_seqs", ARRAY(BigInteger)))[new_runs.c.ordinal]
    run_source = (
        select(*_run_columns(new_runs.c.record, seq))
        .select_from(new_runs)
        .where(new_runs.c.record["thread_id"].astext.in_(select(gate.c.thread_id)))
    )
    written_runs = _write_runs(run_source)

    stmt = (
        update(threads)
        .where(threads.c.thread_id == given.c.thread_id, gated)
        .values(
            flushed_seq=given.c.seq,
            parent_thread_id=given.c.parent_thread_id,
            metadata=given.c.metadata,
            created_at=given.c.created_at,
            updated_at=given.c.updated_at,
            latest_run_id=given.c.latest_run_id,
            message_count=given.c.message_count,
            deleted_at=null(),
        )
        .returning(threads.c.thread_id)
    )
    return stmt.add_cte(written_messages, written_runs)
