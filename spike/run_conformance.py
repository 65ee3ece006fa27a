"""SPIKE: langgraph-checkpoint-conformance against BufferedCheckpointSaver.

    .venv/bin/python spike/run_conformance.py --wal memory|nats --flush none|embedded|each
    .venv/bin/python spike/run_conformance.py --reference   # AsyncPostgresSaver itself
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid

from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.report import ProgressCallbacks

from buffered_store.dev.services import start_services
from buffered_store.stores.urls import to_libpq_url


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--wal", choices=["memory", "nats"], default="memory")
    ap.add_argument("--flush", choices=["none", "embedded", "each"], default="none")
    ap.add_argument("--reference", action="store_true")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()

    services = start_services(nats=args.wal == "nats" and not args.reference)
    try:
        dsn = to_libpq_url(services.database_url)
        from buffered_store.langgraph.saver import BufferedCheckpointSaver, lg_config
        from buffered_store.langgraph.sink import LangGraphSink

        if args.reference:
            from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

            @checkpointer_test(name="AsyncPostgresSaver")
            async def factory():  # type: ignore[no-untyped-def]
                async with AsyncPostgresSaver.from_conn_string(dsn) as saver:
                    await saver.setup()
                    yield saver

        else:
            run = uuid.uuid4().hex[:6]
            extra = {"nats_url": services.nats_url} if args.wal == "nats" else {}
            config = lg_config(
                flush_interval_s=0.05, stream_name=f"LG{run}", hot_bucket=f"lg-hot-{run}",
                quarantine_bucket=f"lg-q-{run}", consumer_name=f"lg-fl-{run}", **extra
            )
            from buffered_store.testing import MemoryJetStream, MemoryWal

            server = MemoryJetStream()
            totals: dict[str, int] = {"sink_tx": 0}

            async def open_wal(name: str):  # type: ignore[no-untyped-def]
                if args.wal == "memory":
                    return MemoryWal(config, server)
                from buffered_store.nats import NatsWal

                return await NatsWal.connect(config, name=name)

            setup_sink = await LangGraphSink.open(dsn)
            await setup_sink.setup()
            await setup_sink.close()

            @checkpointer_test(name=f"Buffered[{args.wal},{args.flush}]")
            async def factory():  # type: ignore[no-untyped-def]
                sink = await LangGraphSink.open(dsn)
                wal = await open_wal("saver")
                saver = BufferedCheckpointSaver(
                    sink, wal, config, flush_each_write=args.flush == "each"
                )
                flusher = None
                if args.flush == "embedded":
                    from buffered_store.langgraph.entry import LG_FORMAT
                    from flusher import Flusher

                    flusher = Flusher(
                        sink, config, wal=await open_wal("flusher"), fmt=LG_FORMAT,
                        backlog_poll_s=0,
                    )
                    await flusher.start()
                try:
                    yield saver
                finally:
                    totals["sink_tx"] += sink.transactions
                    for k, v in saver.stats.items():
                        totals[k] = totals.get(k, 0) + v
                    if flusher is not None:
                        totals["flusher_entries_applied"] = totals.get("flusher_entries_applied", 0) + flusher.stats()["entries_applied"]
                    if flusher is not None:
                        await flusher.stop()
                        await flusher.wal.close() if flusher._wal else None
                    await saver.aclose()
                    await sink.close()

        progress = ProgressCallbacks.verbose() if args.verbose else ProgressCallbacks.default()
        report = await validate(factory, progress=progress)
        report.print_report()
        summary = {
            name: (r.tests_passed, r.tests_failed, r.detected)
            for name, r in report.results.items()
        }
        print(json.dumps({"base": report.passed_all_base(), "level": report.conformance_level(),
                          "results": summary}))
        if not args.reference:
            print("STATS", totals)
        for name, r in report.results.items():
            for f in r.failures:
                print(f"FAIL {name}: {f[:300]}")
        return 0 if report.passed_all() else 1
    finally:
        services.close()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
