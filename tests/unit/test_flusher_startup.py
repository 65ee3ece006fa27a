"""`bufstore flusher` start-up: waits for unavailable services, gives up on real errors."""

from __future__ import annotations

import asyncio

import pytest

from buffered_store.errors import (
    ConfigError,
    DatabaseUnavailableError,
    WalAccessDeniedError,
    WalUnavailableError,
)
from flusher.cli import start_patiently


async def test_start_waits_out_unavailable_services() -> None:
    failures = [WalUnavailableError("set up JetStream"), DatabaseUnavailableError("down")]

    async def attempt() -> str:
        if failures:
            raise failures.pop(0)
        return "running"

    stop = asyncio.Event()
    result = await start_patiently(attempt, stop, "start", initial_s=0.001, max_s=0.001)
    assert result == "running"
    assert failures == []


async def test_start_gives_up_at_once_on_a_configuration_error() -> None:
    calls = 0

    async def attempt() -> str:
        nonlocal calls
        calls += 1
        raise ConfigError("the consumer exists with another ack_wait")

    with pytest.raises(ConfigError):
        await start_patiently(attempt, asyncio.Event(), "start", initial_s=0.001, max_s=0.001)
    assert calls == 1


async def test_stop_ends_the_wait() -> None:
    stop = asyncio.Event()

    async def attempt() -> str:
        stop.set()  # SIGTERM arrives while the service is still down
        raise WalUnavailableError("no servers")

    assert await start_patiently(attempt, stop, "start", initial_s=10, max_s=10) is None


async def test_stop_ends_an_attempt_that_never_returns() -> None:
    # A connection attempt that hangs (a server that accepts but never answers, or a
    # client retrying on its own) must not keep SIGTERM waiting.
    stop = asyncio.Event()
    cancelled = asyncio.Event()
    entered = asyncio.Event()

    async def attempt() -> str:
        entered.set()
        try:
            await asyncio.Future()  # never done
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    starting = asyncio.ensure_future(start_patiently(attempt, stop, "start"))
    await entered.wait()
    stop.set()
    assert await starting is None
    assert cancelled.is_set()


async def test_stop_ends_an_attempt_that_swallows_its_cancellation() -> None:
    # CI failure of stop 33: SIGTERM as the TCP connection to a silent server opened.
    # nats-py's `wait_for(open_connection(...))` returned the connection and dropped the
    # cancellation (Python 3.11, gh-86296), then waited an hour for the INFO line. Here
    # the attempt swallows the first cancellation the same way, then waits on.
    stop = asyncio.Event()
    entered = asyncio.Event()
    cancellations = 0

    async def attempt() -> str:
        nonlocal cancellations
        entered.set()
        try:
            await asyncio.Future()  # the connection opens as the cancellation arrives
        except asyncio.CancelledError:
            cancellations += 1  # wait_for returns the result instead of raising
        try:
            await asyncio.Future()  # the INFO line that never comes
        except asyncio.CancelledError:
            cancellations += 1
            raise
        return "never"

    starting = asyncio.ensure_future(start_patiently(attempt, stop, "start"))
    await entered.wait()
    stop.set()
    # Not `asyncio.timeout`: its cancellation would reach the attempt through `starting`.
    await asyncio.wait({starting}, timeout=5)
    assert starting.done(), "start_patiently still waits on an attempt it cancelled once"
    assert starting.result() is None
    assert cancellations == 2


async def test_refused_credentials_are_not_retried() -> None:
    calls = 0

    async def attempt() -> str:
        nonlocal calls
        calls += 1
        raise WalAccessDeniedError("NATS refused the credentials")

    with pytest.raises(WalAccessDeniedError):
        await start_patiently(attempt, asyncio.Event(), "start", initial_s=0.001, max_s=0.001)
    assert calls == 1
