"""`MemoryWal` beyond the port contract (tests/contracts): the faults it injects, its
clock, and the errors a client meets after closing."""

from __future__ import annotations

import asyncio

import pytest

from buffered_store.config import EngineConfig
from buffered_store.errors import ConfigError, ConflictError, StoreError, WalUnavailableError
from buffered_store.testing import MemoryJetStream, MemoryWal

SUBJECT = "THREADLOG.t.a"


@pytest.fixture
def server() -> MemoryJetStream:
    return MemoryJetStream()


@pytest.fixture
def wal(server: MemoryJetStream) -> MemoryWal:
    return MemoryWal(EngineConfig(), server)


async def test_an_unavailable_server_fails_every_call(
    server: MemoryJetStream, wal: MemoryWal
) -> None:
    await wal.append(SUBJECT, b"1")
    sub = await wal.subscribe()
    [msg] = await sub.fetch(1, 1.0)
    server.available = False
    calls = [
        wal.publish(SUBJECT, b"x", msg_id="x", expected_last_subject_seq=1),
        wal.get(1),
        wal.kv_get("h.a"),
        wal.kv_swap("h.a", b"x", revision=None),
        wal.quarantine.keys(),
        wal.consumer_state(),
        wal.subscribe(),
        sub.fetch(1, 0.1),
        msg.ack(),
    ]
    for call in calls:
        with pytest.raises(WalUnavailableError):
            await call
    server.available = True
    assert await wal.last_seq() == 1
    await msg.ack()
    assert (await wal.consumer_state()).ack_floor == 1


async def test_a_waiting_fetch_fails_when_the_server_goes_down(
    server: MemoryJetStream, wal: MemoryWal
) -> None:
    sub = await wal.subscribe()
    waiting = asyncio.create_task(sub.fetch(1, 10.0))
    await asyncio.sleep(0)
    server.available = False
    with pytest.raises(WalUnavailableError):
        await asyncio.wait_for(waiting, 1.0)


async def test_a_lost_reply_after_the_publish_landed(wal: MemoryWal) -> None:
    wal.lose_publish_replies(1)
    with pytest.raises(WalUnavailableError):
        await wal.publish(SUBJECT, b"1", msg_id="a:1", expected_last_subject_seq=0)
    assert await wal.last_seq() == 1  # it landed
    with pytest.raises(ConflictError):  # the retry meets its own first copy
        await wal.publish(SUBJECT, b"1", msg_id="a:1", expected_last_subject_seq=0)
    assert await wal.publish(SUBJECT, b"1", msg_id="a:1", expected_last_subject_seq=1) == (1, True)


async def test_the_duplicate_window_follows_the_server_clock(
    server: MemoryJetStream, wal: MemoryWal
) -> None:
    await wal.publish(SUBJECT, b"1", msg_id="a:1", expected_last_subject_seq=0)
    server.advance(wal.config.duplicate_window_s - 1)
    assert await wal.publish(SUBJECT, b"1", msg_id="a:1", expected_last_subject_seq=1) == (1, True)
    server.advance(1)
    assert await wal.publish(SUBJECT, b"1", msg_id="a:1", expected_last_subject_seq=1) == (2, False)


async def test_advancing_the_clock_wakes_a_waiting_fetch(
    server: MemoryJetStream, wal: MemoryWal
) -> None:
    await wal.append(SUBJECT, b"1")
    sub = await wal.subscribe()
    await sub.fetch(1, 1.0)
    waiting = asyncio.create_task(sub.fetch(1, 10.0))
    await asyncio.sleep(0)
    server.advance(wal.config.ack_wait_s)
    [again] = await asyncio.wait_for(waiting, 1.0)
    assert again.num_delivered == 2


async def test_deleting_the_consumer_ends_a_waiting_fetch_empty(
    server: MemoryJetStream, wal: MemoryWal
) -> None:
    await wal.append(SUBJECT, b"1")
    sub = await wal.subscribe()
    [old] = await sub.fetch(1, 1.0)
    waiting = asyncio.create_task(sub.fetch(1, 10.0))
    await asyncio.sleep(0)
    assert wal.delete_consumer()
    assert await asyncio.wait_for(waiting, 1.0) == []
    with pytest.raises(WalUnavailableError):
        await sub.fetch(1, 0.1)
    assert await wal.ensure_consumer()
    await old.ack()  # settles nothing on the new consumer
    state = await wal.consumer_state()
    assert (state.num_pending, state.ack_floor) == (1, 0)
    [again] = await sub.fetch(1, 1.0)
    assert again.num_delivered == 1


async def test_reconnect_makes_subscriptions_stale(wal: MemoryWal) -> None:
    sub = await wal.subscribe()
    wal.reconnect()
    assert sub.stale
    assert not (await wal.subscribe()).stale


async def test_a_closed_client_and_subscription(server: MemoryJetStream, wal: MemoryWal) -> None:
    other = MemoryWal(wal.config, server)
    sub = await other.subscribe()
    await sub.close()
    with pytest.raises(StoreError):
        await sub.fetch(1, 0.1)
    await wal.close()
    with pytest.raises(WalUnavailableError):
        await wal.last_seq()
    assert await other.last_seq() == 0  # the server and its other clients go on


async def test_objects_with_another_configuration_are_refused(server: MemoryJetStream) -> None:
    MemoryWal(EngineConfig(), server)
    with pytest.raises(ConfigError):
        MemoryWal(EngineConfig(duplicate_window_s=5.0), server)
    with pytest.raises(ConfigError):
        MemoryWal(EngineConfig(ack_wait_s=5.0), server)


async def test_wait_for_times_out(server: MemoryJetStream) -> None:
    with pytest.raises(TimeoutError):
        await server.wait_for(lambda: False, timeout_s=0.05)


def test_the_clock_only_moves_forward(server: MemoryJetStream) -> None:
    with pytest.raises(ValueError, match="forward"):
        server.advance(-1)
