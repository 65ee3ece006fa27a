"""Direct-store specifics of `PostgresThreadRunStore` (the shared semantics are covered by
the conformance suite): what each checkpoint writes, the snapshot cache, schemas,
`apply()` outcomes and error translation. Every test gets its own fresh schema."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import psycopg
import pytest
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url

from buffered_store.engine.flushing import ApplyStatus
from buffered_store.engine.ids import utcnow
from buffered_store.errors import (
    DatabaseUnavailableError,
    SchemaError,
    StoreClosedError,
    ValidationError,
)
from buffered_store.model.changes import (
    EntryKind,
    WalEntry,
)
from buffered_store.model.checkpointing import (
    build_checkpoint_entry,
    build_delete_entry,
    validate_checkpoint,
)
from buffered_store.model.messages import decode_message
from buffered_store.model.records import Message, RunRecord, RunStatus, Thread
from buffered_store.model.target import FlushTarget
from buffered_store.stores import postgres_sql as sql
from buffered_store.stores.postgres import PostgresThreadRunStore

# -- fixtures and helpers -------------------------------------------------------------


def libpq_url(database_url: str) -> str:
    """The SQLAlchemy URL as a plain libpq URL, for raw psycopg connections."""
    return make_url(database_url).set(drivername="postgresql").render_as_string(False)


async def query(database_url: str, statement: str, *params: Any) -> list[tuple[Any, ...]]:
    """Run one statement on a connection of its own; returns its rows (if any)."""
    async with await psycopg.AsyncConnection.connect(
        libpq_url(database_url), autocommit=True
    ) as conn:
        cursor = await conn.execute(statement.encode(), params or None)
        return list(await cursor.fetchall()) if cursor.description else []


@pytest.fixture
async def schema(database_url: str) -> AsyncIterator[str]:
    name = f"bs_{uuid.uuid4().hex[:12]}"
    yield name
    await query(database_url, f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


@pytest.fixture
async def store(database_url: str, schema: str) -> AsyncIterator[PostgresThreadRunStore]:
    async with await PostgresThreadRunStore.connect(
        database_url, schema=schema, migrate=True
    ) as opened:
        yield opened


def msgs(count: int, prefix: str = "m") -> list[Message]:
    return [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"{prefix}{i}"}
        for i in range(count)
    ]


def run_of(thread_id: str, run_id: str = "r1", **fields: Any) -> RunRecord:
    return RunRecord(run_id=run_id, thread_id=thread_id, agent_id="agent", **fields)


async def stored_rows(database_url: str, schema: str, thread_id: str) -> list[tuple[Any, ...]]:
    """(position, thread_seq, xmin) of a thread's rows: xmin changes iff a row is rewritten."""
    return await query(
        database_url,
        f'SELECT position, thread_seq, xmin::text FROM "{schema}".messages '
        "WHERE thread_id = %s ORDER BY position",
        thread_id,
    )


class Chain:
    """Builds a thread's WAL entries the way the buffered writer does (deltas included)."""

    def __init__(self, thread_id: str) -> None:
        self.thread_id = thread_id
        self.seq = 0
        self.thread: Thread | None = None
        self.encoded: list[bytes] | None = None

    def checkpoint(self, messages: Sequence[Message], run_id: str = "r1") -> WalEntry:
        call = validate_checkpoint(self.thread_id, messages, run_of(self.thread_id, run_id), None)
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


# -- what a direct checkpoint writes --------------------------------------------------


async def test_store_implements_both_protocols(store: PostgresThreadRunStore) -> None:
    assert isinstance(store, FlushTarget)


async def test_append_only_checkpoint_writes_only_new_rows(
    store: PostgresThreadRunStore, database_url: str, schema: str
) -> None:
    await store.checkpoint("t", msgs(3), run_of("t"))
    before = await stored_rows(database_url, schema, "t")
    written = store.stats()["messages_written"]

    receipt = await store.checkpoint("t", msgs(5), run_of("t"))

    after = await stored_rows(database_url, schema, "t")
    assert receipt.thread_seq == 2
    assert after[:3] == before  # same xmin: the old rows were not even rewritten
    assert [(pos, seq) for pos, seq, _ in after[3:]] == [(3, 2), (4, 2)]
    assert store.stats()["messages_written"] - written == 2
    assert await store.load_messages("t") == msgs(5)


