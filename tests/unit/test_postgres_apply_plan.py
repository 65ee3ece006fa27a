"""The plan of `PostgresThreadRunStore.apply()` (pure: no database): what its two
pipelines send, and what their answers mean."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import orjson
from sqlalchemy.ext.asyncio import create_async_engine

from buffered_store.engine.flushing import ApplyOutcome, ApplyStatus
from buffered_store.engine.ids import utcnow
from buffered_store.model.changes import (
    WalEntry,
)
from buffered_store.model.checkpointing import (
    build_checkpoint_entry,
    build_delete_entry,
    validate_checkpoint,
)
from buffered_store.model.records import RunRecord, Thread
from buffered_store.stores import postgres_apply as plan
from buffered_store.stores import postgres_sql as sql
from buffered_store.stores.postgres_codec import ThreadRow
from buffered_store.stores.postgres_compiled import StatementCompiler, compile_statement

# The dialect of the store's engine (creating an engine opens no connection).
DIALECT = create_async_engine("postgresql+psycopg://localhost/none").dialect
COMPILER = StatementCompiler(DIALECT, "app")


class Chain:
    """A thread's entries, as the buffered writer builds them."""

    def __init__(self, thread_id: str) -> None:
        self.thread_id = thread_id
        self.seq = 0
        self.thread: Thread | None = None
        self.encoded: list[bytes] | None = None

    def checkpoint(self, count: int, run_id: str = "r1") -> WalEntry:
        messages = [{"role": "user", "content": f"m{i}"} for i in range(count)]
        run = RunRecord(run_id=run_id, thread_id=self.thread_id, agent_id="a")
        call = validate_checkpoint(self.thread_id, messages, run, None)
        entry = build_checkpoint_entry(
            call,
            previous=self.thread,
            previous_messages=self.encoded,
            seq=self.seq + 1,
            now=utcnow(),
        )
        self.seq, self.thread, self.encoded = entry.seq, entry.thread, call.encoded
        return entry

    def delete(self) -> WalEntry:
        self.seq += 1
        self.thread, self.encoded = None, None
        return build_delete_entry(self.thread_id, seq=self.seq, now=utcnow())

    def row(self) -> ThreadRow:
        """The stored row once every entry so far is applied."""
        count = self.thread.message_count if self.thread else 0
        return ThreadRow(self.thread_id, self.seq, count, self.thread)


def call_of(*batches: Sequence[WalEntry]) -> plan.ApplyCall:
    order = sorted((i for i, b in enumerate(batches) if b), key=lambda i: batches[i][0].thread_id)
    return plan.ApplyCall(batches, order)


def sql_of(statement: Any) -> bytes:
    return COMPILER.compile(statement).sql


def failed(thread_id: str) -> tuple[ApplyOutcome, int]:
    return ApplyOutcome(thread_id, ApplyStatus.FAILED, 0, error="x", retriable=False), 0


class Owner(NamedTuple):
    run_id: str
    thread_id: str


# -- compiling ------------------------------------------------------------------------------


def test_statements_render_the_schema_and_bind_their_own_values() -> None:
    compiled = compile_statement(sql.DROP_EMPTY_THREAD, DIALECT, "Odd Schema")
    assert b'"Odd Schema".threads' in compiled.sql
    assert b"%(p_thread_id)s::VARCHAR" in compiled.sql  # the dialect's parameter casts
    params = compiled.params({"p_thread_id": "t"})
    # `flushed_seq = 0` is a value of the statement itself, bound under its own name.
    assert sorted(params.values(), key=str) == [0, "t"]


def test_only_array_parameters_are_processed_into_lists() -> None:
    write = sql.write_statement(live=True, messages_=True, truncate=True, runs_=True)
    compiled = COMPILER.compile(write)
    assert sorted(name for name, _ in compiled.processors) == ["p_run_ids", "p_run_seqs"]
    params = compiled.params({"p_run_ids": ("a",), "p_run_seqs": (3,), "p_seq": 4})
    assert (params["p_run_ids"], params["p_run_seqs"], params["p_seq"]) == (["a"], [3], 4)
    assert params["message_1"] == "role"  # the JSON key of `message ->> 'role'`
    assert COMPILER.compile(write) is compiled


