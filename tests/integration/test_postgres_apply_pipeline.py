"""`PostgresThreadRunStore.apply()` in two round trips (psycopg pipelines; real server).

What it costs (round trips counted by the store and, independently, on the wire), how a
thread whose data Postgres rejects is isolated, the rerun of a transaction Postgres
aborts, the connection it leaves behind, and that it writes the rows SQLAlchemy wrote when
`apply()` executed its statements one by one."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import orjson
import psycopg
import pytest
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from buffered_store.engine import ids
from buffered_store.engine.flushing import ApplyOutcome, ApplyStatus
from buffered_store.engine.ids import MAX_ID_BYTES, utcnow
from buffered_store.model.changes import (
    EntryKind,
    WalEntry,
)
from buffered_store.model.checkpointing import (
    build_checkpoint_entry,
    build_delete_entry,
    validate_checkpoint,
)
from buffered_store.model.records import Message, RunRecord, RunStatus, Thread
from buffered_store.stores import migrate as migrations
from buffered_store.stores import postgres_apply as plan
from buffered_store.stores import postgres_codec as codec
from buffered_store.stores import postgres_sql as sql
from buffered_store.stores.postgres import PostgresThreadRunStore
from buffered_store.stores.postgres_compiled import StatementCompiler
from buffered_store.stores.postgres_pipeline import PipelineConnection
from tests.integration.test_postgres_store import Chain, libpq_url, msgs, query, run_of

# The harness is installed as `buffered_store.benchmarks`; mypy checks the repository's
# folder as the top-level package `benchmarks` (pyproject [tool.mypy] packages).
if TYPE_CHECKING:
    from benchmarks.wire import RoundTrips
else:
    from buffered_store.benchmarks.wire import RoundTrips

# -- helpers --------------------------------------------------------------------------------


@pytest.fixture
def wire() -> Iterator[RoundTrips]:
    counter = RoundTrips()
    yield counter
    counter.close()


async def connect(database_url: str, schema: str, **options: Any) -> PostgresThreadRunStore:
    return await PostgresThreadRunStore.connect(
        database_url, schema=schema, migrate=True, **options
    )


def delta(store: PostgresThreadRunStore, before: dict[str, int], *keys: str) -> list[int]:
    after = store.stats()
    return [after[key] - before[key] for key in keys]


def poisoned(thread_id: str) -> WalEntry:
    """A first entry whose message jsonb refuses: ``\\u0000`` (SQLSTATE 22P05)."""
    return WalEntry(
        thread_id=thread_id,
        seq=1,
        kind=EntryKind.CHECKPOINT,
        at=utcnow(),
        messages=(b'{"content":"\\u0000","role":"user"}',),
        message_count=1,
    )


def cjk(count: int, start: int) -> str:
    """Distinct CJK ideographs (3 UTF-8 bytes each, nothing to compress): 512 of them in a
    thread id and in a run id overflow the btree of ``runs_thread_created_idx``."""
    return "".join(chr(start + i) for i in range(count))


# -- round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("threads", [1, 8, 64])
async def test_apply_costs_two_round_trips_whatever_the_number_of_threads(
    database_url: str, schema_name: str, wire: RoundTrips, threads: int
) -> None:
    async with await connect(database_url, schema_name) as store:
        chains = [Chain(f"t{i:03d}") for i in range(threads)]
        # First call: every thread is new (its row is created); then the steady state.
        for count in (2, 4, 6):
            batches = [
                [c.checkpoint(msgs(count - 1), c.thread_id), c.checkpoint(msgs(count), c.thread_id)]
                for c in chains
            ]
            before = store.stats()
            with wire:
                outcomes = await store.apply(batches)
            assert {o.status for o in outcomes} == {ApplyStatus.APPLIED}
            assert delta(store, before, "round_trips", "transactions") == [2, 1]
        assert wire.total == 3 * 2
        for chain in chains[:: max(1, threads // 4)]:
            assert await store.load_messages(chain.thread_id) == msgs(6)


async def test_the_stores_round_trips_are_those_on_the_wire(
    database_url: str, schema_name: str, wire: RoundTrips
) -> None:
    async with await connect(database_url, schema_name) as store:
        before = store.stats()
        with wire:
            await store.checkpoint("d", msgs(1), run_of("d"))  # the locking path
            await store.checkpoint("d", msgs(2), run_of("d"))  # one statement
            await store.load_messages("d")
            await store.delete_thread("d")
            chain = Chain("a")
            await store.apply([[chain.checkpoint(msgs(1))], [Chain("b").checkpoint(msgs(1), "rb")]])
            await store.apply([[chain.checkpoint(msgs(2))]])
        [counted] = delta(store, before, "round_trips")
        assert counted == wire.total > 4


# -- data Postgres rejects ------------------------------------------------------------------


@pytest.fixture
def longer_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """Accept ids longer than Postgres can index, so such entries reach `apply()`."""
    monkeypatch.setattr(ids, "MAX_ID_BYTES", 4 * MAX_ID_BYTES)


def rejected_entry(kind: str) -> WalEntry:
    if kind == "jsonb refuses the value (22P05)":
        return poisoned("t03-poisoned")
    thread_id = cjk(512, 0x4E00)  # sorts after every "t..." id
    run = RunRecord(run_id=cjk(512, 0x6000), thread_id=thread_id, agent_id="a")
    call = validate_checkpoint(thread_id, msgs(1), run, None)
    return build_checkpoint_entry(call, previous=None, previous_messages=None, seq=1, now=utcnow())


@pytest.mark.usefixtures("longer_ids")
@pytest.mark.parametrize("kind", ["jsonb refuses the value (22P05)", "index row too large (54000)"])
async def test_a_thread_whose_data_postgres_rejects_fails_alone_for_one_more_transaction(
    database_url: str, schema_name: str, kind: str
) -> None:
    async with await connect(database_url, schema_name) as store:
        chains = [Chain(f"t{i:02d}") for i in range(8)]
        await store.apply([[c.checkpoint(msgs(1), c.thread_id)] for c in chains])
        bad = rejected_entry(kind)
        batches = [[c.checkpoint(msgs(2), c.thread_id)] for c in chains]
        batches.insert(3, [bad])
        before = store.stats()
        outcomes = await store.apply(batches)
        assert [o.status for o in outcomes] == [ApplyStatus.APPLIED] * 3 + [ApplyStatus.FAILED] + [
            ApplyStatus.APPLIED
        ] * 5
        failed = outcomes[3]
        assert (failed.thread_id, failed.retriable, failed.flushed_seq) == (bad.thread_id, False, 0)
        expected = "UntranslatableCharacter" if "22P05" in kind else "ProgramLimitExceeded"
        assert expected in (failed.error or "")
        # The first transaction wrote the threads together and was rejected; the second,
        # each thread in its own statement, found the culprit; the third, without it,
        # committed (together again).
        assert delta(store, before, "round_trips", "transactions", "conflict_retries") == [6, 1, 0]
        assert await store.flushed_seqs([bad.thread_id, "t00", "t07"]) == {
            bad.thread_id: 0,
            "t00": 2,
            "t07": 2,
        }
        rows = await query(database_url, f'SELECT thread_id FROM "{schema_name}".threads')
        assert bad.thread_id not in {row[0] for row in rows}
        # The connection went back to the pool clean: the next call costs two round trips.
        before = store.stats()
        outcomes = await store.apply([[c.checkpoint(msgs(3), c.thread_id)] for c in chains])
        assert {o.status for o in outcomes} == {ApplyStatus.APPLIED}
        assert delta(store, before, "round_trips") == [2]
        for chain in chains:
            assert await store.load_messages(chain.thread_id) == msgs(3)


async def test_each_rejected_thread_costs_one_more_transaction(
    database_url: str, schema_name: str
) -> None:
    async with await connect(database_url, schema_name) as store:
        good = [Chain(f"g{i}") for i in range(4)]
        batches = [[poisoned("a-first")], *([c.checkpoint(msgs(1), c.thread_id)] for c in good)]
        batches.append([poisoned("z-last")])
        before = store.stats()
        outcomes = await store.apply(batches)
        assert [o.status.value for o in outcomes] == ["failed"] + ["applied"] * 4 + ["failed"]
        # Together, rejected; then one thread per statement: each rejected thread found by
        # one transaction; the last commits.
        assert delta(store, before, "round_trips", "transactions") == [8, 1]


async def test_a_rejected_statement_early_in_a_pipeline_logs_nothing(
    database_url: str, schema_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """psycopg raises the error of a statement from the execution of a later one when it
    reads it early (here: the first of 64): the pipeline still ends without psycopg
    logging an "error ignored terminating" warning for each rejected thread."""
    async with await connect(database_url, schema_name) as store:
        chains = [Chain(f"t{i:02d}") for i in range(64)]
        await store.apply([[c.checkpoint(msgs(1), c.thread_id)] for c in chains])
        batches = [[c.checkpoint(msgs(2), c.thread_id)] for c in chains]
        outcomes = await store.apply([[poisoned("a-first")], *batches])
        assert [o.status for o in outcomes] == [ApplyStatus.FAILED] + [ApplyStatus.APPLIED] * 64
        assert [r.getMessage() for r in caplog.records if r.name.startswith("psycopg")] == []


# -- gates refused under the lock: a run of another thread ----------------------------------


async def test_a_thread_written_together_that_claims_another_threads_run_fails_alone(
    open_postgres: Any, database_url: str, schema_name: str
) -> None:
    """Three new threads in one combined statement, one of them claiming a run another
    thread owns: its gate refuses it alone; the others commit in the same transaction."""
    store = await open_postgres()
    owner = Chain("owner")
    await store.apply([[owner.checkpoint(msgs(1), "shared")]])
    good, thief, other = Chain("a"), Chain("b"), Chain("c")
    batches = [
        [good.checkpoint(msgs(2), "run-a")],
        [thief.checkpoint(msgs(2), "shared")],
        [other.checkpoint(msgs(3), "run-c")],
    ]
    before = store.stats()
    outcomes = await store.apply(batches)
    assert [o.status for o in outcomes] == [
        ApplyStatus.APPLIED,
        ApplyStatus.FAILED,
        ApplyStatus.APPLIED,
    ]
    assert "RunOwnershipError" in (outcomes[1].error or "")
    assert "'owner'" in (outcomes[1].error or "")
    # Two round trips, one transaction, then the owner read (and the empty row removed).
    assert delta(store, before, "round_trips", "transactions", "statements") == [3, 1, 5]
    assert await store.load_messages("a") == msgs(2)
    assert await store.load_messages("c") == msgs(3)
    assert await store.flushed_seqs(["a", "b", "c"]) == {"a": 1, "b": 0, "c": 1}
    assert [r.run_id for r in await store.list_runs("owner")] == ["shared"]
    assert [r.run_id for r in await store.list_runs("a")] == ["run-a"]
    rows = await query(database_url, f'SELECT thread_id FROM "{schema_name}".threads')
    assert sorted(row[0] for row in rows) == ["a", "c", "owner"]  # b's empty row removed


async def test_a_refused_recreation_leaves_the_thread_as_it_was(open_postgres: Any) -> None:
    store = await open_postgres()
    owner, thread = Chain("owner"), Chain("t")
    await store.apply([[owner.checkpoint(msgs(1), "shared")], [thread.checkpoint(msgs(3), "mine")]])
    # Deleted and re-created in one batch by a run another thread owns: the reset of the
    # thread's rows must not commit without the write its gate refuses.
    batch = [thread.delete(), thread.checkpoint(msgs(1), "shared")]
    before = store.stats()
    [outcome] = await store.apply([batch])
    cost = delta(store, before, "round_trips", "transactions")
    assert (outcome.status, outcome.retriable, outcome.flushed_seq) == (
        ApplyStatus.FAILED,
        False,
        1,
    )
    assert "RunOwnershipError" in (outcome.error or "")
    assert "'owner'" in (outcome.error or "")
    assert await store.load_messages("t") == msgs(3)
    assert [r.run_id for r in await store.list_runs("t")] == ["mine"]
    assert await store.flushed_seqs(["t"]) == {"t": 1}
    # Planned, refused before COMMIT, rolled back, the owner read: four round trips.
    assert cost == [4, 0]


async def test_a_thread_given_twice_whose_first_batch_is_refused(open_postgres: Any) -> None:
    store = await open_postgres()
    owner, thief = Chain("owner"), Chain("thief")
    await store.apply([[owner.checkpoint(msgs(1), "shared")]])
    first = thief.checkpoint(msgs(1), "shared")
    second = thief.checkpoint(msgs(2), "mine")
    outcomes = await store.apply([[first], [owner.checkpoint(msgs(2), "shared")], [second]])
    # The second batch was planned on the first; once the first is left out, it is a gap.
    assert [o.status for o in outcomes] == [
        ApplyStatus.FAILED,
        ApplyStatus.APPLIED,
        ApplyStatus.GAP,
    ]
    assert "RunOwnershipError" in (outcomes[0].error or "")
    assert outcomes[2].missing_from == 1
    assert await store.load_thread("thief") is None
    assert await store.load_messages("owner") == msgs(2)
    assert await store.flushed_seqs(["thief"]) == {"thief": 0}


# -- transactions Postgres aborts, connections left behind ----------------------------------


async def test_a_serialization_failure_runs_the_transaction_again(
    database_url: str, schema_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real 40001: the store's transactions are SERIALIZABLE here, and between the two
    pipelines of the first run another connection updates a run row the second writes."""
    options = {"options": "-c default_transaction_isolation=serializable"}
    async with await connect(database_url, schema_name, connect_args=options) as store:
        chain = Chain("t")
        await store.apply([[chain.checkpoint(msgs(1))]])
        real_send = PipelineConnection.send
        sends = 0

        async def send(self: PipelineConnection, steps: Sequence[Any]) -> Any:
            nonlocal sends
            sends += 1
            if sends == 2:
                await query(
                    database_url,
                    f'UPDATE "{schema_name}".runs SET steps = steps WHERE run_id = %s',
                    "r1",
                )
            return await real_send(self, steps)

        monkeypatch.setattr(PipelineConnection, "send", send)
        before = store.stats()
        [outcome] = await store.apply([[chain.checkpoint(msgs(2))]])
        assert outcome.status is ApplyStatus.APPLIED
        # ROLLBACK rides in the second run's first pipeline: two round trips a run.
        assert delta(store, before, "conflict_retries", "round_trips", "transactions") == [1, 4, 1]
        assert await store.load_messages("t") == msgs(2)


