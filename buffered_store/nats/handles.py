"""What every part of `NatsWal` works with: the connection, the JetStream context on a
request-counting view of it, the reply inbox of the write path and the handles of the
objects once opened (`WalHandles`).

The jobs built on it live beside it: set-up (`setup`), the stream and the durable
consumer (`stream`), the consumer scans (`scan`) and the KV buckets (`kv`); `wal`
assembles them into `NatsWal`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import nats.errors
import nats.js.errors as jse
import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from buffered_store.config import EngineConfig
from buffered_store.nats.connection import max_payload
from buffered_store.nats.requests import CountingConnection, ReplyInbox, until_answered

if TYPE_CHECKING:
    from buffered_store.nats.kv import NatsBucket

EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
"""Publish header: refuse the message unless the subject's last one is at this seq."""
MSG_ID = "Nats-Msg-Id"
"""Publish header: the id a retried publish is deduplicated by."""


class WalHandles:
    """One NATS connection and the handles of the project's JetStream objects."""

    def __init__(self, nc: Client, config: EngineConfig, *, front_end: str | None = None) -> None:
        self._nc = nc
        self.config = config
        self.front_end = front_end
        """The front-end this connection writes or drains for (None: any): a stream it
        creates is tagged with it, and a stream tagged for another is refused."""
        self.stream_front_end: str | None = None
        """The front-end the stream's metadata names, once opened (None: untagged)."""
        self._replies = ReplyInbox(nc)
        self._counting = CountingConnection(nc, config.request_timeout_s, self._replies)
        # nats-py types the context's connection as its client; the counting view
        # answers every attribute the context uses.
        self._js = JetStreamContext(cast(Client, self._counting), timeout=config.request_timeout_s)
        self.stream = config.stream_name
        self.direct = not config.leader_reads
        """Reads use direct gets (any replica answers) rather than the stream leader.

        Direct gets are served by every replica, including one that has not yet applied
        the last acknowledged write, so on a cluster they break read-your-writes and
        can hand the writer a stale cursor; `EngineConfig.read_from` decides.
        """
        self._hot: KeyValue | None = None
        self._hot_prefix = f"$KV.{config.hot_bucket}."
        """Subject prefix of the hot bucket's keys (no JetStream domain is used)."""
        self._quarantine: NatsBucket | None = None

    @property
    def requests(self) -> int:
        """Requests sent to the server so far (each is one round trip)."""
        return self._counting.requests

    @requests.setter
    def requests(self, value: int) -> None:
        self._counting.requests = value

    def record_requests(self) -> list[str]:
        """From now on, append the subject of every request made through the
        connection's request path (JetStream API calls, direct gets, KV reads) to the
        returned list: what a test looking at where reads go needs."""
        return self._counting.record()

    @property
    def max_payload(self) -> int:
        """Largest message the server accepts (1 MiB before the connection says)."""
        return max_payload(self._nc)

    def receive_in_bulk(self) -> None:
        """Tune this connection for receiving many messages (a scan of the WAL tail): it
        parses their headers with `scan.header_lines`."""
        from buffered_store.nats.scan import parse_headers_faster

        parse_headers_faster(self._nc)

    @property
    def reconnects(self) -> int:
        """Times the client re-established its connection."""
        return int(self._nc.stats.get("reconnects", 0))

    async def _js_publish(
        self, subject: str, payload: bytes, headers: dict[str, str]
    ) -> tuple[int, bool]:
        """`JetStreamContext.publish` on the hot path, minus its layers: one request on
        the connection's reply inbox and the ack parsed with orjson. Errors are nats-py's
        own, for `translated`."""
        timeout_s = self.config.request_timeout_s
        counting = self._counting
        counting.requests += 1
        try:
            msg = await self._replies.request(subject, payload, headers, timeout_s=timeout_s)
        except nats.errors.NoRespondersError:
            # Nobody listened (a stream just placed, a leader being elected): send again
            # within the budget, as every request does (`until_answered`). Only here, so
            # the usual request makes no retry closure and no extra coroutine; the first
            # refusal came back at once, so the budget stays about the same.

            async def send(left_s: float) -> Msg:
                counting.requests += 1
                return await self._replies.request(subject, payload, headers, timeout_s=left_s)

            try:
                msg = await until_answered(send, timeout_s)
            except nats.errors.NoRespondersError:
                raise jse.NoStreamResponseError from None
        ack = orjson.loads(msg.data)
        error = ack.get("error")
        if error is not None:
            raise jse.APIError.from_error(error)
        return int(ack["seq"]), bool(ack.get("duplicate"))