# -- round trip 1 ---------------------------------------------------------------------------


def test_opening_creates_the_threads_whose_first_entry_is_there_then_locks_all() -> None:
    new, old = Chain("b-new"), Chain("a-old")
    old.checkpoint(1)
    invalid = dataclasses.replace(Chain("c").checkpoint(1), thread_id="c\ud800")
    call = call_of([new.checkpoint(1)], [old.checkpoint(2)], [invalid], [])
    opening = plan.opening(call, COMPILER, rollback=False)
    assert opening is not None
    assert [step.sql for step in opening.steps] == [
        b"BEGIN",
        sql_of(sql.CREATE_THREADS),
        sql_of(sql.LOCK_THREADS),
    ]
    # Invalid ids are left out: their batch fails in planning, alone.
    assert opening.steps[1].params == {"p_thread_ids": ["b-new"]}
    assert opening.steps[2].params == {"p_thread_ids": ["a-old", "b-new"]}
    assert all(step.batch is None for step in opening.steps)
    assert (opening.create_at, opening.lock_at) == (1, 2)


def test_opening_without_new_threads_after_a_failed_run() -> None:
    chain = Chain("t")
    chain.checkpoint(1)
    call = call_of([chain.checkpoint(2)], [chain.checkpoint(3)])
    opening = plan.opening(call, COMPILER, rollback=True)
    assert opening is not None
    assert [step.sql for step in opening.steps] == [b"ROLLBACK", b"BEGIN", sql_of(sql.LOCK_THREADS)]
    assert opening.steps[2].params == {"p_thread_ids": ["t"]}  # once, though given twice
    assert (opening.create_at, opening.lock_at) == (None, 2)


def test_opening_leaves_out_rejected_and_refused_batches() -> None:
    first, second = Chain("first"), Chain("second")
    call = call_of([first.checkpoint(1)], [second.checkpoint(1)])
    call.rejected[1] = failed("second")
    opening = plan.opening(call, COMPILER, rollback=False)
    assert opening is not None
    assert opening.steps[-1].params == {"p_thread_ids": ["first"]}
    call.refused[0] = plan.Refusal(0, "first", 0, ("r1",))
    assert plan.opening(call, COMPILER, rollback=False) is None


# -- round trip 2 ---------------------------------------------------------------------------


def test_writing_plans_each_thread_on_its_locked_row_and_commits() -> None:
    a, b, c = Chain("a"), Chain("b"), Chain("c")
    b.checkpoint(1)
    stale = b.checkpoint(2)
    call = call_of([c.checkpoint(1)], [stale], [a.checkpoint(1), a.checkpoint(2)])
    rows = {"b": b.row(), "a": ThreadRow("a", 0, 0, None)}
    # c is to be written but has no row (another flusher dropped an empty one before
    # the lock): the transaction must run again.
    assert plan.writing(call, rows, {"a"}, COMPILER).vanished
    rows["c"] = ThreadRow("c", 0, 0, None)
    writing = plan.writing(call, rows, {"a", "c"}, COMPILER)
    assert not writing.vanished
    assert writing.decided == {1: (ApplyOutcome("b", ApplyStatus.STALE, 2), 0)}
    assert [(step.batch, step.sql == b"COMMIT") for step in writing.steps] == [
        (2, False),
        (0, False),
        (None, True),
    ]
    assert [writing.writes[i].at for i in (2, 0)] == [0, 1]
    settled = plan.settle(writing, [plan.StepResult(1, [])] * 3)
    assert settled.applied == {
        2: (ApplyOutcome("a", ApplyStatus.APPLIED, 2), 2),
        0: (ApplyOutcome("c", ApplyStatus.APPLIED, 1), 1),
    }
    assert (settled.messages, settled.runs, settled.refused) == (3, 2, [])


