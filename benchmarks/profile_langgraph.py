"""Client CPU and latency per LangGraph step of `BufferedCheckpointSaver`'s write path.

Not a benchmark scenario: a small probe for tuning ``aput``/``aput_writes``. Each thread
makes, per step, the calls LangGraph makes for a step of the `langgraph` scenario's
graph (one node appending a ~200-byte AIMessage to ``messages`` and setting
``remaining``): ``aput_writes`` of the task's writes as a background task, then
``aput`` of the checkpoint, awaited (with durability="sync" the step waits for it). The
message list is read back as new objects every 20 steps, as at the start of a run
(where no list delta applies). One step in flight per thread, no flusher: the sink is
`MemoryLangGraphSink` (it only seeds new threads), so no Postgres is needed. It reports
the step latency (from the writes' call to the checkpoint's return) and the client CPU
(`time.process_time`) per step, after a warm-up the figures leave out.

    .venv/bin/python -m buffered_store.benchmarks.profile_langgraph             # own nats-server
    NATS_URL=nats://127.0.0.1:4222 .venv/bin/python -m buffered_store.benchmarks.profile_langgraph \
        --threads 8 --steps 250 --json out.jsonl          # one JSON line per run, appended
    .venv/bin/python -m buffered_store.benchmarks.profile_langgraph --threads 32 --steps 60 \
        --rate 300                                        # paced, as the harness's 50% point

Compare two commits by running it alternately from two checkouts and taking the ratio
run by run: one run is noisy on a shared machine.

``--floor N`` first times N bare JetStream publishes through nats-py, one at a time, of
a step's WAL entry size (``--floor-bytes``): the wall time and the client's user and
system CPU of the one round trip a buffered step cannot do without, next to the saver's
figures (``floor_*`` keys). ``--floor-gap-ms G`` starts each one G ms after the previous
one returned, as the round trips of a paced load start from an idle process (on a
virtual machine each wake-up from idle costs CPU and time: compare with G = 0).

``--timeline`` marks the clock at each stage of the measured steps' write path and
reports each stage's median (``timeline`` key; the stages are in `step_timeline`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import os
import random
import resource
import time
import uuid
from typing import Any, cast

from langchain_core.messages import AIMessage, AnyMessage, HumanMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import ChannelVersions, Checkpoint
from langgraph.checkpoint.base.id import uuid6

from buffered_store.langgraph import BufferedCheckpointSaver
from buffered_store.langgraph.config import LangGraphConfig
from buffered_store.langgraph.memory_sink import MemoryLangGraphSink
from buffered_store.langgraph.sink import LangGraphSink
from buffered_store.nats import NatsWal

from .measure import runqueue_wait_s
from .processes import delete_wal_objects, probe_nats, scratch_stream
from .step_timeline import marking, stage_times

FILLER = "x" * 180
RUN_STEPS = 20
"""Steps after which the messages are read back as new objects (a new run)."""


def version(n: int) -> str:
    """A channel version as LangGraph's savers make them."""
    return f"{n:032}.0.{0.621980327078477 + n / 1e6}"


def checkpoint(messages: list[AnyMessage], n: int) -> Checkpoint:
    """The checkpoint LangGraph writes after the `n`-th version of the channels."""
    return {
        "v": 4,
        "ts": "2026-11-26T12:33:45.981639+00:00",
        "id": str(uuid6()),
        "channel_values": {"messages": messages, "remaining": 5},
        "channel_versions": {
            "__start__": version(2),
            "messages": version(n),
            "remaining": version(n),
            "branch:to:step": version(n),
        },
        "versions_seen": {
            "__input__": {},
            "__start__": {"__start__": version(1)},
            "step": {"branch:to:step": version(n - 1)},
        },
        "updated_channels": ["messages", "remaining"],
    }


