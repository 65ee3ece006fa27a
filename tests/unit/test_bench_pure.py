"""Pure parts of the benchmark harness: the workload's store call, warm-call latencies."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import pytest

from buffered_store.memory import InMemoryThreadRunStore
from buffered_store.protocol import ThreadRunStore

# The harness is installed as `buffered_store.benchmarks`; mypy checks the repository's
# folder as the top-level package `benchmarks` (pyproject [tool.mypy] packages).
if TYPE_CHECKING:
    from benchmarks.measure import LatencyLog
    from benchmarks.workload import Workload, make_threads, seed, write_step
else:
    from buffered_store.benchmarks.measure import LatencyLog
    from buffered_store.benchmarks.workload import Workload, make_threads, seed, write_step


class Recording(InMemoryThreadRunStore):
    """Counts the messages each call hands over."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[str, int]] = []

    async def checkpoint(self, thread_id: str, messages: Any, run: Any, **kw: Any) -> Any:
        self.sent.append(("checkpoint", len(messages)))
        return await super().checkpoint(thread_id, messages, run, **kw)

    async def append(self, thread_id: str, messages: Any, run: Any, **kw: Any) -> Any:
        self.sent.append(("append", len(messages)))
        return await super().append(thread_id, messages, run, **kw)


@pytest.mark.parametrize("api", ["checkpoint", "append"])
async def test_a_step_sends_the_snapshot_or_only_the_new_messages(
    api: Literal["checkpoint", "append"],
) -> None:
    workload = Workload(threads=1, seed_messages=10, messages_per_step=2, api=api)
    store = Recording()
    [state] = make_threads("t", workload)
    await seed(store, [state])
    for _ in range(3):
        state.advance(workload, 0.0)
        await write_step(store, state, workload.api)

    sizes = (2, 2, 2) if api == "append" else (12, 14, 16)
    assert store.sent == [("checkpoint", 10), *((api, n) for n in sizes)]
    assert await store.load_messages(state.thread_id) == state.history


async def test_an_append_after_a_failed_one_resends_what_was_not_acknowledged() -> None:
    workload = Workload(threads=1, seed_messages=4, messages_per_step=2, api="append")
    store = Recording()
    [state] = make_threads("t", workload)
    await seed(store, [state])
    state.advance(workload, 0.0)

    class Down(InMemoryThreadRunStore):
        async def append(self, *args: Any, **kw: Any) -> Any:
            raise ConnectionError("down")

    down: ThreadRunStore = Down()
    with pytest.raises(ConnectionError):
        await write_step(down, state, "append")
    state.advance(workload, 0.0)
    await write_step(store, state, "append")

    assert store.sent[-1] == ("append", 4)
    assert await store.load_messages(state.thread_id) == state.history


def test_warm_latencies_leave_out_each_threads_first_call() -> None:
    log = LatencyLog()
    log.ok(0.0, 50.0, cold=True)
    log.ok(0.1, 1.0)
    log.ok(0.1, 40.0, cold=True)
    log.ok(0.2, 2.0)
    assert log.warm_ms() == [1.0, 2.0]
    assert list(log.durations_ms) == [50.0, 1.0, 40.0, 2.0]
