"""The stream side of the WAL: appends (the write path's compare-and-set publish),
reads of single messages and ranges, trimming, and the flusher's durable consumer (its
state, its activity, and the subscription that delivers it)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime

import nats.js.errors as jse

from buffered_store.engine.ports import ConsumerState, StoredMsg
from buffered_store.nats.delivery import NatsDelivery
from buffered_store.nats.errors import raise_translated, translated
from buffered_store.nats.handles import EXPECTED_LAST_SUBJECT_SEQ, MSG_ID, WalHandles
from buffered_store.nats.scan import scan_by_consumer, stored_msg


class WalStream(WalHandles):
    """The WAL stream and its durable consumer (part of `NatsWal`)."""

    async def publish(
        self, subject: str, payload: bytes, *, msg_id: str, expected_last_subject_seq: int
    ) -> tuple[int, bool]:
        """Append with a per-subject compare-and-set; returns (stream seq, duplicate).

        Raises `ConflictError` when another entry is now the last one on the subject.
        """
        headers = {MSG_ID: msg_id, EXPECTED_LAST_SUBJECT_SEQ: str(expected_last_subject_seq)}
        try:
            return await self._js_publish(subject, payload, headers)
        except Exception as exc:  # `translated`, minus a context manager per append
            raise_translated(exc, lambda: f"publish {subject}")

    async def get(self, seq: int) -> StoredMsg | None:
        """The message at a stream seq, or None when absent."""
        async with translated(f"get message {seq}"):
            try:
                raw = await self._js.get_msg(self.stream, seq=seq, direct=self.direct)
            except jse.NotFoundError:
                return None
        return stored_msg(raw)

    async def last_on(self, subject: str) -> StoredMsg | None:
        """The last message on a subject, or None."""
        async with translated(f"get last message of {subject}"):
            try:
                raw = await self._js.get_last_msg(self.stream, subject, direct=self.direct)
            except jse.NotFoundError:
                return None
        return stored_msg(raw)

    async def next_on(self, subject: str, from_seq: int) -> StoredMsg | None:
        """The first message on a subject at or after a stream seq, or None."""
        async with translated(f"get next message of {subject}"):
            try:
                raw = await self._js.get_msg(
                    self.stream,
                    seq=max(1, from_seq),
                    subject=subject,
                    next=True,
                    direct=self.direct,
                )
            except jse.NotFoundError:
                return None
        return stored_msg(raw)

    async def read_range(self, first: int, last: int) -> list[StoredMsg]:
        """The WAL's messages with stream seq in ``[first, last]``, in stream order.

        One short-lived consumer delivers them in batches of `SCAN_BATCH`: a round trip
        per batch instead of one direct get per message (where reads go to the leader,
        what the consumer's replica had not applied yet is read from the leader after).
        """
        if last < first:
            return []
        return await self._scan(f"read WAL messages {first}..{last}", None, first, last)

    async def read_subject(self, subject: str, from_seq: int) -> list[StoredMsg]:
        """Every message on a subject at or after a stream seq, in stream order: one
        short-lived consumer filtered on the subject (made, pulled in batches of
        `SCAN_BATCH`, deleted), not a direct get per message (where reads go to the
        leader, what the consumer's replica had not applied yet is read from the leader
        after)."""
        return await self._scan(
            f"read the messages of {subject} from {from_seq}", subject, from_seq
        )

    async def _scan(
        self, what: str, subject: str | None, first: int, last: int = 0
    ) -> list[StoredMsg]:
        """`scan_by_consumer` of the stream (`subject`: None for all), errors translated."""
        async with translated(what):
            return await scan_by_consumer(
                self._js,
                self._nc,
                self.stream,
                subject,
                max(1, first),
                "",
                last=last,
                timeout_s=self.config.request_timeout_s,
                leader=not self.direct,
            )

    async def get_many(self, seqs: Sequence[int], *, parallel: int = 64) -> list[StoredMsg]:
        """Messages at several stream seqs (absent ones skipped), fetched concurrently."""
        out: list[StoredMsg] = []
        for start in range(0, len(seqs), parallel):
            chunk = await asyncio.gather(*(self.get(s) for s in seqs[start : start + parallel]))
            out.extend(m for m in chunk if m is not None)
        return out

    async def tail_bounds(self) -> tuple[int, int]:
        """(first unacknowledged stream seq, last stream seq) of the flusher consumer.

        Everything not yet flushed lies in that range; so may some flushed entries acked
        out of order, which readers drop by comparing with the watermarks.
        """
        state = await self.consumer_state()
        return state.ack_floor + 1, state.last_seq

    async def append(self, subject: str, payload: bytes) -> int:
        """Append without any expectation; the stream seq."""
        async with translated(f"publish {subject}"):
            ack = await self._js.publish(subject, payload, stream=self.stream)
        return int(ack.seq)

    async def last_seq(self) -> int:
        """The stream's last seq (0: empty)."""
        async with translated("read the stream state"):
            info = await self._js.stream_info(self.stream)
        return int(info.state.last_seq)

    async def purge_below(self, seq: int) -> None:
        """Remove every message below stream seq `seq` (one purge request)."""
        if seq <= 1:
            return
        async with translated(f"trim the WAL below {seq}"):
            await self._js.purge_stream(self.stream, seq=seq)

    async def consumer_state(self) -> ConsumerState:
        """The durable consumer's counters and the stream's last seq."""
        async with translated("read the flusher consumer"):
            consumer, stream = await asyncio.gather(
                self._js.consumer_info(self.stream, self.config.consumer_name),
                self._js.stream_info(self.stream),
            )
        return ConsumerState(
            num_pending=int(consumer.num_pending or 0),
            num_ack_pending=int(consumer.num_ack_pending or 0),
            num_redelivered=int(consumer.num_redelivered or 0),
            ack_floor=int(consumer.ack_floor.stream_seq or 0) if consumer.ack_floor else 0,
            last_seq=int(stream.state.last_seq),
            messages=int(stream.state.messages),
            first_seq=int(stream.state.first_seq),
            bytes=int(stream.state.bytes),
        )

    async def consumer_activity(self) -> tuple[int, float | None]:
        """(pull requests waiting on the durable consumer, seconds since it last
        delivered a message or had one acknowledged; None: never): whether a flusher
        consumes it, as the server sees it."""
        async with translated("read the flusher consumer"):
            info = await self._js.consumer_info(self.stream, self.config.consumer_name)
        stamps = [
            seq.last_active
            for seq in (info.delivered, info.ack_floor)
            if seq is not None and seq.last_active is not None
        ]
        idle = None
        if stamps:
            now = datetime.now(UTC)
            idle = max(0.0, (now - max(stamps)).total_seconds())
        return int(info.num_waiting or 0), idle

    async def subscribe(self) -> NatsDelivery:
        """A pull subscription bound to the durable consumer; the connection then parses
        headers as a bulk receiver does (`receive_in_bulk`): every entry carries two."""
        self.receive_in_bulk()
        reconnects = self.reconnects
        async with translated("bind to the flusher consumer"):
            return await NatsDelivery.open(
                self._nc,
                self.stream,
                self.config.consumer_name,
                lambda: self.reconnects != reconnects,
            )
