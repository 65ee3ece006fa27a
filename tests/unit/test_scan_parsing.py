"""The consumer scan's own parsing of what nats-py hands it: the same answers as nats-py's."""

from __future__ import annotations

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NotJSMessageError

from buffered_store.nats.delivery import NatsDelivered
from buffered_store.nats.scan import ack_counters, ack_fields, header_lines


@pytest.mark.parametrize(
    "reply",
    [
        "$JS.ACK.WAL.scan.1.42.7.1700000000000000000.3",
        "$JS.ACK.dom.hash.WAL.scan.1.42.7.1700000000000000000.0.token",
        "$JS.ACK._.hash.WAL.scan.2.9000.8.1700000000000000000.12",
    ],
)
def test_ack_counters_are_nats_py_s_metadata(reply: str) -> None:
    meta = Msg(None, reply=reply).metadata  # type: ignore[arg-type]
    assert ack_counters(reply) == (meta.sequence.stream, meta.num_pending)
    assert ack_fields(reply) == (meta.sequence.stream, meta.num_delivered, meta.num_pending)


@pytest.mark.parametrize(
    "reply",
    [
        "$JS.ACK.WAL.flusher.3.42.7.1700000000000000000.3",
        "$JS.ACK._.hash.WAL.flusher.1.9000.8.1700000000000000000.12.token",
    ],
)
def test_a_delivered_message_s_counters_are_its_metadata(reply: str) -> None:
    msg = Msg(None, subject="WAL.t", reply=reply, data=b"{}")  # type: ignore[arg-type]
    delivered = NatsDelivered(msg)
    assert (delivered.stream_seq, delivered.num_delivered) == (
        msg.metadata.sequence.stream,
        msg.metadata.num_delivered,
    )
    assert (delivered.subject, delivered.data) == ("WAL.t", b"{}")


def test_a_message_without_an_ack_subject_is_refused_as_nats_py_refuses_it() -> None:
    msg = Msg(None, subject="WAL.t", reply="_INBOX.abc", data=b"{}")  # type: ignore[arg-type]
    with pytest.raises(NotJSMessageError):
        NatsDelivered(msg)


@pytest.mark.parametrize(
    "reply", [None, "", "_INBOX.abc", "$JS.ACK.too.short", "$JS.ACK.a.b.c.x.1.2.3"]
)
def test_what_is_not_a_jetstream_reply_gives_none(reply: str | None) -> None:
    assert ack_counters(reply) is None
    assert ack_fields(reply) is None


@pytest.mark.parametrize(
    "raw",
    [
        b"Nats-Msg-Id: t.1\r\nNats-Expected-Last-Subject-Sequence: 0\r\n\r\n",
        b"A:1\r\nB:\t2\r\nbad name: 3\r\nnocolon\r\n\xff\xfe: 4\r\nC: caf\xc3\xa9 \r\n",
        b"",
        b"Tab\tName: x\r\nOk: \xff\r\n",
    ],
)
def test_header_lines_are_nats_py_s(raw: bytes) -> None:
    assert header_lines(raw) == Client._parse_header_lines(raw)
