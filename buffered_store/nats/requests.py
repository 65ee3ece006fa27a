"""Requests to the server: the write path's reply inbox, sending again a request nobody
listened to, and the connection handed to nats-py's JetStream context, which counts
every request it sends.

Every JetStream call nats-py makes (stream and consumer management, direct gets, KV
reads and writes) is one `request` on the connection its context was given. `NatsWal`
gives it a `CountingConnection` rather than the client: it counts and records those
requests, sends each through the write path's reply inbox (not nats-py's own request
path, whose replies wait for a task of their own), sends again one nobody listened to
(`until_answered`, where `may_appear`), and leaves the client itself untouched.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors
from nats.aio.client import NO_RESPONDERS_STATUS, Client
from nats.aio.msg import Msg
from nats.js.api import Header

from buffered_store.backoff import Backoff
from buffered_store.nats.errors import NO_RESPONDERS_FIRST_WAIT_S, NO_RESPONDERS_MAX_WAIT_S
from buffered_store.nats.publishing import Publisher
from buffered_store.timers import EXPIRY_SLACK_S as EXPIRY_SLACK_S
from buffered_store.timers import SharedTimer

log = logging.getLogger("buffered_store.nats.requests")


async def until_answered(send: Callable[[float], Awaitable[Msg]], budget_s: float) -> Msg:
    """The reply `send(timeout_s)` gets, sending again while the server answers "no
    responders", all within `budget_s` seconds (then `NoRespondersError`): each send is
    given only the time left.

    Nobody received such a request, so sending it again cannot store anything twice. On a
    cluster a stream or bucket that was just created answers this way until the node the
    client talks to has learnt where it lives, and a replicated one while it elects a
    leader: a short wait turns those moments into a slower call instead of a failure.
    """
    loop = asyncio.get_running_loop()
    started = loop.time()
    retry: Backoff | None = None  # made on the first refusal: most requests never get one
    left = budget_s
    while True:
        try:
            return await send(left)
        except nats.errors.NoRespondersError:
            if retry is None:
                retry = Backoff(
                    NO_RESPONDERS_FIRST_WAIT_S, NO_RESPONDERS_MAX_WAIT_S, budget_s=budget_s
                )
                retry.left(started)
            wait = retry.next_wait(loop.time())
            if wait is None:
                raise
        await asyncio.sleep(wait)
        left = max(retry.left(loop.time()), NO_RESPONDERS_FIRST_WAIT_S)


def may_appear(subject: str) -> bool:
    """Whether "no responders" on `subject` can be a moment's state worth waiting out: a
    stream's or bucket's subjects and its direct gets, yes; the rest of the JetStream API
    (`$JS.API.`) is answered by every server with JetStream enabled, so there it means
    JetStream is off, and the call fails at once."""
    return not subject.startswith("$JS.API.") or subject.startswith("$JS.API.DIRECT.GET.")


class ReplyInbox:
    """Request/reply for the write path's two round trips, on one wildcard inbox.

    `Client.request` does the same, but waits for each reply through
    `asyncio.wait_for`, about a fifth of a checkpoint's client CPU. Here each request
    only notes its deadline beside its future, and one timer, set for the nearest
    deadline, fails those whose time is up (`nats.errors.TimeoutError`): a constant
    timeout makes each new deadline later than the timer's, so a request schedules,
    cancels and compares no timer of its own. The subscription is made on first use
    and, like any subscription, renewed by nats-py after a reconnect.

    Replies are handed over where the client reads them (`Dispatch`), not through a
    subscription callback: nats-py queues each message for a callback's own task, one
    more turn of the loop, with every other ready callback of a busy process ahead, on
    every round trip.
    """

    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._prefix = nc.new_inbox() + "."
        self._publisher = Publisher(nc)
        self._waiting: dict[str, asyncio.Future[Msg]] = {}
        self._deadlines: SharedTimer[str] = SharedTimer(self._time_out)
        self._tokens = itertools.count()
        self._subscribed: asyncio.Future[Any] | None = None

    async def request(
        self, subject: str, payload: bytes, headers: dict[str, str] | None, *, timeout_s: float
    ) -> Msg:
        """The reply to one request; nats-py's errors on failure (`TimeoutError` and
        `NoRespondersError` included), as `Client.request` raises them."""
        await self._subscribe()
        loop = asyncio.get_running_loop()
        token = str(next(self._tokens))
        reply: asyncio.Future[Msg] = loop.create_future()
        self._waiting[token] = reply
        self._deadlines.add(token, loop.time() + timeout_s)
        try:
            if headers:
                await self._publisher.publish(subject, payload, self._prefix + token, headers)
            else:
                await self._nc.publish(subject, payload, reply=self._prefix + token)
            msg = await reply
        finally:
            self._waiting.pop(token, None)
            self._deadlines.discard(token)
        if msg.headers and msg.headers.get(Header.STATUS) == NO_RESPONDERS_STATUS:
            raise nats.errors.NoRespondersError
        return msg

    def _time_out(self, token: str) -> None:
        """The request's deadline has passed: fail it."""
        reply = self._waiting.get(token)
        if reply is not None and not reply.done():
            reply.set_exception(nats.errors.TimeoutError())

    async def _subscribe(self) -> None:
        if self._subscribed is None:
            loop = asyncio.get_running_loop()
            self._subscribed = asyncio.ensure_future(
                self._nc.subscribe(self._prefix + "*", future=Dispatch(loop, self._deliver))
            )
        if self._subscribed.done() and self._subscribed.exception() is None:
            return
        try:
            await asyncio.shield(self._subscribed)
        except BaseException:
            if self._subscribed.done():
                self._subscribed = None  # failed: the next request subscribes again
            raise

    def _deliver(self, msg: Msg) -> None:
        reply = self._waiting.pop(msg.subject[len(self._prefix) :], None)
        if reply is not None and not reply.done():
            reply.set_result(msg)


