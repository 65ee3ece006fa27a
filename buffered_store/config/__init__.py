"""Configuration of the buffered store, its writers and the flusher: made of role
settings (`buffered_store.config.roles`), frozen, validated at construction.

`EngineConfig` is what every part of a deployment shares: where NATS is
(`ConnectionSettings`, ``config.connection``), the WAL's JetStream objects (`WalLayout`,
``config.wal``) and how it is flushed (`FlushPolicy`, ``config.flush``). `WriterConfig`
adds how a store instance writes and reads (`WriterSettings`, ``config.writer``): what
the engine's writer takes. `BufferedStoreConfig` adds the thread-run front-end's own
settings (`ThreadRunSettings`, ``config.threadrun``); the flusher's and the LangGraph
saver's configurations compose theirs the same way (`flusher.config.FlusherConfig`,
`buffered_store.langgraph.config.LangGraphConfig`).

Flat keywords and attributes work as before: ``BufferedStoreConfig(nats_url=...,
recent_window=64)``, ``config.recent_window``. Every field can also come from an
environment variable named ``BUFSTORE_<FIELD>`` in upper case (e.g. ``BUFSTORE_NATS_URL``,
``BUFSTORE_FLUSH_INTERVAL_S``) through `from_env()`.
"""

from __future__ import annotations

from dataclasses import dataclass

from buffered_store.config.composed import ENV_PREFIX, Composed, Role
from buffered_store.config.flat import (
    ConnectionFields,
    FlushPolicyFields,
    ThreadRunFields,
    WalLayoutFields,
    WriterFields,
)
from buffered_store.config.roles import (
    READ_FROM,
    ConnectionSettings,
    FlushPolicy,
    ReadConsistency,
    ThreadRunSettings,
    WalLayout,
    WriterSettings,
)

__all__ = [
    "ENV_PREFIX",
    "READ_FROM",
    "BufferedStoreConfig",
    "Composed",
    "ConnectionSettings",
    "EngineConfig",
    "FlushPolicy",
    "ReadConsistency",
    "Role",
    "ThreadRunSettings",
    "WalLayout",
    "WriterConfig",
    "WriterSettings",
]


@dataclass(frozen=True, init=False)
class EngineConfig(Composed, ConnectionFields, WalLayoutFields, FlushPolicyFields):
    """Settings shared by the stores and the flusher: where the WAL lives and how it
    is flushed."""

    connection: ConnectionSettings
    wal: WalLayout
    flush: FlushPolicy

    @property
    def leader_reads(self) -> bool:
        """True when reads must be answered by the stream leader (see `read_from`)."""
        if self.read_from == "auto":
            return self.replicas > 1
        return self.read_from == "leader"

    @property
    def servers(self) -> list[str]:
        """The NATS server URLs as a list."""
        return self.connection.servers

    def credentials_file(self) -> str | None:
        """The credentials file's path, or None when none is configured or the
        credentials are given as the file's contents (`ConfigError` when the file named
        does not exist)."""
        return self.connection.credentials_file()


@dataclass(frozen=True, init=False)
class WriterConfig(EngineConfig, WriterFields):
    """The engine settings plus how a store instance writes and reads: what the engine's
    writer takes, whatever the front-end."""

    writer: WriterSettings


@dataclass(frozen=True, init=False)
class BufferedStoreConfig(WriterConfig, ThreadRunFields):
    """Configuration of `BufferedThreadRunStore`."""

    threadrun: ThreadRunSettings
