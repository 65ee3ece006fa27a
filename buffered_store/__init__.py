"""Write-buffering thread-checkpoint store: a NATS JetStream WAL in front of any
`ThreadRunStore` (normally Postgres), with read-your-writes overlays.

Heavy parts (Postgres, NATS) are imported on first use, so ``import buffered_store`` stays
cheap and the pure modules stay usable without services.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from buffered_store.config import ReadConsistency
from buffered_store.engine.flushing import FlushStatus
from buffered_store.errors import (
    BackendUnavailableError,
    CommitUnknownError,
    ConfigError,
    ConflictError,
    DatabaseUnavailableError,
    FlushTimeoutError,
    PayloadTooLargeError,
    RunOwnershipError,
    StoreClosedError,
    StoreError,
    ThreadOwnershipError,
    ValidationError,
    WalEntriesExpiredError,
    WalFullError,
    WalUnavailableError,
)
from buffered_store.model.protocol import ThreadRunStore
from buffered_store.model.records import (
    CheckpointReceipt,
    Message,
    RunRecord,
    RunStatus,
    Thread,
)

if TYPE_CHECKING:
    from buffered_store.config import BufferedStoreConfig
    from buffered_store.stores.memory import InMemoryThreadRunStore
    from buffered_store.stores.postgres import PostgresThreadRunStore
    from buffered_store.threadrun.store import BufferedThreadRunStore

_LAZY = {
    "BufferedThreadRunStore": "buffered_store.threadrun.store",
    "BufferedStoreConfig": "buffered_store.config",
    "InMemoryThreadRunStore": "buffered_store.stores.memory",
    "PostgresThreadRunStore": "buffered_store.stores.postgres",
}

__all__ = [
    "BackendUnavailableError",
    "BufferedStoreConfig",
    "BufferedThreadRunStore",
    "CheckpointReceipt",
    "CommitUnknownError",
    "ConfigError",
    "ConflictError",
    "DatabaseUnavailableError",
    "FlushStatus",
    "FlushTimeoutError",
    "InMemoryThreadRunStore",
    "Message",
    "PayloadTooLargeError",
    "PostgresThreadRunStore",
    "ReadConsistency",
    "RunOwnershipError",
    "RunRecord",
    "RunStatus",
    "StoreClosedError",
    "StoreError",
    "Thread",
    "ThreadOwnershipError",
    "ThreadRunStore",
    "ValidationError",
    "WalEntriesExpiredError",
    "WalFullError",
    "WalUnavailableError",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'buffered_store' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
