"""A slower link to Postgres: the delaying proxy (`proxy.py`) in front of the server,
calibrated so that it adds the round trip asked for, with the round trips measured."""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import psycopg

from .harness import with_host
from .proxy import ProxyProcess, start_proxy


def ping_ms(url: str, count: int) -> float:
    """Median `SELECT 1` round trip (ms) over `count`, on one connection to `url`."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT 1")
        samples = []
        for _ in range(count):
            began = time.perf_counter()
            conn.execute("SELECT 1")
            samples.append((time.perf_counter() - began) * 1000)
    return statistics.median(samples)


@dataclass
class Link:
    """A delaying proxy in front of Postgres, calibrated to add a round trip."""

    proxy: ProxyProcess
    added_rtt_ms: float
    """The round trip the link is meant to add."""
    delay_ms_each_way: float
    """What the proxy sleeps in each direction, after calibration."""
    plain_ms: float
    proxied_ms: float
    count: int
    first_try: dict[str, float] = field(default_factory=dict)

    @property
    def route(self) -> tuple[str, int]:
        """Host and port that reach Postgres through the link."""
        return "127.0.0.1", self.proxy.port

    def via(self, url: str) -> str:
        """`url` (libpq or SQLAlchemy) reaching the same database through the link."""
        return with_host(url, *self.route)

    def figures(self) -> dict[str, Any]:
        """The link as measured, for results.json."""
        return {
            "added_rtt_ms_target": self.added_rtt_ms,
            "delay_ms_each_way_used": self.delay_ms_each_way,
            "calibration_first_try": self.first_try,
            "select_1_median_of": self.count,
            "measured_rtt_ms": {
                "plain": self.plain_ms,
                "proxied": self.proxied_ms,
                "added": self.proxied_ms - self.plain_ms,
            },
        }

    def describe(self) -> str:
        """The link in one paragraph, for a report."""
        return (
            f"`SELECT 1` round trip, median of {self.count}: {self.plain_ms:.3f} ms direct, "
            f"{self.proxied_ms:.3f} ms through the proxy: the link adds "
            f"{self.proxied_ms - self.plain_ms:.3f} ms per round trip. Target added round "
            f"trip: {self.added_rtt_ms:g} ms; the proxy sleeps {self.delay_ms_each_way:.3f} ms "
            f"each way after calibration (first try with "
            f"{self.first_try['delay_ms_each_way']:g} ms added "
            f"{self.first_try['added_ms']:.3f} ms)."
        )


async def open_link(postgres_url: str, added_rtt_ms: float, *, count: int) -> Link:
    """A proxy in front of the Postgres server of `postgres_url` (libpq) adding
    `added_rtt_ms` per round trip, half of it each way. The proxy's sleeps overshoot a
    little, so the per-direction delay is calibrated once against the measured `SELECT
    1` round trip: a slower link than asked would flatter the buffered side. Stop it
    with `link.proxy.stop()`."""
    target = urlsplit(postgres_url)
    host, port = target.hostname or "127.0.0.1", target.port or 5432
    plain = await asyncio.to_thread(ping_ms, postgres_url, count)
    delay_ms = added_rtt_ms / 2
    proxy = await start_proxy(host, port, delay_ms=delay_ms, max_seconds=4 * 3600)
    proxied = await asyncio.to_thread(
        ping_ms, with_host(postgres_url, "127.0.0.1", proxy.port), count
    )
    first_try = {"delay_ms_each_way": delay_ms, "added_ms": proxied - plain}
    excess = (proxied - plain) - added_rtt_ms
    if excess > 0.05:
        await proxy.stop()
        delay_ms = max(0.0, delay_ms - excess / 2)
        proxy = await start_proxy(host, port, delay_ms=delay_ms, max_seconds=4 * 3600)
        proxied = await asyncio.to_thread(
            ping_ms, with_host(postgres_url, "127.0.0.1", proxy.port), count
        )
    return Link(proxy, added_rtt_ms, delay_ms, plain, proxied, count, first_try)
