"""The settings of each role, one frozen keyword-only dataclass per role, each validated
on its own: how to reach NATS (`ConnectionSettings`), what the WAL's JetStream objects
look like (`WalLayout`), how entries are flushed (`FlushPolicy`), how a store instance
writes and reads (`WriterSettings`) and what only the thread-run front-end needs
(`ThreadRunSettings`). The flusher's and the LangGraph saver's own settings live with
them (`flusher.config`, `buffered_store.langgraph.config`).

The configurations users build (`BufferedStoreConfig`, `FlusherConfig`,
`LangGraphConfig`) are made of these (`buffered_store.config.composed`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from buffered_store.config.composed import Role, check_positive, check_positive_int
from buffered_store.errors import ConfigError

_NAME = re.compile(r"^[A-Za-z0-9_-]+$")
READ_FROM = ("auto", "leader", "any")
"""Accepted values of `ConnectionSettings.read_from`."""


class ReadConsistency(StrEnum):
    """How a read of the buffered store relates to acknowledged checkpoints."""

    READ_YOUR_WRITES = "read_your_writes"
    """Overlay the unflushed WAL tail on the inner store (default)."""
    STRONG = "strong"
    """Flush the pending entries first, then read the inner store."""
    EVENTUAL = "eventual"
    """Read the inner store only; may miss unflushed checkpoints."""


@dataclass(frozen=True, kw_only=True)
class ConnectionSettings(Role):
    """How to reach the NATS servers: where they are, who we are, how long to wait."""

    nats_url: str = "nats://127.0.0.1:4222"
    """Comma-separated NATS server URLs."""
    credentials: str | None = None
    """A NATS ``.creds`` file: its path or its contents."""
    tls_ca_file: str | None = None
    """PEM file of the CA(s) that signed the NATS servers' certificates (None: the
    system's trusted CAs, used when a server requires TLS or a URL says ``tls://``)."""
    tls_cert_file: str | None = None
    """PEM client certificate, for servers that verify clients (with `tls_key_file`)."""
    tls_key_file: str | None = None
    """PEM private key of `tls_cert_file` (None: the key is in the certificate file)."""
    connect_timeout_s: float = 10.0
    """Deadline of the first NATS connection, every attempt included; a refused login
    or TLS handshake fails at once. Later reconnects are not bounded."""
    request_timeout_s: float = 2.0
    """Timeout of one NATS request."""
    read_from: str = "auto"
    """Which servers answer the store's reads of the stream and the buckets.

    ``"leader"``: the stream leader only (JetStream's ``STREAM.MSG.GET`` API), so a read
    sees every write acknowledged before it; ``"any"``: any replica (direct gets, one
    round trip less work for the leader, but a replica that has not yet applied the last
    write answers with the older value); ``"auto"`` (default): ``"leader"`` when
    ``replicas > 1``, else ``"any"`` (with one replica the only server is the leader).
    """

    def __post_init__(self) -> None:
        if not self.nats_url:
            raise ConfigError("nats_url must not be empty")
        check_positive(self, "connect_timeout_s", "request_timeout_s")
        for name in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
            if getattr(self, name) == "":
                object.__setattr__(self, name, None)
        if self.tls_key_file is not None and self.tls_cert_file is None:
            raise ConfigError("tls_key_file needs tls_cert_file (the certificate of that key)")
        if self.read_from not in READ_FROM:
            raise ConfigError(
                f"read_from must be one of {', '.join(READ_FROM)}, got {self.read_from!r}"
            )

    @property
    def servers(self) -> list[str]:
        """The NATS server URLs as a list."""
        return [url.strip() for url in self.nats_url.split(",") if url.strip()]

    def credentials_file(self) -> str | None:
        """The credentials file's path, or None when none is configured or the
        credentials are given as the file's contents (`ConfigError` when the file named
        does not exist)."""
        if self.credentials is None or "-----BEGIN" in self.credentials:
            return None
        path = Path(self.credentials).expanduser()
        if not path.is_file():
            raise ConfigError(f"credentials file {str(path)!r} does not exist")
        return str(path)