def test_rows_created_for_threads_not_written_are_dropped_in_the_transaction() -> None:
    good = Chain("good")
    corrupt = dataclasses.replace(Chain("corrupt").checkpoint(1), keep=3, message_count=3)
    call = call_of([corrupt], [good.checkpoint(1)])
    rows = {t: ThreadRow(t, 0, 0, None) for t in ("good", "corrupt")}
    writing = plan.writing(call, rows, {"good", "corrupt"}, COMPILER)
    assert writing.decided[0][0].status is ApplyStatus.FAILED
    assert [step.sql for step in writing.steps[1:]] == [sql_of(sql.DROP_EMPTY_THREAD), b"COMMIT"]
    assert writing.steps[1].params == {"p_thread_id": "corrupt", "flushed_seq_1": 0}


def test_a_thread_given_twice_plans_its_second_batch_on_the_first() -> None:
    chain = Chain("t")
    first = [chain.checkpoint(1), chain.checkpoint(2)]
    second = [chain.checkpoint(3, run_id="r2")]
    call = call_of(first, second)
    writing = plan.writing(call, {"t": ThreadRow("t", 0, 0, None)}, {"t"}, COMPILER)
    assert writing.writes[1].base == ThreadRow("t", 2, 2, first[1].thread)
    assert writing.writes[1].batch.write.params["p_expected_seq"] == 2
    # Should the first write be refused, the second would be planned on a row that
    # never was: nothing may commit before the answers are read.
    assert not writing.commit
    assert writing.steps[-1].sql != b"COMMIT"


def test_a_later_batch_decided_on_a_write_that_claims_runs_waits_for_its_answer() -> None:
    chain = Chain("t")
    first = [chain.checkpoint(1), chain.checkpoint(2)]
    call = call_of(first, first[1:])
    writing = plan.writing(call, {"t": ThreadRow("t", 0, 0, None)}, {"t"}, COMPILER)
    # Stale only if the first write is not refused.
    assert writing.decided == {1: (ApplyOutcome("t", ApplyStatus.STALE, 2), 0)}
    assert not writing.commit


def test_a_reset_that_claims_runs_is_not_committed_blindly() -> None:
    chain = Chain("t")
    chain.checkpoint(2)
    call = call_of([chain.delete(), chain.checkpoint(1, run_id="r2")])
    writing = plan.writing(call, {"t": ThreadRow("t", 1, 2, None)}, set(), COMPILER)
    assert writing.steps[0].sql == sql_of(sql.RESET_THREAD)
    assert [step.batch for step in writing.steps] == [0, 0]  # no COMMIT
    assert not writing.commit
    # A delete alone claims no run: its gate cannot be refused under the lock.
    tombstone = Chain("u")
    tombstone.checkpoint(2)
    call = call_of([tombstone.delete()])
    writing = plan.writing(call, {"u": ThreadRow("u", 1, 2, None)}, set(), COMPILER)
    assert writing.commit
    assert writing.steps[-1].sql == b"COMMIT"


def test_every_reset_of_a_call_comes_before_its_first_gated_write() -> None:
    # A and B re-created, each taking the other's old run: each gate needs the other's
    # reset first. A thread's later batch that resets again keeps its place after the
    # thread's earlier write (the reset drops what that write wrote).
    a, b, c = Chain("a"), Chain("b"), Chain("c")
    a.checkpoint(1, run_id="ra")
    b.checkpoint(1, run_id="rb")
    rows = {t.thread_id: t.row() for t in (a, b, c)}
    a_batch = [a.delete(), a.checkpoint(1, run_id="rb")]
    b_batch = [b.delete(), b.checkpoint(1, run_id="ra")]
    c_first = [c.checkpoint(1, run_id="rc")]
    c_again = [c.delete(), c.checkpoint(1, run_id="rc2")]
    writing = plan.writing(call_of(a_batch, b_batch, c_first, c_again), rows, {"c"}, COMPILER)
    reset = sql_of(sql.RESET_THREAD)
    shape = [(step.batch, step.sql == reset) for step in writing.steps if step.batch is not None]
    assert shape == [
        (0, True),
        (1, True),
        (0, False),
        (1, False),
        (2, False),
        (3, True),
        (3, False),
    ]
    assert {index: w.at for index, w in writing.writes.items()} == {0: 2, 1: 3, 2: 4, 3: 6}
    assert not writing.commit  # a refused gate must not commit the resets


