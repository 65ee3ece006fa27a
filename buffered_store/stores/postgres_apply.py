"""The plan of one `PostgresThreadRunStore.apply()` call: what it sends and what the
answers mean. Pure: no I/O (`PostgresThreadRunStore` awaits, `postgres_pipeline` sends).

A call is one transaction in two round trips (two psycopg pipelines), whatever the
number of threads:

1. `opening`: ``BEGIN``, the insert of the missing rows of the threads the call may
   create (only when some batch holds a thread's first entry) and the lock of every
   thread row of the call: rows created before any lock is taken, both in code point
   order, so concurrent flushers take row locks in one global order.
2. `writing`, planned on the locked rows (`postgres_codec.plan_batch`): the writes; the
   removal of the rows created for threads that are then not written (an empty row reads
   as absent, this only tidies up); ``COMMIT``. The threads whose write is one plain
   change (`Write.combinable`: no reset, no rows dropped; the call's only batch of the
   thread, no run id shared with another of them) are written together by one statement
   (`postgres_sql.combined_write_statement`), when there are at least two, after every
   other batch; every other batch gets its own statement, in thread order, the threads
   holding a delete first, those deleted for good before those re-created
   (`planning.deletes_first`: another thread of the call may take one of their runs
   over). The resets of the threads deleted in their first batch of the call come
   before every write: two re-created threads may swap their runs, each claim needing
   the other's reset.

A statement the database rejects aborts the pipeline; `Step.batch` names the batch whose
data it was, and the transaction runs again without that batch (`ApplyCall.rejected`).
The combined statement names no batch: the transaction runs again with each thread in
its own statement (`ApplyCall.combine` cleared), which names it.
A gated write that writes nothing under the lock means another thread owns one of its
runs: the batch fails, and `after_commit` reads the owner for the error. When such a
refusal would leave something behind (the reset of the thread's rows, or a later batch
of the same thread planned on top of the refused write), `writing` leaves ``COMMIT`` out
of the pipeline, so the transaction can be rolled back and run again without the batch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.sql import ClauseElement

from buffered_store.engine.flushing import ApplyOutcome, ApplyStatus, let_go_outcome
from buffered_store.errors import StoreError, ValidationError
from buffered_store.model.changes import (
    WalEntry,
)
from buffered_store.model.checkpointing import run_owned_elsewhere
from buffered_store.model.planning import deletes_first
from buffered_store.stores import postgres_codec as codec
from buffered_store.stores import postgres_sql as sql
from buffered_store.stores.postgres_compiled import StatementCompiler

__all__ = [
    "BEGIN",
    "COMMIT",
    "ROLLBACK",
    "ApplyCall",
    "Done",
    "Opening",
    "Planned",
    "Refusal",
    "Settled",
    "Step",
    "StepResult",
    "Writing",
    "after_commit",
    "created_ids",
    "locked_rows",
    "opening",
    "refused_outcomes",
    "rejected_outcome",
    "settle",
    "to_leave_out",
    "writing",
]

Done = dict[int, tuple[ApplyOutcome, int]]
"""Outcomes by batch index, with the number of entries applied."""


@dataclass(frozen=True, slots=True)
class Step:
    """One statement of a pipeline."""

    sql: bytes
    params: Mapping[str, Any] | None = None
    batch: int | None = None
    """The batch whose data the statement writes (None: the transaction's own)."""
    rows: bool = False
    """Whether its rows are read."""


@dataclass(frozen=True, slots=True)
class StepResult:
    """What a statement of a pipeline returned."""

    rowcount: int
    rows: list[Any]


BEGIN = Step(b"BEGIN")
COMMIT = Step(b"COMMIT")
ROLLBACK = Step(b"ROLLBACK")


def _step(
    compiler: StatementCompiler,
    statement: ClauseElement,
    values: Mapping[str, Any],
    *,
    batch: int | None = None,
    rows: bool = False,
) -> Step:
    text, params = compiler.query(statement, values)
    return Step(text, params, batch, rows)


@dataclass(frozen=True, slots=True)
class Refusal:
    """A batch whose gated write was refused under the lock: one of its runs belongs to
    another thread."""

    index: int
    thread_id: str
    flushed_seq: int
    run_ids: tuple[str, ...]


@dataclass(slots=True)
class ApplyCall:
    """One `apply()` call: its batches, and what its earlier transactions decided."""

    batches: Sequence[Sequence[WalEntry]]
    order: list[int]
    """Indexes of the non-empty batches, in thread id order."""
    rejected: Done = field(default_factory=dict)
    """Batches whose data the database rejected (FAILED), left out of later runs."""
    refused: dict[int, Refusal] = field(default_factory=dict)
    """Batches refused in a run that was rolled back, left out of later runs."""
    combine: bool = True
    """Whether `writing` may write threads in one combined statement (cleared when the
    database rejected one: the next run writes each thread alone, which tells whose data
    it was)."""

    def active(self) -> list[int]:
        """The batches the next transaction plans, in thread id order."""
        return [i for i in self.order if i not in self.rejected and i not in self.refused]

    def thread_of(self, index: int) -> str:
        """The thread id of a batch."""
        return self.batches[index][0].thread_id


def _valid(thread_id: str) -> bool:
    try:
        codec.check_key(thread_id, "thread_id")
    except ValidationError:
        return False  # its batch fails in planning, alone
    return True


# -- round trip 1 ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Opening:
    """The first pipeline: where its answers are."""

    steps: list[Step]
    lock_ids: list[str]
    create_at: int | None
    """Index of the step inserting missing rows (its rows: the ids inserted)."""
    lock_at: int
    """Index of the step locking the rows (its rows: the locked rows)."""


def opening(call: ApplyCall, compiler: StatementCompiler, *, rollback: bool) -> Opening | None:
    """``BEGIN``, create and lock (after a ``ROLLBACK`` of the previous run if asked);
    None when no batch names a valid thread (all fail in planning, nothing to send)."""
    active = call.active()
    lock_ids = [t for t in dict.fromkeys(call.thread_of(i) for i in active) if _valid(t)]
    if not lock_ids:
        return None
    # Only a batch holding its thread's first entry can create the thread: any other
    # batch of a thread without a row is a gap, which writes nothing.
    create_ids = [
        thread_id
        for thread_id in dict.fromkeys(
            call.thread_of(i) for i in active if any(e.seq == 1 for e in call.batches[i])
        )
        if _valid(thread_id)
    ]
    steps = [ROLLBACK, BEGIN] if rollback else [BEGIN]
    create_at = None
    if create_ids:
        # Sorted: Python orders str by code point, as the "C" collation orders UTF-8.
        create_at = len(steps)
        params = sql.bind(thread_ids=sorted(create_ids))
        steps.append(_step(compiler, sql.CREATE_THREADS, params, rows=True))
    lock_at = len(steps)
    steps.append(_step(compiler, sql.LOCK_THREADS, sql.bind(thread_ids=lock_ids), rows=True))
    return Opening(steps, lock_ids, create_at, lock_at)


def locked_rows(opening: Opening, results: Sequence[StepResult]) -> dict[str, codec.ThreadRow]:
    """The locked rows by thread id (threads without a row are missing)."""
    return {row.thread_id: row for row in map(codec.thread_row, results[opening.lock_at].rows)}


def created_ids(opening: Opening, results: Sequence[StepResult]) -> set[str]:
    """Ids of the rows the first pipeline inserted (empty until written)."""
    if opening.create_at is None:
        return set()
    return {row[0] for row in results[opening.create_at].rows}


# -- round trip 2 ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Planned:
    """A batch's write in the second pipeline."""

    at: int
    """Index of its gated write among the steps (the combined one, if `combined`)."""
    batch: codec.PlannedBatch
    base: codec.ThreadRow
    """The row it was planned on."""
    combined: bool = False
    """Written by the combined statement (which returns the ids of the threads it wrote)."""


@dataclass(slots=True)
class Writing:
    """The second pipeline and what is known without it."""

    steps: list[Step] = field(default_factory=list)
    decided: Done = field(default_factory=dict)
    """Outcomes known from the plan alone (stale, gap, failed in planning)."""
    writes: dict[int, Planned] = field(default_factory=dict)
    commit: bool = True
    """Whether ``COMMIT`` ends the pipeline (else it is sent once the answers are read)."""
    vanished: bool = False
    """A batch to write found no row (another flusher removed an empty one between the
    insert and the lock): nothing is sent, the transaction runs again."""
    combined_at: int | None = None
    """Index of the combined statement among the steps (None: none)."""


def writing(
    call: ApplyCall,
    rows: Mapping[str, codec.ThreadRow],
    created: set[str],
    compiler: StatementCompiler,
) -> Writing:
    """Plan every active batch on its locked row and build the second pipeline."""
    plan = Writing()
    current = dict(rows)  # the rows as this transaction leaves them so far
    active = call.active()
    last_batch = {call.thread_of(index): index for index in active}
    batches_of = Counter(call.thread_of(index) for index in active)
    planned_all: list[tuple[int, codec.PlannedBatch, codec.ThreadRow]] = []
    together: dict[int, tuple[codec.PlannedBatch, codec.ThreadRow]] = {}
    claimed: set[str] = set()  # run ids of the threads written together
    for index in active:
        entries = call.batches[index]
        thread_id = entries[0].thread_id
        row = current.get(thread_id)
        base = row or codec.ThreadRow(thread_id, 0, 0, None)
        planned = codec.plan_batch(entries, base)
        if isinstance(planned, ApplyOutcome):
            plan.decided[index] = (planned, 0)
            continue
        if row is None:
            return Writing(decided=plan.decided, vanished=True)
        write = planned.write
        # Together: a thread's only batch of the call, written by one gated change; a
        # run id in two of them would make the combined upsert touch a row twice.
        if (
            call.combine
            and write.combinable
            and batches_of[thread_id] == 1
            and claimed.isdisjoint(write.run_ids)
        ):
            claimed.update(write.run_ids)
            together[index] = (planned, base)
        planned_all.append((index, planned, base))
        current[thread_id] = planned.after
    if len(together) < 2:  # one thread alone is cheaper in its own statement
        together = {}
    # The threads holding a delete first, each thread's batches kept in order: a run a
    # deleted thread owned may be taken over by another thread of the same call.
    rank = {index: n for n, group in enumerate(deletes_first(call.batches)) for index in group}
    planned_all.sort(key=lambda item: rank[item[0]])
    # Every reset of a thread's first batch before any write: two re-created threads may
    # swap their runs, each claim needing the other's reset (a refused one rolls back).
    hoisted: set[int] = set()
    first_seen: set[str] = set()
    for index, planned, _ in planned_all:
        write = planned.write
        if write.thread_id in first_seen:
            continue
        first_seen.add(write.thread_id)
        if write.reset:
            hoisted.add(index)
            plan.steps.append(
                _step(compiler, sql.RESET_THREAD, sql.bind(thread_id=write.thread_id), batch=index)
            )
    for index, planned, base in planned_all:
        if index in together:
            continue
        write = planned.write
        if write.reset and index not in hoisted:
            plan.steps.append(
                _step(compiler, sql.RESET_THREAD, sql.bind(thread_id=write.thread_id), batch=index)
            )
        plan.writes[index] = Planned(len(plan.steps), planned, base)
        plan.steps.append(_step(compiler, write.statement, write.params, batch=index))
    if together:
        plan.combined_at = len(plan.steps)
        params = codec.combined_write([planned.write for planned, _ in together.values()])
        plan.steps.append(_step(compiler, sql.combined_write_statement(), params, rows=True))
        for index, (planned, base) in together.items():
            plan.writes[index] = Planned(plan.combined_at, planned, base, combined=True)
    written = {call.thread_of(index) for index in plan.writes}
    for thread_id in sorted(created - written):
        plan.steps.append(_step(compiler, sql.DROP_EMPTY_THREAD, sql.bind(thread_id=thread_id)))
    # Under the lock only a run owned by another thread makes a gate refuse; a refusal
    # must not commit a reset without its write, nor an outcome of a later batch of the
    # same thread planned on it.
    plan.commit = not any(
        planned.batch.write.run_ids
        and (planned.batch.write.reset or last_batch[call.thread_of(index)] != index)
        for index, planned in plan.writes.items()
    )
    if plan.commit:
        plan.steps.append(COMMIT)
    return plan


@dataclass(slots=True)
class Settled:
    """The outcome of the second pipeline."""

    applied: Done = field(default_factory=dict)
    refused: list[Refusal] = field(default_factory=list)
    messages: int = 0
    runs: int = 0
    """Message and run rows written by the applied batches."""


def settle(plan: Writing, results: Sequence[StepResult]) -> Settled:
    """Which gated writes wrote (their gate returned the new watermark) and which were
    refused."""
    settled = Settled()
    together: set[str] = set()
    if plan.combined_at is not None:
        together = {row[0] for row in results[plan.combined_at].rows}
    for index, planned in plan.writes.items():
        write = planned.batch.write
        wrote = write.thread_id in together if planned.combined else results[planned.at].rowcount
        if wrote:
            outcome = ApplyOutcome(write.thread_id, ApplyStatus.APPLIED, planned.batch.last_seq)
            settled.applied[index] = (outcome, planned.batch.entries)
            settled.messages += write.messages
            settled.runs += write.runs
        else:
            settled.refused.append(
                Refusal(index, write.thread_id, planned.base.flushed_seq, write.run_ids)
            )
    return settled


def to_leave_out(refusals: Sequence[Refusal]) -> list[Refusal]:
    """The refusals a rolled back run leaves out of the next: the first of each thread
    (a later batch of the same thread was planned on the refused one, and is planned
    again on the row as it is)."""
    first: dict[str, Refusal] = {}
    for refusal in refusals:
        first.setdefault(refusal.thread_id, refusal)
    return list(first.values())


def rejected_outcome(
    call: ApplyCall, plan: Writing, index: int, error: BaseException
) -> ApplyOutcome:
    """The outcome of a batch whose statement the database rejected."""
    planned = plan.writes.get(index)
    flushed_seq = planned.base.flushed_seq if planned is not None else 0
    return codec.failed(call.thread_of(index), flushed_seq, error)


# -- after the commit ----------------------------------------------------------------------


def after_commit(
    refusals: Sequence[Refusal], created: set[str], compiler: StatementCompiler
) -> list[Step]:
    """Read the owners of the refused batches' runs, and remove the rows created for
    their threads (only if still empty: another flusher may have written them since)."""
    steps = [
        _step(
            compiler,
            sql.SELECT_RUN_OWNERS,
            sql.bind(thread_id=refusal.thread_id, run_ids=list(refusal.run_ids)),
            batch=refusal.index,
            rows=True,
        )
        for refusal in refusals
    ]
    for thread_id in sorted({r.thread_id for r in refusals} & created):
        steps.append(_step(compiler, sql.DROP_EMPTY_THREAD, sql.bind(thread_id=thread_id)))
    return steps


def refused_outcomes(refusals: Sequence[Refusal], results: Sequence[StepResult]) -> Done:
    """FAILED outcomes naming the owner of each refused batch's run (the owner lookups
    are the first steps of `after_commit`)."""
    done: Done = {}
    for refusal, result in zip(refusals, results, strict=False):
        error: StoreError
        if result.rows:
            owner = result.rows[0]
            error = run_owned_elsewhere(owner.run_id, owner.thread_id, refusal.thread_id)
            done[refusal.index] = (codec.failed(refusal.thread_id, refusal.flushed_seq, error), 0)
        else:
            # The owner changed again since (its thread deleted): the same entries may apply.
            done[refusal.index] = (let_go_outcome(refusal.thread_id, refusal.flushed_seq), 0)
    return done
