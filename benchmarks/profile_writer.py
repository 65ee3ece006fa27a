"""Writer CPU per checkpoint: the buffered write path next to the raw publish + KV CAS loop.

Not a benchmark scenario: a small, reproducible probe for tuning the hot path. It runs
checkpoints on 1 thread (one call in flight) and on 64 threads (one call in flight per
thread) at several history lengths, with an `InMemoryThreadRunStore` inner store and no
flusher, and reports client CPU (`time.process_time`) per checkpoint, which stays
meaningful on a busy shared machine where wall time does not. The raw loop does what
`benchmarks/scenarios/raw.py` does: publish with the expected last subject seq, then a KV
update with the revision cached from the previous one.

    .venv/bin/python -m buffered_store.benchmarks.profile_writer                 # own nats-server
    NATS_URL=nats://127.0.0.1:4222 .venv/bin/python -m buffered_store.benchmarks.profile_writer
    .venv/bin/python -m buffered_store.benchmarks.profile_writer --api append  # append()
    .venv/bin/python -m buffered_store.benchmarks.profile_writer --profile out.pstats --history 2000
    .venv/bin/python -m buffered_store.benchmarks.profile_writer --api append checkpoint \
        --warmup --rounds 7 --json cases.json             # what `bufstore bench writer-cpu` runs

Each round measures every history length once (in an order rotated from round to round),
each case on fresh threads and a fresh WAL; with several rounds the median is the figure.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import json
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import nats
import orjson
from nats.js.api import KeyValueConfig, StorageType, StreamConfig

from buffered_store.config import BufferedStoreConfig
from buffered_store.model.records import Message, RunRecord
from buffered_store.stores.memory import InMemoryThreadRunStore
from buffered_store.threadrun.store import BufferedThreadRunStore

from .processes import WalMonitor, probe_nats
from .workload import message


@dataclass
class Probe:
    """One thread of a probe: its history and run, grown by one step per checkpoint."""

    index: int
    thread_id: str
    history: list[Message]
    run: RunRecord
    step: int = 0

    def advance(self, per_step: int, size: int) -> None:
        """Append the next step's messages (new dict objects, like an agent runtime)."""
        self.step += 1
        for k in range(per_step):
            self.history.append(message(self.index, self.step, k, size, None))
        self.run = self.run.replace(steps=self.step)


def probes(prefix: str, threads: int, history: int, size: int) -> list[Probe]:
    """Threads with `history` seed messages each."""
    out = []
    for i in range(threads):
        thread_id = f"{prefix}-{i}"
        seed = [message(i, 0, k, size, None) for k in range(history)]
        run = RunRecord(run_id=f"{thread_id}-run", thread_id=thread_id, agent_id="agent")
        out.append(Probe(i, thread_id, seed, run))
    return out


@dataclass
class Case:
    """One measured case: a side (and API) on some threads at some history length."""

    side: str
    """The buffered store or the raw loop: "buffered" or "raw"."""
    api: str
    """The buffered store's call ("append" or "checkpoint"); "raw" for the raw loop."""
    threads: int
    history: int
    """Messages of each thread's history when the measured checkpoints start."""
    round: int
    checkpoints: int
    cpu_us: float
    """Client CPU (`time.process_time`) per checkpoint, µs."""
    wall_us: float
    history_end: int
    nats_requests: float | None = None
    """NATS requests per checkpoint (buffered; the raw loop makes 2 by construction)."""
    durations_ms: list[float] = field(default_factory=list)
    """Every measured call, from call to return."""


async def measure(
    states: list[Probe],
    steps: int,
    checkpoint: Callable[[Probe], Awaitable[Any]],
    *,
    per_step: int,
    size: int,
    profiler: cProfile.Profile | None = None,
    durations_ms: list[float] | None = None,
) -> tuple[float, float]:
    """Run `steps` checkpoints per thread, from a collected heap; (CPU µs, wall µs) per
    checkpoint. Each call's duration goes to `durations_ms` when given (two clock reads a
    call: well under 1 µs)."""

    async def one(state: Probe) -> None:
        for _ in range(steps):
            state.advance(per_step, size)
            if durations_ms is None:
                await checkpoint(state)
                continue
            began = time.perf_counter()
            await checkpoint(state)
            durations_ms.append((time.perf_counter() - began) * 1000)

    # A settled heap first: the histories were just built in one burst, and the first
    # full collection of them (tens of ms with 64 threads of 2,000 messages) would
    # otherwise land in this short window, a cost of the set-up, not of the calls. A
    # process that grew its history over time pays it amortised over as many allocations
    # at every history length. Both sides get the same treatment.
    gc.collect()
    with _profiling(profiler):
        cpu0, wall0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(one(s) for s in states))
        cpu1, wall1 = time.process_time(), time.perf_counter()
    n = steps * len(states)
    return (cpu1 - cpu0) / n * 1e6, (wall1 - wall0) / n * 1e6


