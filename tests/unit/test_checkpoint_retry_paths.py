"""The two retries inside one `checkpoint()` call, over a `MemoryWal`: a run claim lost
under the write (the thread deleted meanwhile) is claimed again, at most `MAX_RECLAIMS`
times on one deadline, and an entry too large for the WAL is written again once, on a
new deadline, after learning the thread's snapshot. Either way the thread's lock and its
cursor's pin are released, and the failure is counted."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

import pytest

from buffered_store.config import BufferedStoreConfig
from buffered_store.errors import ConflictError, PayloadTooLargeError
from buffered_store.stores.memory import InMemoryThreadRunStore
from buffered_store.testing import make_messages, make_run, open_memory_store
from buffered_store.threadrun import store as store_module
from buffered_store.threadrun.store import MAX_RECLAIMS, BufferedThreadRunStore


async def _store() -> BufferedThreadRunStore:
    store = open_memory_store(InMemoryThreadRunStore(), BufferedStoreConfig(drain_on_close=False))
    await store.checkpoint("t", make_messages(2), make_run("t", "r"))
    return store


def _failing(error: type[BaseException], deadlines: list[float]) -> Any:
    """A `WriteBuffer.write` whose every call fails with `error`, noting its deadline."""

    def write(*args: Any, deadline: float, **kwargs: Any) -> Coroutine[Any, Any, Any]:
        deadlines.append(deadline)

        async def fail() -> Any:
            raise error

        return fail()

    return write


def _released(store: BufferedThreadRunStore) -> bool:
    return not store._locks._locks and not store._writer.cursors._pinned


async def test_a_claim_lost_on_every_attempt_gives_up_after_max_reclaims(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = await _store()
    deadlines: list[float] = []
    monkeypatch.setattr(store._buffer, "write", _failing(store_module._ClaimLost, deadlines))
    with pytest.raises(ConflictError, match="keeps being deleted"):
        await store.checkpoint("t", make_messages(3), make_run("t", "r"))
    assert len(deadlines) == MAX_RECLAIMS
    assert len(set(deadlines)) == 1  # one budget for every attempt
    assert _released(store)
    assert store.stats()["checkpoints_failed"] == 1
    await store.close()


async def test_an_entry_too_large_is_written_again_once_after_learning_the_snapshot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = await _store()
    deadlines: list[float] = []
    primed: list[str] = []

    async def prime(thread_id: str) -> bool:
        primed.append(thread_id)
        return True

    monkeypatch.setattr(store._buffer, "write", _failing(PayloadTooLargeError, deadlines))
    monkeypatch.setattr(store, "_prime_snapshot", prime)
    with pytest.raises(PayloadTooLargeError):
        await store.checkpoint("t", make_messages(3), make_run("t", "r"))
    assert primed == ["t"]
    assert len(deadlines) == 2
    assert deadlines[1] > deadlines[0]  # the second write has a budget of its own
    assert _released(store)
    # An append sends only its new messages: knowing the snapshot would not help.
    deadlines.clear()
    with pytest.raises(PayloadTooLargeError):
        await store.append("t", make_messages(1, start=3), make_run("t", "r"))
    assert (primed, len(deadlines)) == (["t"], 1)
    assert _released(store)
    await store.close()
