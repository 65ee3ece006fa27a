"""`MemoryWal`: the engine's `Wal` port in memory, the twin of `buffered_store.nats.NatsWal`.

One `MemoryWal` is one client ("connection") of a `MemoryJetStream`; several on one
server behave like store instances and flushers sharing a NATS server. The semantics are
the server's (see `buffered_store.testing.jetstream`), and the contract tests in
tests/contracts run the same assertions against both implementations.

`requests` counts round trips as `NatsWal` counts them: one per stream or KV read or
write, two for `consumer_state`, none for fetches and acks (which are no requests on
NATS either). Every call gives the event loop a turn before it acts, as a round trip
would, so concurrent callers interleave.

Faults, besides the server's (`MemoryJetStream.available`, `delete_consumer`):
`lose_publish_replies(n)` makes the next publishes land and then fail as if their reply
was lost; `reconnect()` marks the subscriptions of this client stale.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence

from buffered_store.config import EngineConfig
from buffered_store.engine.ports import AgedValue, ConsumerState, KvValue, StoredMsg
from buffered_store.errors import (
    ConflictError,
    PayloadTooLargeError,
    StoreClosedError,
    WalObjectMissingError,
    WalUnavailableError,
)
from buffered_store.testing.jetstream import (
    MemoryConsumer,
    MemoryJetStream,
    MemoryKv,
    check_key,
)


class MemoryWal:
    """The WAL stream, hot bucket, quarantine bucket and durable consumer in memory.

    Args:
        config: names and settings, as for `NatsWal` (``nats_url`` is not used). The
            stream, buckets and consumer are created on `server` when missing.
        server: the shared server state; a fresh one by default.
    """

    def __init__(self, config: EngineConfig, server: MemoryJetStream | None = None) -> None:
        self.config = config
        self.server = server if server is not None else MemoryJetStream()
        self.requests = 0
        """Requests sent to the server so far (each one round trip)."""
        self._stream = self.server.open_stream(config)
        self._hot = self.server.open_bucket(config.hot_bucket)
        self._quarantine = MemoryBucket(
            self, self.server.open_bucket(config.quarantine_bucket), "quarantine bucket"
        )
        self.server.ensure_consumer(config)
        self.reconnects = 0
        """Times this client "re-established its connection" (see `reconnect`)."""
        self._closed = False
        self._lost_replies = 0

    # -- faults ---------------------------------------------------------------------------

    def lose_publish_replies(self, n: int = 1) -> None:
        """The next `n` calls of `publish` reach the server (and land, if they may) but
        raise `WalUnavailableError`, as a publish whose reply timed out."""
        if n < 0:
            raise ValueError("n must be >= 0")
        self._lost_replies = n

    def reconnect(self) -> None:
        """Pretend the connection was re-established: existing subscriptions turn stale."""
        self.reconnects += 1

    def delete_consumer(self) -> bool:
        """Delete the durable consumer on the server (as an operator); True if it existed."""
        return self.server.delete_consumer(self.config.stream_name, self.config.consumer_name)

    async def _request(self, what: str, count: int = 1) -> None:
        """One round trip: counted, a turn of the event loop, then the server must answer."""
        self.requests += count
        await asyncio.sleep(0)
        self.check_reachable(what)

    def check_reachable(self, what: str) -> None:
        """Raise `WalUnavailableError` when closed or when the server is down."""
        if self._closed:
            raise WalUnavailableError(f"{what}: the connection is closed")
        if not self.server.available:
            raise WalUnavailableError(f"{what}: the server is unavailable")

    def _check_size(self, what: str, payload: bytes) -> None:
        if len(payload) > self.max_payload:
            raise PayloadTooLargeError(
                f"{what}: {len(payload)} bytes exceed the server's max_payload ({self.max_payload})"
            )

    # -- the Wal port -----------------------------------------------------------------------

    @property
    def max_payload(self) -> int:
        """Largest message the server accepts, in bytes."""
        return self.server.max_payload

    @property
    def quarantine(self) -> MemoryBucket:
        """The quarantine bucket."""
        return self._quarantine

    async def close(self) -> None:
        """Let go of the server: every later call raises `WalUnavailableError`."""
        self._closed = True
        self.server.notify()

    async def publish(
        self, subject: str, payload: bytes, *, msg_id: str, expected_last_subject_seq: int
    ) -> tuple[int, bool]:
        """Append with a per-subject compare-and-set, deduplicated by `msg_id` (see
        `engine.ports.Wal.publish`); (stream seq, duplicate)."""
        what = f"publish {subject}"
        self._check_size(what, payload)
        await self._request(what)
        self._check_captured(what, subject)
        lost, self._lost_replies = self._lost_replies > 0, max(0, self._lost_replies - 1)
        try:
            seq, duplicate = self._stream.publish(
                subject,
                payload,
                msg_id=msg_id,
                expected=expected_last_subject_seq,
                now=self.server.now(),
            )
        except ConflictError:
            if lost:
                raise WalUnavailableError(f"{what}: the reply was lost") from None
            raise
        self.server.notify()
        if lost:
            raise WalUnavailableError(f"{what}: the reply was lost after the message landed")
        return seq, duplicate

    def _check_captured(self, what: str, subject: str) -> None:
        if not self._stream.captures(subject):
            # NATS: no stream listens, the request gets "no responders".
            raise WalUnavailableError(f"{what}: no stream captures the subject")

    async def append(self, subject: str, payload: bytes) -> int:
        """Append without any expectation; the stream seq."""
        what = f"publish {subject}"
        self._check_size(what, payload)
        await self._request(what)
        self._check_captured(what, subject)
        seq = self._stream.store(subject, payload)
        self.server.notify()
        return seq

    async def get(self, seq: int) -> StoredMsg | None:
        """The message at a stream seq, or None when absent."""
        await self._request(f"get message {seq}")
        return self._stream.messages.get(seq)

    async def last_on(self, subject: str) -> StoredMsg | None:
        """The last message on a subject, or None."""
        await self._request(f"get last message of {subject}")
        return self._stream.last_on(subject)

    async def next_on(self, subject: str, from_seq: int) -> StoredMsg | None:
        """The first message on a subject at or after a stream seq, or None."""
        await self._request(f"get next message of {subject}")
        return self._stream.next_on(subject, max(1, from_seq))

    async def read_subject(self, subject: str, from_seq: int) -> list[StoredMsg]:
        """Every message on a subject at or after a stream seq, in stream order."""
        # NatsWal: a short-lived consumer, created and deleted (fetches are no requests).
        await self._request(f"read the messages of {subject} from {from_seq}", count=2)
        return [
            msg
            for seq, msg in sorted(self._stream.messages.items())
            if seq >= from_seq and msg.subject == subject
        ]

    async def get_many(self, seqs: Sequence[int], *, parallel: int = 64) -> list[StoredMsg]:
        """Messages at several stream seqs (absent ones skipped), in the order asked."""
        found = await asyncio.gather(*(self.get(seq) for seq in seqs))
        return [msg for msg in found if msg is not None]

    async def read_range(self, first: int, last: int) -> list[StoredMsg]:
        """Messages with stream seq in ``[first, last]``, in stream order."""
        if last < first:
            return []
        # NatsWal: a short-lived consumer, created and deleted (fetches are no requests).
        await self._request(f"read WAL messages {first}..{last}", count=2)
        messages = self._stream.messages
        seqs = range(max(1, first), min(last, self._stream.last_seq) + 1)
        return [messages[s] for s in seqs if s in messages]

    async def last_seq(self) -> int:
        """The stream's last seq (0: empty)."""
        await self._request("read the stream state")
        return self._stream.last_seq

    # -- the durable consumer -----------------------------------------------------------------

    def _consumer(self, what: str) -> MemoryConsumer:
        consumer = self.server.consumer(self.config.stream_name, self.config.consumer_name)
        if consumer is None:
            raise WalObjectMissingError(f"{what}: consumer {self.config.consumer_name!r} not found")
        return consumer

    async def tail_bounds(self) -> tuple[int, int]:
        """(first unacknowledged stream seq, last stream seq)."""
        state = await self.consumer_state()
        return state.ack_floor + 1, state.last_seq

    async def consumer_state(self) -> ConsumerState:
        """The durable consumer's counters (two requests, as on NATS)."""
        await self._request("read the flusher consumer", count=2)
        consumer = self._consumer("read the flusher consumer")
        return ConsumerState(
            num_pending=consumer.num_pending,
            num_ack_pending=len(consumer.unacked),
            num_redelivered=consumer.num_redelivered,
            ack_floor=consumer.ack_floor,
            last_seq=self._stream.last_seq,
            messages=len(self._stream.messages),
            first_seq=self._stream.first_seq,
            bytes=self._stream.bytes,
        )

    async def purge_below(self, seq: int) -> None:
        """Remove every message below stream seq `seq` (one request)."""
        await self._request(f"trim the WAL below {seq}")
        self._stream.purge_below(seq)
        self.server.notify()

    async def ensure_consumer(self) -> bool:
        """Create the durable consumer if it is missing; True when it had to be."""
        await self._request("re-create the flusher consumer")
        if self.server.consumer(self.config.stream_name, self.config.consumer_name):
            return False
        self.requests += 2  # NatsWal: looks again, then adds it
        return self.server.ensure_consumer(self.config)

    async def subscribe(self) -> MemoryDelivery:
        """A new subscription to the durable consumer (no request: a bind is a SUB)."""
        await asyncio.sleep(0)
        self.check_reachable("bind to the flusher consumer")
        return MemoryDelivery(self)

    # -- the hot bucket -------------------------------------------------------------------------

    async def kv_get(self, key: str) -> KvValue | None:
        """A hot key's value and revision, or None when absent or deleted."""
        return await _kv_get(self, self._hot, key)

    async def kv_get_many(self, keys: Sequence[str]) -> list[KvValue | None]:
        """Several hot keys, in the order asked."""
        return list(await asyncio.gather(*(self.kv_get(key) for key in keys)))

    async def kv_swap(self, key: str, value: bytes, *, revision: int | None) -> int:
        """Compare-and-set a hot key on its revision (None: it must be absent)."""
        return await _kv_swap(self, self._hot, key, value, revision)

    async def kv_put(self, key: str, value: bytes) -> int:
        """Unconditional write of a hot key; the new revision."""
        return await _kv_write(self, self._hot, f"put {key}", key, value)

    async def kv_delete(self, key: str) -> None:
        """Delete a hot key (writes a delete marker)."""
        await _kv_write(self, self._hot, f"delete {key}", key, None)

    async def hot_oldest(self, prefix: str, limit: int) -> list[AgedValue]:
        """The least recently written live hot keys under `prefix`, at most `limit`;
        `written_at` on the server's clock (`MemoryJetStream.now`)."""
        await self._request("scan the oldest hot records", count=2)
        out: list[AgedValue] = []
        for key, (revision, value) in self._hot.latest.items():
            if len(out) == limit:
                break
            if value is not None and key.startswith(prefix):
                # Unix time, as the server reports it: the age on the server's clock.
                age_s = self.server.now() - self._hot.written_at.get(key, 0.0)
                out.append(AgedValue(key, value, revision, time.time() - age_s))
        return out

    async def kv_forget(self, key: str, revision: int) -> bool:
        """Remove a hot key at `revision`, leaving no marker (two requests)."""
        check_key(key)
        await self._request(f"forget {key}", count=2)
        forgotten = self._hot.forget(key, revision)
        self.server.notify()
        return forgotten

    async def hot_updates(self, prefix: str, from_seq: int) -> list[StoredMsg]:
        """The latest value of every live hot key under `prefix` (whole tokens: empty or
        ending with a dot, as the subject filter ``<prefix>>`` on the server) whose
        revision is at least `from_seq`, in revision order."""
        found, read = self._hot.scan(prefix, max(1, from_seq))
        # NatsWal: a direct get per message (markers included) and one that finds none;
        # past 8, a short-lived consumer (created and deleted) reads the rest.
        await self._request(f"scan hot records from {from_seq}", count=_scan_requests(read))
        return found


