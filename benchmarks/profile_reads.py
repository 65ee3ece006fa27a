"""Client CPU and latency per read of the WAL's hot bucket through `NatsWal`.

Not a benchmark scenario: a small probe for the read path's requests (a run's first read
gets the thread's hot record and the last entry of its subject beside a Postgres read;
list reads, reads of a tail and the flusher's checks make the same direct gets). It
writes `--keys` hot records, then reads them back with `NatsWal.kv_get`, first one at a
time (`--gets` in all) and then `--concurrency` at once: the client's CPU
(`time.process_time`) per get, the median wall time of a get and the gets per second.

    .venv/bin/python -m buffered_store.benchmarks.profile_reads               # own nats-server
    .venv/bin/python -m buffered_store.benchmarks.profile_reads --rounds 3 --json out.jsonl

Compare two commits by running it alternately from two checkouts (``PYTHONPATH`` set to
each), the figures taken run by run: one run is noisy on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from typing import Any

from buffered_store.config import BufferedStoreConfig
from buffered_store.nats import NatsWal

from .processes import delete_wal_objects, probe_nats


async def read_case(wal: NatsWal, keys: list[str], gets: int, concurrency: int) -> dict[str, Any]:
    """`gets` reads of `keys` in turn, `concurrency` at a time: CPU and wall figures."""
    durations: list[float] = []
    per_worker = max(1, gets // concurrency)

    async def worker(index: int) -> None:
        for step in range(per_worker):
            began = time.perf_counter()
            value = await wal.kv_get(keys[(index * 7 + step) % len(keys)])
            durations.append(time.perf_counter() - began)
            if value is None:
                raise RuntimeError("a hot record written before the run was not found")

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    count = per_worker * concurrency
    return {
        "concurrency": concurrency,
        "gets": count,
        "cpu_us_per_get": round(1e6 * cpu / count, 1),
        "wall_p50_ms": round(1e3 * statistics.median(durations), 3),
        "gets_per_s": round(count / wall),
    }


async def measure(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The cases of one run, on fresh objects deleted after."""
    tag = uuid.uuid4().hex[:8]
    config = BufferedStoreConfig(
        nats_url=url,
        stream_name=f"READS_{tag}",
        hot_bucket=f"reads-hot-{tag}",
        quarantine_bucket=f"reads-quarantine-{tag}",
        consumer_name=f"reads-{tag}",
    )
    wal = await NatsWal.connect(config)
    try:
        keys = [f"h.probe-{i}" for i in range(args.keys)]
        for key in keys:
            await wal.kv_swap(key, b"x" * args.size, revision=None)
        cases = []
        for _ in range(args.rounds):
            await read_case(wal, keys, min(200, args.gets), 1)  # warm-up, not kept
            cases.append(await read_case(wal, keys, args.gets, 1))
            cases.append(await read_case(wal, keys, args.gets * 2, args.concurrency))
        return cases
    finally:
        await wal.close()
        await delete_wal_objects(config)


async def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One run on `--nats-url` or $NATS_URL (else a nats-server of its own); its cases."""
    services = probe_nats(args.nats_url)
    try:
        return await measure(services.nats_url, args)
    finally:
        services.close()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line."""
    p = argparse.ArgumentParser(
        prog="python -m buffered_store.benchmarks.profile_reads", description=__doc__
    )
    p.add_argument("--nats-url", help="use this server (default: $NATS_URL, else start one)")
    p.add_argument("--keys", type=int, default=64, help="hot records written and read back")
    p.add_argument("--size", type=int, default=800, help="bytes per hot record")
    p.add_argument("--gets", type=int, default=1500, help="reads one at a time, per round")
    p.add_argument("--concurrency", type=int, default=32, help="reads at once, second case")
    p.add_argument("--rounds", type=int, default=1, help="measure every case this many times")
    p.add_argument("--json", help="append the run's cases to this file, one JSON line")
    return p.parse_args(argv)


if __name__ == "__main__":
    options = parse()
    measured = asyncio.run(main(options))
    for case in measured:
        print(
            f"{case['concurrency']:3d} at once: {case['cpu_us_per_get']:7.1f} µs CPU per get, "
            f"p50 {case['wall_p50_ms']:.3f} ms, {case['gets_per_s']:,} gets/s"
        )
    if options.json:
        with open(options.json, "a", encoding="utf-8") as out:
            out.write(json.dumps({"options": vars(options), "cases": measured}) + "\n")