def test_refused_writes_name_the_owner_after_the_commit() -> None:
    thief, other = Chain("thief"), Chain("other")
    call = call_of([thief.checkpoint(1, run_id="shared")], [other.checkpoint(1)])
    rows = {t: ThreadRow(t, 0, 0, None) for t in ("thief", "other")}
    writing = plan.writing(call, rows, {"thief", "other"}, COMPILER)
    assert writing.commit
    # Both written by the combined statement, which returns only "other": the thief's
    # gate refused.
    assert writing.combined_at == 0
    results = [plan.StepResult(1, [("other",)]), plan.StepResult(0, [])]
    settled = plan.settle(writing, results)
    assert list(settled.applied) == [1]
    assert settled.refused == [plan.Refusal(0, "thief", 0, ("shared",))]
    steps = plan.after_commit(settled.refused, {"thief", "other"}, COMPILER)
    assert [(step.sql, step.batch) for step in steps] == [
        (sql_of(sql.SELECT_RUN_OWNERS), 0),
        (sql_of(sql.DROP_EMPTY_THREAD), None),
    ]
    assert steps[0].params == {"p_thread_id": "thief", "p_run_ids": ["shared"]}
    owners = [plan.StepResult(1, [Owner("shared", "owner")]), plan.StepResult(0, [])]
    [(outcome, entries)] = plan.refused_outcomes(settled.refused, owners).values()
    assert (outcome.status, outcome.retriable, entries) == (ApplyStatus.FAILED, False, 0)
    assert "RunOwnershipError" in (outcome.error or "")
    assert "'owner'" in (outcome.error or "")
    assert (outcome.waits_for, outcome.retry_now) == ("owner", False)
    # The owner let the run go meanwhile (its transaction committed between the gate and
    # the lookup): the same entries may apply at once.
    [(outcome, _)] = plan.refused_outcomes(settled.refused, [plan.StepResult(0, [])]).values()
    assert (outcome.status, outcome.retriable) == (ApplyStatus.FAILED, True)
    assert (outcome.waits_for, outcome.retry_now) == (None, True)


def test_a_rejected_batch_fails_with_the_database_error() -> None:
    chain = Chain("t")
    call = call_of([chain.checkpoint(1)])
    writing = plan.writing(call, {"t": ThreadRow("t", 0, 0, None)}, set(), COMPILER)
    outcome = plan.rejected_outcome(call, writing, 0, ValueError("index row too large"))
    assert (outcome.status, outcome.retriable, outcome.flushed_seq) == (
        ApplyStatus.FAILED,
        False,
        0,
    )
    assert outcome.error == "ValueError: index row too large"


def test_a_rolled_back_run_leaves_out_the_first_refusal_of_each_thread() -> None:
    refusals = [
        plan.Refusal(0, "a", 0, ("shared",)),
        plan.Refusal(2, "a", 1, ("mine",)),  # planned on batch 0: planned again
        plan.Refusal(1, "b", 0, ("other",)),
    ]
    assert plan.to_leave_out(refusals) == [refusals[0], refusals[2]]


# -- threads written together --------------------------------------------------------------


