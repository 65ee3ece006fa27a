"""Messages a flush cycle holds, grouped per thread, and how they are given back.

Every message is settled exactly once (ack, nak or term): `Held.settled` guards against
settling twice, which nats-py would reject, and against forgetting one, because a cycle
naks whatever is still unsettled when it ends.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from buffered_store.engine.entries import Entry
from buffered_store.engine.ports import Delivered
from flusher.policy import HeldSeq, Settle
from flusher.stats import FlusherStats

log = logging.getLogger("flusher")


@dataclass(eq=False, slots=True)
class Held:
    """A fetched message the cycle holds, with its entry once decoded."""

    msg: Delivered
    entry: Entry | None = None
    settled: bool = False

    @property
    def num_delivered(self) -> int:
        """Deliveries of the message so far (1 on the first)."""
        return self.msg.num_delivered


@dataclass(eq=False, slots=True)
class ThreadWork:
    """A thread's held messages and the entries fetched for it from the stream."""

    thread_id: str
    held: list[Held]
    fetched: dict[int, Entry] = field(default_factory=dict)

    def unsettled(self) -> list[Held]:
        """Held messages not yet acked, nak'ed or terminated."""
        return [h for h in self.held if not h.settled]

    def batch(self) -> list[Entry]:
        """Entries to apply: unsettled held ones and fetched ones, by seq, deduplicated."""
        by_seq = dict(self.fetched)
        for held in self.unsettled():
            assert held.entry is not None
            by_seq.setdefault(held.entry.seq, held.entry)
        return [by_seq[seq] for seq in sorted(by_seq)]

    def seqs(self) -> list[HeldSeq]:
        """What `plan_outcome` needs to know of the unsettled held messages."""
        return [
            HeldSeq(h.entry.seq, h.entry.stream_seq, h.num_delivered)
            for h in self.unsettled()
            if h.entry is not None
        ]

    def forget_upto(self, watermark: int) -> None:
        """Drop fetched entries the target already holds."""
        self.fetched = {seq: e for seq, e in self.fetched.items() if seq > watermark}


class Settler:
    """Sends acks, naks and terms, counting them."""

    def __init__(self, stats: FlusherStats) -> None:
        self.stats = stats

    async def all(self, held: Sequence[Held], action: Settle, delay_s: float = 0.0) -> None:
        """Settle every message of `held` not settled yet, one after the other: settling
        only queues a publish on the client (no round trip), so a task per message
        would cost more than the publish itself."""
        for h in held:
            if not h.settled:
                await self.one(h, action, delay_s)

    async def one(self, held: Held, action: Settle, delay_s: float = 0.0) -> None:
        """Settle one message (a nak redelivers it after `delay_s`)."""
        if held.settled:
            return
        held.settled = True  # never twice, even when sending fails
        try:
            if action is Settle.ACK:
                await held.msg.ack()
                self.stats.acked += 1
            elif action is Settle.NAK:
                await held.msg.nak(delay_s or None)
                self.stats.naked += 1
            else:
                await held.msg.term()
        except Exception as exc:
            # The server redelivers after ack_wait; a redelivered entry comes back STALE
            # or is applied then, so a lost ack costs time, never data.
            self.stats.nats_errors += 1
            log.debug(
                "could not %s a message: %r", action.value, exc, extra={"action": "settle_failed"}
            )
