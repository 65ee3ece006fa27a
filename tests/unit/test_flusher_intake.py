"""`flusher.intake.Intake`'s collection window over a scripted subscription: what it asks
the subscription for, and when (no server: the subscription records the calls)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from buffered_store.engine.ports import Delivered
from flusher.config import MIN_FETCH_TIMEOUT_S, FlusherConfig
from flusher.intake import FILL_CHECK_S, Intake
from flusher.stats import FlusherStats


class Msg:
    def __init__(self, n: int) -> None:
        self.data = f"m{n}".encode()
        self.subject = "THREADLOG.t.x"
        self.stream_seq = n
        self.num_delivered = 1

    async def ack(self) -> None: ...
    async def nak(self, delay_s: float | None = None) -> None: ...
    async def term(self) -> None: ...
    async def in_progress(self) -> None: ...


class ScriptedDelivery:
    """Starts with `queued` delivered and the pull request that delivered them still
    open; it ends right after the first fetch (its expiry was set by the previous
    window). A fetch that may wait opens one when none is open, as `NatsDelivery` does."""

    def __init__(self, queued: int, *, request_ends_after_first_fetch: bool = True) -> None:
        self.queue: list[Any] = [Msg(n) for n in range(queued)]
        self.pulling = True
        self.ends = request_ends_after_first_fetch
        self.fetches: list[tuple[int, float]] = []
        self.lingering: list[bool] = []
        self.byte_budgets: list[int] = []
        self.stale = False

    @property
    def waiting(self) -> int:
        return len(self.queue)

    def queued(self) -> Sequence[Delivered]:
        return list(self.queue)

    async def fetch(
        self, count: int, timeout_s: float, *, linger: bool = True, max_bytes: int = 0
    ) -> list[Any]:
        self.fetches.append((count, timeout_s))
        self.lingering.append(linger)
        self.byte_budgets.append(max_bytes)
        taken: list[Any] = []
        while self.queue and len(taken) < count:
            if max_bytes and sum(len(m.data) for m in taken) >= max_bytes:
                break
            taken.append(self.queue.pop(0))
        if len(taken) < count and timeout_s >= 0.02 and linger and not self.pulling:
            self.pulling = True
        elif len(self.fetches) == 1 and self.ends:
            self.pulling = False
        return taken

    async def close(self) -> None: ...


class OneSubscription:
    def __init__(self, delivery: ScriptedDelivery) -> None:
        self.delivery = delivery

    async def subscribe(self) -> ScriptedDelivery:
        return self.delivery


async def streaming(delivery: ScriptedDelivery, config: FlusherConfig) -> Intake:
    """An intake whose last window filled a whole batch (its next window streams), with
    `delivery` then holding what the test scripted, and its calls recorded from there."""
    script = delivery.queue
    delivery.queue = [Msg(1000 + n) for n in range(config.flush_batch_size)]
    intake = Intake(OneSubscription(delivery), config, FlusherStats())  # type: ignore[arg-type]
    await intake.collect(lambda: False)
    assert len(intake.take()) == config.flush_batch_size
    delivery.queue, delivery.fetches, delivery.lingering = script, [], []
    delivery.pulling = True
    return intake


async def test_a_window_that_does_not_fill_asks_at_its_start_and_at_its_end_only() -> None:
    """Below a batch per window, nothing streams: one message starts the window, and
    its end takes everything waiting in one request left closed."""
    delivery = ScriptedDelivery(queued=0, request_ends_after_first_fetch=False)
    delivery.pulling = False
    arrivals = [Msg(n) for n in range(5)]

    async def fetch(
        count: int, timeout_s: float, *, linger: bool = True, max_bytes: int = 0
    ) -> list[Any]:
        delivery.fetches.append((count, timeout_s))
        delivery.lingering.append(linger)
        taken, arrivals[:] = arrivals[:count], arrivals[count:]
        return taken

    delivery.fetch = fetch  # type: ignore[method-assign]
    config = FlusherConfig(flush_interval_s=0.2, flush_batch_size=100, fetch_timeout_s=0.5)
    intake = Intake(OneSubscription(delivery), config, FlusherStats())  # type: ignore[arg-type]
    await intake.collect(lambda: False)
    assert len(intake.take()) == 5
    assert [count for count, _ in delivery.fetches] == [1, 99]
    assert delivery.lingering == [True, False]
    assert delivery.fetches[1][1] == config.fetch_timeout_s  # the burst may take a while


async def test_what_a_previous_request_queued_is_all_taken_by_the_first_fetch() -> None:
    delivery = ScriptedDelivery(queued=3)
    config = FlusherConfig(flush_interval_s=0.1, flush_batch_size=100)
    intake = Intake(OneSubscription(delivery), config, FlusherStats())  # type: ignore[arg-type]
    await intake.collect(lambda: False)
    assert len(intake.take()) == 3
    assert [count for count, _ in delivery.fetches] == [100, 97]
    assert delivery.lingering == [True, False]


async def test_a_window_after_a_full_one_streams_whose_request_ends_early_opens_one() -> None:
    """The window's first messages came from the queue, delivered by a request of the
    previous window that ends soon after: a streaming window asks for one for its rest,
    instead of leaving what is written meanwhile to its end."""
    delivery = ScriptedDelivery(queued=3)
    config = FlusherConfig(flush_interval_s=0.3, flush_batch_size=100)
    intake = await streaming(delivery, config)
    delivery.ends = True
    await intake.collect(lambda: False)
    assert len(intake.take()) == 3
    first, *during, last = delivery.fetches
    assert first[0] == 100
    assert first[1] > FILL_CHECK_S
    assert len(during) == 1  # once open, the window waits without asking again
    assert during[0][0] == 97
    assert during[0][1] >= FILL_CHECK_S
    assert last == (97, MIN_FETCH_TIMEOUT_S)  # the drain at the window's end
    assert all(delivery.lingering)


async def test_a_streaming_window_with_a_request_open_fills_without_asking() -> None:
    delivery = ScriptedDelivery(queued=3, request_ends_after_first_fetch=False)
    config = FlusherConfig(flush_interval_s=0.2, flush_batch_size=100)
    intake = await streaming(delivery, config)
    delivery.ends = False
    await intake.collect(lambda: False)
    assert [count for count, _ in delivery.fetches] == [100, 97]
    assert all(delivery.lingering)


async def test_a_window_ends_once_its_messages_reach_flush_batch_bytes() -> None:
    """Large entries: the window takes no more than `flush_batch_bytes` of payloads
    (each fetch asks for the bytes left), ends at once instead of waiting out its
    interval, and the next window streams as after any full batch."""
    delivery = ScriptedDelivery(queued=0, request_ends_after_first_fetch=False)
    delivery.queue = [Msg(n) for n in range(10, 30)]  # "m10".."m29": 3 bytes each
    config = FlusherConfig(flush_interval_s=5.0, flush_batch_size=100, flush_batch_bytes=10)
    intake = Intake(OneSubscription(delivery), config, FlusherStats())  # type: ignore[arg-type]
    started = asyncio.get_running_loop().time()
    await intake.collect(lambda: False)
    assert asyncio.get_running_loop().time() - started < 1.0  # not the 5 s interval
    taken = intake.take()
    assert [m.stream_seq for m in taken] == [10, 11, 12, 13]  # 12 bytes: the fourth ends it
    assert intake.bytes_in_hand == 0
    assert delivery.byte_budgets[0] == 10
    assert all(0 < budget <= 10 for budget in delivery.byte_budgets)
    delivery.fetches.clear()
    await intake.collect(lambda: False)
    assert [m.stream_seq for m in intake.take()] == [14, 15, 16, 17]
    assert delivery.fetches[0][0] == 100  # streaming: the whole batch asked for at once