@dataclass(frozen=True, kw_only=True)
class WalLayout(Role):
    """The WAL's JetStream objects: their names, retention, replicas and the durable
    consumer's delivery settings (what `NatsWal` creates, or checks when they exist)."""

    stream_name: str = "THREADLOG"
    hot_bucket: str = "thread-hot"
    quarantine_bucket: str = "thread-quarantine"
    consumer_name: str = "thread-flusher"
    max_age_s: float | None = None
    """Age after which the server drops a WAL entry, flushed or not (None, the default:
    never). An opt-in safety net only: an entry still unflushed at that age is lost, and
    the next write on its thread is refused (`WalEntriesExpiredError`). Flushed entries
    leave the stream after `retain_flushed_s` anyway."""
    retain_flushed_s: float = 300.0
    """How long a flushed entry stays in the stream after its flush (then the flushers
    trim it): the window a read that started before that flush needs to find it."""
    wal_max_bytes: int | None = None
    """Most bytes the WAL stream may hold (None, the default: no limit). When the
    unflushed backlog fills it, writes are refused with `WalFullError` (retriable) and
    nothing acknowledged is lost; flushers trim flushed entries early under pressure."""
    duplicate_window_s: float = 120.0
    """Window in which a retried publish with the same `Nats-Msg-Id` is deduplicated."""
    replicas: int = 1
    """Stream and bucket replicas (3 in a cluster for durability)."""
    ack_wait_s: float = 30.0
    """Time a flusher holds a message before the server redelivers it elsewhere."""
    max_ack_pending: int = 20_000
    """Unacknowledged messages the durable consumer allows in flight."""

    def __post_init__(self) -> None:
        for name in ("stream_name", "hot_bucket", "quarantine_bucket", "consumer_name"):
            value = getattr(self, name)
            if not isinstance(value, str) or not _NAME.match(value):
                raise ConfigError(f"{name} must match [A-Za-z0-9_-]+, got {value!r}")
        if "-" in self.stream_name:
            raise ConfigError("stream_name must not contain '-' (it is a subject token)")
        if self.max_age_s is not None and not self.max_age_s > 0:
            raise ConfigError(f"max_age_s must be positive or None, got {self.max_age_s!r}")
        if self.wal_max_bytes is not None and (
            isinstance(self.wal_max_bytes, bool)
            or not isinstance(self.wal_max_bytes, int)
            or self.wal_max_bytes < 1
        ):
            raise ConfigError(
                f"wal_max_bytes must be a positive integer or None, got {self.wal_max_bytes!r}"
            )
        check_positive(self, "retain_flushed_s", "duplicate_window_s", "ack_wait_s")
        check_positive_int(self, "replicas", "max_ack_pending")
        if self.max_age_s is not None and self.duplicate_window_s > self.max_age_s:
            raise ConfigError("duplicate_window_s must not exceed max_age_s")


@dataclass(frozen=True, kw_only=True)
class FlushPolicy(Role):
    """How the WAL is flushed, shared by a store's configuration and the flushers built
    from it (`FlusherConfig.from_store_config`)."""

    flush_interval_s: float = 0.5
    """Collection window of the flusher: entries are coalesced per thread within it."""
    flush_batch_size: int = 1024
    """Most WAL messages one flush cycle takes."""
    flush_batch_bytes: int = 64 * 1024 * 1024
    """About the most payload bytes one flush cycle takes (it stops taking messages once
    it holds this many; a message larger than what is left still comes, alone if need
    be): with large entries, `flush_batch_size` of them would hold up to `max_payload`
    each in the flusher's memory and in one transaction."""
    poison_attempts: int = 5
    """Deliveries (or apply attempts) before an entry is quarantined."""

    def __post_init__(self) -> None:
        check_positive(self, "flush_interval_s")
        check_positive_int(self, "flush_batch_size", "flush_batch_bytes", "poison_attempts")