async def test_cached_checkpoint_is_one_statement(store: PostgresThreadRunStore) -> None:
    await store.checkpoint("t", msgs(1), run_of("t"))
    before = store.stats()
    await store.checkpoint("t", msgs(2), run_of("t"))
    after = store.stats()
    assert after["statements"] - before["statements"] == 1
    assert after["transactions"] - before["transactions"] == 1
    assert after["fast_checkpoints"] - before["fast_checkpoints"] == 1


async def test_rewrite_from_the_middle_rewrites_only_changed_rows(
    store: PostgresThreadRunStore, database_url: str, schema: str
) -> None:
    await store.checkpoint("t", msgs(5), run_of("t"))
    before = await stored_rows(database_url, schema, "t")
    edited = msgs(5)
    edited[2] = {"role": "user", "content": "edited"}

    await store.checkpoint("t", edited, run_of("t"))

    after = await stored_rows(database_url, schema, "t")
    assert after[:2] == before[:2]
    assert after[2][1] == 2
    assert after[2][2] != before[2][2]
    # Rows after the first change that did not change are compared, not rewritten.
    assert after[3:] == before[3:]
    assert await store.load_messages("t") == edited


async def test_truncation_deletes_rows_past_the_new_length(
    store: PostgresThreadRunStore, database_url: str, schema: str
) -> None:
    await store.checkpoint("t", msgs(5), run_of("t"))
    await store.checkpoint("t", msgs(2), run_of("t"))
    assert [row[0] for row in await stored_rows(database_url, schema, "t")] == [0, 1]
    assert await store.load_messages("t") == msgs(2)
    thread = await store.load_thread("t")
    assert thread is not None
    assert thread.message_count == 2

    await store.checkpoint("t", [], run_of("t"))
    assert await stored_rows(database_url, schema, "t") == []
    assert await store.load_messages("t") == []


async def test_cache_miss_reads_the_snapshot_and_still_appends_only(
    store: PostgresThreadRunStore, database_url: str, schema: str
) -> None:
    # jsonb reorders keys and prints 1e16 as an integer: neither may fool the diff.
    odd = {"role": "user", "content": "1e+16", "nested": {"b": 1, "a": [1.5, None, 1e16]}}
    history = [odd, *msgs(3)]
    await store.checkpoint("t", history, run_of("t"))
    before = await stored_rows(database_url, schema, "t")

    async with await PostgresThreadRunStore.connect(database_url, schema=schema) as restarted:
        await restarted.checkpoint("t", [*history, *msgs(1, "new")], run_of("t"))
        stats = restarted.stats()

    assert stats["snapshot_reads"] == 1
    assert stats["messages_written"] == 1
    after = await stored_rows(database_url, schema, "t")
    assert after[:4] == before
    assert after[4][1] == 2
    loaded = await store.load_messages("t")
    assert loaded is not None
    assert loaded[0] == odd
    assert isinstance(loaded[0]["nested"]["a"][2], float)


async def test_stale_cache_falls_back_to_locking(
    store: PostgresThreadRunStore, database_url: str, schema: str
) -> None:
    await store.checkpoint("t", msgs(2), run_of("t"))
    async with await PostgresThreadRunStore.connect(database_url, schema=schema) as other:
        assert (await other.checkpoint("t", msgs(3, "other"), run_of("t"))).thread_seq == 2

    fast = store.stats()["fast_checkpoints"]
    receipt = await store.checkpoint("t", msgs(4), run_of("t"))

    assert receipt.thread_seq == 3
    assert store.stats()["fast_checkpoints"] == fast
    assert await store.load_messages("t") == msgs(4)


