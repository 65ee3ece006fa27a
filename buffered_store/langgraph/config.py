"""Configuration of the LangGraph checkpointer: the engine's and the writer's settings
with its own stream, buckets and consumer, plus its own (`LangGraphSettings`: where
LangGraph's Postgres tables live, how writes are batched)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from buffered_store.config import ENV_PREFIX, Role, ThreadRunSettings, WriterConfig
from buffered_store.errors import ConfigError

LG_ENV_PREFIX = "BUFSTORE_LG_"
SHARED_ENV = (
    "NATS_URL",
    "CREDENTIALS",
    "TLS_CA_FILE",
    "TLS_CERT_FILE",
    "TLS_KEY_FILE",
    "CONNECT_TIMEOUT_S",
)
"""Read from ``BUFSTORE_*`` too, when no ``BUFSTORE_LG_*`` variable sets them: one NATS
deployment usually carries both front-ends."""
CONVENTIONAL_ENV = {"DATABASE_URL": "DATABASE_URL", "NATS_URL": "NATS_URL"}
"""Field (upper case) -> the unprefixed variable read last, as the CLI, the quickstart and
most platforms (Heroku, Render, Railway, docker-compose files) name them."""


@dataclass(frozen=True, kw_only=True)
class LangGraphSettings(Role):
    """What only the LangGraph saver needs: its Postgres tables and pool, how its writes
    are batched, its owner name and entry format."""

    database_url: str = "postgresql://127.0.0.1:5432/postgres"
    """Where LangGraph's tables live: a libpq URL (``postgresql://``; a SQLAlchemy
    ``postgresql+psycopg://`` URL is accepted too) or a ``key=value`` conninfo string."""
    pool_min_size: int = 1
    pool_max_size: int = 8
    """Postgres connections of the saver's pool (reads, `force_flush`)."""
    db_timeout_s: float = 2.0
    """Longest wait for a pooled Postgres connection. While Postgres is down a read gives
    up after this long (and answers from the WAL when it holds the thread's history)."""
    owner: str | None = None
    """This saver's name for `claim`: a thread claimed by one owner refuses writes from
    savers with another owner (or none). None: this saver cannot claim."""
    flush_each_write: bool = False
    """Every write returns once it is in Postgres (a `force_flush` after each): no
    buffering left, for tests and for migrating off the saver gradually."""
    write_linger_s: float = 0.002
    """How long a task's writes (``aput_writes``) may wait for a checkpoint of the same
    thread to share its WAL entry (LangGraph saves the step's checkpoint right after its
    tasks' writes); 0 sends every write at once. A checkpoint never waits."""
    hot_linger_s: float = 0.5
    """How long a thread's hot record (where readers in other processes start looking
    for its unflushed entries) waits after a write before it is advanced in the
    background, so that the thread's writes of that moment share one update whose round
    trip runs off the graph's step; 0: right after each write. A write is acknowledged
    without it either way; other processes' scans of the pending threads (``status``,
    another saver's ``delete_for_runs`` or ``force_flush_all``) may see a thread's newest
    entries up to this late, and a process that dies loses the updates still lingering
    (its entries are flushed all the same; readers find them on the stream). This
    saver's own reads, ``force_flush_all`` and ``close`` never wait for it."""
    max_inflight_writes: int = 64
    """WAL publishes in flight at once in this saver (more wait their turn, in order);
    0: no bound."""
    check_deltas: bool = False
    """Check every delta blob against the list serialised whole and write the whole
    list when they differ (a debugging aid: it costs the serialisation deltas save). A
    delta assumes the items of a list already saved are not changed in place afterwards,
    as LangGraph's reducers (``add_messages``) never do; see docs/how-to/langgraph.md."""
    wal_format: int = 2
    """Wire format of the entries this saver writes: 2 (binary values, several
    operations per entry); 1 only while a process older than this version still reads
    the WAL (a rolling upgrade), which cannot read format 2. Every version reads both."""

    def __post_init__(self) -> None:
        if not self.database_url:
            raise ConfigError("database_url must not be empty")
        if not isinstance(self.pool_min_size, int) or self.pool_min_size < 0:
            raise ConfigError(f"pool_min_size must be >= 0, got {self.pool_min_size!r}")
        if not isinstance(self.pool_max_size, int) or self.pool_max_size < max(
            1, self.pool_min_size
        ):
            raise ConfigError(
                f"pool_max_size must be >= 1 and >= pool_min_size, got {self.pool_max_size!r}"
            )
        if not isinstance(self.db_timeout_s, int | float) or not self.db_timeout_s > 0:
            raise ConfigError(f"db_timeout_s must be > 0, got {self.db_timeout_s!r}")
        if not isinstance(self.write_linger_s, int | float) or not 0 <= self.write_linger_s <= 1:
            raise ConfigError(
                f"write_linger_s must be between 0 and 1, got {self.write_linger_s!r}"
            )
        if not isinstance(self.hot_linger_s, int | float) or not 0 <= self.hot_linger_s <= 10:
            raise ConfigError(f"hot_linger_s must be between 0 and 10, got {self.hot_linger_s!r}")
        if not isinstance(self.max_inflight_writes, int) or self.max_inflight_writes < 0:
            raise ConfigError(f"max_inflight_writes must be >= 0, got {self.max_inflight_writes!r}")
        if self.wal_format not in (1, 2):
            raise ConfigError(f"wal_format must be 1 or 2, got {self.wal_format!r}")
        if self.owner is not None and (not self.owner or "\x00" in self.owner):
            raise ConfigError("owner must be a non-empty string without NUL, or None")


