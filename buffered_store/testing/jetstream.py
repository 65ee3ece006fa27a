"""`MemoryJetStream`: the server side of the in-memory WAL, shared by `MemoryWal`s.

What a JetStream server keeps for this project, and the rules it applies, without I/O:
streams (per-subject compare-and-set, a message-id deduplication window), KV buckets
keeping one value per key (revisions are the bucket stream's sequences, delete markers
included) and durable pull consumers with explicit acks (ack wait, nak delays,
`max_ack_pending`, ack floor). `buffered_store.testing.wal.MemoryWal` is the client side;
several of them on one `MemoryJetStream` behave like processes sharing one server.

Time is the server's own clock: `time.monotonic()` plus what `advance()` added, so a test
can expire ack waits, nak delays and the duplicate window without sleeping.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from buffered_store.config import EngineConfig
from buffered_store.engine.ports import StoredMsg
from buffered_store.errors import ConfigError, ConflictError, ValidationError, WalFullError

DEFAULT_MAX_PAYLOAD = 1024 * 1024
"""A nats-server's default `max_payload` (1 MiB)."""

_VALID_KEY = re.compile(r"^[-/_=.a-zA-Z0-9]+$")


def check_key(key: str) -> None:
    """Refuse a key NATS KV refuses (`ValidationError`): the characters nats-py accepts,
    not starting or ending with a dot."""
    if not key or key[0] == "." or key[-1] == "." or not _VALID_KEY.match(key):
        raise ValidationError(f"invalid KV key {key!r}")


class MemoryStream:
    """A stream keeping every message (no limits): stream seqs from 1, the last message of
    each subject, and the message ids seen within the duplicate window."""

    def __init__(self, name: str, duplicate_window_s: float, max_bytes: int | None = None) -> None:
        self.name = name
        self.duplicate_window_s = duplicate_window_s
        self.max_bytes = max_bytes
        """Most bytes the stream holds; a publish past it is refused (discard "new")."""
        self.bytes = 0
        """Bytes held: each message's payload and subject (about what the server counts)."""
        self.first_seq = 1
        """Seqs below were purged."""
        self.messages: dict[int, StoredMsg] = {}
        self.by_subject: dict[str, list[int]] = {}
        self.last_seq = 0
        self._seen: dict[str, tuple[int, float]] = {}
        """Message id -> (stream seq, when stored), oldest first."""
        self.consumers: dict[str, MemoryConsumer] = {}

    def captures(self, subject: str) -> bool:
        """Whether a publish to `subject` lands in this stream (``<name>.>``)."""
        return subject.startswith(self.name + ".") and len(subject) > len(self.name) + 1

    def store(self, subject: str, data: bytes) -> int:
        """Append unconditionally (but for the byte limit); the new stream seq."""
        size = len(data) + len(subject)
        if self.max_bytes is not None and self.bytes + size > self.max_bytes:
            raise WalFullError(f"publish {subject}: the WAL is full (maximum bytes exceeded)")
        self.last_seq += 1
        self.messages[self.last_seq] = StoredMsg(self.last_seq, subject, bytes(data))
        self.by_subject.setdefault(subject, []).append(self.last_seq)
        self.bytes += size
        return self.last_seq

    def purge_below(self, seq: int) -> None:
        """Remove every message below `seq` (as a JetStream purge with ``seq``)."""
        for old in range(self.first_seq, min(seq, self.last_seq + 1)):
            msg = self.messages.pop(old, None)
            if msg is None:
                continue
            self.bytes -= len(msg.data) + len(msg.subject)
            seqs = self.by_subject[msg.subject]
            seqs.remove(old)
            if not seqs:
                del self.by_subject[msg.subject]
        self.first_seq = max(self.first_seq, min(seq, self.last_seq + 1))

    def publish(
        self, subject: str, data: bytes, *, msg_id: str, expected: int, now: float
    ) -> tuple[int, bool]:
        """Append if `subject`'s last message is at `expected` (0: none), deduplicated by
        `msg_id`; (stream seq, duplicate). The expectation is checked first, as
        JetStream does: a retried publish whose first copy landed is a conflict."""
        last = self.last_on(subject)
        if (last.seq if last else 0) != expected:
            raise ConflictError(
                f"publish {subject}: last message is at {last.seq if last else 0}, "
                f"expected {expected}"
            )
        self._expire(now)
        seen = self._seen.get(msg_id)
        if seen is not None:
            return seen[0], True
        seq = self.store(subject, data)
        self._seen[msg_id] = (seq, now)
        return seq, False

    def _expire(self, now: float) -> None:
        horizon = now - self.duplicate_window_s
        while self._seen:
            msg_id, (_, at) = next(iter(self._seen.items()))
            if at > horizon:
                break
            del self._seen[msg_id]

    def last_on(self, subject: str) -> StoredMsg | None:
        """The last message on a subject, or None."""
        seqs = self.by_subject.get(subject)
        return self.messages[seqs[-1]] if seqs else None

    def next_on(self, subject: str, from_seq: int) -> StoredMsg | None:
        """The first message on a subject at or after `from_seq`, or None."""
        for seq in self.by_subject.get(subject, ()):
            if seq >= from_seq:
                return self.messages[seq]
        return None


