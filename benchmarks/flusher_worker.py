"""`python -m buffered_store.benchmarks.flusher_worker`: a `Flusher` process that reports its stats.

Configured like any flusher through ``BUFSTORE_*`` variables (`FlusherConfig.from_env`),
plus the database URL and schema. Every `--interval-s` it prints one JSON line with
`Flusher.stats()` and its own CPU seconds. SIGTERM (or the parent's death) stops the
flusher with a drain, prints the final line and exits. `--profile FILE` writes cProfile
stats of the whole run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import os
import signal
import sys
import time
from typing import Any

from . import PACKAGE


def _line(stats: dict[str, Any], final: bool = False) -> None:
    cpu = time.process_time()
    sys.stdout.write(json.dumps({"t": time.time(), "cpu_s": cpu, "final": final, "stats": stats}))
    sys.stdout.write("\n")
    sys.stdout.flush()


async def run(database_url: str, schema: str, interval_s: float) -> int:
    from buffered_store.stores.postgres import PostgresThreadRunStore
    from flusher import Flusher, FlusherConfig

    config = FlusherConfig.from_env()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    parent = os.getppid()
    inner = await PostgresThreadRunStore.connect(database_url, schema=schema)
    try:
        async with Flusher(inner, config) as flusher:
            while not stop.is_set():
                _line(dict(flusher.stats()))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), interval_s)
                if os.getppid() != parent:  # the harness died: do not outlive it
                    stop.set()
        _line(dict(flusher.stats()), final=True)
    finally:
        await inner.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {PACKAGE}.flusher_worker")
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--schema", default="public")
    parser.add_argument("--interval-s", type=float, default=0.25)
    parser.add_argument("--profile", default=None, help="write cProfile stats to this file")
    args = parser.parse_args(argv)
    if args.profile is None:
        return asyncio.run(run(args.database_url, args.schema, args.interval_s))
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        return asyncio.run(run(args.database_url, args.schema, args.interval_s))
    finally:
        profiler.disable()
        profiler.dump_stats(args.profile)


if __name__ == "__main__":
    sys.exit(main())
