"""The ports through which the engine reaches the WAL: a stream, key-value buckets and the
durable consumer's delivery. Protocols only, no I/O.

Two implementations hold to the same contract (tests/contracts): the NATS JetStream
adapter (`buffered_store.nats.NatsWal`) and an in-memory twin for tests without servers
(`buffered_store.testing.MemoryWal`). Failures surface as the store's own errors:
`ConflictError` for a compare-and-set that found something else, `WalUnavailableError`
when the server cannot be reached, `StoreError` for anything else it refused.

Sequences: the stream numbers every message from 1 (`StoredMsg.seq`, the *stream seq*);
a bucket's revision of a key is a sequence of the same kind, increasing across all keys
of the bucket, so "written after revision R" is meaningful between keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from buffered_store.config import EngineConfig


@dataclass(frozen=True, slots=True)
class StoredMsg:
    """A message read back from the stream (or a bucket: `subject` is then the key)."""

    seq: int
    subject: str
    data: bytes


@dataclass(frozen=True, slots=True)
class AgedValue:
    """A hot key's value with its revision and when it was written (Unix seconds)."""

    key: str
    value: bytes
    revision: int
    written_at: float


@dataclass(frozen=True, slots=True)
class KvValue:
    """A key's value with its revision (for compare-and-set)."""

    value: bytes
    revision: int


@dataclass(frozen=True, slots=True)
class ConsumerState:
    """The durable consumer and the stream it reads, as the server reports them."""

    num_pending: int
    """Messages not delivered yet."""
    num_ack_pending: int
    """Messages delivered and not acknowledged yet."""
    num_redelivered: int
    """Messages delivered more than once and not acknowledged yet."""
    ack_floor: int
    """Stream seq below which every message is acknowledged (0: none is)."""
    last_seq: int
    """The stream's last seq."""
    messages: int
    """Messages the stream holds."""
    first_seq: int = 0
    """The stream's first seq (everything below was removed: trimmed or expired)."""
    bytes: int = 0
    """Bytes the stream holds, as the server counts them (payloads, subjects, headers)."""


class Delivered(Protocol):
    """A message the durable consumer handed to one flusher; settle it exactly once."""

    @property
    def subject(self) -> str: ...
    @property
    def data(self) -> bytes: ...
    @property
    def stream_seq(self) -> int: ...
    @property
    def num_delivered(self) -> int:
        """Deliveries so far, 1 on the first."""
        ...

    async def ack(self) -> None:
        """Done with it: never delivered again."""
        ...

    async def nak(self, delay_s: float | None = None) -> None:
        """Deliver it again (after `delay_s`, or at once)."""
        ...

    async def term(self) -> None:
        """Never deliver it again, without having processed it."""
        ...

    async def in_progress(self) -> None:
        """Still working on it: restart its ack timer."""
        ...


class Delivery(Protocol):
    """One flusher's subscription to the durable consumer."""

    @property
    def stale(self) -> bool:
        """The subscription must be created again (the connection was re-established,
        and the server forgot its outstanding pull requests)."""
        ...

    async def fetch(
        self, count: int, timeout_s: float, *, linger: bool = True, max_bytes: int = 0
    ) -> Sequence[Delivered]:
        """Up to `count` messages, waiting at most `timeout_s` (none arrived: empty).
        With `linger` False: only those waiting now, and no pull request is left open.
        With `max_bytes`: no more messages once their payloads reach that many bytes
        (the first always comes, whatever its size), and no request the server answers
        asks for much more."""
        ...

    @property
    def waiting(self) -> int:
        """How many messages `queued` holds."""
        ...

    @property
    def pulling(self) -> bool:
        """Messages arriving now reach `queued` without another `fetch` (a pull request
        is open), or the subscription needs none: the next `fetch` takes all there is."""
        ...

    def queued(self) -> Sequence[Delivered]:
        """Messages already delivered to this subscription and not fetched yet (their
        ack timers run, so a holder keeps them alive with the ones it fetched)."""
        ...

    async def close(self) -> None:
        """Drop the subscription (best effort)."""
        ...


class Bucket(Protocol):
    """A key-value bucket keeping the latest value of each key."""

    async def get(self, key: str) -> KvValue | None:
        """A key's value and revision, or None when absent or deleted."""
        ...

    async def create(self, key: str, value: bytes) -> int:
        """Write a key that does not exist; `ConflictError` when it does."""
        ...

    async def swap(self, key: str, value: bytes, *, revision: int | None) -> int:
        """Compare-and-set: write if the key is at `revision` (None: absent); returns the
        new revision, `ConflictError` when the key moved meanwhile."""
        ...

    async def put(self, key: str, value: bytes) -> int:
        """Unconditional write; returns the new revision."""
        ...

    async def delete(self, key: str) -> None:
        """Delete a key (absent keys are fine)."""
        ...

    async def keys(self) -> list[str]:
        """Every live key."""
        ...