class Dispatch(asyncio.Future[Msg]):
    """What nats-py's ``subscribe(future=...)`` takes for its old-style requests, made to
    pass every message on: the client reads a message for such a subscription and calls
    ``set_result`` at once, in its read loop (no queue, no task), and never looks at the
    future again. This one stays pending and hands each message to `deliver`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, deliver: Callable[[Msg], None]) -> None:
        super().__init__(loop=loop)
        self._deliver = deliver

    def set_result(self, result: Msg, /) -> None:
        try:
            self._deliver(result)
        except Exception as exc:
            # Raised here, it would end the client's read loop, which nats-py logs and
            # leaves ended: every later reply of the connection would be lost with it.
            log.error(
                "a message handler failed in the client's read loop: %r",
                exc,
                exc_info=exc,
                extra={"action": "dispatch_failed", "subject": result.subject},
            )


class CountingConnection:
    """The client as nats-py's JetStream context sees it: `request` counts (and, when
    asked, records) each request, sends it through `replies` and sends again one nobody
    listened to; everything else is the client's own attribute.

    Through `replies` rather than `Client.request`: nats-py hands a reply to its
    requests' subscription callback, a task of its own, and the caller waits in
    `asyncio.wait_for`, two more turns of the loop behind every ready task of a busy
    process. A read of a hot record costs about 30% less client CPU and a third less
    wall time this way (`benchmarks.profile_reads`; docs/benchmarks/history.md, *Stop 45*).
    """

    def __init__(self, nc: Client, default_timeout_s: float, replies: ReplyInbox) -> None:
        self._nc = nc
        self._default_timeout_s = default_timeout_s
        self._replies = replies
        self.requests = 0
        """Requests sent so far (each is one round trip): through this connection, and
        those the write path's reply inbox adds."""
        self.recorded: list[str] | None = None
        """Subjects of the requests sent since `record` (None: not recording)."""

    def record(self) -> list[str]:
        """Start recording the subject of every request; the list they go into."""
        self.recorded = []
        return self.recorded

    async def request(self, subject: str, *args: Any, **kwargs: Any) -> Msg:
        """`Client.request`, counted, and sent again while nobody listens where someone
        may appear; all within the call's timeout (default: the configured one)."""
        # The flusher's pull fetches are publishes, not requests: neither counted here
        # nor sent again.
        replies = self._replies
        # `Client.request`'s arguments, as nats-py's JetStream context passes them.
        payload: bytes = args[0] if args else kwargs.get("payload", b"")
        headers: dict[str, str] | None = kwargs.get("headers")

        async def send(timeout_s: float) -> Msg:
            self.requests += 1
            if self.recorded is not None:
                self.recorded.append(subject)
            return await replies.request(subject, payload, headers, timeout_s=timeout_s)

        budget_s = kwargs.get("timeout") or self._default_timeout_s
        if not may_appear(subject):
            return await send(budget_s)
        return await until_answered(send, budget_s)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._nc, name)
