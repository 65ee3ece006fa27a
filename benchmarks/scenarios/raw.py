"""`raw`: a JetStream publish + KV compare-and-set loop written straight on nats-py, the
limit the buffered store is compared against, next to the buffered store (with and
without its flusher) and direct Postgres, all closed loop with the same threads."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import Any

import nats
import orjson
from nats.js.api import KeyValueConfig, StorageType, StreamConfig

from ..harness import Bench
from ..measure import (
    CpuMeter,
    LatencyLog,
    Timeline,
    cdf_points,
    cpu_delta,
    rate_series,
    settle_harness_heap,
)
from ..measure import summarize as summary
from ..report import fmt
from ..sides import SidePlan, run_side, sample_loop
from ..targets import ratio, target
from ..workload import ThreadState, Workload, drive, make_threads
from . import Outcome
from .common import api, side_get

DESCRIPTION = (
    "64 threads, closed loop, 2 cores. The raw loop does per checkpoint what the design's "
    "write path needs and nothing else: publish the new messages with "
    "`Nats-Expected-Last-Subject-Sequence` (the thread's previous stream seq) and "
    "`Nats-Msg-Id`, then update the thread's KV key with the revision cached from its "
    "previous update: 2 round trips, no reads, no validation, no encoding of the history. "
    "Then the buffered store without a flusher (its write path alone), with a flusher "
    "process (what it sustains), and direct Postgres, on the same workload."
)


def workload(bench: Bench) -> Workload:
    """Closed loop, like `saturate` (smaller in quick mode)."""
    o = bench.options
    if o.quick:
        return Workload(
            api=api(bench),
            threads=o.threads or 8,
            rate_per_thread=None,
            duration_s=o.duration_s or 2.0,
            seed_messages=20,
        )
    return Workload(
        api=api(bench),
        threads=o.threads or 64,
        rate_per_thread=None,
        duration_s=o.duration_s or 20.0,
    )


async def run_raw(
    bench: Bench,
    wl: Workload,
    *,
    key: str = "raw",
    label: str = "raw publish + KV CAS",
    durable: bool = False,
) -> dict[str, Any]:
    """The raw publish + KV CAS loop as one side (closed loop, or paced when `wl` has a
    rate); each call runs on a stream and bucket of its own, on the default nats-server
    or (`durable`) on the one with ``sync_interval: always``."""
    tag = f"{bench.tag}{key}".replace("_", "")
    stream, bucket = f"RAW_{tag}", f"raw-hot-{tag}"
    url = await bench.durable_nats_url() if durable else bench.nats_url
    server = "nats_server_durable" if durable else "nats_server"
    nc = await nats.connect(url, name="bench-raw")
    js = nc.jetstream(timeout=5)
    await js.add_stream(
        StreamConfig(
            name=stream, subjects=[f"{stream}.>"], storage=StorageType.FILE, allow_direct=True
        )
    )
    kv = await js.create_key_value(
        KeyValueConfig(bucket=bucket, history=1, storage=StorageType.FILE, direct=True)
    )
    states = make_threads(key, wl)
    last_seq: dict[str, int] = {}
    revision: dict[str, int] = {}
    payload_bytes = 0

    async def checkpoint(state: ThreadState) -> None:
        nonlocal payload_bytes
        subject = f"{stream}.{state.index}"
        new = state.history[-wl.messages_per_step :]
        payload = orjson.dumps(
            {
                "t": state.thread_id,
                "s": state.step,
                "keep": len(state.history) - len(new),
                "m": new,
                "run": {"id": state.run.run_id, "steps": state.run.steps, "status": "running"},
            }
        )
        payload_bytes += len(payload)
        headers = {
            "Nats-Msg-Id": f"{state.thread_id}:{state.step}",
            "Nats-Expected-Last-Subject-Sequence": str(last_seq.get(state.thread_id, 0)),
        }
        ack = await js.publish(subject, payload, headers=headers)
        last_seq[state.thread_id] = ack.seq
        hot = orjson.dumps({"seq": state.step, "stream_seq": ack.seq, "n": len(state.history)})
        key = f"t{state.index}"
        rev = revision.get(state.thread_id)
        revision[state.thread_id] = (
            await kv.update(key, hot, last=rev) if rev else await kv.create(key, hot)
        )

    meter = CpuMeter({"harness": os.getpid, "nats_server": lambda: bench.pids()[server]})
    log = LatencyLog()
    timeline = Timeline()
    task = bench.task("raw publish + KV CAS: run", total=wl.duration_s)
    settle_harness_heap()
    cpu_before = meter.sample()
    clock_zero = time.perf_counter()

    async def probe() -> dict[str, float | None]:
        return {"checkpoints": float(log.count), "failed": float(len(log.failures))}

    stop_sampling = asyncio.Event()
    sampler = asyncio.create_task(
        sample_loop(
            bench,
            task,
            timeline,
            clock_zero,
            probe,
            interval_s=0.2 if bench.options.quick else 0.5,
            total_s=wl.duration_s,
            stop=stop_sampling,
        )
    )
    try:
        result = await drive(None, states, wl, log, clock_zero=clock_zero, checkpoint=checkpoint)
    finally:
        stop_sampling.set()
        await sampler
        cpu_after = meter.sample()
        with contextlib.suppress(Exception):
            await js.delete_stream(stream)
            await js.delete_key_value(bucket)
        await nc.close()
    bench.progress.update(task, completed=wl.duration_s)
    ok = log.count
    t = timeline.t_s
    return {
        "key": key,
        "label": label,
        "kind": "raw",
        "nats_server": "sync_interval: always" if durable else "default",
        "workload": wl.__dict__,
        "offered_per_s": wl.target_rate,
        "late_slots": result.late_slots,
        "checkpoints": ok,
        "failed": len(log.failures),
        "failure_kinds": log.failure_kinds(),
        "write_seconds": round(result.seconds, 3),
        "throughput_per_s": ok / result.seconds if result.seconds else None,
        "latency_ms": summary(log.durations_ms),
        "latency_warm_ms": log.warm_summary(
            "every successful call but each thread's first (its first publish and KV create)"
        ),
        "latency_cdf_ms": cdf_points(log.durations_ms),
        "nats": {
            "requests_per_checkpoint": 2.0,
            "requests_per_checkpoint_steady": 2.0,
            "wal_bytes_per_checkpoint": payload_bytes / ok if ok else None,
            "wal_bytes_per_checkpoint_steady": payload_bytes / ok if ok else None,
            "method": "2 requests per iteration by construction; payload bytes counted",
        },
        "cpu": cpu_delta(cpu_before, cpu_after, ok),
        "timeline": {
            **timeline.as_dict(),
            "checkpoints_per_s": rate_series(t, timeline.series.get("checkpoints", [])),
        },
        "unavailable": {
            "pg": "the raw loop does not touch Postgres",
            "flush": "the raw loop has no flusher",
        },
    }


async def run(bench: Bench) -> Outcome:
    wl = workload(bench)
    sides: dict[str, dict[str, Any]] = {"raw": await run_raw(bench, wl)}
    sides["buffered_writer_only"] = await run_side(
        bench,
        SidePlan("buffered_writer_only", "buffered, no flusher", "buffered", flusher=False),
        wl,
    )
    sides["buffered"] = await run_side(
        bench, SidePlan("buffered", "buffered + flusher", "buffered"), wl
    )
    sides["direct"] = await run_side(bench, SidePlan("direct", "direct Postgres", "direct"), wl)
    raw = side_get(sides["raw"], "throughput_per_s")
    buffered = side_get(sides["buffered"], "throughput_per_s")
    writer_only = side_get(sides["buffered_writer_only"], "throughput_per_s")
    r = ratio(buffered, raw)
    r_writer = ratio(writer_only, raw)
    targets = [
        target(
            "sustained",
            f"buffered with flusher {fmt(buffered, 'rate')}/s vs raw {fmt(raw, 'rate')}/s",
            ratio=r,
            met=None if r is None else r >= 0.5,
        ),
        target(
            "sustained",
            f"buffered write path alone {fmt(writer_only, 'rate')}/s vs raw {fmt(raw, 'rate')}/s",
            ratio=r_writer,
            met=None if r_writer is None else r_writer >= 0.5,
            suffix="no flusher running: write path alone",
        ),
    ]
    return Outcome(sides=sides, targets=targets, parameters={"workload": wl.__dict__})
