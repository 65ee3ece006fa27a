"""The `langgraph` scenario's graph and how its threads run it: a `StateGraph` whose one
node appends a message, paced by a think time inside the node (each thread waits for its
next slot, as for an LLM's answer) or back to back (closed loop)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Annotated, Any, TypedDict

from langchain_core.messages import AIMessage, AnyMessage, HumanMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.graph.state import CompiledStateGraph

from .langgraph_pacing import Slots, StepLog

FILLER = "x" * 180


@dataclass(frozen=True)
class Shape:
    """The workload of one phase: every thread runs the graph `runs` times in turn, each
    run `steps` node runs; paced at `rate_per_s` steps/s over all threads, or closed loop
    (None)."""

    threads: int
    steps: int
    runs: int
    rate_per_s: float | None = None

    @property
    def total_steps(self) -> int:
        """Graph steps of the phase."""
        return self.threads * self.steps * self.runs

    @property
    def checkpoints_per_thread(self) -> int:
        """Each run writes its input's checkpoint, one with the input applied (LangGraph's
        step 0) and one per step."""
        return self.runs * (self.steps + 2)


def thread_id(phase: str, index: int) -> str:
    """The `index`-th thread of a phase, named alike on every side (each side has a
    database, or an in-memory saver, of its own)."""
    return f"lg-{phase}-{index:04d}"


class State(TypedDict):
    """A chat thread: its messages, and the steps left in this run."""

    messages: Annotated[list[AnyMessage], add_messages]
    remaining: int


class Thinker:
    """The node's think time: in a paced phase each thread's node waits for the thread's
    next slot; in a closed loop it does not wait. The time each node waited is recorded
    per run, so the step latency can leave it out."""

    def __init__(self, slots: dict[str, Slots] | None) -> None:
        self.slots = slots
        self.clock_zero = time.perf_counter()
        self._runs: dict[str, list[float]] = {}

    def start(self) -> None:
        """The phase starts now: slots are counted from here."""
        self.clock_zero = time.perf_counter()

    def new_run(self, thread: str) -> list[float]:
        """The think times (s) of the thread's run starting now, filled as its nodes run."""
        thinks: list[float] = []
        self._runs[thread] = thinks
        return thinks

    async def arrive(self, thread: str) -> None:
        """Before the thread's first run, wait until its first slot: paced threads start
        spread over the first interval, as paced arrivals do, instead of all reading their
        threads and writing their input's checkpoints at once."""
        slots = self.slots[thread] if self.slots is not None else None
        if slots is None:
            return
        delay = self.clock_zero + slots.due_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)

    async def think(self, thread: str) -> None:
        """Wait for the thread's slot (paced) and record how long that took."""
        thinks = self._runs[thread]
        slots = self.slots[thread] if self.slots is not None else None
        began = time.perf_counter()
        wait = slots.wait_s(began - self.clock_zero) if slots is not None else 0.0
        if wait <= 0:
            thinks.append(0.0)
            return
        await asyncio.sleep(wait)
        # What the node actually waited, timer overshoot included: it is think time.
        thinks.append(time.perf_counter() - began)

    @property
    def late_slots(self) -> int:
        """Slots skipped by threads that fell more than one interval behind."""
        return sum(s.late_slots for s in (self.slots or {}).values())


def build_graph(
    checkpointer: BaseCheckpointSaver[Any], thinker: Thinker
) -> CompiledStateGraph[Any]:
    """One node that thinks, then appends a ~200-byte AI message, looping until the run's
    steps are done."""

    async def step(state: State, config: RunnableConfig) -> dict[str, Any]:
        await thinker.think(str(config["configurable"]["thread_id"]))
        n = len(state["messages"])
        return {
            "messages": [AIMessage(content=f"step {n}: {FILLER}")],
            "remaining": state["remaining"] - 1,
        }

    # Async, as the node: LangGraph runs a sync function of an async graph in a thread pool,
    # one hop per step that every side would pay and that has nothing to do with saving.
    async def route(state: State) -> str:
        return "step" if state["remaining"] > 0 else END

    graph = StateGraph(State)
    graph.add_node("step", step)
    graph.add_edge(START, "step")
    graph.add_conditional_edges("step", route, ["step", END])
    return graph.compile(checkpointer=checkpointer)


async def drive(
    graph: CompiledStateGraph[Any], shape: Shape, phase: str, thinker: Thinker, log: StepLog
) -> float:
    """Every thread of the phase runs the graph `shape.runs` times in turn, all threads
    at once; returns the seconds from the start until the last run returned."""

    async def thread(index: int) -> None:
        tid = thread_id(phase, index)
        config: RunnableConfig = {"configurable": {"thread_id": tid}}
        await thinker.arrive(tid)
        for run in range(shape.runs):
            inputs = {
                "messages": [HumanMessage(content=f"run {run}: {FILLER}")],
                "remaining": shape.steps,
            }
            thinks = thinker.new_run(tid)
            marks: list[float] = []
            began = time.perf_counter()
            try:
                # The input and LangGraph's step 0 stream no update: one per node run.
                async for _ in graph.astream(
                    inputs, config, stream_mode="updates", durability="sync"
                ):
                    marks.append(time.perf_counter())
                    log.streamed += 1
                log.run(began, marks, time.perf_counter(), thinks)
            except Exception as exc:  # measured: a side's failed runs are a figure
                log.fail(exc)

    thinker.start()
    started = thinker.clock_zero
    await asyncio.gather(*(thread(i) for i in range(shape.threads)))
    return time.perf_counter() - started