async def test_concurrent_writers_get_unique_gap_free_seqs(
    store: PostgresThreadRunStore, database_url: str, schema: str
) -> None:
    async with await PostgresThreadRunStore.connect(database_url, schema=schema) as other:
        await store.checkpoint("t", msgs(1), run_of("t"))
        await other.checkpoint("t", msgs(2), run_of("t"))  # both caches now hold a snapshot

        async def write(target: PostgresThreadRunStore, i: int) -> tuple[int, int]:
            receipt = await target.checkpoint("t", msgs(3 + i % 4, f"w{i}-"), run_of("t"))
            return receipt.thread_seq, i

        results = await asyncio.gather(*(write(store if i % 2 else other, i) for i in range(20)))

    seqs = sorted(seq for seq, _ in results)
    assert seqs == list(range(3, 23))
    last = max(results)[1]
    assert await store.load_messages("t") == msgs(3 + last % 4, f"w{last}-")
    thread = await store.load_thread("t")
    assert thread is not None
    assert thread.message_count == 3 + last % 4


async def test_invalid_checkpoint_writes_nothing(
    store: PostgresThreadRunStore, database_url: str, schema: str
) -> None:
    with pytest.raises(ValidationError):
        await store.checkpoint("t", [{"content": "no role"}], run_of("t"))
    with pytest.raises(ValidationError):
        await store.checkpoint("t", msgs(1), run_of("other"))
    assert await query(database_url, f'SELECT count(*) FROM "{schema}".threads') == [(0,)]


async def test_delete_keeps_the_watermark_and_recreates_fresh(
    store: PostgresThreadRunStore,
) -> None:
    await store.checkpoint("t", msgs(3), run_of("t", "r1"))
    created = await store.load_thread("t")
    await store.delete_thread("t")
    await store.delete_thread("t")  # already deleted: no-op
    await store.delete_thread("never-existed")

    assert await store.load_thread("t") is None
    assert await store.load_messages("t") is None
    assert await store.load_run("r1") is None
    assert (await store.flushed_seqs(["t", "never-existed"])) == {"t": 2, "never-existed": 0}
    assert await store.list_threads() == []

    receipt = await store.checkpoint("t", msgs(1), run_of("t", "r2"))
    recreated = await store.load_thread("t")
    assert receipt.thread_seq == 3
    assert recreated is not None
    assert created is not None
    assert recreated.created_at > created.created_at
    assert await store.load_messages("t") == msgs(1)
    assert [run.run_id for run in await store.list_runs("t")] == ["r2"]


# -- ids, schemas, indexes ------------------------------------------------------------


async def test_like_metacharacters_in_ids_match_only_themselves(
    store: PostgresThreadRunStore,
) -> None:
    for thread_id in ("a%", "a_", "ab", "a\\"):
        await store.checkpoint(thread_id, msgs(1, thread_id), run_of(thread_id, f"run-{thread_id}"))
    for thread_id in ("a%", "a_", "a\\"):
        assert [r.run_id for r in await store.list_runs(thread_id)] == [f"run-{thread_id}"]
        assert await store.load_messages(thread_id) == msgs(1, thread_id)
    assert await store.load_run("run-a_") is not None
    assert await store.load_run("run-a%x") is None
    assert await store.flushed_seqs(["a_", "a%"]) == {"a_": 1, "a%": 1}


async def test_schemas_are_isolated(store: PostgresThreadRunStore, database_url: str) -> None:
    other_schema = f"bs_{uuid.uuid4().hex[:12]}"
    try:
        async with await PostgresThreadRunStore.connect(
            database_url, schema=other_schema, migrate=True
        ) as other:
            await store.checkpoint("t", msgs(1), run_of("t"))
            assert await other.load_thread("t") is None
            assert await other.list_runs() == []
            await other.checkpoint("t", msgs(2), run_of("t"))
            assert await store.load_messages("t") == msgs(1)
    finally:
        await query(database_url, f'DROP SCHEMA IF EXISTS "{other_schema}" CASCADE')
    # Nothing leaked into the default schema.
    assert await query(database_url, "SELECT to_regclass('public.threads')") == [(None,)]


