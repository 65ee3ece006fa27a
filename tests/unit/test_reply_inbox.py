"""`ReplyInbox` without a server: how soon a request resumes once the client has read its
reply. The client is a fake that hands messages over as nats-py's read loop does: to a
subscription's ``future`` at once, or through the queue a callback's task reads."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.msg import Msg

from buffered_store.nats.requests import ReplyInbox


class Client:
    """The part of nats-py's `Client` a `ReplyInbox` uses, and its read loop."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.future: asyncio.Future[Msg] | None = None
        self.queue: asyncio.Queue[Msg] = asyncio.Queue()
        self.reader: asyncio.Task[None] | None = None

    def new_inbox(self) -> str:
        return "_INBOX.test"

    async def subscribe(
        self,
        subject: str,
        *,
        cb: Callable[[Msg], Awaitable[None]] | None = None,
        future: asyncio.Future[Msg] | None = None,
    ) -> None:
        if future is not None:
            self.future = future
        elif cb is not None:
            self.reader = asyncio.create_task(self._read(cb))

    async def publish(self, subject: str, payload: bytes, **kwargs: Any) -> None:
        self.sent.append(kwargs["reply"])

    def receive(self, reply: str, data: bytes) -> None:
        """What the read loop does with a message for the inbox (`_process_msg`)."""
        msg = Msg(_client=self, subject=reply, data=data)  # type: ignore[arg-type]
        if self.future is not None:
            if not self.future.cancelled():
                self.future.set_result(msg)
        else:
            self.queue.put_nowait(msg)

    async def _read(self, cb: Callable[[Msg], Awaitable[None]]) -> None:
        while True:
            await cb(await self.queue.get())


async def test_a_request_resumes_in_the_turn_after_its_reply_is_read() -> None:
    client = Client()
    inbox = ReplyInbox(client)  # type: ignore[arg-type]
    requests = [asyncio.create_task(inbox.request("s", b"x", {}, timeout_s=60)) for _ in range(2)]
    for _ in range(5):
        await asyncio.sleep(0)
    assert len(client.sent) == 2
    client.receive(client.sent[1], b"second")
    await asyncio.sleep(0)  # only the request the reply belongs to resumes
    assert requests[1].done()
    assert requests[1].result().data == b"second"
    assert not requests[0].done()
    client.receive(client.sent[0], b"first")
    assert (await requests[0]).data == b"first"
    assert client.reader is None
