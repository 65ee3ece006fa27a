"""Pure parts of the `langgraph` scenario: each thread's pacing slots, the latencies of a
graph run with its nodes' think time taken out, how many runs the paced points make, and
the CPU of a phase per graph step. No I/O and no clock: times come in as numbers."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..measure import cpu_delta, summarize


@dataclass
class Slots:
    """One thread's pacing: a slot every `interval_s` (phase clock, seconds), the first at
    `due_s`. Each step's node waits for its slot, as for an LLM's answer (the think
    time). A thread more than one interval behind skips the slots it missed (counted in
    `late_slots`) instead of bursting to catch up, so the offered rate is never exceeded:
    a side that cannot keep up achieves less than it was offered."""

    interval_s: float
    due_s: float
    late_slots: int = 0

    def wait_s(self, now_s: float) -> float:
        """Seconds the step whose node starts at `now_s` waits for its slot (0 when the
        slot is due or past); the next step's slot is one interval after this one's."""
        behind = now_s - self.due_s
        if behind > self.interval_s:
            skipped = int(behind / self.interval_s)
            self.late_slots += skipped
            self.due_s += skipped * self.interval_s
        wait = max(0.0, self.due_s - now_s)
        self.due_s += self.interval_s
        return wait


def thread_slots(threads: int, rate_per_s: float, rng: random.Random) -> list[Slots]:
    """Slots of `threads` threads offering `rate_per_s` steps/s together: each thread one
    step every `threads / rate_per_s` seconds, its first slot at a random offset within
    the first interval (the same offsets on every side when `rng` is seeded alike)."""
    if threads < 1 or rate_per_s <= 0:
        raise ValueError(f"need threads >= 1 and a positive rate, got {threads}, {rate_per_s}")
    interval = threads / rate_per_s
    return [Slots(interval, rng.random() * interval) for _ in range(threads)]


@dataclass(frozen=True)
class RunTimes:
    """Latencies (ms) of one graph run, its nodes' think time taken out."""

    first_ms: float
    """From the call to the first streamed update: reading the thread, the input's
    checkpoints, the first node and its checkpoint."""
    steps_ms: list[float]
    """Between two consecutive streamed updates: the node, the checkpoint `put` LangGraph
    awaits after it (durability="sync"; the node's `put_writes` runs meanwhile) and
    LangGraph's own work. (With stream_mode="updates" alone LangGraph hands a node's
    update over when the next tick starts, after that checkpoint.)"""
    end_ms: float
    """From the last update to the run's return (its checkpoint came before the update)."""
    run_ms: float
    """From the call to the return."""


def run_times(
    began: float, marks: Sequence[float], end: float, thinks: Sequence[float]
) -> RunTimes:
    """The latencies of a run called at `began` (seconds) that streamed one update per
    node at `marks` and returned at `end`; `thinks[i]` is the time node i spent waiting
    for its slot, which lies between update i-1 (the call, for i = 0) and update i."""
    if not marks or len(marks) != len(thinks):
        raise ValueError(f"{len(marks)} updates for {len(thinks)} node runs")
    steps = [
        (b - a - think) * 1000
        for (a, b), think in zip(itertools.pairwise(marks), thinks[1:], strict=True)
    ]
    return RunTimes(
        first_ms=(marks[0] - began - thinks[0]) * 1000,
        steps_ms=steps,
        end_ms=(end - marks[-1]) * 1000,
        run_ms=(end - began - sum(thinks)) * 1000,
    )


@dataclass
class StepLog:
    """Latencies of every run of a phase (ms, think time out), and the failed runs."""

    steps_ms: list[float] = field(default_factory=list)
    first_ms: list[float] = field(default_factory=list)
    end_ms: list[float] = field(default_factory=list)
    runs_ms: list[float] = field(default_factory=list)
    think_ms: list[float] = field(default_factory=list)
    nodes: int = 0
    """Node runs (graph steps) of the runs that completed."""
    failures: dict[str, int] = field(default_factory=dict)
    streamed: int = 0
    """Updates streamed so far, failed runs' included (the progress line's count)."""

    def run(
        self, began: float, marks: Sequence[float], end: float, thinks: Sequence[float]
    ) -> None:
        """Record a completed run (see `run_times`)."""
        times = run_times(began, marks, end, thinks)
        self.steps_ms += times.steps_ms
        self.first_ms.append(times.first_ms)
        self.end_ms.append(times.end_ms)
        self.runs_ms.append(times.run_ms)
        self.think_ms += [t * 1000 for t in thinks]
        self.nodes += len(marks)

    def fail(self, error: BaseException) -> None:
        """Record a failed run."""
        kind = type(error).__name__
        self.failures[kind] = self.failures.get(kind, 0) + 1

    def figures(self) -> dict[str, Any]:
        """Summaries of every latency."""
        return {
            "latency_ms": summarize(self.steps_ms),
            "latency_first_ms": summarize(self.first_ms),
            "latency_end_ms": summarize(self.end_ms),
            "run_latency_ms": summarize(self.runs_ms),
            "think_ms": summarize(self.think_ms),
        }


def paced_runs(
    max_per_s: float | None,
    *,
    threads: int,
    steps: int,
    runs: int,
    judged_s: float,
    fraction: float,
) -> int:
    """Runs per thread of every paced point: as many as let the judged point (`fraction`
    of the maximum) last at most `judged_s` at its offered rate; at least one, and at
    most the closed loop's `runs`, so no paced thread's history outgrows the closed
    loop's. Every side runs the same number at every point."""
    if not max_per_s or max_per_s <= 0:
        return 1
    fit = int(judged_s * fraction * max_per_s / (threads * steps))
    return max(1, min(runs, fit))


def phase_cpu(
    before: dict[str, float],
    after: dict[str, float],
    steps: int,
    *,
    flusher_s: float | None = None,
    flusher_wait_s: float | None = None,
    outside_total: Sequence[str] = (),
) -> dict[str, Any]:
    """CPU seconds per process over a phase and ms per graph step. `flusher_s` (the
    flusher process's own report) joins the total; the processes in `outside_total` (the
    delaying proxy: it stands for a network, not for work of a side) are reported but
    not counted in it, nor among the machine's other processes. `runqueue_wait_seconds`:
    each process's wait for a core over the phase (`flusher_wait_s`: the flusher's);
    `gc_ms_per_step`: the graphs' process's time in its garbage collector, per step (part
    of its CPU)."""
    cpu = cpu_delta(before, after, steps)
    seconds: dict[str, float] = cpu["seconds"]
    for name in outside_total:
        seconds["total"] = round(seconds["total"] - seconds.get(name, 0.0), 3)
    if flusher_s is not None:
        seconds["flusher"] = round(flusher_s, 3)
        seconds["total"] = round(seconds["total"] + flusher_s, 3)
        seconds["other_processes"] = round(seconds["other_processes"] - flusher_s, 3)
    per_step = {
        name: round(value * 1000 / steps, 4) if steps else None for name, value in seconds.items()
    }
    waited: dict[str, float] = cpu["runqueue_wait_seconds"]
    if flusher_wait_s is not None:
        waited["flusher"] = round(flusher_wait_s, 3)
    return {
        "seconds": seconds,
        "ms_per_step": per_step,
        "outside_total": list(outside_total),
        "runqueue_wait_seconds": waited,
        "gc_ms_per_step": {
            name: round(value * 1000 / steps, 4) if steps else None
            for name, value in cpu["gc_seconds"].items()
        },
    }