def _scan_requests(read: int) -> int:
    direct_gets = 8
    return read + 1 if read < direct_gets else direct_gets + 2


async def _kv_get(wal: MemoryWal, kv: MemoryKv, key: str) -> KvValue | None:
    check_key(key)
    await wal._request(f"read {key}")
    found = kv.get(key)
    return KvValue(found[1], found[0]) if found else None


async def _kv_write(wal: MemoryWal, kv: MemoryKv, what: str, key: str, value: bytes | None) -> int:
    check_key(key)
    if value is not None:
        wal._check_size(what, value)
    await wal._request(what)
    revision = kv.write(key, value, now=wal.server.now())
    wal.server.notify()
    return revision


async def _kv_swap(
    wal: MemoryWal, kv: MemoryKv, key: str, value: bytes, revision: int | None
) -> int:
    check_key(key)
    what = f"update {key}" if revision is not None else f"create {key}"
    wal._check_size(what, value)
    await wal._request(what)
    last = kv.last_revision(key)
    if revision is None and last != 0:
        # nats-py's create: the write on revision 0 fails, a get tells a delete marker
        # from a live key, and a deleted key is written on the marker's revision.
        wal.requests += 1
        if kv.get(key) is not None:
            raise ConflictError(f"{what}: the key exists")
        wal.requests += 1
        revision = last
    written = kv.write(key, value, expected=revision or 0, now=wal.server.now())
    wal.server.notify()
    return written


