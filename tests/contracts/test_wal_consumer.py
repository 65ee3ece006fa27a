"""The `Wal` port's durable consumer, over `MemoryWal` and `NatsWal` alike: delivery,
explicit acks and the ack floor, naks, terms, the ack wait, `max_ack_pending`, waiting
fetches, and a consumer deleted and created again."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from buffered_store.engine.ports import ConsumerState, Wal
from buffered_store.errors import StoreError
from tests.contracts.harness import WalHarness


async def fill(wal: Wal, n: int) -> None:
    for i in range(1, n + 1):
        await wal.append(f"{wal.config.stream_name}.t.s{i % 2}", f"m{i}".encode())


def seqs(msgs: object) -> list[int]:
    assert isinstance(msgs, list)
    return [m.stream_seq for m in msgs]


async def test_fetch_ack_and_the_ack_floor(wal: Wal) -> None:
    await fill(wal, 3)
    state = await wal.consumer_state()
    assert state.bytes > 0  # as each server counts them (headers, subjects): not compared
    assert dataclasses.replace(state, bytes=0) == ConsumerState(
        num_pending=3,
        num_ack_pending=0,
        num_redelivered=0,
        ack_floor=0,
        last_seq=3,
        messages=3,
        first_seq=1,
    )
    assert await wal.tail_bounds() == (1, 3)
    sub = await wal.subscribe()
    assert not sub.stale
    got = list(await sub.fetch(10, 2.0))
    assert [(m.stream_seq, m.data, m.num_delivered) for m in got] == [
        (1, b"m1", 1),
        (2, b"m2", 1),
        (3, b"m3", 1),
    ]
    assert got[0].subject == f"{wal.config.stream_name}.t.s1"
    state = await wal.consumer_state()
    assert (state.num_pending, state.num_ack_pending, state.ack_floor) == (0, 3, 0)
    await got[0].ack()
    await got[2].ack()  # out of order: the floor stops below the unacked 2
    await _settled(wal, ack_floor=1, num_ack_pending=1)
    assert await wal.tail_bounds() == (2, 3)
    await got[1].ack()
    await _settled(wal, ack_floor=3, num_ack_pending=0)
    assert await wal.tail_bounds() == (4, 3)
    assert list(await sub.fetch(10, 0.2)) == []  # acked: never delivered again
    await sub.close()


async def test_purge_below_removes_older_messages_and_the_consumer_goes_on(wal: Wal) -> None:
    await fill(wal, 5)
    sub = await wal.subscribe()
    got = list(await sub.fetch(3, 2.0))
    for msg in got:
        await msg.ack()
    await _settled(wal, ack_floor=3, num_ack_pending=0)
    before = (await wal.consumer_state()).bytes
    await wal.purge_below(4)
    state = await wal.consumer_state()
    assert (state.first_seq, state.messages, state.last_seq, state.ack_floor) == (4, 2, 5, 3)
    assert 0 < state.bytes < before
    assert await wal.get(3) is None
    assert [m.seq for m in await wal.read_range(1, 5)] == [4, 5]
    await wal.purge_below(2)  # below the first seq: removes nothing
    assert (await wal.consumer_state()).messages == 2
    rest = list(await sub.fetch(10, 2.0))
    assert [m.stream_seq for m in rest] == [4, 5]
    await sub.close()


async def test_nak_redelivers_at_once(wal: Wal) -> None:
    await fill(wal, 2)
    sub = await wal.subscribe()
    first, _second = await sub.fetch(2, 2.0)
    await first.nak()
    [again] = await sub.fetch(1, 2.0)
    assert (again.stream_seq, again.data, again.num_delivered) == (1, b"m1", 2)
    state = await wal.consumer_state()
    assert (state.num_redelivered, state.num_ack_pending, state.ack_floor) == (1, 2, 0)
    await again.ack()
    await _settled(wal, ack_floor=1, num_ack_pending=1)
    assert (await wal.consumer_state()).num_redelivered == 0


async def test_nak_with_a_delay(harness: WalHarness) -> None:
    wal = await harness.open()
    await fill(wal, 1)
    sub = await wal.subscribe()
    [msg] = await sub.fetch(1, 2.0)
    await msg.nak(1.0)
    assert list(await sub.fetch(1, 0.2)) == []
    await harness.elapse(1.0)
    [again] = await sub.fetch(1, 3.0)
    assert (again.stream_seq, again.num_delivered) == (1, 2)


async def test_unacked_messages_come_back_after_the_ack_wait(harness: WalHarness) -> None:
    wal = await harness.open(ack_wait_s=1.0)
    await fill(wal, 2)
    sub = await wal.subscribe()
    first, second = await sub.fetch(2, 2.0)
    await second.ack()
    assert list(await sub.fetch(1, 0.2)) == []
    await harness.elapse(1.0)
    [again] = await sub.fetch(2, 3.0)
    assert (again.stream_seq, again.num_delivered) == (first.stream_seq, 2)


async def test_in_progress_restarts_the_ack_wait(harness: WalHarness) -> None:
    wal = await harness.open(ack_wait_s=1.0)
    await fill(wal, 1)
    sub = await wal.subscribe()
    [msg] = await sub.fetch(1, 2.0)
    await harness.elapse(0.6)
    await msg.in_progress()
    await harness.elapse(0.6)  # 1.2 s since delivery, 0.6 s since in_progress
    assert list(await sub.fetch(1, 0.1)) == []
    await harness.elapse(0.6)
    [again] = await sub.fetch(1, 3.0)
    assert again.num_delivered == 2


async def test_term_never_delivers_again(harness: WalHarness) -> None:
    wal = await harness.open(ack_wait_s=1.0)
    await fill(wal, 2)
    sub = await wal.subscribe()
    first, second = await sub.fetch(2, 2.0)
    await first.term()
    await second.ack()
    await _settled(wal, ack_floor=2, num_ack_pending=0)
    await harness.elapse(1.2)
    assert list(await sub.fetch(2, 0.3)) == []


async def test_fetch_waits_for_a_message_and_times_out_empty(wal: Wal) -> None:
    sub = await wal.subscribe()
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert list(await sub.fetch(5, 0.3)) == []
    assert loop.time() - started >= 0.25
    waiting = asyncio.create_task(sub.fetch(5, 10.0))
    await asyncio.sleep(0.1)
    started = loop.time()
    await fill(wal, 1)
    msgs = list(await waiting)
    assert seqs(msgs) == [1]
    assert loop.time() - started < 5.0  # woken by the message, not the timeout


async def test_max_ack_pending_holds_new_deliveries_back(harness: WalHarness) -> None:
    wal = await harness.open(max_ack_pending=2)
    await fill(wal, 3)
    sub = await wal.subscribe()
    got = list(await sub.fetch(10, 1.0))
    assert seqs(got) == [1, 2]
    assert list(await sub.fetch(10, 0.3)) == []
    assert (await wal.consumer_state()).num_pending == 1
    await got[0].ack()
    assert seqs(list(await sub.fetch(10, 2.0))) == [3]


async def test_two_subscriptions_share_the_messages(harness: WalHarness) -> None:
    wal, other = await harness.open(), await harness.open()
    await fill(wal, 4)
    first, second = await wal.subscribe(), await other.subscribe()
    mine = list(await first.fetch(2, 2.0))
    theirs = list(await second.fetch(10, 2.0))
    assert seqs(mine) == [1, 2]
    assert seqs(theirs) == [3, 4]


async def test_another_client_sees_writes_and_conflicts(harness: WalHarness) -> None:
    wal, other = await harness.open(), await harness.open()
    subject = f"{wal.config.stream_name}.t.a"
    await wal.publish(subject, b"1", msg_id="a:1", expected_last_subject_seq=0)
    last = await other.last_on(subject)
    assert last is not None
    assert last.data == b"1"
    revision = await other.kv_swap("h.a", b"x", revision=None)
    hot = await wal.kv_get("h.a")
    assert hot is not None
    assert hot.revision == revision


async def test_a_deleted_consumer_is_created_again(harness: WalHarness) -> None:
    wal = await harness.open()
    await fill(wal, 2)
    sub = await wal.subscribe()
    for msg in await sub.fetch(2, 2.0):
        await msg.ack()
    await _settled(wal, ack_floor=2, num_ack_pending=0)
    assert await wal.ensure_consumer() is False
    await harness.delete_consumer()
    with pytest.raises(StoreError):
        await wal.consumer_state()
    assert await wal.ensure_consumer() is True
    assert await wal.ensure_consumer() is False
    # A new consumer starts from the beginning of the stream: acked entries come again.
    state = await wal.consumer_state()
    assert (state.num_pending, state.ack_floor, state.last_seq) == (2, 0, 2)
    fresh = await wal.subscribe()
    assert [(m.stream_seq, m.num_delivered) for m in await fresh.fetch(2, 2.0)] == [
        (1, 1),
        (2, 1),
    ]


async def _settled(wal: Wal, *, ack_floor: int, num_ack_pending: int) -> None:
    """Wait until the server has applied the acks sent: a NATS ack is a message without
    reply, so nothing tells when it was processed but the consumer's counters."""
    state = None
    for _ in range(250):
        state = await wal.consumer_state()
        if (state.ack_floor, state.num_ack_pending) == (ack_floor, num_ack_pending):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"acks not applied: {state}")


async def test_a_fetch_stops_at_its_byte_budget(wal: Wal) -> None:
    """`max_bytes`: messages are handed out until their payloads reach it; the first
    always comes, even alone and larger than the budget (or it would never be flushed)."""
    subject = f"{wal.config.stream_name}.t.x"
    for i in range(7):
        await wal.append(subject, bytes([65 + i]) * 1000)
    sub = await wal.subscribe()
    assert seqs(list(await sub.fetch(10, 2.0, max_bytes=2500))) == [1, 2, 3]
    assert seqs(list(await sub.fetch(10, 2.0, max_bytes=10))) == [4]
    assert seqs(list(await sub.fetch(10, 2.0, max_bytes=0))) == [5, 6, 7]  # 0: no limit
    await sub.close()