class LangGraphFields:
    """`LangGraphSettings`'s fields as attributes of `LangGraphConfig` (type checkers)."""

    database_url: str
    pool_min_size: int
    pool_max_size: int
    db_timeout_s: float
    owner: str | None
    flush_each_write: bool
    write_linger_s: float
    hot_linger_s: float
    max_inflight_writes: int
    check_deltas: bool
    wal_format: int


LEGACY_KNOBS = ("check_snapshots", "run_claim_grace_s")
"""Keywords `LangGraphConfig` took before its settings were composed by role, when it
derived from the thread-run store's configuration: accepted, ignored by the saver (as
they always were), with a `DeprecationWarning`."""


@dataclass(frozen=True, init=False)
class LangGraphConfig(WriterConfig, LangGraphFields):
    """Configuration of `BufferedCheckpointSaver`: the engine's and the writer's roles
    plus `LangGraphSettings` (``config.langgraph``).

    The stream, buckets and consumer default to names of their own (``LGWAL``,
    ``lg-hot``, ``lg-quarantine``, ``lg-flusher``), so a thread-run store and a
    LangGraph checkpointer can share one NATS server without ever reading each other's
    entries. ``read_consistency`` applies as in the thread-run store (`STRONG` flushes
    the thread before each read, `EVENTUAL` reads Postgres alone).
    """

    langgraph: LangGraphSettings

    ROLE_DEFAULTS: ClassVar[Mapping[str, Mapping[str, Any]]] = {
        "wal": {
            "stream_name": "LGWAL",
            "hot_bucket": "lg-hot",
            "quarantine_bucket": "lg-quarantine",
            "consumer_name": "lg-flusher",
        }
    }

    def __init__(self, **settings: Any) -> None:
        legacy = {name: settings.pop(name) for name in LEGACY_KNOBS if name in settings}
        if legacy:
            warnings.warn(
                f"LangGraphConfig ignores {', '.join(sorted(legacy))}: settings of the "
                "thread-run store, never used by the LangGraph saver",
                DeprecationWarning,
                stacklevel=2,
            )
        super().__init__(**settings)
        object.__setattr__(self, "_legacy", ThreadRunSettings(**legacy))

    @property
    def check_snapshots(self) -> bool:
        """Deprecated: a thread-run store setting the saver never used."""
        return bool(self.__dict__["_legacy"].check_snapshots)

    @property
    def run_claim_grace_s(self) -> float:
        """Deprecated: a thread-run store setting the saver never used."""
        return float(self.__dict__["_legacy"].run_claim_grace_s)

    @property
    def conninfo(self) -> str:
        """`database_url` as psycopg takes it."""
        url = self.database_url
        scheme, sep, rest = url.partition("://")
        if sep and scheme.lower().startswith(("postgresql+", "postgres+")):
            return "postgresql://" + rest
        return url

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Self:
        """Build from ``BUFSTORE_LG_*`` variables (``BUFSTORE_LG_DATABASE_URL``,
        ``BUFSTORE_LG_STREAM_NAME``, ...); where the NATS servers are and how to reach
        them (``nats_url``, ``credentials``, the ``tls_*`` files, ``connect_timeout_s``)
        fall back to their ``BUFSTORE_*`` variables. The URLs fall back last to the
        conventional ``DATABASE_URL`` and ``NATS_URL``, as the ``bufstore`` commands read
        them, rather than to localhost. Keyword overrides win."""
        env = os.environ if environ is None else environ
        mapped = {
            ENV_PREFIX + field: env[name] for field, name in CONVENTIONAL_ENV.items() if name in env
        }
        mapped.update(
            {ENV_PREFIX + n: env[ENV_PREFIX + n] for n in SHARED_ENV if ENV_PREFIX + n in env}
        )
        mapped.update(
            {
                ENV_PREFIX + k[len(LG_ENV_PREFIX) :]: v
                for k, v in env.items()
                if k.startswith(LG_ENV_PREFIX)
            }
        )
        return super().from_env(mapped, **overrides)