class MemoryBucket:
    """A KV bucket of a `MemoryWal` (the engine's `Bucket` port)."""

    def __init__(self, wal: MemoryWal, kv: MemoryKv, what: str) -> None:
        self._wal = wal
        self._kv = kv
        self._what = what

    async def get(self, key: str) -> KvValue | None:
        """A key's value and revision, or None when absent or deleted."""
        return await _kv_get(self._wal, self._kv, key)

    async def create(self, key: str, value: bytes) -> int:
        """Write a key that does not exist; `ConflictError` when it does."""
        return await _kv_swap(self._wal, self._kv, key, value, None)

    async def swap(self, key: str, value: bytes, *, revision: int | None) -> int:
        """Compare-and-set on the key's revision (None: absent); the new revision."""
        return await _kv_swap(self._wal, self._kv, key, value, revision)

    async def put(self, key: str, value: bytes) -> int:
        """Unconditional write; the new revision."""
        return await _kv_write(self._wal, self._kv, f"put {key} in the {self._what}", key, value)

    async def delete(self, key: str) -> None:
        """Delete a key (absent is fine: a marker is written either way)."""
        await _kv_write(self._wal, self._kv, f"delete {key} in the {self._what}", key, None)

    async def keys(self) -> list[str]:
        """Every live key, in revision order."""
        await self._wal._request(f"list the {self._what}")
        return [key for key, (_, value) in self._kv.latest.items() if value is not None]