async def test_a_row_vanished_before_the_lock_runs_the_transaction_again(
    open_postgres: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another flusher may remove a row it created empty between this call's insert (which
    found the row) and its lock (which does not): the call runs again, like a deadlock
    victim. The lock's answer is doctored to say so."""
    store = await open_postgres()
    real = plan.locked_rows
    runs = 0

    def without_rows(*args: Any) -> Any:
        nonlocal runs
        runs += 1
        return {} if runs == 1 else real(*args)

    monkeypatch.setattr(plan, "locked_rows", without_rows)
    before = store.stats()
    [outcome] = await store.apply([[Chain("t").checkpoint(msgs(1))]])
    assert outcome.status is ApplyStatus.APPLIED
    assert delta(store, before, "conflict_retries", "round_trips", "transactions") == [1, 3, 1]
    assert await store.load_messages("t") == msgs(1)


async def _wait_until_waiting_for_a_lock(database_url: str, app: str) -> None:
    # Postgres offers no notification of a backend starting to wait: look.
    for _ in range(1000):
        rows = await query(
            database_url,
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE application_name = %s AND wait_event_type = 'Lock'",
            app,
        )
        if rows[0][0]:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the apply never waited for the lock")


async def test_a_cancelled_apply_leaves_no_transaction_behind(
    database_url: str, schema_name: str
) -> None:
    app = f"bs-test-{uuid.uuid4().hex[:8]}"
    options = {"application_name": app}
    async with await connect(
        database_url, schema_name, pool_size=1, max_overflow=0, connect_args=options
    ) as store:
        chain = Chain("t")
        await store.apply([[chain.checkpoint(msgs(1))]])
        entry = chain.checkpoint(msgs(2))
        async with await psycopg.AsyncConnection.connect(libpq_url(database_url)) as holder:
            await holder.execute(
                f'SELECT 1 FROM "{schema_name}".threads WHERE thread_id = %s FOR UPDATE'.encode(),
                ("t",),
            )
            task = asyncio.create_task(store.apply([[entry]]))
            await _wait_until_waiting_for_a_lock(database_url, app)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await holder.rollback()
        left = await query(
            database_url,
            "SELECT state FROM pg_stat_activity WHERE application_name = %s AND state <> 'idle'",
            app,
        )
        assert left == []
        [outcome] = await store.apply([[entry]])
        assert outcome.status is ApplyStatus.APPLIED
        assert await store.load_messages("t") == msgs(2)


