"""Two OS processes checkpoint one thread at the same time (invariant 2 across processes).

Each process runs `procs/writer.py` with its own `BufferedThreadRunStore`, NATS
connection and Postgres pool; they only share the WAL objects and the database.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from pathlib import Path
from typing import Any

from buffered_store.engine.threadlog import ThreadLog
from buffered_store.threadrun.entry import FORMAT
from tests.e2e.children import child_env
from tests.e2e.procs.writer import snapshot
from tests.plugins.stores import ConfigFactory, PostgresFactory, StoreFactory

WRITER = Path(__file__).parent / "procs" / "writer.py"
PER_PROCESS = 120
NAMES = ("p1", "p2")


async def run_writers(env: dict[str, str], thread: str) -> dict[str, list[dict[str, Any]]]:
    """Start one writer per name, release them together, return their JSON lines."""
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            str(WRITER),
            name,
            thread,
            str(PER_PROCESS),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        for name in NAMES
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 30)
            if line != b"ready\n":
                _, err = await proc.communicate()
                raise AssertionError(f"writer did not start: {line!r}\n{err.decode()}")
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            await proc.stdin.drain()
        outputs = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), 90)
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()  # only our own child, by its handle
                await proc.wait()
    result: dict[str, list[dict[str, Any]]] = {}
    for name, proc, (out, err) in zip(NAMES, procs, outputs, strict=True):
        lines = out.decode().splitlines()
        assert proc.returncode == 0, f"{name} failed:\n{err.decode()}"
        assert lines[-1] == "done", f"{name} did not finish:\n{err.decode()}"
        result[name] = [json.loads(line) for line in lines[:-1]]
    return result


async def test_two_processes_checkpoint_one_thread_with_unique_gap_free_seqs(
    make_config: ConfigFactory,
    open_store: StoreFactory,
    open_postgres: PostgresFactory,
    database_url: str,
    schema_name: str,
) -> None:
    """2 x 120 concurrent checkpoints of one thread from two processes: the receipts'
    seqs are exactly 1..240, each WAL entry is the one its receipt's writer sent, and
    after force_flush Postgres holds the snapshot and run of the entry with seq 240 (and
    each writer's run at its last step): no lost, duplicated or mixed checkpoint."""
    inner = await open_postgres()
    store = await open_store(inner, drain_on_close=False)  # creates the WAL objects
    thread = f"shared-{uuid.uuid4().hex[:8]}"
    lines = await run_writers(child_env(make_config(), database_url, schema_name), thread)

    owner: dict[int, tuple[str, int]] = {}
    conflicts = 0.0
    for name, records in lines.items():
        conflicts += records[-1]["stats"]["cas_conflicts"]
        errors = [r for r in records if "error" in r]
        assert not errors, f"{name}: {errors[:3]}"
        for record in records[:-1]:
            assert record["seq"] not in owner, f"seq {record['seq']} acknowledged twice"
            owner[record["seq"]] = (name, record["step"])
    total = PER_PROCESS * len(NAMES)
    assert sorted(owner) == list(range(1, total + 1))
    assert conflicts > 0, "the two writers never overlapped: the test proved nothing"

    log = ThreadLog(store.wal, store.config, FORMAT)
    hot = await log.hot(thread)
    assert hot is not None
    assert hot.record.seq == total
    for entry in await log.entries_between(thread, 0, total, hot.record):
        name, step = owner[entry.seq]
        assert entry.run is not None
        assert (entry.run.run_id, entry.run.steps) == (f"run-{name}", step), entry.seq
        assert entry.message_count == len(snapshot(name, step))

    assert await store.force_flush(thread) == total
    name, step = owner[total]
    assert await inner.load_messages(thread) == snapshot(name, step)
    latest = await inner.latest_run(thread)
    assert latest is not None
    assert (latest.run_id, latest.steps) == (f"run-{name}", step)
    for writer in NAMES:
        run = await inner.load_run(f"run-{writer}")
        assert run is not None
        assert run.steps == PER_PROCESS
    assert (await inner.flushed_seqs([thread]))[thread] == total