class MemoryDelivered:
    """A message delivered by the durable consumer (the engine's `Delivered`).

    Settling it while the server is unavailable raises `WalUnavailableError` and changes
    nothing (the message comes back after the ack wait, as a lost ack would). Settling a
    message of a consumer deleted since is a no-op.
    """

    __slots__ = ("_consumer", "_wal", "data", "num_delivered", "stream_seq", "subject")

    def __init__(
        self, wal: MemoryWal, consumer: MemoryConsumer, msg: StoredMsg, deliveries: int
    ) -> None:
        self._wal = wal
        self._consumer = consumer
        self.subject = msg.subject
        self.data = msg.data
        self.stream_seq = msg.seq
        self.num_delivered = deliveries

    def _live(self, what: str) -> MemoryConsumer | None:
        self._wal.check_reachable(what)
        config = self._wal.config
        live = self._wal.server.consumer(config.stream_name, config.consumer_name)
        return live if live is self._consumer else None

    async def ack(self) -> None:
        """Done with it: never delivered again."""
        consumer = self._live("ack")
        if consumer is not None:
            consumer.settle(self.stream_seq)
            self._wal.server.notify()

    async def nak(self, delay_s: float | None = None) -> None:
        """Deliver it again, after `delay_s` when given."""
        consumer = self._live("nak")
        if consumer is not None:
            consumer.nak(self.stream_seq, self._wal.server.now() + (delay_s or 0.0))
            self._wal.server.notify()

    async def term(self) -> None:
        """Never deliver it again, without having processed it."""
        consumer = self._live("term")
        if consumer is not None:
            consumer.settle(self.stream_seq)
            self._wal.server.notify()

    async def in_progress(self) -> None:
        """Still working on it: its ack wait starts again."""
        consumer = self._live("in progress")
        if consumer is not None:
            consumer.touch(self.stream_seq, self._wal.server.now())
            self._wal.server.notify()


