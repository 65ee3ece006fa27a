"""Fixtures of the port contract tests: one `WalHarness` (tests/contracts/harness.py) per
test, over each implementation of `engine.ports.Wal` in turn: ``memory`` (no server),
then ``nats`` (the session's nats-server, marked ``integration``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from buffered_store.engine.ports import Wal
from tests.contracts.harness import MemoryHarness, NatsHarness, WalHarness


@pytest.fixture(params=["memory", pytest.param("nats", marks=pytest.mark.integration)])
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[WalHarness]:
    """Each contract test runs once over `MemoryWal`, once over `NatsWal`."""
    made: WalHarness
    if request.param == "memory":
        made = MemoryHarness()
    else:
        made = NatsHarness(request.getfixturevalue("nats_url"))
    try:
        yield made
    finally:
        await made.close()


@pytest.fixture
async def wal(harness: WalHarness) -> Wal:
    """A client with the default settings."""
    return await harness.open()
