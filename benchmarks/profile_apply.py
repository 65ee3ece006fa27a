"""Flusher CPU per applied entry: `PostgresThreadRunStore.apply` on batches like a cycle's.

Not a benchmark scenario: a small, reproducible probe for the client side of a flush
transaction (building parameters, psycopg encoding, row conversion). Each cycle gives
every thread `--entries` new checkpoint entries (each appends `--per-step` messages of
about `--size` bytes and bumps the thread's run) and applies them all in one `apply()`
call, as the flusher does. It reports client CPU (`time.process_time`) per entry and per
message row, the CPU of the Postgres server it started (all its processes: the work
done for the statements, and its background writers) per entry, and apart the CPU of
decoding the fetched messages' subjects and payloads,
`flusher.policy.classify`), which stays meaningful on a busy shared machine where wall
time does not. After the measured applies, `--trace-cycles` more are traced on the wire
(`wire.RoundTrips`): round trips per apply, counted without the store's help. With
`--delay-ms`, Postgres sits behind the delaying proxy (`proxy`, that many ms each way),
so the wall time per apply shows what its round trips cost over a real link.

    .venv/bin/python -m buffered_store.benchmarks.profile_apply               # own Postgres
    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/test \\
        .venv/bin/python -m buffered_store.benchmarks.profile_apply --profile apply.pstats
    .venv/bin/python -m buffered_store.benchmarks.profile_apply --delay-ms 1 --cycles 10
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
from sqlalchemy.engine import make_url

from buffered_store.dev.services import PostgresServer
from buffered_store.engine.flushing import ApplyStatus
from buffered_store.engine.ids import utcnow
from buffered_store.engine.keys import wal_subject
from buffered_store.engine.threadlog import group_by_thread
from buffered_store.model.changes import (
    WalEntry,
)
from buffered_store.model.checkpointing import build_checkpoint_entry, validate_checkpoint
from buffered_store.model.records import Message, RunRecord, Thread
from buffered_store.stores.postgres import PostgresThreadRunStore
from buffered_store.stores.urls import to_libpq_url
from buffered_store.threadrun.entry import (
    FORMAT,
    encode_entry,
)
from flusher.policy import classify

from .measure import process_cpu
from .proxy import ProxyProcess, start_proxy
from .wire import RoundTrips
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


async def traced_round_trips(
    store: PostgresThreadRunStore, writers: list[Writer], args: argparse.Namespace
) -> float:
    """Round trips per apply on the wire, over `--trace-cycles` more (unmeasured) applies."""
    if args.trace_cycles <= 0:
        return float("nan")
    counter = RoundTrips()
    try:
        with counter:
            await run_cycles(store, writers, args.trace_cycles, args, None)
        return counter.total / int(args.trace_cycles)
    finally:
        counter.close()


def server_cpu(server: PostgresServer | None) -> float | None:
    """CPU seconds of the Postgres server this probe started, all its processes (None:
    a server given by URL, whose processes may not be ours to read)."""
    pid = server.pid if server is not None else None
    return process_cpu(pid, children=True) if pid else None


async def behind_proxy(url: str, delay_ms: float) -> tuple[str, ProxyProcess]:
    """`url` rewritten to reach its server through a delaying proxy, and the proxy."""
    parsed = make_url(url)
    proxy = await start_proxy(
        parsed.host or "127.0.0.1", parsed.port or 5432, delay_ms=delay_ms, max_seconds=3600
    )
    return parsed.set(host="127.0.0.1", port=proxy.port).render_as_string(False), proxy


async def main(args: argparse.Namespace) -> None:
    """Warm-up cycles (new threads, prepared statements), the measured ones, the traced."""
    url = args.database_url or os.environ.get("DATABASE_URL")
    server = None
    if url is None:
        server = PostgresServer()
        server.start()
        url = server.url
    schema = f"probe_{uuid.uuid4().hex[:10]}"
    profiler = cProfile.Profile() if args.profile else None
    proxy = None
    try:
        store_url = url
        if args.delay_ms > 0:
            store_url, proxy = await behind_proxy(url, args.delay_ms)
        store = await PostgresThreadRunStore.connect(store_url, schema=schema, migrate=True)
        try:
            writers = [Writer(i, f"probe-{i}") for i in range(args.threads)]
            await run_cycles(store, writers, args.warmup, args, None)
            server_cpu0 = server_cpu(server)
            measured = await run_cycles(store, writers, args.cycles, args, profiler)
            server_cpu1 = server_cpu(server)
            decode, cpu, wall, applied = measured
            round_trips = await traced_round_trips(store, writers, args)
        finally:
            await store.close()
    finally:
        if proxy is not None:
            await proxy.stop()
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
    if server_cpu0 is not None and server_cpu1 is not None:
        print(f"postgres server cpu {(server_cpu1 - server_cpu0) * 1e6 / applied:.1f} µs/entry")
    print(f"decode (subject and payload) cpu {decode * 1e6 / applied:.1f} µs/entry")
    delay = f" (Postgres behind a {args.delay_ms:g} ms each way proxy)" if proxy else ""
    print(f"round trips {round_trips:.1f}/apply on the wire{delay}")
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
    p.add_argument(
        "--trace-cycles", type=int, default=3, help="applies traced to count round trips"
    )
    p.add_argument(
        "--delay-ms",
        type=float,
        default=0.0,
        help="put Postgres behind the delaying proxy, this many ms each way (0: direct)",
    )
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse()))
