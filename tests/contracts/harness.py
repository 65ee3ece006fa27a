"""`WalHarness`: opens the `engine.ports.Wal` implementations the port contract tests run
over (tests/contracts/conftest.py hands one to each test).

- ``memory``: `MemoryWal`s on a `MemoryJetStream` of the test's own; time moves with
  `MemoryJetStream.advance`, so nothing sleeps.
- ``nats``: `NatsWal`s on the session's nats-server (marked ``integration``), with
  stream, buckets and consumer of unique names deleted afterwards; time moves by sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from buffered_store.config import EngineConfig
from buffered_store.engine.ports import Wal
from buffered_store.nats import NatsWal
from buffered_store.testing import MemoryJetStream, MemoryWal
from tests.plugins.stores import jetstream, unique_names


class WalHarness:
    """Opens `Wal`s of one implementation on one server, and plays the operator and the
    clock. Every test gets its own stream, buckets and consumer."""

    kind: str

    def __init__(self) -> None:
        self.opened: list[Wal] = []
        self.config: EngineConfig | None = None

    async def open(self, **overrides: Any) -> Wal:
        """A client on this test's WAL objects (created by the first one, whose settings
        win); keyword arguments override the `EngineConfig`."""
        if self.config is None:
            self.config = self._config(**overrides)
        wal = await self._connect(self.config.replace(**overrides))
        self.opened.append(wal)
        return wal

    def _config(self, **overrides: Any) -> EngineConfig:
        settings: dict[str, Any] = {**unique_names(), **overrides}
        return EngineConfig(**settings)

    async def _connect(self, config: EngineConfig) -> Wal:
        raise NotImplementedError

    async def delete_consumer(self) -> None:
        """Delete the durable consumer, as an operator would."""
        raise NotImplementedError

    async def elapse(self, seconds: float) -> None:
        """Let `seconds` pass on the server's clock."""
        raise NotImplementedError

    async def close(self) -> None:
        """Close every client and remove the test's objects."""
        for wal in self.opened:
            with contextlib.suppress(Exception):
                await wal.close()


class MemoryHarness(WalHarness):
    """`MemoryWal`s sharing one `MemoryJetStream`."""

    kind = "memory"

    def __init__(self) -> None:
        super().__init__()
        self.server = MemoryJetStream()

    async def _connect(self, config: EngineConfig) -> Wal:
        return MemoryWal(config, self.server)

    async def delete_consumer(self) -> None:
        assert self.config is not None
        assert self.server.delete_consumer(self.config.stream_name, self.config.consumer_name)

    async def elapse(self, seconds: float) -> None:
        self.server.advance(seconds)
        await asyncio.sleep(0)


class NatsHarness(WalHarness):
    """`NatsWal`s, each with its own connection to the session's nats-server."""

    kind = "nats"

    def __init__(self, nats_url: str) -> None:
        super().__init__()
        self.nats_url = nats_url

    def _config(self, **overrides: Any) -> EngineConfig:
        return super()._config(nats_url=self.nats_url, **overrides)

    async def _connect(self, config: EngineConfig) -> Wal:
        return await NatsWal.connect(config, name="contract-test")

    async def delete_consumer(self) -> None:
        assert self.config is not None
        async with jetstream(self.config) as js:
            assert await js.delete_consumer(self.config.stream_name, self.config.consumer_name)

    async def elapse(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def close(self) -> None:
        await super().close()
        if self.config is None:
            return
        async with jetstream(self.config) as js:
            for stream in (
                self.config.stream_name,
                f"KV_{self.config.hot_bucket}",
                f"KV_{self.config.quarantine_bucket}",
            ):
                with contextlib.suppress(Exception):
                    await js.delete_stream(stream)
