"""`langgraph`: M threads each run a LangGraph graph of N steps R times in turn, on four
checkpointers: LangGraph's `InMemorySaver` (no I/O: the floor), the same acknowledging
each checkpoint after one JetStream publish (the floor of one round trip), its
`AsyncPostgresSaver` and `BufferedCheckpointSaver` with its flusher process. First each
side closed loop (the AsyncPostgresSaver's rate is its maximum), then each side paced at
25%, 50% and 90% of that maximum by a think time inside the node: step latency without
the think time, achieved rate, CPU per step of all processes, and the targets of issue 23
judged side by side. `--db-delay-ms D` puts Postgres behind a link adding D ms of round trip;
`--duration-s S` sets how long the judged 50% point lasts, about (it sets the paced runs)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..harness import Bench
from ..link import open_link
from ..profile_langgraph import publish_floor
from . import Outcome
from .langgraph_graph import Shape, thread_id
from .langgraph_pacing import paced_runs
from .langgraph_phase import run_phase
from .langgraph_report import (
    FRACTIONS,
    JUDGED,
    PHASES,
    SIDES,
    correctness,
    judge,
    methods,
    pct,
    plotter,
    rows,
    sections,
)
from .langgraph_sides import POOL_SIZE, prepare_side

DESCRIPTION = (
    "M threads (default 32) each run a LangGraph `StateGraph` of N steps (default 20) R "
    "times in turn (default 5). Each step is one node run that appends a ~200-byte AI "
    "message to the state's `messages` (add_messages), and LangGraph checkpoints it before "
    "the next step starts (durability='sync'). Four sides, each on a database (or an "
    "in-memory saver) of its own: LangGraph's `InMemorySaver` (no I/O: the floor), the "
    "same saver answering each checkpoint only after one JetStream publish of it returned "
    "(the least a write acknowledged after one round trip costs, in the graphs' own "
    "process), its "
    "`AsyncPostgresSaver` on a pool of 10 connections, and `BufferedCheckpointSaver` with "
    "a flusher process (`--front-end langgraph`). First each side closed loop (every thread "
    "runs its graph runs back to back): AsyncPostgresSaver's rate is its maximum. Then each "
    "side in turn paced at 25%, 50% and 90% of that maximum (steps/s over all threads): the "
    "node waits for its thread's next slot, a think time like an LLM call's, left out of "
    "the step latency. The paced points run as many runs per thread as let the 50% point "
    "last about `--duration-s` (default 20 s), at most R. `--db-delay-ms D` puts every "
    "Postgres connection of the sides behind a delaying proxy (D ms round trip); NATS stays "
    "local. After the runs the buffered side calls `force_flush_all` and all four sides "
    "must hold the same checkpoints per thread."
)


@dataclass(frozen=True)
class Sizes:
    """Threads, steps per run, closed-loop runs per thread, and the length the judged
    paced point aims at."""

    threads: int
    steps: int
    runs: int
    judged_s: float


def sizes(bench: Bench) -> Sizes:
    """`--threads`, `--steps`, `--runs`, `--duration-s`, else the mode's defaults."""
    o = bench.options
    if o.api is not None:
        bench.note(f"--api {o.api} ignored: the graph calls the checkpointer")
    if o.rate is not None:
        bench.note(f"--rate {o.rate:g} ignored: the paced points are fractions of a maximum")
    if o.quick:
        return Sizes(o.threads or 4, o.steps or 5, o.runs or 2, o.duration_s or 1.0)
    return Sizes(o.threads or 32, o.steps or 20, o.runs or 5, o.duration_s or 20.0)


ROUND_TRIP_BYTES = 3000
"""Payload of the bare publishes timed beside the judged point (about a step's entry)."""


