"""The write path's publishes with headers, without nats-py's per-call header building.

Every request of a checkpoint carries headers (the WAL publish its message id and
expected last sequence, the hot record's swap its expected revision). nats-py's
`Client.publish` checks both subjects with a regular expression and builds the header
block key by key (a regular expression, a strip, a translate and two encodings each):
about 3 µs of a publish's client CPU, twice per checkpoint. `Publisher` sends the same
protocol command (`hpub_command`) through the client's own outgoing buffer, checking
the header names once each (they are the store's constants) and the values and subjects
with one scan each. Whatever it does not handle the same way goes through
`Client.publish` itself: a connection that is not connected (reconnecting, draining,
closed: nats-py's own errors and buffering apply), a payload over the server's limit,
a name or value nats-py would change or refuse, or a client without the internals it
uses. A flusher's acks (`publish_empty`) take the same route: one formatted command
instead of about 2 µs of nats-py's publish for each message it applied.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from nats.aio.client import Client

__all__ = ["Publisher", "hpub_command"]

_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
"""The header names nats-py sends as they are (others it refuses)."""
_UNSAFE = re.compile(r"\s")
"""What nats-py would strip or translate in a value, or refuse in a subject."""


def hpub_command(subject: str, reply: str, headers: Mapping[str, str], payload: bytes) -> bytes:
    """The ``HPUB`` command nats-py's `publish` sends for these arguments, for names that
    need no stripping and values without whitespace other than inner spaces."""
    block = b"NATS/1.0\r\n"
    for name, value in headers.items():
        block += b"%s: %s\r\n" % (name.encode(), value.encode())
    block += b"\r\n"
    return b"HPUB %s %s %d %d\r\n%s%s\r\n" % (
        subject.encode(),
        reply.encode(),
        len(block),
        len(block) + len(payload),
        block,
        payload,
    )


class Publisher:
    """Publishes with headers on one connection (`Client.publish`'s behaviour)."""

    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._names: set[str] = set()
        """Header names seen to be sent unchanged."""
        self._direct = all(
            hasattr(nc, name) for name in ("_send_command", "_flush_queue", "_flush_pending")
        ) and isinstance(getattr(nc, "stats", None), dict)

    async def publish(
        self, subject: str, payload: bytes, reply: str, headers: Mapping[str, str]
    ) -> None:
        """`Client.publish(subject, payload, reply=reply, headers=headers)`."""
        nc = self._nc
        if (
            self._ready()
            and len(payload) <= nc.max_payload
            and self._plain(subject, reply, headers)
        ):
            await self._send(hpub_command(subject, reply, headers, payload), len(payload))
        else:
            await nc.publish(subject, payload, reply=reply, headers=dict(headers))

    async def publish_empty(self, subject: str) -> None:
        """`Client.publish(subject)`: no payload, reply or headers (a consumer's ack)."""
        if self._ready() and subject and not _UNSAFE.search(subject):
            await self._send(b"PUB %s  0\r\n\r\n" % subject.encode(), 0)  # nats-py's spacing
        else:
            await self._nc.publish(subject)

    def _ready(self) -> bool:
        """The client has the internals used here and is connected (not draining)."""
        nc = self._nc
        return self._direct and nc.is_connected and not nc.is_draining

    async def _send(self, command: bytes, payload_size: int) -> None:
        """What nats-py's `_send_publish` does with a built command."""
        nc = self._nc
        nc.stats["out_msgs"] += 1
        nc.stats["out_bytes"] += payload_size
        await nc._send_command(command)
        flush_queue = nc._flush_queue
        if flush_queue is not None and flush_queue.empty():
            await nc._flush_pending()

    def _plain(self, subject: str, reply: str, headers: Mapping[str, str]) -> bool:
        """Whether nats-py would send these as they are (no strip, no translation, no
        refusal): then `hpub_command` is what it sends."""
        if not subject or _UNSAFE.search(subject) or _UNSAFE.search(reply):
            return False
        for name, value in headers.items():
            if name not in self._names:
                if not _HEADER_NAME.fullmatch(name):
                    return False
                self._names.add(name)
            if value != value.strip() or "\r" in value or "\n" in value:
                return False
        return True
