"""`Publisher` sends exactly what nats-py's `Client.publish` sends, and lets nats-py
handle whatever it would change, refuse or buffer. A client that never connects stands
in for a connected one: its outgoing commands are captured instead of written."""

from __future__ import annotations

import asyncio
from typing import Any

import nats.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from buffered_store.errors import StoreError
from buffered_store.nats.delivery import NatsDelivered
from buffered_store.nats.publishing import Publisher, hpub_command

SUBJECT, REPLY = "THREADLOG.t.dGhyZWFk", "_INBOX.abc.7"
HEADERS = {"Nats-Msg-Id": "dGhyZWFk:12:w-1", "Nats-Expected-Last-Subject-Sequence": "41"}


class CapturingClient(Client):
    """A `Client` in the CONNECTED state whose commands are recorded, not sent."""

    def __init__(self) -> None:
        super().__init__()
        self._status = Client.CONNECTED
        self._max_payload = 1024
        self._flush_queue = None  # nothing to wake: `publish` never flushes here
        self.sent: list[bytes] = []
        self.published = 0

    async def _send_command(self, cmd: bytes, priority: bool = False) -> None:
        self.sent.append(bytes(cmd))

    async def publish(self, *args: Any, **kwargs: Any) -> None:
        self.published += 1
        await super().publish(*args, **kwargs)


async def _both(
    subject: str, payload: bytes, reply: str, headers: dict[str, str]
) -> tuple[CapturingClient, CapturingClient]:
    theirs, ours = CapturingClient(), CapturingClient()
    await theirs.publish(subject, payload, reply=reply, headers=headers)
    await Publisher(ours).publish(subject, payload, reply, headers)
    return theirs, ours


@pytest.mark.parametrize(
    "headers",
    [HEADERS, {"KV-Operation": "PURGE"}, {"Nats-Expected-Last-Subject-Sequence": "0", "A": "b c"}],
)
async def test_sends_the_bytes_nats_py_sends_without_going_through_it(
    headers: dict[str, str],
) -> None:
    payload = b'{"v":1,"m":[{"role":"user"}]}'
    theirs, ours = await _both(SUBJECT, payload, REPLY, headers)
    assert ours.sent == theirs.sent
    assert ours.sent == [hpub_command(SUBJECT, REPLY, headers, payload)]
    assert ours.published == 0  # the direct route
    assert ours.stats["out_msgs"] == theirs.stats["out_msgs"] == 1
    assert ours.stats["out_bytes"] == theirs.stats["out_bytes"] == len(payload)


@pytest.mark.parametrize(
    "headers",
    [
        {"Nats-Msg-Id": " padded "},  # nats-py strips it
        {"Nats-Msg-Id": "two\r\nlines"},  # nats-py turns the line break into spaces
        {" Nats-Msg-Id": "x"},  # nats-py strips the name
    ],
)
async def test_what_nats_py_would_change_goes_through_nats_py(headers: dict[str, str]) -> None:
    theirs, ours = await _both(SUBJECT, b"x", REPLY, headers)
    assert ours.published == 1
    assert ours.sent == theirs.sent


async def test_what_nats_py_refuses_is_refused_by_nats_py() -> None:
    ours = CapturingClient()
    publisher = Publisher(ours)
    with pytest.raises(nats.errors.BadSubjectError):
        await publisher.publish("bad subject", b"x", REPLY, HEADERS)
    with pytest.raises(nats.errors.BadHeaderError):
        await publisher.publish(SUBJECT, b"x", REPLY, {"Bad:Name": "x"})
    with pytest.raises(nats.errors.MaxPayloadError):
        await publisher.publish(SUBJECT, b"x" * 2000, REPLY, HEADERS)
    assert ours.sent == []


async def test_a_connection_not_connected_is_left_to_nats_py() -> None:
    closed = CapturingClient()
    closed._status = Client.CLOSED
    with pytest.raises(nats.errors.ConnectionClosedError):
        await Publisher(closed).publish(SUBJECT, b"x", REPLY, HEADERS)
    draining = CapturingClient()
    draining._status = Client.DRAINING_PUBS
    with pytest.raises(nats.errors.ConnectionDrainingError):
        await Publisher(draining).publish(SUBJECT, b"x", REPLY, HEADERS)
    # Reconnecting: nats-py buffers the command until the connection is back.
    reconnecting = CapturingClient()
    reconnecting._status = Client.RECONNECTING
    reconnecting._max_pending_size = 1024 * 1024
    await Publisher(reconnecting).publish(SUBJECT, b"x", REPLY, HEADERS)
    assert reconnecting.published == 1
    assert reconnecting.sent == [hpub_command(SUBJECT, REPLY, HEADERS, b"x")]


async def test_an_idle_client_is_woken_to_write_as_publish_wakes_it() -> None:
    client = CapturingClient()
    client._flush_queue = asyncio.Queue()
    flushed: list[bool] = []

    async def flush_pending(force_flush: bool = False) -> None:
        flushed.append(force_flush)

    client._flush_pending = flush_pending  # type: ignore[method-assign]
    await Publisher(client).publish(SUBJECT, b"x", REPLY, HEADERS)
    assert flushed == [False]


ACK_SUBJECT = "$JS.ACK.THREADLOG.flusher.1.17.9.1796000000000000000.0"


async def test_an_ack_sends_what_nats_py_sends_for_it() -> None:
    theirs, ours = CapturingClient(), CapturingClient()
    await Msg(theirs, subject="THREADLOG.t.x", reply=ACK_SUBJECT).ack()
    await Publisher(ours).publish_empty(ACK_SUBJECT)
    assert ours.published == 0
    assert ours.sent == theirs.sent
    assert ours.stats["out_msgs"] == theirs.stats["out_msgs"] == 1


async def test_a_delivered_message_acks_once_through_the_publisher() -> None:
    client = CapturingClient()
    delivered = NatsDelivered(
        Msg(client, subject="THREADLOG.t.x", reply=ACK_SUBJECT), Publisher(client)
    )
    assert (delivered.stream_seq, delivered.num_delivered) == (17, 1)
    await delivered.ack()
    assert client.published == 0
    assert client.sent == [b"PUB " + ACK_SUBJECT.encode() + b"  0\r\n\r\n"]
    # A second ack is refused as nats-py refuses it, and sends nothing.
    with pytest.raises(StoreError):
        await delivered.ack()
    assert len(client.sent) == 1
