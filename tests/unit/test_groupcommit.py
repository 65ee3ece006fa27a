"""`GroupCommit`: one publish at a time per thread, later writes joining the next one,
writes that linger for a follower, bounded publishes in flight. Pure asyncio: the
publish is a fake that records what it was given and waits for the test's go."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from buffered_store.engine.groupcommit import GroupCommit


class Publisher:
    """Records each publish and holds it until released."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []
        self.gates: list[asyncio.Event] = []
        self.hold = True
        self.fail: BaseException | None = None
        self.inflight = 0
        self.most_inflight = 0

    async def __call__(self, thread_id: str, items: Sequence[str]) -> str:
        self.calls.append((thread_id, list(items)))
        gate = asyncio.Event()
        self.gates.append(gate)
        self.inflight += 1
        self.most_inflight = max(self.most_inflight, self.inflight)
        try:
            if self.hold:
                await gate.wait()
            if self.fail is not None:
                raise self.fail
            return f"{thread_id}:{len(self.calls)}"
        finally:
            self.inflight -= 1

    def release_all(self) -> None:
        self.hold = False
        for gate in self.gates:
            gate.set()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_writes_queued_behind_one_in_flight_go_out_together() -> None:
    publish = Publisher()
    commit: GroupCommit[str, str] = GroupCommit(publish)
    first = asyncio.create_task(commit.submit("t", "a", joins=True, urgent=True))
    await settle()
    queued = [
        asyncio.create_task(commit.submit("t", item, joins=True, urgent=True))
        for item in ("b", "c")
    ]
    await settle()
    assert publish.calls == [("t", ["a"])]  # b and c wait for a's round trip
    publish.release_all()
    assert await first == "t:1"
    assert await asyncio.gather(*queued) == ["t:2", "t:2"]
    assert publish.calls == [("t", ["a"]), ("t", ["b", "c"])]
    assert (commit.publishes, commit.joined) == (2, 1)


async def test_a_write_that_does_not_join_goes_alone_in_its_place() -> None:
    publish = Publisher()
    commit: GroupCommit[str, str] = GroupCommit(publish)
    tasks = [asyncio.create_task(commit.submit("t", "a", joins=True, urgent=True))]
    await settle()
    for item, joins in (("b", True), ("delete", False), ("c", True), ("d", True)):
        tasks.append(asyncio.create_task(commit.submit("t", item, joins=joins, urgent=True)))
    await settle()
    publish.release_all()
    await asyncio.gather(*tasks)
    assert [items for _, items in publish.calls] == [["a"], ["b"], ["delete"], ["c", "d"]]


async def test_a_lingering_write_waits_for_an_urgent_one_and_shares_its_publish() -> None:
    publish = Publisher()
    publish.hold = False
    commit: GroupCommit[str, str] = GroupCommit(publish, linger_s=60.0)
    writes = asyncio.create_task(commit.submit("t", "writes", joins=True, urgent=False))
    await settle()
    assert publish.calls == []  # lingering (for up to a minute here)
    checkpoint = await commit.submit("t", "checkpoint", joins=True, urgent=True)
    assert await writes == checkpoint
    assert publish.calls == [("t", ["writes", "checkpoint"])]


async def test_an_urgent_write_ends_a_linger_in_the_next_turn_of_the_loop() -> None:
    # Counted in turns of the event loop, not in time: each turn a write waits is a
    # wait behind every other ready callback of a busy process.
    publish = Publisher()
    commit: GroupCommit[str, str] = GroupCommit(publish, linger_s=60.0)
    writes = asyncio.create_task(commit.submit("t", "writes", joins=True, urgent=False))
    await settle()
    checkpoint = asyncio.create_task(commit.submit("t", "checkpoint", joins=True, urgent=True))
    await asyncio.sleep(0)  # the checkpoint is submitted
    await asyncio.sleep(0)  # the drainer wakes
    assert publish.calls == [("t", ["writes", "checkpoint"])]
    publish.release_all()
    assert await writes == await checkpoint == "t:1"


async def test_a_caller_resumes_in_the_turn_after_its_publish_returns() -> None:
    publish = Publisher()
    commit: GroupCommit[str, str] = GroupCommit(publish)
    write = asyncio.create_task(commit.submit("t", "a", joins=True, urgent=True))
    await settle()
    publish.gates[0].set()
    await asyncio.sleep(0)  # the publish returns, the drainer resolves the write
    await asyncio.sleep(0)  # its caller resumes
    assert write.done()
    assert write.result() == "t:1"


async def test_a_cancelled_caller_does_not_cancel_its_write() -> None:
    publish = Publisher()
    commit: GroupCommit[str, str] = GroupCommit(publish)
    first = asyncio.create_task(commit.submit("t", "a", joins=True, urgent=True))
    await settle()
    queued = asyncio.create_task(commit.submit("t", "b", joins=True, urgent=True))
    await settle()
    queued.cancel()
    await settle()
    publish.release_all()
    assert await first == "t:1"
    await commit.settled()
    assert publish.calls == [("t", ["a"]), ("t", ["b"])]
    assert queued.cancelled()


async def test_a_lingering_write_alone_goes_out_after_the_linger() -> None:
    publish = Publisher()
    publish.hold = False
    commit: GroupCommit[str, str] = GroupCommit(publish, linger_s=0.001)
    assert await commit.submit("t", "writes", joins=True, urgent=False) == "t:1"


async def test_threads_never_wait_for_each_other_and_in_flight_publishes_are_bounded() -> None:
    publish = Publisher()
    commit: GroupCommit[str, str] = GroupCommit(publish, max_inflight=2)
    tasks = [
        asyncio.create_task(commit.submit(f"t{i}", "x", joins=True, urgent=True)) for i in range(5)
    ]
    await settle()
    assert [thread for thread, _ in publish.calls] == ["t0", "t1"]  # two slots
    publish.release_all()
    await asyncio.gather(*tasks)
    assert sorted(thread for thread, _ in publish.calls) == [f"t{i}" for i in range(5)]
    assert publish.most_inflight == 2


async def test_a_failed_publish_fails_every_write_it_held_and_the_queue_goes_on() -> None:
    publish = Publisher()
    commit: GroupCommit[str, str] = GroupCommit(publish)
    first = asyncio.create_task(commit.submit("t", "a", joins=True, urgent=True))
    await settle()
    joined = [
        asyncio.create_task(commit.submit("t", item, joins=True, urgent=True))
        for item in ("b", "c")
    ]
    await settle()
    publish.fail = ValueError("refused")
    publish.gates[0].set()
    with pytest.raises(ValueError, match="refused"):
        await first
    await settle()
    publish.release_all()
    for task in joined:
        with pytest.raises(ValueError, match="refused"):
            await task
    publish.fail = None
    assert await commit.submit("t", "d", joins=True, urgent=True) == "t:3"


async def test_settled_waits_for_every_write_submitted() -> None:
    publish = Publisher()
    commit: GroupCommit[str, str] = GroupCommit(publish, linger_s=60.0)
    task = asyncio.create_task(commit.submit("t", "a", joins=True, urgent=False))
    await settle()
    waiting = asyncio.create_task(commit.settled())
    await settle()
    assert not waiting.done()
    publish.release_all()
    await commit.submit("t", "b", joins=True, urgent=True)  # ends the linger
    await waiting
    assert task.done()
