"""Configuration of the flusher service: the shared engine settings plus its own.

`FlusherConfig` is made of the engine's roles (`connection`, `wal`, `flush`: see
`buffered_store.config`) and the flusher's own settings (`FlusherSettings`, ``config.flusher``),
so one set of ``BUFSTORE_*`` environment variables configures the store and the flusher
alike (`FlusherConfig.from_env()`), and a flusher embedded next to a store can share the
store's settings with `from_store_config`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self

from buffered_store.config import ENV_PREFIX, EngineConfig, Role
from buffered_store.errors import ConfigError

MIN_FETCH_TIMEOUT_S = 0.005
"""Shorter fetches are pointless: the server expires a pull request 0.1 ms before it."""


@dataclass(frozen=True, kw_only=True)
class FlusherSettings(Role):
    """The flusher service's own settings: fetching, retries and back-off, draining,
    housekeeping."""

    fetch_timeout_s: float = 0.5
    """Longest single pull request. Fetches are kept short inside the collection window
    because one fetch can stall for its whole timeout (nats.py #933/#986)."""
    max_rounds: int = 4
    """Apply calls one cycle may make for a thread: the first, plus rounds that fetch
    missing earlier entries from the stream (GAP) before giving the messages back."""
    db_retry_initial_s: float = 0.1
    """First wait after the database was unreachable; doubles per attempt."""
    db_retry_max_s: float = 5.0
    """Longest wait between attempts while the database is unreachable (retries go on)."""
    nak_delay_initial_s: float = 0.5
    """Redelivery delay after a failed apply or quarantine write; doubles per delivery."""
    nak_delay_max_s: float = 30.0
    """Longest redelivery delay of a message that keeps failing."""
    requeue_delay_s: float = 0.05
    """Redelivery delay of messages a cycle could not settle for lack of rounds."""
    nats_retry_initial_s: float = 0.1
    """First wait after a failed fetch (other than its normal timeout); doubles."""
    nats_retry_max_s: float = 5.0
    """Longest wait between fetch attempts while JetStream misbehaves."""
    drain_timeout_s: float = 30.0
    """How long `stop(drain=True)` lets the current cycle finish before giving up."""
    apply_timeout_s: float = 120.0
    """Longest a cycle's apply transaction may run. Past it the transaction is abandoned
    (its connection closed, so Postgres rolls it back and releases its row locks) and the
    cycle is retried as for an unreachable database: a stalled client or server never
    holds the threads' locks, and the flush, for ever."""
    hot_idle_s: float = 7 * 24 * 3600.0
    """A thread's hot record is removed once the thread has been idle this long, is
    flushed up to it and has no entry left in the stream (deleted threads too): the hot
    bucket keeps the threads in use, not every thread ever written. Its next writer
    reads the thread from the inner store once. 0 keeps every hot record."""
    trim_interval_s: float = 5.0
    """Seconds between two looks at the stream by the trimming of flushed entries
    (`flusher.trim`: two requests, plus a purge and a read of the quarantine when
    something can go); 0 disables trimming in this flusher."""

    def __post_init__(self) -> None:
        positive = (
            "fetch_timeout_s",
            "db_retry_initial_s",
            "db_retry_max_s",
            "nak_delay_initial_s",
            "nak_delay_max_s",
            "requeue_delay_s",
            "nats_retry_initial_s",
            "nats_retry_max_s",
            "drain_timeout_s",
            "apply_timeout_s",
        )
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"{name} must be positive, got {value!r}")
        if (
            isinstance(self.trim_interval_s, bool)
            or not isinstance(self.trim_interval_s, int | float)
            or self.trim_interval_s < 0
        ):
            raise ConfigError(f"trim_interval_s must be >= 0, got {self.trim_interval_s!r}")
        if (
            isinstance(self.hot_idle_s, bool)
            or not isinstance(self.hot_idle_s, int | float)
            or self.hot_idle_s < 0
        ):
            raise ConfigError(f"hot_idle_s must be >= 0, got {self.hot_idle_s!r}")
        if self.fetch_timeout_s < MIN_FETCH_TIMEOUT_S:
            raise ConfigError(f"fetch_timeout_s must be at least {MIN_FETCH_TIMEOUT_S}")
        if not isinstance(self.max_rounds, int) or self.max_rounds < 1:
            raise ConfigError(f"max_rounds must be a positive integer, got {self.max_rounds!r}")
        for initial, cap in (
            ("db_retry_initial_s", "db_retry_max_s"),
            ("nak_delay_initial_s", "nak_delay_max_s"),
            ("nats_retry_initial_s", "nats_retry_max_s"),
        ):
            if getattr(self, initial) > getattr(self, cap):
                raise ConfigError(f"{initial} must not exceed {cap}")


class FlusherFields:
    """`FlusherSettings`'s fields as attributes of `FlusherConfig` (for type checkers)."""

    fetch_timeout_s: float
    max_rounds: int
    db_retry_initial_s: float
    db_retry_max_s: float
    nak_delay_initial_s: float
    nak_delay_max_s: float
    requeue_delay_s: float
    nats_retry_initial_s: float
    nats_retry_max_s: float
    drain_timeout_s: float
    apply_timeout_s: float
    hot_idle_s: float
    trim_interval_s: float


@dataclass(frozen=True, init=False)
class FlusherConfig(EngineConfig, FlusherFields):
    """Settings of `Flusher`: the engine's roles plus `FlusherSettings`."""

    flusher: FlusherSettings

    def check(self) -> None:
        """Rules across roles."""
        # Held messages are kept alive with in-progress acks every ack_wait/3, but a
        # collection window longer than ack_wait would let the server redeliver messages
        # before the cycle even starts.
        if self.flush_interval_s >= self.ack_wait_s:
            raise ConfigError("flush_interval_s must be shorter than ack_wait_s")

    @classmethod
    def from_store_config(cls, cfg: EngineConfig, **overrides: Any) -> Self:
        """A flusher configuration sharing the engine settings of a store's configuration
        (its `connection`, `wal` and `flush`); keyword overrides win."""
        shared: dict[str, Any] = {attr: getattr(cfg, attr) for attr in EngineConfig.roles()}
        return cls(**shared, **overrides)

    @classmethod
    def for_front_end(
        cls,
        cfg: EngineConfig,
        *,
        env_prefixes: Sequence[str] = (ENV_PREFIX,),
        environ: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> Self:
        """The flusher of a front-end configured by `cfg` (its writers' configuration,
        e.g. a `LangGraphConfig` read from ``BUFSTORE_LG_*``): every engine setting is
        `cfg`'s, so the stream and consumer the flusher expects are the ones its
        writers create (``max_age_s``, ``replicas``, ``duplicate_window_s``,
        ``ack_wait_s``, ...); the flusher's own knobs (``fetch_timeout_s``,
        ``drain_timeout_s``, ...) come from the first of `env_prefixes` that sets them.
        Keyword overrides win over both."""
        env = os.environ if environ is None else environ
        mapped: dict[str, str] = {}
        for name in FlusherSettings.knob_names():
            for prefix in env_prefixes:
                raw = env.get(prefix + name.upper())
                if raw is not None:
                    mapped[ENV_PREFIX + name.upper()] = raw
                    break
        shared: dict[str, Any] = {attr: getattr(cfg, attr) for attr in EngineConfig.roles()}
        return cls.from_env(mapped, **{**shared, **overrides})
