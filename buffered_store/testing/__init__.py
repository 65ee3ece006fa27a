"""Helpers for testing code that uses the store, public and documented; no services needed.

Inner stores (`buffered_store.testing.stores`):

- `FaultyFlushTarget` wraps an inner store (for instance `InMemoryThreadRunStore`) and
  injects the failures a flusher must survive: applies that raise, hang or slow down.
- `make_run` and `make_messages` build valid records with little typing; `make_entries`
  a thread's WAL entries as a writer builds them.

The WAL in memory (`buffered_store.testing.wal`, `buffered_store.testing.jetstream`):

- `MemoryWal` is the engine's `Wal` port without NATS, held to the same contract as
  `NatsWal` (tests/contracts). `MemoryJetStream` is the server state several of them can
  share, so store instances and flushers work on one WAL; it also injects faults
  (``available = False``, `delete_consumer`, `advance` of its clock).
- `open_memory_store` assembles a `BufferedThreadRunStore` over a `MemoryWal`.

Conformance suites (`buffered_store.testing.conformance`): the `ThreadRunStore` and
`FlushTarget` checks this project's stores pass, to run against a store of your own with
`validate()` (no pytest) or as pytest classes (docs/how-to/conformance.md).

Example::

    server = MemoryJetStream()
    inner = InMemoryThreadRunStore()
    config = BufferedStoreConfig(flush_interval_s=0.05)
    store = open_memory_store(inner, config, server=server)
    flusher = Flusher(inner, config, wal=MemoryWal(config, server))
    await flusher.start()
    await store.checkpoint("t1", make_messages(2), make_run("t1"))
    server.available = False            # NATS is down: checkpoints now fail
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from buffered_store.config import BufferedStoreConfig
from buffered_store.engine.ids import utcnow
from buffered_store.model.protocol import ThreadRunStore
from buffered_store.testing.jetstream import DEFAULT_MAX_PAYLOAD, MemoryJetStream
from buffered_store.testing.stores import (
    FaultyFlushTarget,
    InnerStore,
    make_entries,
    make_messages,
    make_run,
)
from buffered_store.testing.wal import MemoryBucket, MemoryDelivered, MemoryDelivery, MemoryWal
from buffered_store.threadrun.store import BufferedThreadRunStore

__all__ = [
    "DEFAULT_MAX_PAYLOAD",
    "FaultyFlushTarget",
    "InnerStore",
    "MemoryBucket",
    "MemoryDelivered",
    "MemoryDelivery",
    "MemoryJetStream",
    "MemoryWal",
    "make_entries",
    "make_messages",
    "make_run",
    "open_memory_store",
]


def open_memory_store(
    inner: ThreadRunStore,
    config: BufferedStoreConfig | None = None,
    *,
    server: MemoryJetStream | None = None,
    clock: Callable[[], datetime] = utcnow,
) -> BufferedThreadRunStore:
    """A `BufferedThreadRunStore` around `inner` whose WAL is a new `MemoryWal` on
    `server` (a fresh `MemoryJetStream` by default), assembled as
    `BufferedThreadRunStore.connect` assembles it over NATS.

    `config` defaults to `BufferedStoreConfig()` (no environment variables are read;
    ``nats_url`` is not used). Give several stores, and flushers' `MemoryWal`s, the same
    `server` to have them share one WAL. Closing the store closes its `MemoryWal`.
    """
    config = config if config is not None else BufferedStoreConfig()
    return BufferedThreadRunStore.over(inner, MemoryWal(config, server), config, clock=clock)
