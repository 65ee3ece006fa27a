"""Flusher CPU per applied entry: `PostgresThreadRunStore.apply` on batches like a cycle's.

Not a benchmark scenario: a small, reproducible probe for the client side of a flush
transaction (building parameters, psycopg encoding, row conversion). Each cycle gives
every thread `--entries` new checkpoint entries (each appends `--per-step` messages of
about `--size` bytes and bumps the thread's run) and applies them all in one `apply()`
call, as the flusher does. It reports client CPU (`time.process_time`) per entry and per
message row (and, apart, the CPU of decoding the fetched messages' subjects and payloads,
`flusher.policy.classify`), which stays meaningful on a busy shared machine where wall
time does not.

    .venv/bin/python -m buffered_store.benchmarks.profile_apply               # own Postgres
    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/test \\
        .venv/bin/python -m buffered_store.benchmarks.profile_apply --profile apply.pstats
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import time
import uuid
from dataclasses import dataclass, field

import psycopg

from buffered_store.dev.services import PostgresServer
from buffered_store.engine.flushing import ApplyStatus
from buffered_store.engine.ids import utcnow
from buffered_store.engine.keys import wal_subject
from buffered_store.engine.threadlog import group_by_thread
from buffered_store.stores.postgres import PostgresThreadRunStore
from buffered_store.stores.urls import to_libpq_url
from buffered_store.threadrun.checkpointing import build_checkpoint_entry, validate_checkpoint
from buffered_store.threadrun.entry import FORMAT, WalEntry, encode_entry
from buffered_store.threadrun.records import Message, RunRecord, Thread
from flusher.policy import classify

from .workload import message

STREAM = "THREADLOG"


@dataclass
class Writer:
    """One thread's writer: builds its WAL entries the way the buffered store does."""

    index: int
    thread_id: str
    seq: int = 0
    step: int = 0
    thread: Thread | None = None
    history: list[Message] = field(default_factory=list)
    encoded: list[bytes] | None = None

    def next_entry(self, per_step: int, size: int) -> WalEntry:
        """The entry of the next step: `per_step` new messages, the run bumped."""
        self.step += 1
        self.history.extend(message(self.index, self.step, k, size, None) for k in range(per_step))
        run = RunRecord(
            run_id=f"{self.thread_id}-run", thread_id=self.thread_id, agent_id="agent"
        ).replace(steps=self.step)
        call = validate_checkpoint(self.thread_id, self.history, run, None)
        entry = build_checkpoint_entry(
            call,
            previous=self.thread,
            previous_messages=self.encoded,
            seq=self.seq + 1,
            now=utcnow(),
        )
        self.seq, self.thread, self.encoded = entry.seq, entry.thread, call.encoded
        return entry


async def run_cycles(
    store: PostgresThreadRunStore,
    writers: list[Writer],
    cycles: int,
    args: argparse.Namespace,
    profiler: cProfile.Profile | None,
) -> tuple[float, float, float, int]:
    """CPU seconds spent decoding the cycle's messages and in `apply()`, wall seconds in
    `apply()`, over `cycles`; and the entries applied."""
    decode = cpu = wall = 0.0
    applied = 0
    for _ in range(cycles):
        fetched = [
            (wal_subject(STREAM, w.thread_id), encode_entry(w.next_entry(args.per_step, args.size)))
            for w in writers
            for _ in range(args.entries)
        ]
        if profiler is not None:
            profiler.enable()
        cpu0 = time.process_time()
        # What the flusher does with each fetched message before grouping it by thread.
        decoded = [classify(FORMAT, STREAM, subject, data, 0) for subject, data in fetched]
        decode += time.process_time() - cpu0
        batches = list(group_by_thread([e for e in decoded if isinstance(e, WalEntry)]).values())
        cpu0, wall0 = time.process_time(), time.perf_counter()
        outcomes = await store.apply(batches)
        cpu += time.process_time() - cpu0
        wall += time.perf_counter() - wall0
        if profiler is not None:
            profiler.disable()
        if any(o.status is not ApplyStatus.APPLIED for o in outcomes):
            raise RuntimeError(
                f"not applied: {[o for o in outcomes if o.status.value != 'applied']}"
            )
        applied += sum(len(b) for b in batches)
    return decode, cpu, wall, applied


async def main(args: argparse.Namespace) -> None:
    """Warm-up cycles (new threads, prepared statements), then the measured ones."""
    url = args.database_url or os.environ.get("DATABASE_URL")
    server = None
    if url is None:
        server = PostgresServer()
        server.start()
        url = server.url
    schema = f"probe_{uuid.uuid4().hex[:10]}"
    profiler = cProfile.Profile() if args.profile else None
    try:
        store = await PostgresThreadRunStore.connect(url, schema=schema, migrate=True)
        try:
            writers = [Writer(i, f"probe-{i}") for i in range(args.threads)]
            await run_cycles(store, writers, args.warmup, args, None)
            measured = await run_cycles(store, writers, args.cycles, args, profiler)
            decode, cpu, wall, applied = measured
        finally:
            await store.close()
    finally:
        async with await psycopg.AsyncConnection.connect(
            to_libpq_url(url), autocommit=True
        ) as conn:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'.encode())
        if server is not None:
            server.close()
    rows = applied * args.per_step
    print(
        f"{args.threads} threads x {args.entries} entries per apply, {args.per_step} message(s) "
        f"of ~{args.size} B per entry, {args.cycles} applies measured"
    )
    print(
        f"cpu {cpu * 1e6 / applied:.1f} µs/entry, {cpu * 1e6 / rows:.1f} µs/message row; "
        f"wall {wall * 1e3 / args.cycles:.1f} ms/apply"
    )
    print(f"decode (subject and payload) cpu {decode * 1e6 / applied:.1f} µs/entry")
    if profiler is not None:
        profiler.dump_stats(args.profile)
        print(f"profile written to {args.profile}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line."""
    p = argparse.ArgumentParser(
        prog="python -m buffered_store.benchmarks.profile_apply", description=__doc__
    )
    p.add_argument(
        "--database-url", help="use this server (default: $DATABASE_URL, else start one)"
    )
    p.add_argument("--threads", type=int, default=64, help="threads per apply")
    p.add_argument("--entries", type=int, default=4, help="entries per thread per apply")
    p.add_argument("--per-step", type=int, default=2, help="messages appended per entry")
    p.add_argument("--size", type=int, default=800, help="approximate bytes per message")
    p.add_argument("--warmup", type=int, default=3, help="applies not measured")
    p.add_argument("--cycles", type=int, default=40, help="applies measured")
    p.add_argument("--profile", help="write a cProfile of the measured applies to this file")
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse()))
