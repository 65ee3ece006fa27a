"""Listing a KV bucket's keys on NATS: only the server ends a listing.

nats-py's ``KeyValue.keys`` judged its listing complete when a consumer-info answer
said nothing was pending and its callback had seen nothing yet, so deliveries still on
their way counted as absent (nats.py issue 842): the quarantine bucket listed no key, a
replay found its thread "not quarantined" (CI, 2026-11-27), and the trimmer's floor
ignored every record. These tests hold deliveries back the way a busy event loop does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from buffered_store.config import BufferedStoreConfig
from buffered_store.nats import NatsWal
from flusher.trim import quarantined_floor

HOLD_S = 0.5
"""How long each delivery to a subscription waits before its callback sees it."""
SEND_LATE_S = 0.2
"""How long each request waits before it goes out (the server has pushed meanwhile)."""


@contextlib.contextmanager
def late_deliveries(wal: NatsWal) -> Iterator[list[bytes]]:
    """Deliver every message except request answers `HOLD_S` late, in order, and send
    each request `SEND_LATE_S` late: what a busy event loop does to a callback's task and
    to a request following a subscription. Yields the subjects held back."""
    nc: Any = wal._nc
    replies: Any = wal._replies  # every request of the WAL goes through its reply inbox
    original: Callable[..., Awaitable[None]] = nc._process_msg
    send: Callable[..., Awaitable[Any]] = replies.request
    answers = replies._prefix.encode()
    held: list[bytes] = []
    queue: asyncio.Queue[tuple[float, tuple[Any, ...]]] = asyncio.Queue()
    loop = asyncio.get_running_loop()

    async def deliver_late() -> None:
        while True:
            due, args = await queue.get()
            await asyncio.sleep(max(0.0, due - loop.time()))
            await original(*args)

    async def process(sid: int, subject: bytes, *args: Any) -> None:
        if bytes(subject).startswith(answers):
            await original(sid, subject, *args)
            return
        held.append(bytes(subject))
        queue.put_nowait((loop.time() + HOLD_S, (sid, subject, *args)))

    async def request(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(SEND_LATE_S)
        return await send(*args, **kwargs)

    worker = loop.create_task(deliver_late())
    nc._process_msg, replies.request = process, request
    try:
        yield held
    finally:
        nc._process_msg = original
        del replies.request  # the class's own again
        worker.cancel()


async def test_a_listing_waits_for_deliveries_still_on_their_way(
    config: BufferedStoreConfig,
) -> None:
    wal = await NatsWal.connect(config)
    try:
        bucket = wal.quarantine
        for key in ("t.a", "t.b", "m.7", "m.9"):
            await bucket.create(key, b"{}")
        await bucket.delete("t.b")
        with late_deliveries(wal) as held:
            assert await bucket.keys() == ["t.a", "m.7", "m.9"]
        assert held  # the listing's deliveries did come late
    finally:
        await wal.close()


async def test_the_trim_floor_sees_records_delivered_late(config: BufferedStoreConfig) -> None:
    """The floor the trimmer keeps for quarantined messages, whose loss would be silent."""
    wal = await NatsWal.connect(config)
    try:
        await wal.quarantine.create("m.41", b"{}")
        await wal.quarantine.create("t.x", b'{"stream_seqs": [37, 52]}')
        with late_deliveries(wal):
            assert await quarantined_floor(wal) == 37
    finally:
        await wal.close()


async def test_a_listing_of_an_empty_or_emptied_bucket(config: BufferedStoreConfig) -> None:
    wal = await NatsWal.connect(config)
    try:
        bucket = wal.quarantine
        assert await bucket.keys() == []
        await bucket.create("m.1", b"{}")
        await bucket.delete("m.1")
        with late_deliveries(wal):
            assert await bucket.keys() == []
    finally:
        await wal.close()