def test_threads_with_one_plain_batch_each_are_written_by_one_statement() -> None:
    chains = [Chain(t) for t in ("b", "a", "c")]
    call = call_of(*([c.checkpoint(2, run_id=f"run-{c.thread_id}")] for c in chains))
    rows = {c.thread_id: ThreadRow(c.thread_id, 0, 0, None) for c in chains}
    writing = plan.writing(call, rows, set(), COMPILER)
    assert [step.sql for step in writing.steps] == [
        sql_of(sql.combined_write_statement()),
        b"COMMIT",
    ]
    assert writing.combined_at == 0
    assert writing.steps[0].rows
    params = writing.steps[0].params
    assert params is not None
    # One element per thread, in thread id order; the JSON texts joined as they are.
    assert params["p_thread_ids"] == ["a", "b", "c"]
    assert params["p_expected_seqs"] == [0, 0, 0]
    assert params["p_seqs"] == [1, 1, 1]
    assert params["p_message_counts"] == [2, 2, 2]
    assert params["p_keeps"] == [0, 0, 0]
    messages = orjson.loads(params["p_messages"])
    assert messages == [[{"role": "user", "content": f"m{i}"} for i in range(2)]] * 3
    runs = orjson.loads(params["p_run_records"])
    assert [(r["run_id"], r["thread_id"]) for r in runs] == [
        ("run-a", "a"),
        ("run-b", "b"),
        ("run-c", "c"),
    ]
    assert params["p_run_seqs"] == [1, 1, 1]
    assert orjson.loads(params["p_metadatas"]) == [{}, {}, {}]
    # The statement returns the threads it wrote: one not returned was refused.
    settled = plan.settle(writing, [plan.StepResult(2, [("a",), ("c",)]), plan.StepResult(0, [])])
    assert sorted(o.thread_id for o, _ in settled.applied.values()) == ["a", "c"]
    assert [r.thread_id for r in settled.refused] == ["b"]
    assert (settled.messages, settled.runs) == (4, 2)


def test_what_one_statement_cannot_write_is_written_alone() -> None:
    twice, reset, shrink, clash, plain = (Chain(t) for t in ("d", "e", "f", "g", "h"))
    twice_batches = [twice.checkpoint(1, run_id="rd")], [twice.checkpoint(2, run_id="rd")]
    reset.checkpoint(2, run_id="re")
    reset_batch = [reset.delete(), reset.checkpoint(1, run_id="re2")]
    shrink.checkpoint(3, run_id="rf")
    shrunk = shrink.checkpoint(1, run_id="rf")  # fewer messages than stored: a truncation
    call = call_of(
        *twice_batches,
        reset_batch,
        [shrunk],
        [clash.checkpoint(1, run_id="shared")],
        [plain.checkpoint(1, run_id="shared")],  # the same run id as "g": alone
        [Chain("i").checkpoint(1, run_id="ri")],
    )
    rows = {
        "d": ThreadRow("d", 0, 0, None),
        "e": ThreadRow("e", 1, 2, None),
        "f": ThreadRow("f", 1, 3, None),
        "g": ThreadRow("g", 0, 0, None),
        "h": ThreadRow("h", 0, 0, None),
        "i": ThreadRow("i", 0, 0, None),
    }
    writing = plan.writing(call, rows, set(), COMPILER)
    combined = [i for i, p in writing.writes.items() if p.combined]
    assert sorted(call.thread_of(i) for i in combined) == ["g", "i"]
    alone = sorted(call.thread_of(i) for i, p in writing.writes.items() if not p.combined)
    assert alone == ["d", "d", "e", "f", "h"]
    assert writing.combined_at is not None
    assert writing.steps[writing.combined_at].params["p_thread_ids"] == ["g", "i"]  # type: ignore[index]
    # Cleared after the database rejected a combined statement: each thread alone.
    call.combine = False
    writing = plan.writing(call, rows, set(), COMPILER)
    assert writing.combined_at is None
    assert not any(p.combined for p in writing.writes.values())


def test_a_single_thread_is_written_by_its_own_statement() -> None:
    chain = Chain("t")
    writing = plan.writing(
        call_of([chain.checkpoint(1)]), {"t": ThreadRow("t", 0, 0, None)}, set(), COMPILER
    )
    assert writing.combined_at is None
    assert writing.steps[0].batch == 0