@contextmanager
def _profiling(profiler: cProfile.Profile | None) -> Iterator[None]:
    if profiler is None:
        yield
        return
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()


async def buffered_case(
    url: str,
    threads: int,
    history: int,
    steps: int,
    args: argparse.Namespace,
    profiler: cProfile.Profile | None,
    *,
    api: str,
    durations_ms: list[float] | None = None,
) -> tuple[float, float, float]:
    """(CPU µs, wall µs, NATS requests) per checkpoint of the buffered store."""
    tag = uuid.uuid4().hex[:8]
    config = BufferedStoreConfig(
        nats_url=url,
        stream_name=f"PW_{tag}",
        hot_bucket=f"pw-hot-{tag}",
        quarantine_bucket=f"pw-q-{tag}",
        consumer_name=f"pw-{tag}",
        drain_on_close=False,
    )
    store = await BufferedThreadRunStore.connect(InMemoryThreadRunStore(), config)
    try:
        states = probes(f"b{tag}", threads, history, args.size)

        async def checkpoint(state: Probe) -> None:
            if api == "append" and state.step > 1:
                new = state.history[-args.per_step :]
                await store.append(state.thread_id, new, state.run)
            else:
                await store.checkpoint(state.thread_id, state.history, state.run)

        # Warm-up (unmeasured): the cold checkpoint with the full history, and one append.
        await measure(states, 2, checkpoint, per_step=args.per_step, size=args.size)
        before = store.stats()["nats_requests"]
        cpu, wall = await measure(
            states,
            steps,
            checkpoint,
            per_step=args.per_step,
            size=args.size,
            profiler=profiler,
            durations_ms=durations_ms,
        )
        requests = (store.stats()["nats_requests"] - before) / (steps * threads)
    finally:
        monitor = await WalMonitor.connect(config)
        await monitor.delete_objects()
        await monitor.close()
        await store.close()
    return cpu, wall, requests


async def raw_case(
    url: str,
    threads: int,
    history: int,
    steps: int,
    args: argparse.Namespace,
    *,
    durations_ms: list[float] | None = None,
) -> tuple[float, float]:
    """(CPU µs, wall µs) per iteration of the raw publish + KV CAS loop."""
    tag = uuid.uuid4().hex[:8]
    stream, bucket = f"RAWP_{tag}", f"rawp-{tag}"
    nc = await nats.connect(url, name="profile-raw")
    js = nc.jetstream(timeout=5)
    await js.add_stream(
        StreamConfig(
            name=stream, subjects=[f"{stream}.>"], storage=StorageType.FILE, allow_direct=True
        )
    )
    kv = await js.create_key_value(
        KeyValueConfig(bucket=bucket, history=1, storage=StorageType.FILE, direct=True)
    )
    last_seq: dict[str, int] = {}
    revision: dict[str, int] = {}

    async def checkpoint(state: Probe) -> None:
        new = state.history[-args.per_step :]
        payload = orjson.dumps(
            {
                "t": state.thread_id,
                "s": state.step,
                "keep": len(state.history) - len(new),
                "m": new,
                "run": {"id": state.run.run_id, "steps": state.run.steps, "status": "running"},
            }
        )
        headers = {
            "Nats-Msg-Id": f"{state.thread_id}:{state.step}",
            "Nats-Expected-Last-Subject-Sequence": str(last_seq.get(state.thread_id, 0)),
        }
        ack = await js.publish(f"{stream}.{state.index}", payload, headers=headers)
        last_seq[state.thread_id] = ack.seq
        hot = orjson.dumps({"seq": state.step, "stream_seq": ack.seq, "n": len(state.history)})
        key = f"t{state.index}"
        rev = revision.get(state.thread_id)
        revision[state.thread_id] = (
            await kv.update(key, hot, last=rev) if rev else await kv.create(key, hot)
        )

    try:
        states = probes(f"r{tag}", threads, history, args.size)
        await measure(states, 2, checkpoint, per_step=args.per_step, size=args.size)
        return await measure(
            states,
            steps,
            checkpoint,
            per_step=args.per_step,
            size=args.size,
            durations_ms=durations_ms,
        )
    finally:
        await js.delete_stream(stream)
        await js.delete_key_value(bucket)
        await nc.close()