# -- the rows written: those of the statements executed one by one --------------------------


T0 = utcnow().replace(microsecond=123456)


class RichChain:
    """A thread whose entries use every column: runs with every field, thread metadata,
    a parent thread, Unicode, floats jsonb would print as integers."""

    def __init__(self, thread_id: str) -> None:
        self.thread_id = thread_id
        self.seq = 0
        self.thread: Thread | None = None
        self.encoded: list[bytes] | None = None
        self.history: list[Message] = []

    def step(self, *, add: int = 1, keep: int | None = None, run_id: str = "r1") -> WalEntry:
        base = self.history if keep is None else self.history[:keep]
        n = self.seq + 1
        self.history = base + [
            {"role": "assistant", "content": f"é✓\u2028 {n}.{i}", "n": 1e16, "k": [None, {}]}
            for i in range(add)
        ]
        at = T0 + timedelta(seconds=n)
        run = RunRecord(
            run_id=f"{self.thread_id}-{run_id}",
            thread_id=self.thread_id,
            agent_id="agent ✓",
            status=RunStatus.DONE if n % 2 else RunStatus.RUNNING,
            parent_run_id="parent-run",
            parent_thread_id="parent-thread",
            created_at=T0,
            updated_at=at,
            finished_at=at if n % 2 else None,
            steps=n,
            input_tokens=2**40 + n,
            output_tokens=n,
            error=None if n % 3 else 'boom \\ "quoted"',
            output={"answer": n, "f": 0.5, "big": 1e17},
            metadata={"tag": "x", "n": n},
        )
        call = validate_checkpoint(self.thread_id, self.history, run, {"topic": "t", "n": n})
        entry = build_checkpoint_entry(
            call, previous=self.thread, previous_messages=self.encoded, seq=n, now=at
        )
        self.seq, self.thread, self.encoded = entry.seq, entry.thread, call.encoded
        return entry

    def delete(self) -> WalEntry:
        self.seq += 1
        self.thread, self.encoded, self.history = None, None, []
        return build_delete_entry(
            self.thread_id, seq=self.seq, now=T0 + timedelta(seconds=self.seq)
        )