class MemoryKv:
    """A KV bucket with history 1: the latest message of each key, value or delete marker.

    Revisions are the bucket stream's seqs, increasing across keys; a delete writes a
    marker (a revision of its own), so a key once deleted is not "absent" for a
    compare-and-set on revision 0, exactly as on the server (`create` copes with it).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.last_seq = 0
        self.latest: dict[str, tuple[int, bytes | None]] = {}
        """Key -> (revision, value; None for a delete marker)."""
        self.written_at: dict[str, float] = {}
        """Key -> server time of its last write."""

    def get(self, key: str) -> tuple[int, bytes] | None:
        """(revision, value) of a live key, or None."""
        found = self.latest.get(key)
        if found is None or found[1] is None:
            return None
        return found[0], found[1]

    def last_revision(self, key: str) -> int:
        """The key's last message, delete markers included (0: never written)."""
        found = self.latest.get(key)
        return found[0] if found else 0

    def write(
        self, key: str, value: bytes | None, *, expected: int | None = None, now: float = 0.0
    ) -> int:
        """Store a value (None: a delete marker), if the key's last message is at
        `expected` when given; the new revision."""
        if expected is not None and self.last_revision(key) != expected:
            raise ConflictError(f"update {key}: the key changed meanwhile")
        self.last_seq += 1
        self.written_at[key] = now
        self.latest.pop(key, None)  # re-inserted last: dict order is revision order
        self.latest[key] = (self.last_seq, None if value is None else bytes(value))
        return self.last_seq

    def forget(self, key: str, revision: int) -> bool:
        """Remove the key and every trace of it (a purge marker, then the marker purged),
        if its last message is at `revision`."""
        if self.last_revision(key) != revision:
            return False
        self.last_seq += 1  # the marker's revision, purged at once
        del self.latest[key]
        self.written_at.pop(key, None)
        return True

    def scan(self, prefix: str, from_seq: int) -> tuple[list[StoredMsg], int]:
        """Live keys under `prefix` (whole subject tokens: empty or ending with a dot)
        whose revision is at least `from_seq`, in revision order; and how many messages
        a server scan reads for them (delete markers included)."""
        if prefix and not prefix.endswith("."):
            return [], 0  # `<prefix>>` is no wildcard on the server: nothing matches
        found: list[StoredMsg] = []
        read = 0
        for key, (revision, value) in self.latest.items():
            if revision >= from_seq and key.startswith(prefix) and len(key) > len(prefix):
                read += 1
                if value is not None:
                    found.append(StoredMsg(revision, key, value))
        return found, read


@dataclass(slots=True)
class Unacked:
    """A delivered message waiting for its ack."""

    deliveries: int
    due: float
    """Server time from which it is delivered again (ack wait over, or nak delay)."""


