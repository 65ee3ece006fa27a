"""`ReplyInbox`, the request/reply of the write path's two round trips: every reply
reaches its own request, and failures come out as nats-py's `Client.request` raises
them (so `translated` maps them to our errors as before)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import nats
import nats.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from buffered_store.nats.wal import ReplyInbox


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[Client]:
    client = await nats.connect(nats_url)
    yield client
    await client.close()


async def test_concurrent_requests_each_get_their_own_reply(nc: Client) -> None:
    async def answer(msg: Msg) -> None:
        # Answer out of order: later requests first, after a short, varying delay.
        await asyncio.sleep(0.02 - int(msg.data) * 0.0002)
        tag = (msg.headers or {}).get("X-Tag", "")
        await msg.respond(msg.data + b":" + tag.encode())

    await nc.subscribe("rq.echo", cb=answer)
    inbox = ReplyInbox(nc)
    replies = await asyncio.gather(
        *(
            inbox.request("rq.echo", str(i).encode(), {"X-Tag": f"t{i}"}, timeout_s=5)
            for i in range(60)
        )
    )
    assert [r.data for r in replies] == [f"{i}:t{i}".encode() for i in range(60)]


async def test_a_subject_nobody_serves_raises_no_responders(nc: Client) -> None:
    inbox = ReplyInbox(nc)
    with pytest.raises(nats.errors.NoRespondersError):
        await inbox.request("rq.nobody", b"x", {"X-Tag": "t"}, timeout_s=5)


async def test_an_unanswered_request_times_out_and_its_late_reply_is_dropped(
    nc: Client,
) -> None:
    held: list[Msg] = []

    async def hold(msg: Msg) -> None:
        held.append(msg)  # answered only after the requester gave up

    async def answer(msg: Msg) -> None:
        await msg.respond(b"ok")

    await nc.subscribe("rq.slow", cb=hold)
    await nc.subscribe("rq.fast", cb=answer)
    inbox = ReplyInbox(nc)
    began = time.monotonic()
    with pytest.raises(nats.errors.TimeoutError):
        await inbox.request("rq.slow", b"x", {"X-Tag": "t"}, timeout_s=0.2)
    assert 0.15 < time.monotonic() - began < 2
    await held[0].respond(b"late")
    # The late reply matches no waiting request; the next request gets its own.
    reply = await inbox.request("rq.fast", b"y", {"X-Tag": "t"}, timeout_s=5)
    assert reply.data == b"ok"


async def test_requests_on_a_closed_connection_fail_and_do_not_hang(nc: Client) -> None:
    inbox = ReplyInbox(nc)
    await nc.close()
    with pytest.raises(nats.errors.ConnectionClosedError):
        await asyncio.wait_for(inbox.request("rq.any", b"x", {"X-Tag": "t"}, timeout_s=5), 10)