@pytest.mark.parametrize(
    ("statement", "params", "index"),
    [
        (sql.SELECT_LIVE_THREADS, {}, "threads_live_updated_idx"),
        (sql.select_runs(by_thread=False, by_status=False), {}, "runs_created_idx"),
        (
            sql.select_runs(by_thread=True, by_status=False),
            {"thread_id": "t"},
            "runs_thread_created_idx",
        ),
        (
            sql.select_runs(by_thread=False, by_status=True),
            {"status": "done"},
            "runs_status_created_idx",
        ),
    ],
)
async def test_list_queries_are_served_by_their_index(
    store: PostgresThreadRunStore,
    database_url: str,
    schema: str,
    statement: Any,
    params: dict[str, Any],
    index: str,
) -> None:
    rendered = statement.params(sql.bind(limit=50, offset=0, **params)).compile(
        dialect=create_engine(database_url).dialect, compile_kwargs={"literal_binds": True}
    )
    async with await psycopg.AsyncConnection.connect(
        libpq_url(database_url), autocommit=True
    ) as conn:
        await conn.execute(f'SET search_path TO "{schema}"'.encode())
        # Tables this small are always scanned and sorted; forbid that to see whether an
        # index delivers the rows already in order.
        for setting in ("enable_seqscan", "enable_bitmapscan", "enable_sort"):
            await conn.execute(f"SET {setting} TO off".encode())
        plan = await (await conn.execute(f"EXPLAIN {rendered}".encode())).fetchall()
    text = "\n".join(row[0] for row in plan)
    assert index in text, text
    assert "Sort" not in text, text


# -- connect and errors ---------------------------------------------------------------


async def test_connect_without_migration_raises_schema_error(
    database_url: str, schema: str
) -> None:
    with pytest.raises(SchemaError, match="bufstore db upgrade"):
        await PostgresThreadRunStore.connect(database_url, schema=schema)


async def test_concurrent_migrating_connects_in_one_process(database_url: str, schema: str) -> None:
    other = f"{schema}_b"
    try:
        stores = await asyncio.gather(
            *(
                PostgresThreadRunStore.connect(database_url, schema=name, migrate=True)
                for name in (schema, other, schema, other)
            )
        )
        for opened in stores:
            await opened.close()
    finally:
        await query(database_url, f'DROP SCHEMA IF EXISTS "{other}" CASCADE')


async def test_connect_accepts_libpq_urls(database_url: str, schema: str) -> None:
    plain = libpq_url(database_url)
    async with await PostgresThreadRunStore.connect(plain, schema=schema, migrate=True) as store:
        await store.checkpoint("t", msgs(1), run_of("t"))
    async with await PostgresThreadRunStore.connect(
        plain.replace("postgresql://", "postgres://", 1), schema=schema
    ) as store:
        assert await store.load_messages("t") == msgs(1)


async def test_unreachable_database_is_unavailable() -> None:
    with pytest.raises(DatabaseUnavailableError):
        await PostgresThreadRunStore.connect(
            "postgresql://postgres@127.0.0.1:1/none", connect_args={"connect_timeout": 2}
        )


async def test_closed_store_refuses_calls(store: PostgresThreadRunStore) -> None:
    await store.close()
    await store.close()
    with pytest.raises(StoreClosedError):
        await store.checkpoint("t", msgs(1), run_of("t"))
    with pytest.raises(StoreClosedError):
        await store.load_thread("t")
    with pytest.raises(StoreClosedError):
        await store.apply([])


async def test_lost_connections_raise_database_unavailable(database_url: str, schema: str) -> None:
    app = f"bs-test-{uuid.uuid4().hex[:8]}"
    async with await PostgresThreadRunStore.connect(
        database_url,
        schema=schema,
        migrate=True,
        pool_size=1,
        max_overflow=0,
        connect_args={"application_name": app},
    ) as store:
        await store.checkpoint("t", msgs(1), run_of("t"))
        killed = await query(
            database_url,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
            app,
        )
        assert killed == [(True,)]
        with pytest.raises(DatabaseUnavailableError) as raised:
            await store.apply([[Chain("u").checkpoint(msgs(1), "ru")]])
        assert raised.value.retriable
        # The pool replaces the dead connection: the store recovers by itself.
        outcome = await store.apply([[Chain("u").checkpoint(msgs(1), "ru")]])
        assert outcome[0].status is ApplyStatus.APPLIED


# -- apply ------------------------------------------------------------------------------


