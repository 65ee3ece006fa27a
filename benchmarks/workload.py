"""The agent workload: threads whose history grows by a few messages per checkpoint.

Every thread keeps its message list (the same objects from step to step, as an agent
runtime does) and its run record. The first message of each step carries `t`, the wall
clock time the checkpoint call started, so the flush lag of every checkpoint can be read
back from Postgres afterwards (commit timestamp of the row minus `t`).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from buffered_store.model.protocol import ThreadRunStore
from buffered_store.model.records import Message, RunRecord, RunStatus

from .measure import LatencyLog

_TEXT = (
    "tool output reasoning plan observation result the agent calls search with query "
    "and reads the answer then decides next step given context window budget"
)
_WORDS = _TEXT.split()


@dataclass(frozen=True)
class Workload:
    """Shape of the load one side runs."""

    threads: int = 64
    rate_per_thread: float | None = 20.0
    """Checkpoints per second per thread; None: each thread as fast as it can."""
    duration_s: float = 60.0
    seed_messages: int = 200
    """History of each thread before the measured steps (written in an unmeasured phase)."""
    messages_per_step: int = 2
    message_bytes: int = 300
    """Approximate JSON size of one message."""
    stop_when_history_bytes: int | None = None
    """Stop a thread once its history is larger than this (large-thread)."""
    api: Literal["checkpoint", "append"] = "checkpoint"
    """Which store call a step makes, on every side alike: `checkpoint` (the full
    snapshot) or `append` (only the messages not yet acknowledged: O(new))."""

    @property
    def target_rate(self) -> float | None:
        """Offered checkpoints per second over all threads (None for a closed loop)."""
        return None if self.rate_per_thread is None else self.rate_per_thread * self.threads


def filler(size: int, seed: int) -> str:
    """Deterministic text of about `size` characters."""
    rng = random.Random(seed)
    words: list[str] = []
    length = 0
    while length < size:
        word = rng.choice(_WORDS)
        words.append(word)
        length += len(word) + 1
    return " ".join(words)[:size]


_FILLERS: dict[int, list[str]] = {}


def message(thread: int, step: int, k: int, size: int, stamp: float | None) -> Message:
    """One chat message of about `size` bytes; `stamp` goes into `t` when given."""
    texts = _FILLERS.get(size)
    if texts is None:
        texts = _FILLERS[size] = [filler(max(16, size - 90), s) for s in range(16)]
    out: dict[str, Any] = {
        "role": "assistant" if k % 2 == 0 else "tool",
        "content": texts[(thread + step + k) % len(texts)],
        "meta": {"step": step, "k": k},
    }
    if stamp is not None:
        out["t"] = stamp
    return out


@dataclass
class ThreadState:
    """One thread of the workload."""

    index: int
    thread_id: str
    history: list[Message]
    run: RunRecord
    step: int = 0
    history_bytes: int = 0
    acked: int = 0
    """Messages of `history` the store acknowledged: an append sends the ones after."""

    def advance(self, workload: Workload, stamp: float) -> None:
        """Append the messages of the next step and bump the run."""
        self.step += 1
        for k in range(workload.messages_per_step):
            self.history.append(
                message(self.index, self.step, k, workload.message_bytes, stamp if k == 0 else None)
            )
        self.history_bytes += workload.messages_per_step * workload.message_bytes
        self.run = self.run.replace(
            steps=self.step,
            input_tokens=self.run.input_tokens + 120,
            output_tokens=self.run.output_tokens + 40,
            status=RunStatus.RUNNING,
        )


def make_threads(prefix: str, workload: Workload) -> list[ThreadState]:
    """The threads of one side, each with its seed history (not yet written)."""
    states = []
    for i in range(workload.threads):
        thread_id = f"{prefix}-{i}"
        history = [
            message(i, 0, k, workload.message_bytes, None) for k in range(workload.seed_messages)
        ]
        run = RunRecord(run_id=f"{thread_id}-run", thread_id=thread_id, agent_id=f"agent-{i % 8}")
        states.append(
            ThreadState(
                i, thread_id, history, run, history_bytes=len(history) * workload.message_bytes
            )
        )
    return states


async def seed(store: ThreadRunStore, states: list[ThreadState], *, parallel: int = 16) -> None:
    """Write each thread's seed history once (unmeasured)."""
    gate = asyncio.Semaphore(parallel)

    async def one(state: ThreadState) -> None:
        async with gate:
            await store.checkpoint(state.thread_id, state.history, state.run)

    await asyncio.gather(*(one(s) for s in states))
    for state in states:
        state.acked = len(state.history)


