"""`NatsWal`: the engine's ports (`buffered_store.engine.ports`) on a stream, two KV
buckets and the flusher's durable consumer, over one NATS connection.

Thin on purpose: it awaits, translates nats errors into our family (`translated`) and
counts requests; deciding what to write is the callers' business. No nats-py object
leaves the package. Each job lives in its own module: set-up (`setup`), the stream and
the consumer (`stream`, `scan`), the KV buckets (`kv`), requests (`requests`) and the
state they share (`handles`); this one opens and closes the connection.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Literal

from buffered_store.backoff import Backoff
from buffered_store.config import EngineConfig
from buffered_store.errors import WalUnavailableError
from buffered_store.nats.connection import Reconnect, open_client
from buffered_store.nats.kv import HotKv
from buffered_store.nats.setup import WalSetup
from buffered_store.nats.stream import WalStream

log = logging.getLogger("buffered_store.nats.wal")


class NatsWal(WalSetup, WalStream, HotKv):
    """One NATS connection with the project's JetStream objects (the `engine.ports.Wal`)."""

    @classmethod
    async def connect(
        cls,
        config: EngineConfig,
        *,
        name: str = "bufstore",
        setup: Literal["ensure", "open", "none"] = "ensure",
        reconnect: Reconnect = "forever",
        connect_timeout_s: float | None = None,
        front_end: str | None = None,
        confirm_stream: Callable[[NatsWal], Awaitable[None]] | None = None,
    ) -> NatsWal:
        """Connect and open the JetStream objects.

        ``setup``: ``"ensure"`` (default) creates whatever object is missing; ``"open"``
        opens existing ones (`StoreError` naming a missing stream, consumer or hot
        bucket); ``"none"`` touches no server object, for handles that only read the
        stream.

        The first connection and the set-up must stand within `connect_timeout_s`
        (default ``config.connect_timeout_s``; `WalUnavailableError` naming the server
        after it); refused credentials or TLS raise `WalAccessDeniedError` at once. A
        set-up that JetStream does not answer (a cluster electing its meta or stream
        leader, a server still recovering its streams) is tried again within that
        budget; one it refuses (`ConfigError`, `WalRefusedError`, a missing object) is
        not. ``reconnect``: ``"forever"`` (default: stores and flushers) reconnects after
        any later loss; ``"never"`` gives up on a lost connection (Spark tasks);
        ``"probe"`` too, tries each server once, without retries, and logs nothing (a
        one-shot health check).
        See `connection.open_client`.

        ``front_end`` (``"threadrun"``, ``"langgraph"``): a stream created here is tagged
        with it (stream metadata), and a stream tagged for another front-end is refused
        with `ConfigError` (see `buffered_store.engine.frontend`). ``confirm_stream``
        runs right after the stream is opened, before anything else is created (a
        flusher judges an untagged stream there).
        """
        budget_s = (
            config.connection.connect_timeout_s if connect_timeout_s is None else connect_timeout_s
        )
        loop = asyncio.get_running_loop()
        backoff = Backoff(initial_s=0.1, max_s=1.0, budget_s=budget_s)
        backoff.left(loop.time())  # one deadline for the connection and the set-up
        nc = await open_client(
            config.connection, name=name, reconnect=reconnect, timeout_s=budget_s
        )
        wal = cls(nc, config, front_end=front_end)
        try:
            while setup != "none":
                try:
                    await (
                        wal.ensure_objects(confirm_stream)
                        if setup == "ensure"
                        else wal.open_objects()
                    )
                    break
                except WalUnavailableError as exc:
                    wait = None if reconnect == "probe" else backoff.next_wait(loop.time())
                    if wait is None:
                        raise WalUnavailableError(
                            f"{exc} (JetStream did not answer the set-up within {budget_s:g} s, "
                            f"{backoff.attempts} attempt(s))"
                        ) from exc
                    log.info(
                        "JetStream did not answer the set-up (%s); trying again",
                        exc,
                        extra={"action": "jetstream_setup_retry", "attempts": backoff.attempts},
                    )
                    await asyncio.sleep(wait)
        except BaseException:
            await nc.close()
            raise
        return wal

    async def close(self, *, drain: bool = True) -> None:
        """Flush pending writes (unless `drain` is False) and close the connection."""
        if not self._nc.is_closed:
            if not drain:
                await self._nc.close()
                return
            try:
                await asyncio.wait_for(self._nc.drain(), timeout=self.config.request_timeout_s)
            except Exception:  # closing anyway; nothing is pending that matters
                await self._nc.close()
