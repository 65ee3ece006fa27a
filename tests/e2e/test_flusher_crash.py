"""A flusher process SIGKILLed at its worst moments, then a fresh one (invariants 1, 7-9).

The flusher honours ``BUFSTORE_CRASH_POINT`` (a test hook):

- ``after_commit``: SIGKILL itself right after the apply transaction committed, before
  any ack: Postgres holds the batch and every message of it comes back (applied again:
  stale, acked);
- ``mid_batch``: SIGKILL itself after fetching a batch, before applying it.

After the crash a fresh flusher process drains the redelivered and the newer entries.
A third case has the test SIGKILL a busy flusher at whatever moment it made progress,
without any hook. Nothing may be lost or applied twice: every thread ends with the
snapshot of its last acknowledged checkpoint, every run at its last version (an entry
applied out of order would leave an older one), the watermark at the latest seq, no KV
flushed mark raised by a flusher cycle (acks follow the commit instead), and the consumer
has nothing pending.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
import uuid

import pytest

from buffered_store.engine.threadlog import ThreadLog
from buffered_store.model.records import Message, RunRecord
from buffered_store.testing import InnerStore, make_run
from buffered_store.threadrun.entry import FORMAT
from buffered_store.threadrun.store import BufferedThreadRunStore
from tests.e2e.children import child_env
from tests.plugins.stores import ConfigFactory, PostgresFactory, StoreFactory

THREADS = 5
ACK_WAIT_S = 2.0
"""Short, so messages of the killed flusher come back quickly."""
FLUSH_INTERVAL_S = 0.2


def snapshot(thread: str, step: int) -> list[Message]:
    return [{"role": "user", "content": f"{thread}:{step}:{i}"} for i in range(1 + step % 4)]


class Workload:
    """Checkpoints of several threads, each with a few runs; remembers what was acked."""

    def __init__(self, store: BufferedThreadRunStore) -> None:
        self.store = store
        self.threads = [f"t{i}-{uuid.uuid4().hex[:8]}" for i in range(THREADS)]
        self.step = dict.fromkeys(self.threads, 0)
        self.runs: dict[str, RunRecord] = {}
        """Latest acknowledged version of each run."""

    async def write(self, rounds: int) -> None:
        for _ in range(rounds):
            for thread in self.threads:
                step = self.step[thread] + 1
                run = make_run(thread, run_id=f"run-{thread}-{step // 4}", steps=step)
                receipt = await self.store.checkpoint(thread, snapshot(thread, step), run)
                assert receipt.thread_seq == step
                self.step[thread] = step
                self.runs[run.run_id] = run

    async def assert_flushed(self, inner: InnerStore) -> None:
        log = ThreadLog(self.store.wal, self.store.config, FORMAT)
        seqs = await inner.flushed_seqs(self.threads)
        for thread in self.threads:
            step = self.step[thread]
            assert seqs[thread] == step, thread
            assert await inner.load_messages(thread) == snapshot(thread, step)
            assert await log.mark(thread) is None, thread  # cycles raise no KV marks
        for run_id, run in self.runs.items():
            assert await inner.load_run(run_id) == run, run_id


async def start_flusher(
    env: dict[str, str], database_url: str, schema: str
) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "flusher",
        "--database-url",
        database_url,
        "--schema",
        schema,
        "--stats-interval",
        "0",
        "--log-level",
        "WARNING",
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )


async def stop_process(proc: asyncio.subprocess.Process) -> bytes:
    """Stop our own child (SIGTERM, then SIGKILL) and return its stderr."""
    if proc.returncode is None:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 15)
        except TimeoutError:
            proc.kill()
    assert proc.stderr is not None
    _, err = await proc.communicate()
    return err


async def consumer_idle(store: BufferedThreadRunStore) -> bool:
    info = await store.wal.consumer_state()
    return not info.num_pending and not info.num_ack_pending


async def crash(
    proc: asyncio.subprocess.Process,
    store: BufferedThreadRunStore,
    inner: InnerStore,
    work: Workload,
) -> bool:
    """Wait until the doomed flusher exits (True), or flushed everything instead of
    crashing (False: the BUFSTORE_CRASH_POINT hook is missing)."""
    deadline = time.monotonic() + 30
    while proc.returncode is None:
        assert time.monotonic() < deadline, "the flusher neither crashed nor flushed"
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), 0.2)
        if proc.returncode is None:
            flushed = await inner.flushed_seqs(work.threads)
            if flushed == work.step and await consumer_idle(store):
                return False
    return True


async def kill_while_flushing(
    proc: asyncio.subprocess.Process, inner: InnerStore, work: Workload
) -> None:
    """SIGKILL our flusher child as soon as it made progress while writes go on."""
    deadline = time.monotonic() + 30
    while not any((await inner.flushed_seqs(work.threads)).values()):
        assert time.monotonic() < deadline, "the flusher never flushed anything"
        await work.write(rounds=1)
    await work.write(rounds=1)
    proc.kill()  # our own child, by its handle
    await proc.wait()


@pytest.mark.parametrize("crash_point", ["after_commit", "mid_batch", "sigkill_by_test"])
async def test_killed_flusher_loses_nothing_and_applies_nothing_twice(
    make_config: ConfigFactory,
    open_store: StoreFactory,
    open_postgres: PostgresFactory,
    database_url: str,
    schema_name: str,
    crash_point: str,
) -> None:
    inner = await open_postgres()
    overrides = {"ack_wait_s": ACK_WAIT_S, "flush_interval_s": FLUSH_INTERVAL_S}
    store = await open_store(inner, drain_on_close=False, **overrides)
    work = Workload(store)
    await work.write(rounds=8)
    env = child_env(make_config(**overrides), database_url, schema_name)
    env.update(
        BUFSTORE_ACK_WAIT_S=str(ACK_WAIT_S),
        BUFSTORE_FLUSH_INTERVAL_S=str(FLUSH_INTERVAL_S),
        BUFSTORE_SCHEMA=schema_name,
    )

    if crash_point == "sigkill_by_test":
        doomed = await start_flusher(env, database_url, schema_name)
        await kill_while_flushing(doomed, inner, work)
    else:
        doomed = await start_flusher(
            {**env, "BUFSTORE_CRASH_POINT": crash_point}, database_url, schema_name
        )
        if not await crash(doomed, store, inner, work):
            await stop_process(doomed)
            pytest.fail(
                "the flusher flushed everything without crashing: it does not honour "
                f"BUFSTORE_CRASH_POINT={crash_point} yet"
            )
        assert doomed.returncode == -signal.SIGKILL, (
            f"flusher exited with {doomed.returncode}, not by SIGKILL at {crash_point}\n"
            + (await stop_process(doomed)).decode()[-2000:]
        )
        # The hook fires on the first batch (every entry is pending when the flusher
        # starts). after_commit: Postgres holds the batch; mid_batch: nothing was
        # applied. Either way nothing was acked.
        stored = await inner.flushed_seqs(work.threads)
        if crash_point == "after_commit":
            assert any(stored.values()), f"nothing was committed before the crash: {stored}"
        else:
            assert not any(stored.values()), f"the batch was applied before the crash: {stored}"
        assert not await consumer_idle(store), "messages were acked before the crash"
    assert doomed.returncode == -signal.SIGKILL

    await work.write(rounds=3)  # newer entries while no flusher runs
    fresh = await start_flusher(env, database_url, schema_name)
    try:
        deadline = time.monotonic() + 30
        while not (
            await consumer_idle(store) and (await inner.flushed_seqs(work.threads)) == work.step
        ):
            assert fresh.returncode is None, (await stop_process(fresh)).decode()[-2000:]
            assert time.monotonic() < deadline, "the fresh flusher did not drain the WAL"
            await asyncio.sleep(0.1)  # another process is working: poll, with a deadline
        await work.assert_flushed(inner)
        for thread in work.threads:
            status = await store.flush_status(thread)
            assert (status.flushed_seq, status.pending) == (work.step[thread], 0)
    finally:
        err = await stop_process(fresh)
    assert fresh.returncode == 0, err.decode()[-2000:]