async def round_trip_from_idle(bench: Bench, rate_per_s: float) -> dict[str, float]:
    """Bare JetStream publishes through nats-py, one at a time, each starting 1/rate s
    after the previous one returned, as the steps of the judged point start from an
    idle process: the one round trip a buffered step cannot do without, at this load
    on this machine (`profile_langgraph.publish_floor`)."""
    count = 20 if bench.options.quick else 200
    gap_ms = round(1000 / rate_per_s, 2)
    bench.say(f"one round trip from idle: {count} bare publishes, {gap_ms:g} ms apart")
    return await publish_floor(bench.nats_url, count=count, size=ROUND_TRIP_BYTES, gap_ms=gap_ms)


# -- the scenario --------------------------------------------------------------------------


async def run(bench: Bench) -> Outcome:
    n = sizes(bench)
    delay = bench.options.db_delay_ms or 0.0
    link = None
    if delay > 0:
        count = 50 if bench.options.quick else 300
        link = await open_link(bench.admin_libpq_url, delay, count=count)
        bench.say(f"link: {link.describe()}")
    phases: dict[str, dict[str, Any]] = {}
    shapes: dict[str, Shape] = {}
    round_trip: dict[str, float] | None = None
    try:
        sides = {key: await prepare_side(bench, key, link) for key in SIDES}
        shapes["max"] = Shape(n.threads, n.steps, n.runs)
        # AsyncPostgresSaver first: its closed-loop rate sets the paced points.
        for key in ("direct", *(k for k in SIDES if k != "direct")):
            phases[f"{key}_max"] = await run_phase(bench, sides[key], "max", shapes["max"], link)
        d_max = phases["direct_max"]["throughput_per_s"]
        if not d_max:
            raise RuntimeError("AsyncPostgresSaver completed no step closed loop: no maximum")
        runs = paced_runs(
            d_max,
            threads=n.threads,
            steps=n.steps,
            runs=n.runs,
            judged_s=n.judged_s,
            fraction=JUDGED,
        )
        for fraction in FRACTIONS:
            phase = pct(fraction)
            shapes[phase] = Shape(n.threads, n.steps, runs, fraction * d_max)
            for key in SIDES:
                phases[f"{key}_{phase}"] = await run_phase(
                    bench, sides[key], phase, shapes[phase], link
                )
            if fraction == JUDGED:
                round_trip = await round_trip_from_idle(bench, fraction * d_max)
    finally:
        if link is not None:
            await link.proxy.stop()
    expected = {
        thread_id(phase, i): shape.checkpoints_per_thread
        for phase, shape in shapes.items()
        for i in range(shape.threads)
    }
    urls = {key: side.db.libpq_url for key, side in sides.items() if side.db is not None}
    found = {key: side.found for key, side in sides.items() if side.db is None}
    check = await correctness(urls, found, expected)
    ordered = {f"{key}_{phase}": phases[f"{key}_{phase}"] for phase in PHASES for key in SIDES}
    for figures in ordered.values():
        ids = [thread_id(figures["phase"], i) for i in range(n.threads)]
        figures["checkpoints"] = sum(check["found"][figures["kind"]][t][0] for t in ids)
        pg = figures.get("pg")
        if pg is not None:
            pg["transactions_per_checkpoint"] = (
                pg["transactions"] / figures["checkpoints"] if figures["checkpoints"] else None
            )
    bench.say(("[green]" if check["ok"] else "[red]") + f"correctness:[/] {check['summary']}")
    if not check["ok"]:
        bench.note(f"correctness check failed: {check['summary']}")
    return Outcome(
        sides=ordered,
        targets=judge(ordered, delay_ms=delay, round_trip=round_trip),
        parameters={
            **asdict(n),
            "paced_runs": runs,
            "asyncpostgressaver_max_per_s": d_max,
            "fractions": list(FRACTIONS),
            "judged_fraction": JUDGED,
            "pool_size_direct": POOL_SIZE,
            "durability": "sync",
            "db_delay_ms": delay,
            "round_trip_from_idle": round_trip,
            **({"link": link.figures()} if link else {}),
        },
        sections=sections(ordered, check, link.describe() if link else None),
        methods=methods(delay),
        figures={"correctness": check, "shapes": {k: asdict(v) for k, v in shapes.items()}},
        side_rows=rows(),
        latency_of="graph step",
        extra_plots=[plotter(ordered)],
    )