def workload() -> list[list[list[WalEntry]]]:
    """Apply calls touching every statement shape: new threads, appends, rewrites from
    the middle, truncations, runs changing, deletes, re-creations after a delete."""
    a, b, c, d = (RichChain(name) for name in ("a", "b", "c ✓", "d"))
    return [
        [[a.step(add=3), a.step()], [b.step(add=2)], [c.step(add=4)], [d.step()]],
        [[a.step(run_id="r2")], [b.step(keep=1, add=3)], [c.step(keep=2, add=0)], [d.delete()]],
        [[a.step(keep=0, add=2)], [b.delete(), b.step(add=2, run_id="r3")], [d.step(add=2)]],
        [[a.step(), a.step(keep=1, add=1)], [b.step(keep=4, add=0)], [c.delete()]],
    ]


async def reference_apply(
    engine: AsyncEngine, batches: Sequence[Sequence[WalEntry]], sent: list[tuple[Any, Any]]
) -> None:
    """`apply()`'s writes as SQLAlchemy executed them before the pipelines: per thread,
    in id order, in one transaction, lock (or insert), plan, reset, gated write."""
    async with engine.begin() as conn:
        for batch in sorted(batches, key=lambda b: b[0].thread_id):
            thread_id = batch[0].thread_id
            found = (await conn.execute(sql.LOCK_THREAD, sql.bind(thread_id=thread_id))).first()
            base = codec.thread_row(found) if found else codec.ThreadRow(thread_id, 0, 0, None)
            planned = codec.plan_batch(batch, base)
            assert not isinstance(planned, ApplyOutcome), planned
            if found is None:
                await conn.execute(sql.ENSURE_THREAD, sql.bind(thread_id=thread_id))
            write = planned.write
            if write.reset:
                params = sql.bind(thread_id=thread_id)
                await conn.execute(sql.RESET_THREAD, params)
                sent.append((sql.RESET_THREAD, params))
            assert (await conn.execute(write.statement, write.params)).first() is not None
            sent.append((write.statement, write.params))


