"""`python -m buffered_store.benchmarks.flusher_worker`: a `Flusher` process that reports its stats.

Configured like any flusher through ``BUFSTORE_*`` variables (`FlusherConfig.from_env`),
plus the database URL and schema (`--front-end langgraph`: the LangGraph checkpointer's
entries into LangGraph's tables, found through the URL's search_path). Every
`--interval-s` it prints one JSON line with `Flusher.stats()` and its own CPU seconds.
SIGTERM (or the parent's death) stops the flusher with a drain, prints the final line and
exits. `--profile FILE` writes cProfile stats of the whole run.
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


async def _open_target(database_url: str, schema: str, front_end: str) -> tuple[Any, Any]:
    """(what the flusher writes into, the entries' format: None for the thread-run store's)."""
    if front_end == "langgraph":
        from buffered_store.langgraph import LG_FORMAT, LangGraphSink

        return await LangGraphSink.open(database_url), LG_FORMAT
    from buffered_store.stores.postgres import PostgresThreadRunStore

    return await PostgresThreadRunStore.connect(database_url, schema=schema), None


async def run(database_url: str, schema: str, interval_s: float, front_end: str) -> int:
    from flusher import Flusher, FlusherConfig
    from flusher.heap import settle_heap

    config = FlusherConfig.from_env()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    parent = os.getppid()
    inner, fmt = await _open_target(database_url, schema, front_end)
    try:
        async with Flusher(inner, config, fmt=fmt) as flusher:
            settle_heap()  # as `bufstore flusher` does once its flusher runs
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
    parser.add_argument("--front-end", choices=("threadrun", "langgraph"), default="threadrun")
    args = parser.parse_args(argv)
    main_ = run(args.database_url, args.schema, args.interval_s, args.front_end)
    if args.profile is None:
        return asyncio.run(main_)
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        return asyncio.run(main_)
    finally:
        profiler.disable()
        profiler.dump_stats(args.profile)


if __name__ == "__main__":
    sys.exit(main())