async def main(args: argparse.Namespace) -> list[Case]:
    """Every case, one table row each; the cases."""
    services = probe_nats(args.nats_url)
    url = services.nats_url
    profiler = cProfile.Profile() if args.profile else None
    cases: list[Case] = []
    try:
        print(
            f"nats {url}; {args.per_step} message(s) of ~{args.size} B appended per step; "
            f"buffered side calls {' and '.join(f'{a}()' for a in args.api)}"
        )
        print(
            f"{'side':<22}{'threads':>8}{'history':>9}{'round':>6}{'ckpts':>7}"
            f"{'cpu µs':>9}{'wall µs':>9}"
        )
        for threads in args.threads:
            # Capped so the history grows little while it is measured.
            steps = max(1, min(args.max_steps, args.checkpoints // threads))
            # Round -1 (--warmup) is not kept: the first cases a process runs cost more.
            for round_ in range(-1 if args.warmup else 0, args.rounds):
                # Rotated so no history length is always measured first (or last).
                shift = round_ % len(args.history)
                for history in args.history[shift:] + args.history[:shift]:
                    measured = await _cases(url, threads, history, steps, round_, args, profiler)
                    for case in measured:
                        _print(case)
                    if round_ >= 0:
                        cases += measured
    finally:
        services.close()
    if args.rounds > 1:
        _print_medians(cases)
    if profiler is not None:
        profiler.dump_stats(args.profile)
        print(f"profile of the buffered cases written to {args.profile}")
    return cases


def write_json(path: str, args: argparse.Namespace, cases: list[Case]) -> None:
    """The options and every case (with its call durations) as one JSON document."""
    parameters = {k: v for k, v in vars(args).items() if k not in ("json", "profile")}
    document = {"parameters": parameters, "cases": [asdict(c) for c in cases]}
    Path(path).write_text(json.dumps(document))


async def _cases(
    url: str,
    threads: int,
    history: int,
    steps: int,
    round_: int,
    args: argparse.Namespace,
    profiler: cProfile.Profile | None,
) -> list[Case]:
    """The raw loop's case (unless --no-raw) and one buffered case per API."""
    n = steps * threads
    end = history + steps * args.per_step
    out = []
    if not args.no_raw:
        durations: list[float] = []
        cpu, wall = await raw_case(url, threads, history, steps, args, durations_ms=durations)
        out.append(Case("raw", "raw", threads, history, round_, n, cpu, wall, end, 2.0, durations))
    for api in args.api:
        durations = []
        cpu, wall, req = await buffered_case(
            url, threads, history, steps, args, profiler, api=api, durations_ms=durations
        )
        out.append(
            Case("buffered", api, threads, history, round_, n, cpu, wall, end, req, durations)
        )
    return out


def _print(case: Case) -> None:
    name = case.side if case.side == "raw" else f"{case.side} {case.api}()"
    line = (
        f"{name:<22}{case.threads:>8}{case.history:>9}{case.round:>6}{case.checkpoints:>7}"
        f"{case.cpu_us:>9.0f}{case.wall_us:>9.0f}"
    )
    if case.side == "buffered":
        line += f"   ({case.nats_requests:.2f} NATS requests/ckpt)"
    print(line)


def _print_medians(cases: list[Case]) -> None:
    groups: dict[tuple[str, str, int, int], list[float]] = {}
    for c in cases:
        groups.setdefault((c.side, c.api, c.threads, c.history), []).append(c.cpu_us)
    print("median client CPU µs per checkpoint over the rounds:")
    for (side, api, threads, history), values in groups.items():
        name = side if side == "raw" else f"{side} {api}()"
        median = statistics.median(values)
        print(f"{name:<22}{threads:>8}{history:>9}{median:>22.0f}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line."""
    p = argparse.ArgumentParser(
        prog="python -m buffered_store.benchmarks.profile_writer", description=__doc__
    )
    p.add_argument("--nats-url", help="use this server (default: $NATS_URL, else start one)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 64])
    p.add_argument("--history", type=int, nargs="+", default=[50, 500, 2000])
    p.add_argument("--checkpoints", type=int, default=640, help="measured, over all threads")
    p.add_argument("--max-steps", type=int, default=100, help="measured, per thread")
    p.add_argument("--per-step", type=int, default=2, help="messages appended per step")
    p.add_argument("--size", type=int, default=300, help="approximate bytes per message")
    p.add_argument(
        "--api",
        choices=["checkpoint", "append"],
        nargs="+",
        default=["checkpoint"],
        help="buffered side: full snapshots (checkpoint) or the new messages only (append); "
        "both: a buffered case of each",
    )
    p.add_argument("--rounds", type=int, default=1, help="measure every case this many times")
    p.add_argument(
        "--warmup", action="store_true", help="run one round first and leave it out (round -1)"
    )
    p.add_argument("--no-raw", action="store_true", help="skip the raw loop")
    p.add_argument("--profile", help="write a cProfile of the buffered cases to this file")
    p.add_argument("--json", help="write every case (with its call durations) to this file")
    return p.parse_args(argv)


if __name__ == "__main__":
    options = parse()
    measured = asyncio.run(main(options))
    if options.json:
        write_json(options.json, options, measured)
