"""`Deadlines`: `asyncio.timeout_at` for many writes on one timer. Deadlines already due
when a scope is entered, so nothing sleeps."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from buffered_store.engine.deadlines import Deadlines


async def test_a_task_past_its_deadline_gets_timeout_error() -> None:
    deadlines = Deadlines()
    loop = asyncio.get_running_loop()
    with pytest.raises(TimeoutError), deadlines.at(loop.time()):
        await asyncio.Event().wait()
    current = asyncio.current_task()
    assert current is not None
    assert current.cancelling() == 0  # the cancellation was ours, and is taken back


async def test_scopes_share_one_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    deadlines = Deadlines()
    loop = asyncio.get_running_loop()
    timers: list[float] = []
    call_at = loop.call_at

    def counted(when: float, *args: Any) -> asyncio.TimerHandle:
        timers.append(when)
        return call_at(when, *args)

    monkeypatch.setattr(loop, "call_at", counted)
    start = loop.time() + 60
    for i in range(50):
        with deadlines.at(start + i):
            await asyncio.sleep(0)
    assert timers == [start]  # each later deadline waits behind the first timer


async def test_only_the_tasks_whose_time_is_up_are_cancelled() -> None:
    deadlines = Deadlines()
    loop = asyncio.get_running_loop()
    release = asyncio.Event()

    async def write(when: float) -> str:
        with deadlines.at(when):
            await release.wait()
        return "written"

    late = asyncio.create_task(write(loop.time() + 60))
    due = asyncio.create_task(write(loop.time()))
    with pytest.raises(TimeoutError):
        await due
    assert not late.done()
    release.set()
    assert await late == "written"


async def test_a_scope_left_before_its_timer_runs_cancels_nothing() -> None:
    deadlines = Deadlines()
    loop = asyncio.get_running_loop()
    with deadlines.at(loop.time()):
        pass  # left within the turn: the timer has not run yet
    await asyncio.sleep(0)  # it runs now, and finds nobody
    await asyncio.sleep(0)
    current = asyncio.current_task()
    assert current is not None
    assert current.cancelling() == 0


async def test_a_cancellation_from_elsewhere_stays_a_cancellation() -> None:
    deadlines = Deadlines()
    loop = asyncio.get_running_loop()
    entered = asyncio.Event()

    async def write() -> None:
        with deadlines.at(loop.time() + 60):
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(write())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
