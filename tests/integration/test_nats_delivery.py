"""The flusher's subscription to the durable consumer on NATS: a collection window costs
the server one or two pull requests however many messages it holds (nats-py's `fetch`
sent one or two per call, and a flusher called it per message of a trickle), and
messages delivered but not fetched yet are handed out by the next fetch, kept alive,
and given back on stop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from nats.aio.msg import Msg
from nats.js.api import Header

from buffered_store.config import BufferedStoreConfig
from buffered_store.nats import NatsWal
from buffered_store.nats import delivery as delivery_module
from buffered_store.nats.delivery import MAX_BYTES_SLACK, NatsDelivery
from flusher.config import FlusherConfig
from flusher.intake import Intake
from flusher.stats import FlusherStats


async def trickle(wal: NatsWal, subject: str, count: int, gap_s: float) -> None:
    for i in range(count):
        await wal.append(subject, f"m{i}".encode())
        await asyncio.sleep(gap_s)


async def test_a_window_of_a_trickle_costs_one_or_two_pull_requests(
    config: BufferedStoreConfig,
) -> None:
    wal = await NatsWal.connect(config)
    try:
        fconfig = FlusherConfig.from_store_config(config).replace(flush_interval_s=0.6)
        intake = Intake(wal, fconfig, FlusherStats())
        await intake.open()
        writing = asyncio.create_task(trickle(wal, f"{config.stream_name}.t.x", 20, 0.01))
        await intake.collect(lambda: False)
        await writing
        delivery = intake.subscription
        assert isinstance(delivery, NatsDelivery)
        assert len(intake.take()) == 20  # the whole trickle, in one window
        assert delivery.requests <= 2
        await intake.close()
    finally:
        await wal.close()


async def test_messages_delivered_meanwhile_are_fetched_next(config: BufferedStoreConfig) -> None:
    wal = await NatsWal.connect(config)
    try:
        delivery = await wal.subscribe()
        assert isinstance(delivery, NatsDelivery)
        waiting = asyncio.create_task(delivery.fetch(10, 2.0))
        await asyncio.sleep(0.05)  # the waiting pull request is out
        for i in range(3):
            await wal.append(f"{config.stream_name}.t.x", f"m{i}".encode())
        first = await waiting
        assert first  # the first to arrive, maybe more
        deadline = asyncio.get_running_loop().time() + 5
        while delivery.waiting + len(first) < 3:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.01)
        queued = delivery.queued()
        assert [m.data for m in first + queued] == [b"m0", b"m1", b"m2"]
        for msg in queued:
            await msg.in_progress()  # kept alive as a flusher keeps what it holds
        rest = await delivery.fetch(10, 0.01)
        assert [m.data for m in rest] == [m.data for m in queued]
        assert delivery.requests == 2  # the probe finding nothing, then the waiting one
        await delivery.close()
    finally:
        await wal.close()


async def wait_until(check: Callable[[], bool], what: str) -> None:
    deadline = asyncio.get_running_loop().time() + 10
    while not check():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.01)


async def test_a_probe_hands_out_all_the_server_has_now(config: BufferedStoreConfig) -> None:
    """Not only the first message of the probe's reply: the rest would otherwise wait in
    the queue for the next window."""
    wal = await NatsWal.connect(config)
    try:
        for i in range(50):
            await wal.append(f"{config.stream_name}.t.x", f"m{i}".encode())
        delivery = await wal.subscribe()
        taken = await delivery.fetch(100, 5.0)
        assert [m.data for m in taken] == [f"m{i}".encode() for i in range(50)]
        await delivery.close()
    finally:
        await wal.close()


async def test_a_fetch_served_from_the_queue_keeps_a_request_open_for_the_rest(
    config: BufferedStoreConfig,
) -> None:
    """A window that starts with messages delivered during the previous cycle, after the
    request that delivered them is over, must still receive what is written during it:
    the flush lag was two windows instead of one at 1,280 checkpoints/s."""
    subject = f"{config.stream_name}.t.x"
    wal = await NatsWal.connect(config)
    try:
        delivery = await wal.subscribe()
        assert isinstance(delivery, NatsDelivery)
        waiting = asyncio.create_task(delivery.fetch(2, 30.0))
        await wait_until(lambda: delivery.requests == 2, "the waiting request is out")
        await wal.append(subject, b"m0")
        assert [m.data for m in await waiting] == [b"m0"]
        await wal.append(subject, b"m1")  # the request's last one: it is over after this
        await wait_until(lambda: delivery.waiting == 1, "m1 is delivered")
        assert not delivery.pulling
        await wal.append(subject, b"m2")  # nothing pulls it yet
        assert [m.data for m in await delivery.fetch(10, 30.0)] == [b"m1"]
        assert delivery.pulling  # a request for the rest of the caller's 30 s
        await wait_until(lambda: delivery.waiting == 1, "m2 arrives without a fetch")
        assert [m.data for m in await delivery.fetch(10, 0.001)] == [b"m2"]
        assert delivery.requests == 3
        await delivery.close()
    finally:
        await wal.close()


async def test_a_drain_with_some_queued_takes_the_rest_the_server_holds(
    config: BufferedStoreConfig,
) -> None:
    """A collection window's closing drain (``linger=False``) that finds messages queued
    by an earlier request must not stop at them while the server holds more: in closed
    loop the flusher then fell a window behind after every lull in the writes (flush lag
    p99 0.83 to 0.93 s in `bench saturate`, limit 0.75 s)."""
    subject = f"{config.stream_name}.t.x"
    wal = await NatsWal.connect(config)
    try:
        for i in range(3):
            await wal.append(subject, f"m{i}".encode())
        delivery = await wal.subscribe()
        assert isinstance(delivery, NatsDelivery)
        first = await delivery.fetch(10, 30.0)  # the 3 there, then a request for 7 more
        assert [m.data for m in first] == [b"m0", b"m1", b"m2"]
        assert delivery.pulling
        for i in range(3, 30):
            await wal.append(subject, f"m{i}".encode())
        await wait_until(lambda: not delivery.pulling, "the open request is served")
        assert delivery.waiting == 7  # m3 to m9 queued; m10 to m29 still on the server
        drained = await delivery.fetch(25, 5.0, linger=False)
        assert [m.data for m in drained] == [f"m{i}".encode() for i in range(3, 28)]
        assert not delivery.pulling
        rest = await delivery.fetch(10, 5.0, linger=False)
        assert [m.data for m in rest] == [b"m28", b"m29"]
        await delivery.close()
    finally:
        await wal.close()


async def test_a_pull_request_asks_the_server_for_no_more_than_its_bytes(
    config: BufferedStoreConfig,
) -> None:
    """A fetch with a byte budget asks the server for that many bytes, never less than
    one whole message of the largest size (`max_payload` plus `MAX_BYTES_SLACK`), so a
    flusher's memory holds about a budget, not `flush_batch_size` large messages. The
    server ends such a request with a 409 that is no refusal."""
    wal = await NatsWal.connect(config)
    try:
        big = (wal.max_payload + MAX_BYTES_SLACK) // 2 + 1  # one fits a request, not two
        for i in range(4):
            await wal.append(f"{config.stream_name}.t.x", bytes([65 + i]) * big)
        delivery = await wal.subscribe()
        assert isinstance(delivery, NatsDelivery)
        got = await delivery.fetch(10, 2.0, linger=False, max_bytes=1)
        assert [m.stream_seq for m in got] == [1]
        assert delivery.waiting == 0  # the server stopped at the request's bytes
        assert not delivery.pulling
        rest = await delivery.fetch(10, 2.0, linger=False)  # no budget: all of them
        assert [m.stream_seq for m in rest] == [2, 3, 4]
        await delivery.close()
    finally:
        await wal.close()


async def test_a_message_larger_than_a_request_allows_still_comes(
    config: BufferedStoreConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A message stored through a node with a larger `max_payload` than the one this
    flusher talks to is larger than any request's `max_bytes`: the server answers those
    with a 409 and delivers nothing, for ever. The request after such a 409 asks for
    that one message without a byte limit."""
    monkeypatch.setattr(NatsDelivery, "max_payload", property(lambda self: 1000))
    monkeypatch.setattr(delivery_module, "MAX_BYTES_SLACK", 0)
    wal = await NatsWal.connect(config)
    try:
        for i in range(3):
            await wal.append(f"{config.stream_name}.t.x", bytes([65 + i]) * 5000)
        delivery = await wal.subscribe()
        assert isinstance(delivery, NatsDelivery)
        got: list[int] = []
        for _ in range(8):
            got += [m.stream_seq for m in await delivery.fetch(10, 1.0, max_bytes=3000)]
            if len(got) == 3:
                break
        assert got == [1, 2, 3]
        await delivery.close()
    finally:
        await wal.close()


async def test_a_batch_completed_status_leaves_the_open_request_alone(
    config: BufferedStoreConfig,
) -> None:
    """The server follows the last message of a request with `max_bytes` whose batch
    filled with ``409 Batch Completed``. Read late, after the next request went out, it
    must not count that one as over (the flusher would then ask again, past its bytes)."""
    wal = await NatsWal.connect(config)
    try:
        delivery = await wal.subscribe()
        assert isinstance(delivery, NatsDelivery)
        assert await delivery.fetch(10, 0.1, max_bytes=1000) == []  # a request stays open
        assert delivery.pulling
        status = Msg(
            wal._nc,
            subject="_INBOX.x",
            headers={Header.STATUS.value: "409", Header.DESCRIPTION.value: "Batch Completed"},
        )
        delivery._on_msg(status)
        assert delivery.pulling
        await wal.append(f"{config.stream_name}.t.x", b"m")
        got = await delivery.fetch(10, 2.0, max_bytes=1000)
        assert [m.data for m in got] == [b"m"]
        await delivery.close()
    finally:
        await wal.close()