class MemoryConsumer:
    """A durable pull consumer with explicit acks, delivering every message of its stream
    from seq 1 (deliver policy "all")."""

    def __init__(self, stream: MemoryStream, name: str, *, ack_wait_s: float, max_ack_pending: int):
        self.stream = stream
        self.name = name
        self.ack_wait_s = ack_wait_s
        self.max_ack_pending = max_ack_pending
        self.next_seq = 1
        """The first stream seq never delivered."""
        self.unacked: dict[int, Unacked] = {}

    def take(self, count: int, now: float, max_bytes: int = 0) -> list[tuple[StoredMsg, int]]:
        """Deliver up to `count` messages: (message, deliveries so far). Messages due
        again come first, in stream order; new ones only while fewer than
        `max_ack_pending` wait for their ack. With `max_bytes`, none after their
        payloads reach that many bytes (the first always comes)."""
        out: list[tuple[StoredMsg, int]] = []
        size = 0

        def full() -> bool:
            return len(out) == count or (max_bytes > 0 and size >= max_bytes)

        for seq in sorted(s for s, u in self.unacked.items() if u.due <= now):
            if full():
                return out
            waiting = self.unacked[seq]
            waiting.deliveries += 1
            waiting.due = now + self.ack_wait_s
            if seq not in self.stream.messages:  # purged meanwhile: nothing to deliver
                del self.unacked[seq]
                continue
            out.append((self.stream.messages[seq], waiting.deliveries))
            size += len(self.stream.messages[seq].data)
        while (
            not full()
            and len(self.unacked) < self.max_ack_pending
            and self.next_seq <= self.stream.last_seq
        ):
            seq = max(self.next_seq, self.stream.first_seq)  # skip what was purged
            if seq > self.stream.last_seq:
                break
            self.next_seq = seq + 1
            self.unacked[seq] = Unacked(1, now + self.ack_wait_s)
            out.append((self.stream.messages[seq], 1))
            size += len(self.stream.messages[seq].data)
        return out

    def next_due(self) -> float | None:
        """When the earliest unacked message is due again (None: nothing is unacked)."""
        return min((u.due for u in self.unacked.values()), default=None)

    def settle(self, seq: int) -> None:
        """Ack or term: never deliver it again (unknown or settled already: no-op)."""
        self.unacked.pop(seq, None)

    def nak(self, seq: int, at: float) -> None:
        """Deliver it again from server time `at`."""
        waiting = self.unacked.get(seq)
        if waiting is not None:
            waiting.due = at

    def touch(self, seq: int, now: float) -> None:
        """In progress: its ack wait starts again."""
        waiting = self.unacked.get(seq)
        if waiting is not None:
            waiting.due = now + self.ack_wait_s

    @property
    def ack_floor(self) -> int:
        """Stream seq up to which every message is settled."""
        if self.unacked:
            return min(self.unacked) - 1
        # Like JetStream, a floor below the stream's first seq moves up to it.
        return max(self.next_seq, self.stream.first_seq) - 1

    @property
    def num_pending(self) -> int:
        """Messages not delivered yet."""
        return max(0, self.stream.last_seq - max(self.next_seq, self.stream.first_seq) + 1)

    @property
    def num_redelivered(self) -> int:
        """Unacked messages delivered more than once."""
        return sum(1 for u in self.unacked.values() if u.deliveries > 1)


