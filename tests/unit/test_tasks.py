"""`cancel_and_wait`: a cancelled task is stopped even when it swallows a cancellation."""

from __future__ import annotations

import asyncio

from buffered_store.tasks import cancel_and_wait


async def test_a_task_that_ends_on_its_cancellation_is_cancelled_once() -> None:
    seen = 0

    async def work() -> None:
        nonlocal seen
        try:
            await asyncio.Future()
        except asyncio.CancelledError:
            seen += 1
            await asyncio.sleep(0.05)  # clean-up shorter than `again_s` is not interrupted
            raise

    task = asyncio.create_task(work())
    await asyncio.sleep(0)
    await cancel_and_wait(task, again_s=1.0)
    assert task.cancelled()
    assert seen == 1


async def test_a_task_that_swallows_cancellations_is_cancelled_again() -> None:
    swallowed = 0

    async def work() -> str:
        nonlocal swallowed
        while swallowed < 3:
            try:
                await asyncio.Future()
            except asyncio.CancelledError:
                swallowed += 1  # carries on, as 3.11's wait_for can
        return "ended by itself after three cancellations"

    task = asyncio.create_task(work())
    await asyncio.sleep(0)
    await asyncio.wait({asyncio.ensure_future(cancel_and_wait(task, again_s=0.01))}, timeout=5)
    assert swallowed == 3
    assert task.result() == "ended by itself after three cancellations"


async def test_a_finished_task_is_left_alone() -> None:
    task = asyncio.create_task(asyncio.sleep(0, result="done"))
    await task
    await cancel_and_wait(task)
    assert task.result() == "done"
