"""The admin commands: `status` only reads, `force-flush --all` reports its progress and,
when it times out, which threads it flushed and which not, without leaving threads that
`status` shows as pending forever."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from nats.js.errors import NotFoundError

from buffered_store.cli.store import collect_status
from buffered_store.config import BufferedStoreConfig
from buffered_store.engine.flushing import ApplyOutcome
from buffered_store.errors import FlushTimeoutError, StoreError
from buffered_store.model.changes import (
    WalEntry,
)
from buffered_store.testing import FaultyFlushTarget, InnerStore, make_run
from buffered_store.threadrun.store import BufferedThreadRunStore
from tests.plugins.stores import ConfigFactory, jetstream

BUFSTORE = str(Path(sys.executable).with_name("bufstore"))


class CommitsThenHangs(FaultyFlushTarget):
    """Applies every batch, then never answers for the batches of `thread_id`: a flush
    whose transaction committed and whose caller gave up before hearing so."""

    def __init__(self, inner: InnerStore, thread_id: str) -> None:
        super().__init__(inner)
        self.thread_id = thread_id
        self.hanging = asyncio.Event()

    async def apply(self, batches: Sequence[Sequence[WalEntry]]) -> list[ApplyOutcome]:
        outcomes = await super().apply(batches)
        if any(entries and entries[0].thread_id == self.thread_id for entries in batches):
            self.hanging.set()
            await asyncio.Future()  # never answers
        return outcomes


async def test_status_of_a_stream_that_does_not_exist_creates_nothing(
    make_config: ConfigFactory,
) -> None:
    config = make_config(stream_name="MISTYPED_THREADLOG")
    with pytest.raises(StoreError, match="'MISTYPED_THREADLOG' does not exist"):
        await collect_status(config, limit=10)
    async with jetstream(config) as js:
        with pytest.raises(NotFoundError):
            await js.stream_info("MISTYPED_THREADLOG")
        with pytest.raises(NotFoundError):
            await js.stream_info(f"KV_{config.hot_bucket}")


async def test_timed_out_flush_all_names_what_it_did_and_status_does_not_stay_pending(
    config: BufferedStoreConfig,
    pg_inner: InnerStore,
    database_url: str,
    schema_name: str,
) -> None:
    target = CommitsThenHangs(pg_inner, "c")
    async with BufferedThreadRunStore.connect(target, config) as store:
        for thread_id in ("a", "b", "c"):
            await store.checkpoint(
                thread_id,
                [{"role": "user", "content": "hi"}],
                make_run(thread_id, f"r-{thread_id}"),
            )
        reports: list[tuple[int, int]] = []
        with pytest.raises(FlushTimeoutError) as caught:
            await store.force_flush_all(timeout=1.0, progress=lambda d, t: reports.append((d, t)))
        error = caught.value
        assert (error.flushed, error.not_flushed) == (2, ("c",))
        assert "2 of 3 thread(s) flushed; not flushed: 'c'" in str(error)
        assert reports[0] == (0, 3)
        assert reports[-1] == (2, 3)
        assert target.hanging.is_set()

        # c's data and watermark are in Postgres; its KV mark never came.
        with_db = await collect_status(
            config, limit=10, database_url=database_url, schema=schema_name
        )
        assert with_db["pending_threads"] == 0, with_db["threads"]
        kv_only = await collect_status(config, limit=10)
        assert [row["thread_id"] for row in kv_only["threads"]] == ["c"]

        target.thread_id = ""  # answers again
        assert await store.force_flush("c") == 1  # nothing to apply: the mark catches up
        repaired = await collect_status(config, limit=10)
        assert repaired["pending_threads"] == 0, repaired["threads"]


async def test_force_flush_all_prints_progress_lines_when_not_on_a_terminal(
    make_config: ConfigFactory, pg_inner: InnerStore, database_url: str, schema_name: str
) -> None:
    config = make_config(drain_on_close=False)  # the command is to flush them
    async with BufferedThreadRunStore.connect(pg_inner, config) as store:
        for thread_id in ("a", "b"):
            await store.checkpoint(
                thread_id, [{"role": "user", "content": "x"}], make_run(thread_id, f"r-{thread_id}")
            )
    env = {
        **{k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ},
        "BUFSTORE_NATS_URL": config.nats_url,
        "BUFSTORE_STREAM_NAME": config.stream_name,
        "BUFSTORE_HOT_BUCKET": config.hot_bucket,
        "BUFSTORE_QUARANTINE_BUCKET": config.quarantine_bucket,
        "BUFSTORE_CONSUMER_NAME": config.consumer_name,
        "DATABASE_URL": database_url,
        "BUFSTORE_SCHEMA": schema_name,
    }
    done = await asyncio.to_thread(
        subprocess.run,
        [BUFSTORE, "force-flush", "--all"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "flushed 0/2 thread(s)" in done.stderr
    assert "flushed 2/2 thread(s)" in done.stderr
    assert "flushed 2 thread(s)" in done.stdout