TABLES = {
    "threads": "thread_id",
    "messages": "thread_id, position",
    "runs": "run_id",
}


async def test_rows_equal_those_sqlalchemy_wrote_statement_by_statement(
    database_url: str, schema_name: str
) -> None:
    reference_schema = f"{schema_name}_ref"
    engine = create_async_engine(
        migrations.normalize_url(database_url),
        json_serializer=lambda v: orjson.dumps(v).decode(),
        json_deserializer=orjson.loads,
    )
    captured: list[tuple[str, Any]] = []

    def capture(conn: Any, cursor: Any, statement: str, parameters: Any, *args: Any) -> None:
        captured.append((statement, parameters))

    event.listen(engine.sync_engine, "before_cursor_execute", capture)
    sent: list[tuple[Any, Any]] = []
    try:
        await asyncio.to_thread(
            migrations.upgrade, migrations.normalize_url(database_url), schema=reference_schema
        )
        reference = engine.execution_options(schema_translate_map={None: reference_schema})
        async with await connect(database_url, schema_name) as store:
            for batches in workload():
                captured.clear()
                before = len(sent)
                await reference_apply(reference, batches, sent)
                # What SQLAlchemy sent for each write: the text and parameters the
                # pipelines send (compiled for the reference schema here).
                compiler = StatementCompiler(engine.dialect, reference_schema)
                writes = [c for c in captured if not c[0].lstrip().startswith(("SELECT", "INSERT"))]
                assert len(writes) == len(sent) - before
                for (statement, params), (text, values) in zip(sent[before:], writes, strict=True):
                    compiled = compiler.compile(statement)
                    assert compiled.sql.decode() == text
                    assert compiled.params(params) == values
                outcomes = await store.apply(batches)
                assert {o.status for o in outcomes} == {ApplyStatus.APPLIED}
        for table, key in TABLES.items():
            ours = await query(
                database_url, f'SELECT * FROM "{schema_name}".{table} ORDER BY {key}'
            )
            theirs = await query(
                database_url, f'SELECT * FROM "{reference_schema}".{table} ORDER BY {key}'
            )
            assert ours == theirs, table
            assert ours
    finally:
        await engine.dispose()
        await query(database_url, f'DROP SCHEMA IF EXISTS "{reference_schema}" CASCADE')