async def test_apply_applied_stale_gap_and_reordered_duplicates(
    store: PostgresThreadRunStore,
) -> None:
    chain = Chain("t")
    entries = [chain.checkpoint(msgs(n)) for n in range(1, 7)]

    first = await store.apply([entries[:3]])
    assert first[0].status is ApplyStatus.APPLIED
    assert first[0].flushed_seq == 3

    stale = await store.apply([[entries[1], entries[2], entries[0]]])
    assert stale[0].status is ApplyStatus.STALE
    assert stale[0].flushed_seq == 3

    gap = await store.apply([[entries[4], entries[5]]])
    assert gap[0].status is ApplyStatus.GAP
    assert gap[0].missing_from == 4

    shuffled = [entries[4], entries[1], entries[3], entries[3], entries[5]]
    applied = await store.apply([shuffled])
    assert applied[0].status is ApplyStatus.APPLIED
    assert applied[0].flushed_seq == 6
    assert await store.load_messages("t") == msgs(6)

    again = await store.apply([[entries[4]]])
    assert again[0].status is ApplyStatus.STALE
    stored = await store.read_thread("t", with_messages=True)
    assert stored.flushed_seq == 6
    assert [decode_message(m) for m in stored.messages or []] == msgs(6)


async def test_apply_gap_on_unknown_thread_leaves_no_row(
    store: PostgresThreadRunStore, database_url: str, schema: str
) -> None:
    chain = Chain("new")
    chain.checkpoint(msgs(1))
    outcome = await store.apply([[chain.checkpoint(msgs(2))]])
    assert outcome[0].status is ApplyStatus.GAP
    assert outcome[0].missing_from == 1
    assert await query(database_url, f'SELECT count(*) FROM "{schema}".threads') == [(0,)]


async def test_deleted_thread_never_comes_back_from_late_entries(
    store: PostgresThreadRunStore,
) -> None:
    chain = Chain("t")
    first, second = chain.checkpoint(msgs(1)), chain.checkpoint(msgs(2))
    await store.apply([[first, second]])
    deletion = chain.delete()
    assert (await store.apply([[deletion]]))[0].status is ApplyStatus.APPLIED

    late = await store.apply([[second], [first, second]])
    assert [o.status for o in late] == [ApplyStatus.STALE, ApplyStatus.STALE]
    stored = await store.read_thread("t", with_messages=True)
    assert stored.thread is None
    assert stored.flushed_seq == 3
    assert stored.messages == []
    assert await store.load_run("r1") is None

    # The direct store continues the seqs after the tombstone.
    assert (await store.checkpoint("t", msgs(1), run_of("t"))).thread_seq == 4


async def test_apply_coalesces_a_delete_and_a_recreation(store: PostgresThreadRunStore) -> None:
    chain = Chain("t")
    await store.apply([[chain.checkpoint(msgs(4), "r1")]])
    batch = [
        chain.checkpoint(msgs(5), "r2"),
        chain.delete(),
        chain.checkpoint(msgs(2, "new"), "r3"),
        chain.checkpoint(msgs(3, "new"), "r4"),
    ]
    outcome = await store.apply([batch])
    assert outcome[0].status is ApplyStatus.APPLIED
    assert outcome[0].flushed_seq == 5
    assert await store.load_messages("t") == msgs(3, "new")
    assert sorted(r.run_id for r in await store.list_runs("t")) == ["r3", "r4"]
    assert await store.load_run("r1") is None
    latest = await store.latest_run("t")
    assert latest is not None
    assert latest.run_id == "r4"


async def test_a_failed_thread_does_not_affect_the_others(
    store: PostgresThreadRunStore, database_url: str, schema: str
) -> None:
    good_a, good_c = Chain("a"), Chain("c")
    # jsonb cannot hold \u0000: Postgres rejects this thread's data.
    poisoned = WalEntry(
        thread_id="b",
        seq=1,
        kind=EntryKind.CHECKPOINT,
        at=utcnow(),
        messages=(b'{"content":"\\u0000","role":"user"}',),
        message_count=1,
    )
    inconsistent = WalEntry(
        thread_id="d", seq=1, kind=EntryKind.CHECKPOINT, at=utcnow(), keep=3, message_count=3
    )
    outcomes = await store.apply(
        [
            [good_c.checkpoint(msgs(2), "rc")],
            [poisoned],
            [inconsistent],
            [good_a.checkpoint(msgs(1), "ra")],
            [],
        ]
    )
    statuses = [o.status for o in outcomes]
    assert statuses == [
        ApplyStatus.APPLIED,
        ApplyStatus.FAILED,
        ApplyStatus.FAILED,
        ApplyStatus.APPLIED,
        ApplyStatus.FAILED,
    ]
    assert [o.thread_id for o in outcomes[:4]] == ["c", "b", "d", "a"]
    assert not outcomes[1].retriable
    assert outcomes[1].error
    assert not outcomes[2].retriable
    assert "CorruptEntryError" in (outcomes[2].error or "")
    assert await store.load_messages("a") == msgs(1)
    assert await store.load_messages("c") == msgs(2)
    assert await store.flushed_seqs(["b", "d"]) == {"b": 0, "d": 0}
    rows = await query(database_url, f'SELECT thread_id FROM "{schema}".threads ORDER BY 1')
    assert rows == [("a",), ("c",)]


