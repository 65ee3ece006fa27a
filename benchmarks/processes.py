"""Helper processes and connections of a run: the flusher worker, the WAL monitor.

The flusher runs as its own process (`python -m buffered_store.benchmarks.flusher_worker`), as it is
deployed: it does not share the writers' event loop or GIL, and its CPU time is its own.
It prints its `Flusher.stats()` (plus its own CPU seconds) as JSON lines, read here.

The monitor has its own NATS connection, so asking for the consumer's backlog never
counts as a round trip of the store under test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client
from nats.js.api import StorageType, StreamConfig
from nats.js.errors import NotFoundError

from buffered_store.config import WriterConfig
from buffered_store.dev.services import Services, start_services

from . import PACKAGE

FLUSHER_ENV_FIELDS = (
    "nats_url",
    "stream_name",
    "hot_bucket",
    "quarantine_bucket",
    "consumer_name",
    "flush_interval_s",
    "flush_batch_size",
    "max_age_s",
    "retain_flushed_s",
    "wal_max_bytes",
)


class FlusherProcess:
    """A `Flusher` in a child process, with its latest stats."""

    def __init__(self, proc: asyncio.subprocess.Process, log_path: Path) -> None:
        self.proc = proc
        self.log_path = log_path
        self.latest: dict[str, Any] = {}
        self.cpu_s: float | None = None
        self.ready = asyncio.Event()
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def start(
        cls,
        *,
        database_url: str,
        schema: str,
        config: WriterConfig,
        log_path: Path,
        profile_path: Path | None = None,
        interval_s: float = 0.25,
        front_end: str = "threadrun",
        extra_env: dict[str, str] | None = None,
    ) -> FlusherProcess:
        """Start the worker and wait until its flusher runs. `front_end` "langgraph" drains
        the LangGraph checkpointer's WAL into LangGraph's tables at `database_url` (a libpq
        URL; `schema` is then unused: the URL's search_path finds the tables). `extra_env`
        sets more ``BUFSTORE_*`` variables of the worker (e.g. flusher-only settings)."""
        env = dict(os.environ)
        for name in FLUSHER_ENV_FIELDS:
            env["BUFSTORE_" + name.upper()] = str(getattr(config, name))
        env.update(extra_env or {})
        args = [
            "-m",
            f"{PACKAGE}.flusher_worker",
            "--database-url",
            database_url,
            "--schema",
            schema,
            "--interval-s",
            str(interval_s),
            "--front-end",
            front_end,
        ]
        if profile_path is not None:
            args += ["--profile", str(profile_path)]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=log
            )
        worker = cls(proc, log_path)
        try:
            async with asyncio.timeout(60):
                await worker.ready.wait()
        except TimeoutError:
            await worker.stop()
            raise RuntimeError(f"flusher worker did not start; see {log_path}") from None
        return worker

    @property
    def pid(self) -> int | None:
        """The worker's pid while it runs."""
        return self.proc.pid if self.proc.returncode is None else None

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for line in self.proc.stdout:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            self.latest = record.get("stats", {})
            self.cpu_s = record.get("cpu_s")
            self.ready.set()
        self.ready.set()

    async def stop(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """SIGTERM (the worker stops its flusher with a drain) and wait; final stats."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await self.proc.wait()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._reader, 5)
        return self.latest


class WalMonitor:
    """Backlog of the flusher consumer, on a connection of its own."""

    def __init__(self, nc: Client, config: WriterConfig) -> None:
        self.nc = nc
        self.config = config
        self.js = nc.jetstream(timeout=5)

    @classmethod
    async def connect(cls, config: WriterConfig) -> WalMonitor:
        """Connect to the config's NATS server."""
        nc = await nats.connect(
            config.nats_url, name="bench-monitor", max_reconnect_attempts=-1, connect_timeout=5
        )
        return cls(nc, config)

    async def backlog(self) -> int | None:
        """WAL entries the flusher has not acknowledged (pending + in flight), or None."""
        try:
            info = await self.js.consumer_info(self.config.stream_name, self.config.consumer_name)
        except Exception:
            return None
        return int(info.num_pending or 0) + int(info.num_ack_pending or 0)

    async def wait_drained(self, timeout_s: float) -> float | None:
        """Seconds until the backlog reached 0, or None when it did not within the timeout."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        while loop.time() - start < timeout_s:
            if await self.backlog() == 0:
                return loop.time() - start
            await asyncio.sleep(0.1)
        return None

    async def delete_objects(self) -> None:
        """Remove the run's stream and buckets (best effort)."""
        cfg = self.config
        for stream in (cfg.stream_name, f"KV_{cfg.hot_bucket}", f"KV_{cfg.quarantine_bucket}"):
            with contextlib.suppress(NotFoundError, Exception):
                await self.js.delete_stream(stream)

    async def close(self) -> None:
        """Close the connection."""
        with contextlib.suppress(Exception):
            await self.nc.close()


async def delete_wal_objects(config: WriterConfig) -> None:
    """Remove the stream and buckets `config` names (best effort), on a connection of its
    own: what a probe made for its run."""
    monitor = await WalMonitor.connect(config)
    try:
        await monitor.delete_objects()
    finally:
        await monitor.close()


def probe_nats(nats_url: str | None) -> Services:
    """The NATS a probe runs on: `nats_url` (its ``--nats-url``), else $NATS_URL, else a
    nats-server of its own (or a container, as `start_services` decides); close it after."""
    env = {**os.environ, "NATS_URL": nats_url} if nats_url else None
    return start_services(postgres=False, env=env)


@contextlib.asynccontextmanager
async def scratch_stream(url: str, prefix: str) -> AsyncIterator[tuple[Client, str]]:
    """A NATS connection and a file stream of its own, `prefix_<8 hex digits>` on the
    subjects `<name>.>` (stored as the WAL is), for a probe's bare publishes: the
    connection and the stream's name; the stream is deleted and the connection closed
    on exit."""
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await js.add_stream(
            StreamConfig(name=name, subjects=[f"{name}.>"], storage=StorageType.FILE)
        )
        try:
            yield nc, name
        finally:
            await js.delete_stream(name)
    finally:
        await nc.close()