class MemoryDelivery:
    """One subscription of a `MemoryWal` to the durable consumer (the engine's `Delivery`)."""

    def __init__(self, wal: MemoryWal) -> None:
        self._wal = wal
        self._reconnects = wal.reconnects
        self._closed = False

    @property
    def stale(self) -> bool:
        """`MemoryWal.reconnect()` was called since the subscription was made."""
        return self._wal.reconnects != self._reconnects

    @property
    def waiting(self) -> int:
        """Always 0 (see `queued`)."""
        return 0

    def queued(self) -> list[MemoryDelivered]:
        """None: the in-memory consumer hands messages over only when fetched."""
        return []

    @property
    def pulling(self) -> bool:
        """Always True: nothing needs to stay open, a fetch takes all there is."""
        return True

    async def fetch(
        self, count: int, timeout_s: float, *, linger: bool = True, max_bytes: int = 0
    ) -> list[MemoryDelivered]:
        """Up to `count` messages: those available at once, else the first ones to become
        available (published, nak'ed, or past their ack wait) within `timeout_s` (with
        `linger` False: none then); none: empty. `WalUnavailableError` when the server
        is down or the consumer missing; a fetch waiting while the consumer is deleted
        returns empty, as on NATS."""
        if self._closed:
            raise StoreClosedError("fetch from the flusher consumer: the subscription is closed")
        if count < 1:
            return []
        wal, server, config = self._wal, self._wal.server, self._wal.config
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        wal.check_reachable("fetch from the flusher consumer")
        first = server.consumer(config.stream_name, config.consumer_name)
        if first is None:
            raise WalUnavailableError(
                f"fetch from the flusher consumer: {config.consumer_name!r} not found"
            )
        await asyncio.sleep(0)
        while True:
            wal.check_reachable("fetch from the flusher consumer")
            changed = server.changed()
            if server.consumer(config.stream_name, config.consumer_name) is not first:
                return []  # deleted (and maybe created again) meanwhile
            now = server.now()
            taken = first.take(count, now, max_bytes)
            if taken:
                return [MemoryDelivered(wal, first, msg, n) for msg, n in taken]
            remaining = deadline - loop.time()
            if remaining <= 0 or not linger:
                return []
            due = first.next_due()  # an unacked message comes back then
            wait = remaining if due is None else min(remaining, due - now)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(wait, 0.0)):
                    await changed.wait()

    async def close(self) -> None:
        """Drop the subscription."""
        self._closed = True
