"""The flusher's side of the durable consumer: one subscription (the WAL's `Delivery`),
re-created when it may be stale, and the collection window.

A subscription goes stale when the connection under it was re-established (the server
forgets the outstanding pull requests of a dead connection); the intake asks before each
window and subscribes again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from buffered_store.engine.ports import Delivered, Delivery, Wal
from flusher.config import MIN_FETCH_TIMEOUT_S, FlusherConfig
from flusher.stats import FlusherStats

log = logging.getLogger("flusher.intake")

BUSY_FETCH_TIMEOUT_S = 0.05
"""How long a window that is over waits at a time for the previous cycle to end: short,
so the next cycle starts soon after that one ends (at most this late)."""
FILL_CHECK_S = 0.05
"""How often a filling window looks whether a whole batch is waiting (no request)."""


class Intake:
    """Fetches batches of WAL messages for the flusher."""

    def __init__(self, wal: Wal, config: FlusherConfig, stats: FlusherStats) -> None:
        self.wal = wal
        self.config = config
        self.stats = stats
        self._sub: Delivery | None = None
        self._stale = True
        self._opened = False
        self._streaming = False
        """The last window filled a whole batch: the next one streams (see `collect`)."""
        self.in_hand: list[Delivered] = []
        """Messages of the window being collected (or collected and not yet taken by a
        cycle): kept alive meanwhile, given back if the flusher is cancelled."""
        self.bytes_in_hand = 0
        """Payload bytes of `in_hand`."""

    async def open(self) -> None:
        """Create (or re-create) the pull subscription bound to the durable consumer."""
        await self.close()
        self._sub = await self.wal.subscribe()
        self._stale = False
        if self._opened:
            self.stats.resubscribes += 1
        self._opened = True

    def invalidate(self) -> None:
        """Re-create the subscription before the next fetch (after a fetch error)."""
        self._stale = True

    async def restore_consumer(self) -> bool:
        """After a failed fetch: re-create the durable consumer if it is gone, with the
        configured settings; True when it was. The subscription is re-created before the
        next fetch either way.

        A deleted consumer does not show as such in nats-py: a fetch in flight returns
        empty (the server's 409 is swallowed) and later fetches fail with "no responders"
        (`ServiceUnavailableError`) forever, even after re-binding. Raises `StoreError`
        when the consumer cannot be read or created.
        """
        self.invalidate()
        if not await self.wal.ensure_consumer():
            return False
        self.stats.consumers_recreated += 1
        log.warning(
            "the durable consumer %r was deleted; created it again",
            self.config.consumer_name,
            extra={"action": "consumer_recreated", "consumer": self.config.consumer_name},
        )
        return True

    async def close(self) -> None:
        """Drop the subscription (best effort: the connection may be gone)."""
        sub, self._sub = self._sub, None
        if sub is not None:
            await sub.close()

    async def collect(
        self, should_stop: Callable[[], bool], busy: Callable[[], bool] = lambda: False
    ) -> None:
        """Fetch messages into `in_hand` for one collection window of `flush_interval_s`.

        One fetch waits for the window's first message (capped at `fetch_timeout_s`: a
        single fetch may stall for its whole timeout). Then, as long as windows do not
        fill (the usual case), the window waits without a pull request open and is
        drained at its end by one request the server answers with everything waiting,
        in one burst: a window costs two pull requests, and the flusher is woken a few
        times per window instead of once per message. After a window that filled
        `flush_batch_size`, the next streams instead: its pull request stays open and
        delivers what arrives (one more is opened when it is over), so it ends as soon
        as a whole batch is waiting. A batch is `flush_batch_size` messages or
        `flush_batch_bytes` of their payloads, whichever comes first (every fetch asks
        for about the bytes left, never less than one message of the largest size).
        Either way it ends early when `should_stop()` turns true (what is in hand is
        still returned, to be flushed). While `busy()` (the
        previous cycle still applies, so the next one could not start anyway) it goes on
        past `flush_interval_s`, streaming: a slow commit makes the next batch bigger
        instead of older, and it starts with what was written meanwhile. A fetch error
        after some messages arrived ends the window with those (the subscription is
        re-created next time); before any arrived it propagates, so the caller backs off.

        The messages stay in `in_hand` until the caller takes them with `take`.
        """
        if self._sub is None or self._stale or self._sub.stale:
            await self.open()
        assert self._sub is not None
        sub = self._sub
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.flush_interval_s
        batch_size = self.config.flush_batch_size
        streaming = self._streaming
        msgs = self.in_hand
        while not msgs and not should_stop():
            remaining = deadline - loop.time()
            if remaining < MIN_FETCH_TIMEOUT_S:
                if not busy():
                    return  # an empty window: the caller asks again
                remaining = BUSY_FETCH_TIMEOUT_S
            # Not streaming: a request for one message only, so none stays open once
            # the window has begun (what is queued already is all taken).
            first = batch_size if streaming or sub.waiting else 1
            self._add(await self._fetch(first, remaining))
        if streaming:
            await self._stream(sub, deadline, should_stop, busy)
        else:
            while not should_stop() and not self.full:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                await asyncio.sleep(min(remaining, FILL_CHECK_S))
            if busy():
                # Due while the previous cycle still applies: stream until it ends, so
                # the next cycle starts with everything written meanwhile.
                await self._stream(sub, deadline, should_stop, busy)
        if not self.full:
            try:
                if streaming or sub.pulling:  # what the open request delivered
                    self._add(await self._fetch(batch_size - len(msgs), MIN_FETCH_TIMEOUT_S))
                else:
                    self._add(await self._drain(sub))
            except Exception:
                self.invalidate()  # keep what is in hand; subscribe again next time
        self._streaming = self.full

    async def _drain(self, sub: Delivery) -> list[Delivered]:
        """Everything waiting (up to the rest of a batch), in one burst; no pull request
        is left open."""
        left = self.config.flush_batch_size - len(self.in_hand)
        return list(
            await sub.fetch(
                left, self.config.fetch_timeout_s, linger=False, max_bytes=self._bytes_left()
            )
        )

    async def _stream(
        self,
        sub: Delivery,
        deadline: float,
        should_stop: Callable[[], bool],
        busy: Callable[[], bool],
    ) -> None:
        """Fill the window from an open pull request until its end or a whole batch."""
        loop = asyncio.get_running_loop()
        batch_size = self.config.flush_batch_size
        msgs = self.in_hand
        while not should_stop() and not self.full:
            remaining = deadline - loop.time()
            if remaining > 0:
                if sub.waiting or (not sub.pulling and remaining >= FILL_CHECK_S):
                    # Take what was delivered meanwhile (no request), and keep a pull
                    # request open for the rest of the window: without one, what is
                    # written now would wait for the window's end.
                    self._add(await self._fetch(batch_size - len(msgs), remaining))
                    continue
                await asyncio.sleep(min(remaining, FILL_CHECK_S))
            elif busy():
                self._add(await self._fetch(batch_size - len(msgs), BUSY_FETCH_TIMEOUT_S))
            else:
                break

    def _add(self, fetched: list[Delivered]) -> None:
        self.in_hand.extend(fetched)
        self.bytes_in_hand += sum(len(m.data) for m in fetched)
        self.stats.fetched += len(fetched)

    @property
    def full(self) -> bool:
        """A whole batch is in hand: `flush_batch_size` messages or `flush_batch_bytes`."""
        return (
            len(self.in_hand) >= self.config.flush_batch_size
            or self.bytes_in_hand >= self.config.flush_batch_bytes
        )

    def _bytes_left(self) -> int:
        return max(1, self.config.flush_batch_bytes - self.bytes_in_hand)

    @property
    def subscription(self) -> Delivery | None:
        """The current subscription (None before `open` and after `close`)."""
        return self._sub

    def queued(self) -> list[Delivered]:
        """Messages delivered to the subscription and not fetched yet."""
        return list(self._sub.queued()) if self._sub is not None else []

    def take(self) -> list[Delivered]:
        """Hand the collected messages over (the caller now settles them)."""
        msgs, self.in_hand = self.in_hand, []
        self.bytes_in_hand = 0
        return msgs

    async def _fetch(self, count: int, remaining_s: float) -> list[Delivered]:
        assert self._sub is not None
        timeout = max(MIN_FETCH_TIMEOUT_S, min(remaining_s, self.config.fetch_timeout_s))
        return list(await self._sub.fetch(count, timeout, max_bytes=self._bytes_left()))
