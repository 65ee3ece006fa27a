"""Between records and rows for the Postgres store: parameters, value encoding, row
conversion, and the planning of one thread's write. Pure: no I/O.

`build_write` turns a `ThreadChange` into the gated statement of `postgres_sql` plus its
parameters; `plan_batch` decides what `apply()` does with one thread's entries against
its locked row. Everything that can be wrong with the data fails here, before anything
is sent to the database.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson
from sqlalchemy import Update
from sqlalchemy.engine import Row

from buffered_store.engine.flushing import ApplyOutcome, ApplyStatus, failed_outcome
from buffered_store.engine.ids import check_id
from buffered_store.errors import CorruptEntryError, ValidationError
from buffered_store.model.changes import (
    WalEntry,
)
from buffered_store.model.planning import PlanStatus, ThreadChange, coalesce, plan_entries
from buffered_store.model.records import RunRecord, Thread
from buffered_store.stores.postgres_sql import bind, write_statement

# -- values ------------------------------------------------------------------------------

_BIG_FLOAT = re.compile(rb"[0-9]e\+1[6-9](?![0-9])")
_STRING_OR_BIG_FLOAT = re.compile(rb'"(?:[^"\\]|\\.)*"|-?[0-9]+(?:\.[0-9]+)?e\+1[6-9](?![0-9])')


def _spell_out(match: re.Match[bytes]) -> bytes:
    token = match.group()
    return token if token.startswith(b'"') else format(float(token), ".1f").encode()


def jsonb_text(data: bytes) -> str:
    """JSON text for a jsonb column that reads back as the same JSON values.

    jsonb keeps numbers as numeric and prints ``1e+16`` as ``10000000000000000``, which
    reads back as an integer. Integral floats of that size (orjson writes them with an
    exponent of 16 to 19; larger ones read back as floats anyway) are spelled out with a
    fraction, which numeric keeps.
    """
    if _BIG_FLOAT.search(data):
        data = _STRING_OR_BIG_FLOAT.sub(_spell_out, data)
    return data.decode()


def json_text(value: Any, what: str) -> str:
    """`value` as JSON text for a jsonb column; `ValidationError` if JSON cannot hold it."""
    try:
        return jsonb_text(orjson.dumps(value))
    except orjson.JSONEncodeError as exc:
        raise ValidationError(f"{what} cannot be encoded as JSON: {exc}") from exc


def json_array(items: Iterable[str]) -> str:
    """One JSON array of JSON texts (each already valid JSON: nothing is re-encoded)."""
    return "[" + ",".join(items) + "]"


def check_key(value: Any, what: str) -> str:
    """An id (`check_id`) that Postgres can store: valid UTF-8, so no lone surrogates."""
    check_id(value, what)
    try:
        value.encode()
    except UnicodeEncodeError:
        raise ValidationError(f"{what} is not valid Unicode (lone surrogate)") from None
    return str(value)


# -- row conversion ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ThreadRow:
    """A `threads` row: watermark, stored message count and the live summary (if any)."""

    thread_id: str
    flushed_seq: int
    message_count: int
    thread: Thread | None
    """None for a tombstone (deleted thread)."""


def thread_row(row: Row[Any] | Any) -> ThreadRow:
    """Convert a row selected with `THREAD_COLUMNS` (a SQLAlchemy row, or a psycopg
    named tuple from `apply()`'s pipeline)."""
    live = row.deleted_at is None and row.created_at is not None
    thread = (
        Thread(
            thread_id=row.thread_id,
            parent_thread_id=row.parent_thread_id,
            metadata=row.metadata or {},
            created_at=row.created_at,
            updated_at=row.updated_at,
            latest_run_id=row.latest_run_id,
            message_count=row.message_count,
        )
        if live
        else None
    )
    return ThreadRow(row.thread_id, row.flushed_seq, row.message_count if live else 0, thread)


def canonical(messages: Sequence[Any] | None) -> list[bytes]:
    """Canonical bytes of decoded messages (jsonb reorders keys, so re-encode sorted)."""
    return [orjson.dumps(item, option=orjson.OPT_SORT_KEYS) for item in messages or ()]


def run_from_record(record: Mapping[str, Any]) -> RunRecord:
    """A run from its stored `record` document."""
    return RunRecord.from_json(record)


@dataclass(frozen=True, slots=True)
class Write:
    """A thread change ready to execute: reset first if asked, then the gated statement."""

    thread_id: str
    reset: bool
    statement: Update
    params: dict[str, Any]
    messages: int
    runs: int
    run_ids: tuple[str, ...] = ()
    """Ids of the runs written (a failed gate may mean another thread owns one)."""
    combinable: bool = False
    """Whether `combined_write` can carry it: a live thread's change that drops no stored
    message and is no reset (which needs its own statement first)."""


def build_write(
    change: ThreadChange, *, expected_seq: int, stored_count: int, at: datetime
) -> Write:
    """Statement and parameters writing `change` on top of `stored_count` stored messages.

    `at` is the time of the last entry (the delete time of a tombstone). Raises
    `CorruptEntryError` when the change contradicts itself.
    """
    thread = change.thread
    reset = change.reset and thread is not None
    params: dict[str, Any] = {
        "thread_id": change.thread_id,
        "expected_seq": expected_seq,
        "seq": change.last_seq,
    }
    if thread is None:
        params["at"] = at
        stmt = write_statement(live=False, messages_=False, truncate=False, runs_=False)
        return Write(change.thread_id, False, stmt, bind(**params), 0, 0)
    if thread.message_count != change.message_count:
        raise CorruptEntryError(
            f"thread {change.thread_id!r} at seq {change.last_seq} claims "
            f"{thread.message_count} messages but the change yields {change.message_count}"
        )
    for run, _ in change.runs.values():
        if run.thread_id != change.thread_id:
            raise CorruptEntryError(f"run {run.run_id!r} belongs to another thread")
    params.update(
        parent_thread_id=thread.parent_thread_id,
        metadata=json_text(dict(thread.metadata), "metadata"),
        created_at=thread.created_at,
        updated_at=thread.updated_at,
        latest_run_id=thread.latest_run_id,
        message_count=change.message_count,
    )
    if change.messages:
        # One pass over the joined array: no token of `jsonb_text` spans two messages.
        params["messages"] = jsonb_text(b"[" + b",".join(change.messages) + b"]")
        params["keep"] = change.keep
    if change.runs:
        params["run_records"] = json_array(
            json_text(run.to_json(), "run") for run, _ in change.runs.values()
        )
        params["run_seqs"] = [seq for _, seq in change.runs.values()]
        params["run_ids"] = list(change.runs)
    truncate = change.message_count < (0 if reset else stored_count)
    stmt = write_statement(
        live=True, messages_=bool(change.messages), truncate=truncate, runs_=bool(change.runs)
    )
    return Write(
        change.thread_id,
        reset,
        stmt,
        bind(**params),
        len(change.messages),
        len(change.runs),
        tuple(change.runs),
        combinable=not truncate and not reset,
    )


def combined_write(writes: Sequence[Write]) -> dict[str, Any]:
    """The parameters of `combined_write_statement` writing `writes` (each `combinable`,
    of distinct threads, no run id in two of them), from their own parameters: the JSON
    texts are joined, never encoded again."""
    params = [write.params for write in writes]
    records = [p["p_run_records"][1:-1] for p in params if "p_run_records" in p]
    return bind(
        thread_ids=[p["p_thread_id"] for p in params],
        expected_seqs=[p["p_expected_seq"] for p in params],
        seqs=[p["p_seq"] for p in params],
        parent_thread_ids=[p["p_parent_thread_id"] for p in params],
        created_ats=[p["p_created_at"] for p in params],
        updated_ats=[p["p_updated_at"] for p in params],
        latest_run_ids=[p["p_latest_run_id"] for p in params],
        message_counts=[p["p_message_count"] for p in params],
        keeps=[p.get("p_keep", 0) for p in params],
        metadatas=json_array(p["p_metadata"] for p in params),
        messages=json_array(p.get("p_messages", "[]") for p in params),
        run_records=json_array(r for r in records if r),
        run_seqs=[seq for p in params for seq in p.get("p_run_seqs", ())],
    )


@dataclass(frozen=True, slots=True)
class PlannedBatch:
    """A batch of entries made ready to write against a locked row."""

    write: Write
    last_seq: int
    entries: int
    after: ThreadRow
    """The thread's row once the write is applied (a thread given twice in one call
    plans its second batch on it)."""


def plan_batch(entries: Sequence[WalEntry], row: ThreadRow) -> PlannedBatch | ApplyOutcome:
    """Plan one thread's entries against its locked row: a write, or the outcome.

    Pure, and everything that can be wrong with the entries fails here (as a FAILED
    outcome), before anything is written.
    """
    tid, watermark = row.thread_id, row.flushed_seq
    try:
        check_key(tid, "thread_id")
        if any(entry.thread_id != tid for entry in entries):
            raise CorruptEntryError(f"a batch of thread {tid!r} holds entries of other threads")
        plan = plan_entries(entries, watermark)
        if plan.status is PlanStatus.STALE:
            return ApplyOutcome(tid, ApplyStatus.STALE, watermark)
        if plan.status is PlanStatus.GAP:
            return ApplyOutcome(tid, ApplyStatus.GAP, watermark, missing_from=plan.missing_from)
        change = coalesce(plan.entries, stored_count=row.message_count)
        write = build_write(
            change,
            expected_seq=watermark,
            stored_count=row.message_count,
            at=plan.entries[-1].at,
        )
    except (CorruptEntryError, ValueError, TypeError) as exc:
        # The thread's data is refused (ValidationError is a ValueError): a FAILED
        # outcome for it alone; other threads of the batch go on.
        return failed(tid, watermark, exc)
    live = change.thread is not None
    after = ThreadRow(tid, change.last_seq, change.message_count if live else 0, change.thread)
    return PlannedBatch(write, change.last_seq, len(plan.entries), after)


def failed(thread_id: str, watermark: int, exc: BaseException) -> ApplyOutcome:
    """A FAILED outcome for a data problem: retrying the same entries cannot help."""
    return failed_outcome(thread_id, watermark, exc, retriable=False)
