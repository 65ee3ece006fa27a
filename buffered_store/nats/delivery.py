"""The flusher's side of the durable consumer on NATS: pull requests into one inbox.

nats-py's `fetch` sends a pull request per call (two when nothing is waiting) and waits
for each message with its own timer. A flusher collecting a window message by message
then costs the server a pull request and the client a timer per message. Here one pull
request stays open for a whole window: the server pushes what arrives into the inbox
(up to the request's batch, until it expires), the client's read loop queues it here
(`Dispatch`), and `fetch` hands out what is queued; a new request goes out only once the
previous one is over.

The messages are nats-py's own `Msg` (their ack subject says where to ack), wrapped as
the engine's `Delivered` (`NatsDelivered`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable

import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import DEFAULT_PREFIX, Header

from buffered_store.errors import StoreClosedError, WalUnavailableError
from buffered_store.nats.connection import max_payload
from buffered_store.nats.errors import raise_translated, translated
from buffered_store.nats.publishing import Publisher
from buffered_store.nats.requests import Dispatch
from buffered_store.nats.scan import ack_fields

log = logging.getLogger("buffered_store.nats.delivery")

REQUEST_GRACE_S = 1.0
"""A pull request whose end the server did not signal counts as over this long after it
expired (its status message may have been lost with a connection)."""
MIN_PULL_S = 0.5
"""Shortest life of a waiting pull request (what arrives meanwhile is queued here)."""
OVERLAP_S = 0.1
"""A waiting pull request outlives the fetch that sent it by this much, so the fetch
that drains a collection window at its end finds it open and sends nothing."""
LINGER_AFTER_S = 0.02
"""A fetch shorter than this takes what is there (one request) and never waits."""
_OVER = frozenset({"404", "408"})
"""Statuses that end a pull request normally (nothing more, or it expired)."""
_BYTES_REACHED = "Message Size Exceeds MaxBytes"
"""A ``409``'s description that ends a pull request with `max_bytes` normally: the next
message would go past its bytes."""
_BATCH_COMPLETED = "Batch Completed"
"""A ``409``'s description that follows the last message of a request with `max_bytes`
whose batch was delivered: that message already ended the request here (and a new
request may be open by the time this arrives), so it changes nothing."""
MAX_BYTES_SLACK = 64 * 1024
"""A pull request's `max_bytes` is never below the server's `max_payload` plus this (room
for the subject and reply the server counts too): a message larger than what a request
allows would never be delivered, and the flush would stall on it."""
_HEARTBEAT = "100"


class NatsDelivered:
    """A message delivered by the durable consumer (the engine's `Delivered`)."""

    __slots__ = ("_msg", "_publisher", "data", "num_delivered", "stream_seq", "subject")

    def __init__(self, msg: Msg, publisher: Publisher | None = None) -> None:
        self._msg = msg
        self._publisher = publisher
        self.subject: str = msg.subject
        self.data: bytes = msg.data
        # The counters straight from the reply subject: `msg.metadata` builds three
        # objects and a timestamp for every message a flusher receives.
        fields = ack_fields(msg.reply)
        if fields is None:
            meta = msg.metadata  # raises nats-py's own error for what is not an ack subject
            self.stream_seq: int = int(meta.sequence.stream)
            self.num_delivered: int = int(meta.num_delivered)
        else:
            self.stream_seq, self.num_delivered, _ = fields

    async def ack(self) -> None:
        """Acknowledge it (`translated` as a plain ``except``: a flusher acks every
        message it applies), through the delivery's `Publisher` when it has one (what
        nats-py's `Msg.ack` sends, checked the same)."""
        msg, publisher = self._msg, self._publisher
        try:
            if publisher is None or not msg.reply or getattr(msg, "_ackd", True):
                await msg.ack()  # nats-py's own checks and errors
                return
            await publisher.publish_empty(msg.reply)
            msg._ackd = True
        except Exception as exc:
            raise_translated(exc, lambda: "ack")

    async def nak(self, delay_s: float | None = None) -> None:
        """Have it delivered again, after `delay_s` when given."""
        async with translated("nak"):
            await self._msg.nak(delay=delay_s or None)

    async def term(self) -> None:
        """Never deliver it again."""
        async with translated("term"):
            await self._msg.term()

    async def in_progress(self) -> None:
        """Restart its ack timer."""
        async with translated("in progress"):
            await self._msg.in_progress()


class NatsDelivery:
    """The durable consumer's messages through one inbox (the engine's `Delivery`).

    Pull subscriptions must be created again after the client reconnected (nats.py
    #504): the server forgets the outstanding pull requests of a dead connection, so
    `stale` turns true once the client's reconnect counter moved.
    """

    def __init__(self, nc: Client, stream: str, consumer: str, moved: Callable[[], bool]) -> None:
        self._nc = nc
        self._next = f"{DEFAULT_PREFIX}.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self._inbox = nc.new_inbox()
        self._publisher = Publisher(nc)
        self._moved = moved
        self._sub: Subscription | None = None
        self._queue: collections.deque[Msg] = collections.deque()
        self._queued_bytes = 0
        """Payload bytes of `_queue`."""
        self._changed = asyncio.Event()
        self._budget = 0
        """Messages the open pull request may still deliver (0: none is open)."""
        self._asked = 0
        """Messages the last pull request asked for."""
        self._over_at = 0.0
        """Loop time after which the open request counts as over anyway."""
        self._refused = ""
        self._too_big = False
        """The last request ended on its bytes with nothing delivered: the next message is
        larger than a request's smallest `max_bytes` (a node with a smaller
        `max_payload` than the one that stored it), so the next request asks for that
        one message without `max_bytes` (else it would never be delivered)."""
        self.requests = 0
        """Pull requests sent."""

    @classmethod
    async def open(
        cls, nc: Client, stream: str, consumer: str, moved: Callable[[], bool]
    ) -> NatsDelivery:
        """A delivery with its inbox subscribed."""
        delivery = cls(nc, stream, consumer, moved)
        # Handed over where the client reads them (`Dispatch`), not through a callback
        # of the subscription: nats-py would queue each message for the callback's own
        # task and create a coroutine for it, about 2 µs of the flusher's CPU a message.
        dispatch = Dispatch(asyncio.get_running_loop(), delivery._on_msg)
        delivery._sub = await nc.subscribe(delivery._inbox, future=dispatch)
        return delivery

    @property
    def stale(self) -> bool:
        """The connection was re-established since the subscription was made."""
        return self._moved()

    @property
    def waiting(self) -> int:
        """How many messages `queued` holds."""
        return len(self._queue)

    def queued(self) -> list[NatsDelivered]:
        """Messages delivered to this flusher and not fetched yet (their ack timers run:
        a flusher keeps them alive as it keeps the messages it holds)."""
        return [NatsDelivered(msg, self._publisher) for msg in self._queue]

    @property
    def pulling(self) -> bool:
        """A pull request is open: what arrives is pushed into `queued` without a fetch."""
        return self._open(asyncio.get_running_loop().time())

    async def fetch(
        self, count: int, timeout_s: float, *, linger: bool = True, max_bytes: int = 0
    ) -> list[NatsDelivered]:
        """Up to `count` messages: those queued, else all the server has now, else the
        first to arrive within `timeout_s` (none: empty). When fewer than `count` are
        handed out and the caller can wait, a pull request stays open for the rest until
        `timeout_s` is over: what arrives meanwhile is queued for the next fetch, without
        another request. With `linger` False: those queued and all the server has now,
        up to `count` (waiting up to `timeout_s` for the server to send them), and no
        request stays open. With `max_bytes`, `count` ends sooner once the payloads
        handed out reach that many bytes (the first message always comes), and each
        request asks the server for about the bytes still missing (never less than one
        message of the largest size: `MAX_BYTES_SLACK`)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        may_wait = linger and timeout_s >= LINGER_AFTER_S
        queued = len(self._queue)
        short = not max_bytes or self._queued_bytes < max_bytes
        if queued < count and short and not self._open(loop.time()):
            # Everything there is now, up to what the queue lacks (the server ends the
            # request with a status when it has sent all it had), then, if nothing was,
            # one request that stays open. For one message that may wait, the waiting
            # request alone does both. A fetch that may wait and finds some queued takes
            # those and keeps a request open for the rest (below); a drain asks for the
            # server's too, or a collection window that began with a few queued would
            # end with them and leave the backlog for a later one.
            if not linger or (not queued and (count > 1 or not may_wait)):
                await self._request(count - queued, timeout_s, no_wait=True, max_bytes=max_bytes)
                await self._until(lambda: not self._budget, deadline)
            if not self._queue and may_wait and loop.time() < deadline:
                await self._request(
                    count, deadline - loop.time() + OVERLAP_S, no_wait=False, max_bytes=max_bytes
                )
        await self._until(lambda: bool(self._queue) or not self._open(loop.time()), deadline)
        if self._refused:
            refused, self._refused = self._refused, ""
            raise WalUnavailableError(f"the flusher consumer refused a pull request: {refused}")
        taken: list[NatsDelivered] = []
        size = 0
        while self._queue and len(taken) < count and (not max_bytes or size < max_bytes):
            msg = self._queue.popleft()
            self._queued_bytes -= len(msg.data)
            size += len(msg.data)
            taken.append(NatsDelivered(msg, self._publisher))
        left = deadline - loop.time()
        short = not max_bytes or size < max_bytes
        if len(taken) < count and short and may_wait and left > 0 and not self._open(loop.time()):
            # The request that delivered these is over (or they came from the queue):
            # without a new one nothing more would arrive before the caller's window ends.
            await self._request(
                count - len(taken),
                left + OVERLAP_S,
                no_wait=False,
                max_bytes=max_bytes - size if max_bytes else 0,
            )
        return taken

    async def close(self) -> None:
        """Unsubscribe (best effort: the connection may be gone)."""
        sub, self._sub = self._sub, None
        if sub is None:
            return
        try:
            await sub.unsubscribe()
        except Exception as exc:  # a dead subscription needs no cleanup
            log.debug("unsubscribe failed: %r", exc, extra={"action": "unsubscribe_failed"})

    def _open(self, now: float) -> bool:
        if self._budget and now >= self._over_at:
            self._budget = 0  # its end was never signalled: count it as over
        return self._budget > 0

    async def _request(
        self, count: int, timeout_s: float, *, no_wait: bool, max_bytes: int = 0
    ) -> None:
        """A pull request for `count` messages beyond those queued; with `max_bytes`, for
        about that many payload bytes less those queued (never below one whole message)."""
        if self._too_big:
            count, max_bytes, self._too_big = 1, 0, False  # that one message, whatever its size
        body: dict[str, object] = {"batch": count}
        if max_bytes:
            wanted = max_bytes - self._queued_bytes
            body["max_bytes"] = max(wanted, self.max_payload + MAX_BYTES_SLACK)
        if no_wait:
            body["no_wait"] = True
            self._over_at = asyncio.get_running_loop().time() + REQUEST_GRACE_S
        else:
            # Open a while even for a short fetch: the next ones then find it open and
            # send nothing (a flusher waiting for its cycle fetches every few tens of ms).
            expires_s = max(timeout_s, MIN_PULL_S)
            body["expires"] = int(expires_s * 1_000_000_000)
            self._over_at = asyncio.get_running_loop().time() + expires_s + REQUEST_GRACE_S
        self._budget = self._asked = count
        self.requests += 1
        try:
            await self._nc.publish(self._next, orjson.dumps(body), reply=self._inbox)
        except Exception as exc:
            self._budget = 0
            async with translated("pull from the flusher consumer"):
                raise exc

    async def _until(self, ready: Callable[[], bool], deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while not ready():
            left = deadline - loop.time()
            if left <= 0:
                return
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                return

    @property
    def max_payload(self) -> int:
        """The largest message the server takes (1 MiB until the connection says)."""
        return max_payload(self._nc)

    def _on_msg(self, msg: Msg) -> None:
        headers = msg.headers or {}
        status = headers.get(Header.STATUS.value)
        if status:
            description = headers.get(Header.DESCRIPTION.value, "")
            if status == _HEARTBEAT or description.startswith(_BATCH_COMPLETED):
                return
            if description.startswith(_BYTES_REACHED):
                self._too_big = self._budget == self._asked  # not one message came
            elif status not in _OVER:
                # 409: the consumer was deleted, its leader changed, too many waiting
                # requests...; 503: nobody answers for the consumer.
                self._refused = f"{status} {description}".strip()
            self._budget = 0
            self._changed.set()
            return
        self._queue.append(msg)
        self._queued_bytes += len(msg.data)
        if self._budget:
            self._budget -= 1
        self._changed.set()


def check_open(delivery: NatsDelivery | None) -> NatsDelivery:
    """The delivery, or `StoreClosedError` when it was closed."""
    if delivery is None:
        raise StoreClosedError("the flusher's subscription is closed")
    return delivery
