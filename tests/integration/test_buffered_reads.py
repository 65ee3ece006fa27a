"""Reads of `BufferedThreadRunStore` across instances and consistency modes (invariant 12).

Instance A writes, instance B (its own NATS connection and, over Postgres, its own
connection pool) reads, before any flush: B must see everything A was acknowledged for,
while the inner store has nothing yet.
"""

from __future__ import annotations

import uuid

from buffered_store.config import ReadConsistency
from buffered_store.model.records import RunStatus
from buffered_store.testing import make_messages, make_run
from tests.plugins.stores import InnerPair, StoreFactory


def tid(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


async def test_read_your_writes_across_instances_before_any_flush(
    open_store: StoreFactory, inner_pair: InnerPair
) -> None:
    """Every read on B shows A's acknowledged checkpoints; the inner store does not yet."""
    inner_a, inner_b = inner_pair
    a = await open_store(inner_a, drain_on_close=False)
    b = await open_store(inner_b, drain_on_close=False)
    thread, quiet = tid(), tid("quiet")
    first = make_run(thread, status=RunStatus.DONE)
    await a.checkpoint(quiet, make_messages(1), make_run(quiet))
    await a.checkpoint(thread, make_messages(2), first, metadata={"topic": "x"})
    second = make_run(thread, steps=4, parent_thread_id="parent-1")
    await a.checkpoint(thread, make_messages(5), second)

    assert await b.load_messages(thread) == make_messages(5)
    loaded = await b.load_thread(thread)
    assert loaded is not None
    assert loaded.latest_run_id == second.run_id
    assert loaded.message_count == 5
    assert loaded.parent_thread_id == "parent-1"
    assert dict(loaded.metadata) == {"topic": "x"}
    assert await b.load_run(first.run_id) == first
    assert await b.load_run(second.run_id) == second
    assert await b.latest_run(thread) == second
    assert {r.run_id for r in await b.list_runs(thread)} == {first.run_id, second.run_id}
    assert [r.run_id for r in await b.list_runs(thread, status=RunStatus.DONE)] == [first.run_id]
    assert {r.run_id for r in await b.list_runs()} >= {first.run_id, second.run_id}
    assert [t.thread_id for t in await b.list_threads()] == [thread, quiet]

    assert await inner_b.load_thread(thread) is None
    assert await inner_b.load_messages(thread) is None
    assert await inner_b.load_run(first.run_id) is None
    assert await inner_b.list_threads() == []


async def test_overlay_on_partly_flushed_thread_across_instances(
    open_store: StoreFactory, inner_pair: InnerPair
) -> None:
    """After a flush, newer checkpoints (a rewrite, then an append) and a delete are still
    served from the WAL tail on top of the flushed rows, never mixed with stale rows."""
    inner_a, inner_b = inner_pair
    a = await open_store(inner_a, drain_on_close=False)
    b = await open_store(inner_b, drain_on_close=False)
    thread = tid()
    run = make_run(thread)
    await a.checkpoint(thread, make_messages(4), run)
    assert await a.force_flush(thread) == 1
    rewritten = [*make_messages(2), {"role": "system", "content": "summary"}]
    await a.checkpoint(thread, rewritten, run.replace(steps=2))
    await a.checkpoint(thread, [*rewritten, *make_messages(2, start=50)], run.replace(steps=3))

    assert await b.load_messages(thread) == [*rewritten, *make_messages(2, start=50)]
    assert await inner_b.load_messages(thread) == make_messages(4)
    latest = await b.latest_run(thread)
    assert latest is not None
    assert latest.steps == 3
    assert [r.steps for r in await b.list_runs(thread)] == [3]

    await a.delete_thread(thread)
    assert await b.load_messages(thread) is None
    assert await b.load_thread(thread) is None
    assert await b.load_run(run.run_id) is None
    assert await b.list_runs(thread) == []
    assert thread not in {t.thread_id for t in await b.list_threads()}
    assert await inner_b.load_messages(thread) == make_messages(4)


async def test_strong_flushes_before_reading_and_eventual_reads_the_inner_store(
    open_store: StoreFactory, inner_pair: InnerPair
) -> None:
    """STRONG: the read returns the checkpoint and the inner store then holds it.
    EVENTUAL: reads go to the inner store only (nothing before a flush)."""
    inner_a, inner_b = inner_pair
    writer = await open_store(inner_a, drain_on_close=False)
    eventual = await open_store(
        inner_b, drain_on_close=False, read_consistency=ReadConsistency.EVENTUAL
    )
    strong = await open_store(
        inner_b, drain_on_close=False, read_consistency=ReadConsistency.STRONG
    )
    thread = tid()
    run = make_run(thread)
    await writer.checkpoint(thread, make_messages(3), run)

    assert await eventual.load_messages(thread) is None
    assert await eventual.load_run(run.run_id) is None
    assert await eventual.list_threads() == []

    assert await strong.load_messages(thread) == make_messages(3)
    assert await inner_b.load_messages(thread) == make_messages(3)
    assert await eventual.load_messages(thread) == make_messages(3)

    await writer.checkpoint(thread, make_messages(4), run.replace(steps=7))
    assert [r.steps for r in await strong.list_runs(thread)] == [7]
    assert await eventual.load_messages(thread) == make_messages(4)
    await writer.checkpoint(thread, make_messages(5), run)
    assert [t.message_count for t in await strong.list_threads()] == [5]


async def test_reads_after_a_cold_restart_of_the_writer(
    open_store: StoreFactory, inner_pair: InnerPair
) -> None:
    """A store dropped with entries unflushed: a new instance reads them back, and
    appending from it continues the thread."""
    inner_a, inner_b = inner_pair
    old = await open_store(inner_a, drain_on_close=False)
    thread = tid()
    run = make_run(thread)
    for n in range(1, 6):
        await old.checkpoint(thread, make_messages(n), run)
    await old.close()
    new = await open_store(inner_b, drain_on_close=False)
    assert await new.load_messages(thread) == make_messages(5)
    assert (await new.checkpoint(thread, make_messages(6), run)).thread_seq == 6
    assert await new.force_flush(thread) == 6
    assert await inner_b.load_messages(thread) == make_messages(6)
