"""Concurrent `apply()` calls on overlapping sets of threads new to Postgres (real server).

Several flushers creating the same new threads at once used to deadlock: each locked the
rows that existed, then inserted the missing ones, so a row committed by a third flusher
in between was locked out of order. No deadlock (or any other conflict) may reach the
caller, and every entry must be applied exactly as a single flusher would."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import Any

import psycopg
import pytest

from buffered_store.engine.flushing import ApplyOutcome, ApplyStatus
from buffered_store.errors import ConflictError
from buffered_store.model.changes import (
    WalEntry,
)
from buffered_store.model.messages import decode_message
from buffered_store.stores.postgres import PostgresThreadRunStore
from tests.integration.test_postgres_store import Chain, msgs
from tests.plugins.stores import PostgresFactory

ROUNDS = 25
THREADS_PER_ROUND = 12
APPLIERS = 3


def _batches(
    chains: Sequence[Sequence[WalEntry]], picked: Sequence[int], rng: random.Random
) -> list[list[WalEntry]]:
    """One applier's call: a prefix of each picked thread's entries, in random order."""
    batches = [list(chains[index][: rng.randint(1, len(chains[index]))]) for index in picked]
    rng.shuffle(batches)
    return batches


async def _later(
    delay_s: float, store: PostgresThreadRunStore, batches: list[list[WalEntry]]
) -> list[ApplyOutcome]:
    # Staggered starts: the third applier's commits fall between the other two's statements.
    await asyncio.sleep(delay_s)
    return await store.apply(batches)


async def _one_by_one(
    store: PostgresThreadRunStore, calls: Sequence[list[list[WalEntry]]]
) -> list[ApplyOutcome]:
    outcomes: list[ApplyOutcome] = []
    for batches in calls:
        outcomes.extend(await store.apply(batches))
    return outcomes


async def test_concurrent_applies_on_new_threads_never_conflict(
    open_postgres: PostgresFactory,
) -> None:
    stores: list[PostgresThreadRunStore] = []
    for _ in range(APPLIERS):
        store = await open_postgres()
        assert isinstance(store, PostgresThreadRunStore)
        stores.append(store)
    rng = random.Random(10)
    all_chains: dict[str, list[WalEntry]] = {}
    for round_ in range(ROUNDS):
        chains = []
        for index in range(THREADS_PER_ROUND):
            chain = Chain(f"r{round_}-t{index:02d}")
            chains.append([chain.checkpoint(msgs(n), f"{chain.thread_id}-run{n}") for n in (1, 2)])
            all_chains[chain.thread_id] = chains[-1]
        # Two flushers on overlapping, different subsets of the new threads, while a third
        # creates some of them one at a time: its commits land between their statements.
        calls = []
        for store in stores[:2]:
            picked = rng.sample(range(THREADS_PER_ROUND), k=THREADS_PER_ROUND * 3 // 4)
            calls.append(_later(rng.random() * 0.01, store, _batches(chains, picked, rng)))
        singles = rng.sample(range(THREADS_PER_ROUND), k=THREADS_PER_ROUND // 2)
        calls.append(_one_by_one(stores[2], [_batches(chains, [i], rng) for i in singles]))
        results = await asyncio.gather(*calls)
        for outcomes in results:
            for outcome in outcomes:
                assert outcome.status in (ApplyStatus.APPLIED, ApplyStatus.STALE), outcome
    # Whatever the race left out is applied now; nothing applied may be applied twice.
    final = await stores[0].apply([list(entries) for entries in all_chains.values()])
    assert all(o.status in (ApplyStatus.APPLIED, ApplyStatus.STALE) for o in final)
    assert (await stores[1].apply([list(e) for e in all_chains.values()])) == [
        o.__class__(o.thread_id, ApplyStatus.STALE, 2) for o in final
    ]
    # The rows are created and locked in one global order: no deadlock even happened.
    assert [store.stats()["conflict_retries"] for store in stores] == [0] * APPLIERS
    for thread_id in all_chains:
        stored = await stores[2].read_thread(thread_id, with_messages=True)
        assert stored.flushed_seq == 2
        assert [decode_message(m) for m in stored.messages or []] == msgs(2)
        latest = await stores[2].latest_run(thread_id)
        assert latest is not None
        assert latest.run_id == f"{thread_id}-run2"


def _deadlock() -> psycopg.Error:
    return psycopg.errors.DeadlockDetected("deadlock detected")


async def test_a_deadlock_victim_runs_again(
    open_postgres: PostgresFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = await open_postgres()
    assert isinstance(store, PostgresThreadRunStore)
    real = store._attempt
    failures = iter([_deadlock(), _deadlock()])

    async def victim(*args: Any, **kwargs: Any) -> Any:
        # Fails like a transaction Postgres chose as a deadlock's victim: before commit.
        for failure in failures:
            raise failure
        return await real(*args, **kwargs)

    monkeypatch.setattr(store, "_attempt", victim)
    chain = Chain("t")
    outcomes = await store.apply([[chain.checkpoint(msgs(1))]])
    assert [o.status for o in outcomes] == [ApplyStatus.APPLIED]
    assert store.stats()["conflict_retries"] == 2
    assert await store.load_messages("t") == msgs(1)


async def test_a_deadlock_on_every_run_raises_conflict(
    open_postgres: PostgresFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = await open_postgres()
    assert isinstance(store, PostgresThreadRunStore)
    runs = 0

    async def victim(*args: Any, **kwargs: Any) -> Any:
        nonlocal runs
        runs += 1
        raise _deadlock()

    monkeypatch.setattr(store, "_attempt", victim)
    with pytest.raises(ConflictError):
        await store.apply([[Chain("t").checkpoint(msgs(1))]])
    assert runs > 1
    assert store.stats()["conflict_retries"] == runs - 1