async def thread(
    saver: BufferedCheckpointSaver,
    thread_id: str,
    steps: int,
    latencies: list[float],
    interval_s: float = 0.0,
) -> None:
    """`steps` steps of one thread, each one's latency appended to `latencies`; with an
    `interval_s`, a step starts every `interval_s` (from a random offset), as a paced
    graph's node waits for its slot, and a step more than one interval late skips to
    the next slot."""
    loop = asyncio.get_running_loop()
    slot = loop.time() + random.uniform(0, interval_s)
    config: RunnableConfig = {"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}}
    first = checkpoint([], 2)
    first["channel_values"], first["channel_versions"] = {}, {}
    config = await saver.aput(config, first, {"source": "input", "step": -1, "parents": {}}, {})
    messages: list[AnyMessage] = [HumanMessage(content=f"run 0: {FILLER}", id=thread_id)]
    for step in range(steps):
        if step % RUN_STEPS == 0:
            messages = [m.model_copy() for m in messages[-100:]]
        message = AIMessage(content=f"step {len(messages)}: {FILLER}", id=str(uuid.uuid4()))
        messages = [*messages, message]
        if interval_s > 0:
            while slot < loop.time() - interval_s:
                slot += interval_s
            await asyncio.sleep(max(0.0, slot - loop.time()))
            slot += interval_s
        n = step + 3
        new_versions: ChannelVersions = {
            c: version(n) for c in ("messages", "remaining", "branch:to:step")
        }
        began = time.perf_counter()
        writes = asyncio.create_task(
            saver.aput_writes(
                config,
                [("messages", [message]), ("remaining", 5)],
                str(uuid.uuid4()),
                "~__pregel_pull, step",
            )
        )
        config = await asyncio.create_task(
            saver.aput(
                config,
                checkpoint(messages, n),
                {"source": "loop", "step": step, "parents": {}},
                new_versions,
            )
        )
        await writes
        latencies.append(time.perf_counter() - began)


async def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run: a saver on fresh WAL objects, warmed up, then measured."""
    token = uuid.uuid4().hex[:10]
    config = LangGraphConfig(
        nats_url=url,
        stream_name=f"PROBE_{token}",
        hot_bucket=f"probe-hot-{token}",
        quarantine_bucket=f"probe-quar-{token}",
        consumer_name=f"probe-flusher-{token}",
        drain_on_close=False,
    )
    wal = await NatsWal.connect(config, name="bufstore-probe")
    # Only `flushed_seqs` is asked of the sink on the write path (seeding a new thread).
    saver = BufferedCheckpointSaver(cast(LangGraphSink, MemoryLangGraphSink()), wal, config)
    profiler = cProfile.Profile() if args.profile else None
    latencies: list[float] = []
    marks: list[tuple[float, str]] = []
    try:
        warm: list[float] = []
        await asyncio.gather(
            *(thread(saver, f"warm-{i}", args.warm, warm) for i in range(args.threads))
        )
        cpu, wall = time.process_time(), time.perf_counter()
        waited = runqueue_wait_s(os.getpid())
        if profiler is not None:
            profiler.enable()
        interval_s = args.threads / args.rate if args.rate else 0.0
        with marking(marks) if args.timeline else contextlib.nullcontext():
            await asyncio.gather(
                *(
                    thread(saver, f"t-{i}", args.steps, latencies, interval_s)
                    for i in range(args.threads)
                )
            )
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(args.profile)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        waited_after = runqueue_wait_s(os.getpid())
        threads = len(os.listdir(f"/proc/{os.getpid()}/task")) if waited is not None else None
        stats = saver.stats()
    finally:
        await saver.close()
        await delete_wal_objects(config)
    latencies.sort()
    steps = len(latencies)
    return {
        "threads": args.threads,
        "rate": args.rate,
        "steps": steps,
        "p50_ms": round(1000 * latencies[steps // 2], 3),
        "p90_ms": round(1000 * latencies[steps * 9 // 10], 3),
        "p99_ms": round(1000 * latencies[steps * 99 // 100], 3),
        "cpu_ms_per_step": round(1000 * cpu / steps, 4),
        "wall_ms_per_step": round(1000 * wall / steps, 4),
        **(
            {
                "wait_ms_per_step": round(1000 * (waited_after - waited) / steps, 4),
                "process_threads": threads,
            }
            if waited is not None and waited_after is not None
            else {}
        ),
        "entries": stats["entries"],
        "joined_writes": stats["joined_writes"],
        **({"timeline": stage_times(marks)} if args.timeline else {}),
    }


async def publish_floor(
    url: str, *, count: int, size: int, gap_ms: float = 0.0
) -> dict[str, float]:
    """`count` bare nats-py JetStream publishes of `size` bytes, one at a time, on a file
    stream of their own (deleted after), after a tenth as many unmeasured: microseconds
    per publish of wall time (mean and median), user CPU and system CPU (the socket
    calls), and, where Linux reports it, the time this process's threads were runnable
    but waited for a core (`floor_wait_us`). With `gap_ms`, each publish starts that long
    after the previous one returned, from an idle process as a paced step's does: its
    CPU then includes the wake-ups."""
    body = b"x" * size
    gap_s = gap_ms / 1000
    walls: list[float] = []
    async with scratch_stream(url, "FLOOR") as (nc, name):
        js = nc.jetstream()
        for i in range(max(1, count // 10)):
            await js.publish(f"{name}.{i % 64}", body)
        before = resource.getrusage(resource.RUSAGE_SELF)
        waited = runqueue_wait_s(os.getpid())
        for i in range(count):
            if gap_s > 0:
                await asyncio.sleep(gap_s)
            began = time.perf_counter()
            await js.publish(f"{name}.{i % 64}", body)
            walls.append(time.perf_counter() - began)
        after = resource.getrusage(resource.RUSAGE_SELF)
        waited_after = runqueue_wait_s(os.getpid())
    walls.sort()
    figures = {
        "floor_publishes": count,
        "floor_bytes": size,
        "floor_gap_ms": gap_ms,
        "floor_wall_us": round(1e6 * sum(walls) / count, 1),
        "floor_wall_p50_us": round(1e6 * walls[count // 2], 1),
        "floor_user_us": round(1e6 * (after.ru_utime - before.ru_utime) / count, 1),
        "floor_sys_us": round(1e6 * (after.ru_stime - before.ru_stime) / count, 1),
    }
    if waited is not None and waited_after is not None:
        figures["floor_wait_us"] = round(1e6 * (waited_after - waited) / count, 1)
    return figures


async def main(args: argparse.Namespace) -> dict[str, Any]:
    """One run on `--nats-url` or $NATS_URL (else a nats-server of its own); its figures."""
    services = probe_nats(args.nats_url)
    url = services.nats_url
    try:
        floor = {}
        if args.floor:
            floor = await publish_floor(
                url, count=args.floor, size=args.floor_bytes, gap_ms=args.floor_gap_ms
            )
        return {**await measure(url, args), **floor}
    finally:
        services.close()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line."""
    p = argparse.ArgumentParser(
        prog="python -m buffered_store.benchmarks.profile_langgraph", description=__doc__
    )
    p.add_argument("--nats-url", help="use this server (default: $NATS_URL, else start one)")
    p.add_argument("--threads", type=int, default=8, help="threads, one step in flight each")
    p.add_argument("--steps", type=int, default=250, help="measured steps per thread")
    p.add_argument("--warm", type=int, default=20, help="warm-up steps per thread, not kept")
    p.add_argument(
        "--rate",
        type=float,
        help="paced: steps/s over all threads (each thread's steps at its own slots; the "
        "wait is left out of the latency); default closed loop",
    )
    p.add_argument(
        "--floor",
        type=int,
        default=0,
        help="first time this many bare JetStream publishes, one at a time (the floor)",
    )
    p.add_argument(
        "--floor-bytes",
        type=int,
        default=3000,
        help="payload of the floor's publishes (about a step's WAL entry in the langgraph "
        "scenario)",
    )
    p.add_argument(
        "--floor-gap-ms",
        type=float,
        default=0.0,
        help="start each of the floor's publishes this long after the previous one "
        "returned (from idle, as at a paced load: a process serving `rate` steps/s in all "
        "starts one about every 1000 / rate ms); default back to back",
    )
    p.add_argument(
        "--timeline",
        action="store_true",
        help="mark the clock at each stage of the measured steps' write path; report each "
        "stage's median over the steps that ran alone (`step_timeline`)",
    )
    p.add_argument("--profile", help="write a cProfile of the measured steps to this file")
    p.add_argument("--json", help="append the run's figures to this file, one JSON line")
    return p.parse_args(argv)


if __name__ == "__main__":
    options = parse()
    figures = asyncio.run(main(options))
    print(json.dumps(figures))
    if options.json:
        with open(options.json, "a") as out:
            out.write(json.dumps(figures) + "\n")