async def test_concurrent_flushers_never_move_a_thread_backwards(
    store: PostgresThreadRunStore, database_url: str, schema: str
) -> None:
    chains = [Chain(f"t{i}") for i in range(8)]
    entries = [[c.checkpoint(msgs(n), f"r{c.thread_id}-{n}") for n in (1, 2, 3)] for c in chains]
    async with await PostgresThreadRunStore.connect(database_url, schema=schema) as other:
        # Each flusher sees a different subset, in a different order, concurrently.
        await asyncio.gather(
            store.apply([[e[0], e[1]] for e in entries]),
            other.apply([[e[2], e[0], e[1]] for e in reversed(entries)]),
            store.apply([[e[1]] for e in entries]),
            other.apply([[e[0]] for e in entries]),
        )
        await other.apply([list(e) for e in entries])
    for chain in chains:
        stored = await store.read_thread(chain.thread_id, with_messages=True)
        assert stored.flushed_seq == 3
        assert [decode_message(m) for m in stored.messages or []] == msgs(3)
        latest = await store.latest_run(chain.thread_id)
        assert latest is not None
        assert latest.run_id == f"r{chain.thread_id}-3"


async def test_runs_are_never_replaced_by_older_versions(store: PostgresThreadRunStore) -> None:
    chain = Chain("t")
    first = chain.checkpoint(msgs(1), "r1")
    second = chain.checkpoint(msgs(2), "r2")
    third = chain.checkpoint(msgs(3), "r1")
    await store.apply([[first, second, third]])
    versioned = await store.read_run("r1")
    assert versioned is not None
    assert versioned.thread_seq == 3
    runs = await store.read_runs("t", status=RunStatus.RUNNING, limit=10, offset=0)
    assert {(v.run.run_id, v.thread_seq) for v in runs} == {("r1", 3), ("r2", 2)}
    assert [t.thread_id for t in await store.list_threads(limit=1, offset=0)] == ["t"]


async def test_a_run_let_go_between_the_gate_and_the_owners_lookup_is_taken(
    store: PostgresThreadRunStore, database_url: str, schema: str, monkeypatch: Any
) -> None:
    """The gate of a write under its thread's lock read run R on its owner; the owner's
    delete committed (another process) before the owner was looked up, so the lookup
    found nobody and the write failed with `StoreError("changed under its lock")`, not
    retriable. The write now runs again and takes R. Driven deterministically: the
    owner is deleted right before the lookup."""
    await store.checkpoint("owner", msgs(2), run_of("owner", "shared"))
    lookups = 0
    original = store._execute

    async def execute(conn: Any, statement: Any, params: Any) -> Any:
        nonlocal lookups
        if statement is sql.SELECT_RUN_OWNERS:
            lookups += 1
            if lookups == 1:
                async with await PostgresThreadRunStore.connect(
                    database_url, schema=schema
                ) as other:
                    await other.delete_thread("owner")
        return await original(conn, statement, params)

    monkeypatch.setattr(store, "_execute", execute)
    taken = run_of("thief", "shared", steps=4)
    await store.checkpoint("thief", msgs(1, "t"), taken)
    assert lookups == 1  # the first gate refused, the second wrote
    assert await store.load_run("shared") == taken
    assert await store.load_thread("owner") is None
    assert await store.load_messages("thief") == msgs(1, "t")