async def write_step(store: ThreadRunStore, state: ThreadState, api: str) -> Any:
    """One step's store call: the full snapshot, or the messages the store has not
    acknowledged yet (after a failed append they go again with the next step's, as an
    agent runtime retrying its unsaved messages would; a failure after the write landed,
    a timeout, would then repeat them: only the pg-outage scenario fails calls)."""
    if api == "append":
        receipt = await store.append(state.thread_id, state.history[state.acked :], state.run)
    else:
        receipt = await store.checkpoint(state.thread_id, state.history, state.run)
    state.acked = len(state.history)
    return receipt


@dataclass
class DriveResult:
    """What the drive loop did."""

    seconds: float
    late_slots: int = 0
    """Scheduled checkpoints skipped because the thread fell more than one interval behind."""
    per_thread_steps: list[int] = field(default_factory=list)


async def drive(
    store: ThreadRunStore | None,
    states: list[ThreadState],
    workload: Workload,
    log: LatencyLog,
    *,
    clock_zero: float,
    on_step: Callable[[], None] | None = None,
    checkpoint: Callable[[ThreadState], Awaitable[Any]] | None = None,
) -> DriveResult:
    """Run every thread for `workload.duration_s`: paced at its rate, or closed loop.

    Latency is measured from the call to its return (service time). A paced thread that
    falls more than one interval behind drops the missed slots (counted in `late_slots`)
    instead of bursting to catch up, so the offered load never exceeds the target.
    Each step calls `store.checkpoint` or `store.append` as `workload.api` says;
    `checkpoint` replaces both (the raw loop uses it).
    """
    loop = asyncio.get_running_loop()
    start = loop.time()
    end = start + workload.duration_s
    result = DriveResult(0.0)
    if checkpoint is not None:
        call = checkpoint
    else:
        assert store is not None, "drive() needs a store or a checkpoint callable"
        writer = store

        async def call(s: ThreadState) -> Any:
            return await write_step(writer, s, workload.api)

    async def one(state: ThreadState) -> None:
        interval = 1 / workload.rate_per_thread if workload.rate_per_thread else 0.0
        due = start + random.random() * interval
        cold = True
        while True:
            now = loop.time()
            if now >= end:
                return
            limit = workload.stop_when_history_bytes
            if limit is not None and state.history_bytes > limit:
                return
            if due > now:
                await asyncio.sleep(due - now)
            state.advance(workload, time.time())
            began = time.perf_counter()
            try:
                await call(state)
            except Exception as exc:  # measured: the side's failures are a figure
                log.fail(began - clock_zero, exc)
                if not interval:
                    await asyncio.sleep(0.01)
            else:
                took_ms = (time.perf_counter() - began) * 1000
                log.ok(began - clock_zero, took_ms, cold=cold)
                log.acks[(state.thread_id, state.step)] = time.time()
            cold = False
            if on_step is not None:
                on_step()
            if interval:
                due += interval
                behind = loop.time() - due
                if behind > interval:
                    skipped = int(behind / interval)
                    result.late_slots += skipped
                    due += skipped * interval

    await asyncio.gather(*(one(s) for s in states))
    result.seconds = loop.time() - start
    result.per_thread_steps = [s.step for s in states]
    return result