async def test_a_statement_too_large_to_pipeline_is_sent_on_its_own(
    database_url: str, schema_name: str
) -> None:
    """psycopg does not send some pipelined statements of about 8 MB or more (a single
    text or bytea value, a bytea array: the transaction then sits idle, holding its
    locks, forever; the LangGraph sink's blob arrays met it). This store's text arrays
    go at that size, but the guard does not rely on the parameter types: a snapshot of
    10 MB goes outside pipeline mode, and the next, small, flush is pipelined again."""
    async with await connect(database_url, schema_name) as store:
        chain = Chain("large")
        history = msgs(5_000, prefix="x" * 2_000)
        before = store.stats()
        async with asyncio.timeout(60):  # a hang fails the test instead of the suite
            [outcome] = await store.apply([[chain.checkpoint(history, "large")]])
        assert outcome.status is ApplyStatus.APPLIED
        assert delta(store, before, "unpipelined") == [1]
        assert await store.load_messages("large") == history
        before = store.stats()
        async with asyncio.timeout(60):
            [outcome] = await store.apply([[chain.checkpoint([*history, *msgs(1)], "large")]])
        assert outcome.status is ApplyStatus.APPLIED
        assert delta(store, before, "unpipelined", "round_trips") == [0, 2]


async def test_a_refusal_whose_owner_let_the_run_go_may_apply_at_once(
    open_postgres: Any, monkeypatch: Any
) -> None:
    """A batch's gate read run R on its owner; the owner's delete committed (a flush of
    it side by side, as `force_flush_all` runs them) before the owner was looked up. The
    refusal named nobody and said only ConflictError, so `flush_thread` raised; it now
    says the same entries may apply at once (`retry_now`), and they do. Driven
    deterministically: the owner's delete is applied, by another store, right before
    the lookup."""
    store, other = await open_postgres(), await open_postgres()
    owner, thief = Chain("owner"), Chain("thief")
    await store.apply([[owner.checkpoint(msgs(1), "shared")]])
    original = store._after_commit
    deleted: list[ApplyOutcome] = []

    async def after_commit(
        link: Any, call: Any, decided: Any, settled: plan.Settled, created: Any
    ) -> Any:
        if settled.refused and not deleted:
            deleted.extend(await other.apply([[owner.delete()]]))
        return await original(link, call, decided, settled, created)

    monkeypatch.setattr(store, "_after_commit", after_commit)
    claim = thief.checkpoint(msgs(2), "shared")
    [outcome] = await store.apply([[claim]])
    assert [o.status for o in deleted] == [ApplyStatus.APPLIED]
    assert (outcome.status, outcome.retriable, outcome.retry_now) == (
        ApplyStatus.FAILED,
        True,
        True,
    )
    assert outcome.waits_for is None
    [again] = await store.apply([[claim]])
    assert again.status is ApplyStatus.APPLIED
    assert [r.thread_id for r in await store.list_runs("thief")] == ["thief"]
    assert await store.load_run("shared") is not None