class MemoryJetStream:
    """One in-memory JetStream server: streams, KV buckets, durable consumers, a clock
    and the faults a test switches on.

    Share one between several `MemoryWal`s to have store instances and flushers work on
    the same WAL. Faults:

    - ``available = False``: every call of every `MemoryWal` on this server raises
      `WalUnavailableError` (a fetch waiting meanwhile too) until it is set back.
    - `delete_consumer()`: an operator deleted the durable consumer.
    - `advance(seconds)`: move the server's clock on (ack waits, nak delays and the
      duplicate window expire without sleeping).
    """

    def __init__(
        self,
        *,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_payload = max_payload
        self.streams: dict[str, MemoryStream] = {}
        self.buckets: dict[str, MemoryKv] = {}
        self._clock = clock
        self._offset = 0.0
        self._available = True
        self._changed = asyncio.Event()

    # -- clock and wake-ups --------------------------------------------------------------

    def now(self) -> float:
        """The server's clock, in seconds."""
        return self._clock() + self._offset

    def advance(self, seconds: float) -> None:
        """Move the clock `seconds` on; waiting fetches look again."""
        if seconds < 0:
            raise ValueError("the clock only moves forward")
        self._offset += seconds
        self.notify()

    def notify(self) -> None:
        """The server's state changed: wake whoever waits for it (fetches, `wait_for`)."""
        self._changed.set()
        self._changed = asyncio.Event()

    def changed(self) -> asyncio.Event:
        """Set at the next `notify()`: take it before looking, then wait on it."""
        return self._changed

    async def wait_for(self, condition: Callable[[], bool], *, timeout_s: float = 5.0) -> None:
        """Return once `condition()` holds, looking again after each change of the server
        (a write, a settled delivery, a consumer created or deleted); `TimeoutError`
        after `timeout_s`."""
        async with asyncio.timeout(timeout_s):
            while True:
                changed = self._changed
                if condition():
                    return
                await changed.wait()

    @property
    def available(self) -> bool:
        """Whether the server answers (False: every call raises `WalUnavailableError`)."""
        return self._available

    @available.setter
    def available(self, value: bool) -> None:
        self._available = value
        self.notify()

    # -- objects -------------------------------------------------------------------------

    def open_stream(self, config: EngineConfig) -> MemoryStream:
        """The configured WAL stream, created when missing; `ConfigError` when it exists
        with another duplicate window."""
        stream = self.streams.get(config.stream_name)
        if stream is None:
            stream = MemoryStream(
                config.stream_name, config.duplicate_window_s, config.wal_max_bytes
            )
            self.streams[config.stream_name] = stream
        elif stream.duplicate_window_s != config.duplicate_window_s:
            raise ConfigError(
                f"stream {config.stream_name!r} exists with a different configuration "
                f"(duplicate_window: existing {stream.duplicate_window_s!r}, configured "
                f"{config.duplicate_window_s!r})"
            )
        return stream

    def open_bucket(self, name: str) -> MemoryKv:
        """A KV bucket, created when missing."""
        return self.buckets.setdefault(name, MemoryKv(name))

    def consumer(self, stream: str, name: str) -> MemoryConsumer | None:
        """A durable consumer, or None when it does not exist."""
        found = self.streams.get(stream)
        return found.consumers.get(name) if found else None

    def ensure_consumer(self, config: EngineConfig) -> bool:
        """Create the configured durable consumer if missing; True when it had to be.
        `ConfigError` when it exists with another ack wait."""
        stream = self.open_stream(config)
        existing = stream.consumers.get(config.consumer_name)
        if existing is not None:
            if existing.ack_wait_s != config.ack_wait_s:
                raise ConfigError(
                    f"consumer {config.consumer_name!r} exists with a different configuration "
                    f"(ack_wait: existing {existing.ack_wait_s!r}, configured "
                    f"{config.ack_wait_s!r})."
                )
            return False
        stream.consumers[config.consumer_name] = MemoryConsumer(
            stream,
            config.consumer_name,
            ack_wait_s=config.ack_wait_s,
            max_ack_pending=config.max_ack_pending,
        )
        self.notify()
        return True

    def delete_consumer(self, stream: str, name: str) -> bool:
        """Delete a durable consumer, as an operator would; True when it existed.
        Fetches waiting on it return empty, later ones raise `WalUnavailableError`."""
        found = self.streams.get(stream)
        if found is None or found.consumers.pop(name, None) is None:
            return False
        self.notify()
        return True
