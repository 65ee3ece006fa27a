"""The NATS JetStream adapter: the only package that imports nats-py.

`NatsWal` implements the engine's ports (`buffered_store.engine.ports`) on one connection;
nothing nats-py defines leaves this package.
"""

from buffered_store.nats.wal import NatsWal

__all__ = ["NatsWal"]