class Wal(Protocol):
    """The WAL stream, the hot bucket, the quarantine bucket and the durable consumer."""

    config: EngineConfig
    requests: int
    """Requests sent to the server so far (each one round trip)."""

    @property
    def max_payload(self) -> int:
        """Largest message the server accepts, in bytes."""
        ...

    @property
    def quarantine(self) -> Bucket:
        """The quarantine bucket."""
        ...

    async def close(self) -> None:
        """Finish what is in flight and let go of the server."""
        ...

    # -- stream ---------------------------------------------------------------------------

    async def publish(
        self, subject: str, payload: bytes, *, msg_id: str, expected_last_subject_seq: int
    ) -> tuple[int, bool]:
        """Append if the subject's last message is at `expected_last_subject_seq` (0: the
        subject is empty); returns (stream seq, duplicate). A publish with a `msg_id`
        seen within the duplicate window is not stored again (duplicate is True and the
        stream seq is the first copy's). `ConflictError` when the expectation fails;
        servers check it before deduplicating."""
        ...

    async def append(self, subject: str, payload: bytes) -> int:
        """Append without any expectation (operators' and tests' tool); the stream seq."""
        ...

    async def get(self, seq: int) -> StoredMsg | None:
        """The message at a stream seq, or None when absent."""
        ...

    async def last_on(self, subject: str) -> StoredMsg | None:
        """The last message on a subject, or None."""
        ...

    async def next_on(self, subject: str, from_seq: int) -> StoredMsg | None:
        """The first message on a subject at or after a stream seq, or None."""
        ...

    async def get_many(self, seqs: Sequence[int], *, parallel: int = 64) -> list[StoredMsg]:
        """Messages at several stream seqs (absent ones skipped), in the order asked."""
        ...

    async def read_subject(self, subject: str, from_seq: int) -> list[StoredMsg]:
        """Every message on a subject at or after a stream seq, in stream order, in a few
        round trips however many there are."""
        ...

    async def read_range(self, first: int, last: int) -> list[StoredMsg]:
        """Messages with stream seq in ``[first, last]``, in stream order."""
        ...

    async def last_seq(self) -> int:
        """The stream's last seq (0: empty)."""
        ...

    async def purge_below(self, seq: int) -> None:
        """Remove every message with a stream seq below `seq`, in one request (the
        flushers' trimming of flushed entries)."""
        ...

    # -- the durable consumer ---------------------------------------------------------------

    async def tail_bounds(self) -> tuple[int, int]:
        """(first unacknowledged stream seq, last stream seq): every unflushed entry lies
        in that range (so may some acked out of order)."""
        ...

    async def consumer_state(self) -> ConsumerState:
        """The durable consumer's counters."""
        ...

    async def ensure_consumer(self) -> bool:
        """Create the durable consumer if it is missing; True when it had to be."""
        ...

    async def subscribe(self) -> Delivery:
        """A new subscription to the durable consumer."""
        ...

    # -- the hot bucket -----------------------------------------------------------------------

    async def kv_get(self, key: str) -> KvValue | None:
        """A hot key's value and revision, or None."""
        ...

    async def kv_get_many(self, keys: Sequence[str]) -> list[KvValue | None]:
        """Several hot keys, in the order asked."""
        ...

    async def kv_swap(self, key: str, value: bytes, *, revision: int | None) -> int:
        """Compare-and-set a hot key (see `Bucket.swap`)."""
        ...

    async def kv_put(self, key: str, value: bytes) -> int:
        """Unconditional write of a hot key."""
        ...

    async def kv_delete(self, key: str) -> None:
        """Delete a hot key."""
        ...

    async def hot_oldest(self, prefix: str, limit: int) -> list[AgedValue]:
        """Live hot keys starting with `prefix`, least recently written first, at most
        `limit` (fewer when the oldest revisions of the bucket belong to other keys)."""
        ...

    async def kv_forget(self, key: str, revision: int) -> bool:
        """Remove a hot key whose last write is at `revision`, leaving no delete marker
        behind (two requests); False, removing nothing, when it was written since."""
        ...

    async def hot_updates(self, prefix: str, from_seq: int) -> list[StoredMsg]:
        """The latest value of every hot key starting with `prefix` whose revision is at
        or after `from_seq`, in revision order (`StoredMsg.subject` is the key)."""
        ...