@dataclass(frozen=True, kw_only=True)
class WriterSettings(Role):
    """How one store instance writes (the engine's writer) and reads."""

    read_consistency: ReadConsistency = ReadConsistency.READ_YOUR_WRITES
    checkpoint_timeout_s: float = 10.0
    """Budget of one checkpoint's write once it holds its thread's lock: the run claim,
    retries of the publish and the hot record included (see docs/reference/configuration.md
    for the one case that gets a second budget)."""
    drain_on_close: bool = True
    """`close()` flushes the threads this instance wrote (best effort, bounded)."""
    drain_timeout_s: float = 10.0
    recent_window: int = 64
    """Stream seqs of the latest entries kept in the hot record for direct reads."""
    cursor_cache_threads: int = 4096
    """Threads whose last snapshot this instance keeps to send append-only deltas."""
    entry_cache_bytes: int = 32 * 1024 * 1024
    """Bytes of the entries this instance appended that it keeps for reads of its own
    threads (the newest 64 of each thread; a read of the unflushed tail then needs no
    fetch); 0 keeps none."""
    cursor_cache_bytes: int = 64 * 1024 * 1024
    """Memory those snapshots may take (about): past it the least recently written
    threads are forgotten, and their next write reloads them (the slow path)."""

    def __post_init__(self) -> None:
        if not isinstance(self.read_consistency, ReadConsistency):
            try:
                object.__setattr__(self, "read_consistency", ReadConsistency(self.read_consistency))
            except ValueError:
                raise ConfigError(f"unknown read_consistency {self.read_consistency!r}") from None
        check_positive(self, "checkpoint_timeout_s", "drain_timeout_s")
        if not isinstance(self.entry_cache_bytes, int) or self.entry_cache_bytes < 0:
            raise ConfigError(f"entry_cache_bytes must be >= 0, got {self.entry_cache_bytes!r}")
        check_positive_int(self, "recent_window", "cursor_cache_threads", "cursor_cache_bytes")


@dataclass(frozen=True, kw_only=True)
class ThreadRunSettings(Role):
    """What only the thread-run front-end (`BufferedThreadRunStore`) needs."""

    check_snapshots: bool = False
    """Debug aid: every `checkpoint()` encodes its whole snapshot again to verify that no
    message object seen by an earlier checkpoint of the thread was changed in place
    (`ValidationError` if one was). Off, such a change is seen only in the last two
    messages; `checkpoint()` then costs O(new messages), not O(history)."""
    run_claim_grace_s: float = 300.0
    """How long a run id claimed by a thread that does not (yet) hold the run stays
    reserved to it: the claiming checkpoint may still be in flight (a publish buffered
    across a reconnect lands late). After that, another thread may take the run id over."""
    hot_linger_s: float | None = None
    """None: `checkpoint()` returns once the entry is in the WAL *and* the thread's hot
    record is advanced (two round trips); every read on any instance, list reads
    included, sees it then. A number: the hot record is advanced in the background that
    many seconds later (0: at once), sharing one KV update among the thread's writes
    meanwhile, so `checkpoint()` costs one round trip. Reads of one thread still see
    every acknowledged checkpoint (they read the subject's last entry beside the hot
    record); list reads of *other* instances may miss a checkpoint acknowledged less
    than `hot_linger_s` plus a round trip earlier."""

    def __post_init__(self) -> None:
        check_positive(self, "run_claim_grace_s")
        linger = self.hot_linger_s
        if linger is not None and (
            isinstance(linger, bool) or not isinstance(linger, int | float) or not 0 <= linger <= 10
        ):
            raise ConfigError(f"hot_linger_s must be None or between 0 and 10, got {linger!r}")
