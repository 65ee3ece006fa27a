"""Reads that must equal AsyncPostgresSaver's beyond what the random differential test
reaches by chance (issue 24 items 2, 3 and 5), each in every state a thread can be in:
its entries unflushed, flushed, flushed but for the writes, and rows AsyncPostgresSaver
itself wrote.

- Pending sends of a checkpoint older than format 4 are moved from its parent's
  ``__pregel_tasks`` writes into its channel values (``_migrate_pending_sends``).
- ``aget_delta_channel_history``: the same walk as AsyncPostgresSaver's (an inline JSON
  ``null`` is "nothing stored"), over the overlay, in a constant number of round trips.
- Checkpoint ids ordered as the database's collation orders them (ICU ``en-US``), so the
  latest checkpoint does not change across a flush.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Annotated, Any, TypedDict, cast

import pytest
from langchain_core.runnables import RunnableConfig
from langgraph.channels.delta import DeltaChannel
from langgraph.checkpoint.base import CheckpointMetadata, CheckpointTuple
from langgraph.checkpoint.conformance.test_utils import generate_checkpoint
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from langgraph.checkpoint.serde.types import TASKS, _DeltaSnapshot
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send

from buffered_store.errors import DatabaseUnavailableError
from buffered_store.langgraph import BufferedCheckpointSaver
from tests.langgraph.helpers import fresh_config

MODES = ("tail", "flushed", "writes-pending", "ref-wrote")
"""tail: nothing flushed; flushed: every call flushed; writes-pending: puts flushed,
writes not; ref-wrote: AsyncPostgresSaver wrote the rows the buffered saver reads."""


def norm(t: CheckpointTuple | None) -> Any:
    if t is None:
        return None
    return (t.config, t.checkpoint, t.metadata, t.parent_config, t.pending_writes)


def cfg(tid: str, ns: str = "", cid: str | None = None) -> RunnableConfig:
    configurable: dict[str, Any] = {"thread_id": tid, "checkpoint_ns": ns}
    if cid is not None:
        configurable["checkpoint_id"] = cid
    return {"configurable": configurable}


class Pair:
    """The same calls to AsyncPostgresSaver and the buffered saver, flushed per mode."""

    def __init__(self, ref: AsyncPostgresSaver, buf: BufferedCheckpointSaver, mode: str) -> None:
        self.ref, self.buf, self.mode = ref, buf, mode

    async def put(
        self,
        tid: str,
        ns: str,
        parent: str | None,
        cid: str,
        values: dict[str, Any],
        versions: dict[str, str | int | float],
        *,
        v: int = 1,
    ) -> None:
        cp = generate_checkpoint(
            checkpoint_id=cid, channel_values=values, channel_versions=versions
        )
        cp["v"] = v
        md: CheckpointMetadata = {"source": "loop", "step": 0, "parents": {}}
        config = cfg(tid, ns, parent)
        await self.ref.aput(config, cp, md, dict(versions))
        if self.mode != "ref-wrote":
            await self.buf.aput(config, cp, md, dict(versions))
            if self.mode in ("flushed", "writes-pending"):
                await self.buf.force_flush(tid)

    async def writes(
        self, tid: str, ns: str, cid: str, writes: list[tuple[str, Any]], task: str, path: str
    ) -> None:
        await self.ref.aput_writes(cfg(tid, ns, cid), writes, task, path)
        if self.mode != "ref-wrote":
            await self.buf.aput_writes(cfg(tid, ns, cid), writes, task, path)
            if self.mode == "flushed":
                await self.buf.force_flush(tid)

    async def same(self, method: str, *args: Any, **kwargs: Any) -> None:
        """The buffered saver's answer to the call equals AsyncPostgresSaver's."""
        found = []
        for saver in (self.buf, self.ref):
            call = getattr(saver, method)(*args, **kwargs)
            if method == "alist":
                found.append([norm(t) async for t in call])
            else:
                got = await call
                found.append(norm(got) if method == "aget_tuple" else got)
        assert found[0] == found[1], (method, args, kwargs)


@asynccontextmanager
async def pair(nats_url: str, schemas: tuple[str, str], mode: str) -> AsyncIterator[Pair]:
    ref_dsn, buf_dsn = schemas
    config = fresh_config(
        nats_url, ref_dsn if mode == "ref-wrote" else buf_dsn, drain_on_close=False
    )
    async with (
        AsyncPostgresSaver.from_conn_string(ref_dsn) as ref,
        BufferedCheckpointSaver.connect(config) as buf,
    ):
        await ref.setup()
        await buf.setup()
        yield Pair(ref, buf, mode)


def ids(n: int) -> list[str]:
    """Checkpoint ids in creation order (uuid-shaped, ordered in any collation)."""
    base = uuid.uuid4().hex[:8]
    return [f"{base}-0000-6000-8000-{i:012x}" for i in range(n)]


# -- item 2: pending sends of checkpoints before format 4 --------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_pending_sends_of_checkpoints_before_v4_are_migrated(
    mode: str, nats_url: str, schemas: tuple[str, str]
) -> None:
    tid = f"t-{uuid.uuid4().hex[:8]}"
    p, c3, c4, sub = ids(4)
    async with pair(nats_url, schemas, mode) as both:
        await both.put(tid, "", None, p, {"a": "x"}, {"a": "1.0"})
        await both.writes(tid, "", p, [(TASKS, Send("n", {"i": 1}))], "task-b", "~p:1")
        await both.writes(tid, "", p, [(TASKS, Send("n", {"i": 0})), ("a", "y")], "task-a", "~p:0")
        # v<4 (langgraph-checkpoint's own empty_checkpoint stamps 2): sends migrated;
        # v4: not; a child in another namespace finds them too (the lookup ignores it).
        await both.put(tid, "", p, c3, {"a": "y"}, {"a": "2.0"}, v=2)
        await both.put(tid, "", p, c4, {"a": "y"}, {"a": "3.0"}, v=4)
        await both.put(tid, "sub", p, sub, {}, {"b": "1.0"}, v=3)
        await both.writes(tid, "", c3, [(TASKS, Send("m", 5))], "task-c", "~p:2")
        latest = await both.ref.aget_tuple(cfg(tid, "", c3))
        assert latest is not None
        assert len(latest.checkpoint["channel_values"][TASKS]) == 2
        for target in (cfg(tid), cfg(tid, "", c3), cfg(tid, "", c4), cfg(tid, "sub")):
            await both.same("aget_tuple", target)
        for listed, kwargs in (
            (cfg(tid), {}),
            ({"configurable": {"thread_id": tid}}, {}),
            (cfg(tid), {"limit": 1, "before": cfg(tid, "", c4)}),
        ):
            await both.same("alist", listed, **kwargs)


# -- item 3: aget_delta_channel_history ----------------------------------------------------


async def build_delta_thread(both: Pair, tid: str, chain: list[str]) -> None:
    """A chain with every kind of stored value for channels ``d`` and ``e``: a blob, a
    `_DeltaSnapshot` (inline ``true`` marker plus blob), inline primitives, an inline
    JSON ``null`` (AsyncPostgresSaver: nothing stored), a value without a version, and
    writes of several tasks per checkpoint."""
    layout: list[tuple[dict[str, Any], dict[str, str | int | float]]] = [
        ({"d": [1, 2], "e": 0}, {"d": "1", "e": "1"}),
        ({}, {"d": "1", "e": "1"}),
        ({"d": _DeltaSnapshot([1, 2, 3]), "e": None}, {"d": "2", "e": "2"}),
        ({"e": None}, {"d": "2", "e": "3"}),
        ({"e": 7}, {"e": "4"}),
        ({"e": None, "f": "no version"}, {"e": "5"}),
        ({}, {"d": "2", "e": "5"}),
        ({"e": None}, {"d": "2", "e": "6"}),
    ]
    parent = None
    for i, (values, versions) in enumerate(layout):
        await both.put(tid, "", parent, chain[i], values, versions)
        for task, path in (("tb", "~p:1"), ("ta", "~p:1"), ("tc", "")):
            await both.writes(
                tid, "", chain[i], [("d", [i, task]), ("e", i), ("x", 0), ("d", i)], task, path
            )
        parent = chain[i]
    # A fork off the second checkpoint: only on-path ancestors count.
    await both.put(tid, "", chain[1], chain[len(layout)], {"e": None}, {"e": "9"})


@pytest.mark.parametrize("mode", MODES)
async def test_delta_channel_history_is_async_postgres_savers(
    mode: str, nats_url: str, schemas: tuple[str, str]
) -> None:
    tid = f"t-{uuid.uuid4().hex[:8]}"
    chain = ids(9)
    async with pair(nats_url, schemas, mode) as both:
        await build_delta_thread(both, tid, chain)
        channels = ["d", "e", "f", "x", "nothing"]
        targets = [cfg(tid), cfg(tid, "", "missing-id"), cfg(f"{tid}-none")]
        targets += [cfg(tid, "", cid) for cid in chain]
        for target in targets:
            await both.same("aget_delta_channel_history", config=target, channels=channels)
        # The inline null is not a seed: the walk goes on to the snapshot.
        history = await both.buf.aget_delta_channel_history(
            config=cfg(tid, "", chain[7]), channels=["e"]
        )
        assert history["e"]["seed"] == 7


async def test_delta_channel_history_without_postgres_is_read_from_the_wal(
    nats_url: str, schemas: tuple[str, str]
) -> None:
    """While Postgres is down, a thread the WAL holds whole answers from the WAL alone
    (a graph with a DeltaChannel keeps running, as the others do)."""
    tid = f"t-{uuid.uuid4().hex[:8]}"
    chain = ids(9)
    async with pair(nats_url, schemas, "tail") as both:
        await build_delta_thread(both, tid, chain)

        async def down(*args: Any, **kwargs: Any) -> Any:
            raise DatabaseUnavailableError("Postgres is down (injected)")

        real = both.buf.sink.flushed_seqs
        both.buf.sink.flushed_seqs = down  # type: ignore[method-assign]
        channels = ["d", "e", "f", "x", "nothing"]
        for target in [cfg(tid), cfg(tid, "", "missing-id"), cfg(f"{tid}-none")] + [
            cfg(tid, "", cid) for cid in chain
        ]:
            await both.same("aget_delta_channel_history", config=target, channels=channels)
        both.buf.sink.flushed_seqs = real  # type: ignore[method-assign]


async def test_delta_channel_history_costs_constant_round_trips(
    nats_url: str, schemas: tuple[str, str]
) -> None:
    """One statement finds the chain and another reads its writes and seed, whatever
    its length, also with part of it unflushed."""
    tid = f"t-{uuid.uuid4().hex[:8]}"
    chain = ids(40)
    async with pair(nats_url, schemas, "tail") as both:
        buf = both.buf
        parent = None
        for i, cid in enumerate(chain):
            await both.put(
                tid, "", parent, cid, {"d": [i]} if i == 0 else {}, {"d": str(min(i, 1))}
            )
            await both.writes(tid, "", cid, [("d", i)], "t", "")
            parent = cid
            if i == 25:
                await buf.force_flush(tid)
        used = 0
        real = buf.sink.connection

        def counting(what: str) -> Any:
            nonlocal used
            used += 1
            return real(what)

        buf.sink.connection = counting  # type: ignore[method-assign]
        got = await buf.aget_delta_channel_history(config=cfg(tid), channels=["d"])
        assert got == await both.ref.aget_delta_channel_history(config=cfg(tid), channels=["d"])
        assert len(got["d"]["writes"]) == 39
        assert used <= 4  # watermark, walk, then writes and seed side by side
        # The sync method bridges onto the saver's loop, from another thread.
        assert (
            await asyncio.to_thread(buf.get_delta_channel_history, config=cfg(tid), channels=["d"])
            == got
        )


# -- item 5: checkpoint ids in the database's collation order ------------------------------


@pytest.mark.parametrize("flush_between", [False, True])
async def test_ids_are_ordered_by_the_database_collation(
    flush_between: bool, nats_url: str, icu_schemas: tuple[str, str]
) -> None:
    """Under ICU ``en-US``, ``a < B < c < D`` (code points: ``B < D < a < c``): the
    latest checkpoint, list order and ``before`` are the database's, before and after
    a flush."""
    tid = f"t-{uuid.uuid4().hex[:8]}"
    order = ["a", "B", "c", "D", "e-1", "e1", "E2"]
    async with pair(nats_url, icu_schemas, "tail") as both:
        parent = None
        for i, cid in enumerate(order):
            await both.put(tid, "", parent, cid, {"k": i}, {"k": str(i)})
            parent = cid
            if flush_between and i == 2:
                await both.buf.force_flush(tid)
        reads: list[tuple[RunnableConfig, dict[str, Any]]] = [
            (cfg(tid), {}),
            (cfg(tid), {"limit": 2}),
            (cfg(tid), {"before": cfg(tid, "", "c")}),
            (cfg(tid), {"before": cfg(tid, "", "D"), "limit": 2}),
        ]
        # Puts pending; then flushed but for a write (stored rows alone are merged).
        for _ in range(2):
            await both.same("aget_tuple", cfg(tid))
            for listed, kwargs in reads:
                await both.same("alist", listed, **kwargs)
            await both.same("aget_delta_channel_history", config=cfg(tid, "", "c"), channels=["k"])
            await both.buf.force_flush(tid)
            await both.writes(tid, "", "D", [("x", 1)], "task", "")


async def test_reads_without_postgres_order_ids_by_code_point_under_c(
    nats_url: str, schemas: tuple[str, str]
) -> None:
    """While Postgres is down, the WAL alone answers for a thread it holds whole."""
    await read_two_without_postgres(nats_url, schemas, icu=False)


async def test_reads_without_postgres_do_not_guess_an_icu_order(
    nats_url: str, icu_schemas: tuple[str, str]
) -> None:
    """Under a collation only Postgres can apply, a read that must order several
    unflushed checkpoints raises `DatabaseUnavailableError` instead of guessing."""
    await read_two_without_postgres(nats_url, icu_schemas, icu=True)


async def read_two_without_postgres(nats_url: str, schemas: tuple[str, str], *, icu: bool) -> None:
    tid = f"t-{uuid.uuid4().hex[:8]}"
    async with pair(nats_url, schemas, "tail") as both:
        await both.put(tid, "", None, "a", {"k": 1}, {"k": "1"})
        await both.put(tid, "", "a", "B", {"k": 2}, {"k": "2"})

        async def down(*args: Any, **kwargs: Any) -> Any:
            raise DatabaseUnavailableError("Postgres is down (injected)")

        both.buf.sink.read = down  # type: ignore[method-assign]
        named = await both.buf.aget_tuple(cfg(tid, "", "B"))
        assert named is not None
        assert named.checkpoint["id"] == "B"
        if icu:
            with pytest.raises(DatabaseUnavailableError):
                await both.buf.aget_tuple(cfg(tid))
        else:
            latest = await both.buf.aget_tuple(cfg(tid))
            assert latest is not None
            assert latest.checkpoint["id"] == "a"  # "B" < "a" by code point


@pytest.mark.parametrize("flush_between", [False, True])
async def test_a_checkpoint_put_again_keeps_its_first_parent(
    flush_between: bool, nats_url: str, schemas: tuple[str, str]
) -> None:
    """AsyncPostgresSaver's upsert replaces a checkpoint and its metadata, not its
    parent: reads of the unflushed put give the first parent too (its pending sends,
    its history), whether the first put is flushed or not."""
    tid = f"t-{uuid.uuid4().hex[:8]}"
    a, b = ids(2)
    async with pair(nats_url, schemas, "tail") as both:
        await both.put(tid, "", None, a, {"k": [1]}, {"k": "1"})
        await both.writes(tid, "", a, [(TASKS, Send("n", 1)), ("k", 5)], "task", "~p")
        await both.put(tid, "", a, b, {}, {"k": "2"}, v=2)
        if flush_between:
            await both.buf.force_flush(tid)
        await both.put(tid, "", None, b, {}, {"k": "3"}, v=2)
        await both.same("aget_tuple", cfg(tid))
        await both.same("aget_tuple", cfg(tid, "", b))
        await both.same("alist", cfg(tid))
        await both.same("aget_delta_channel_history", config=cfg(tid), channels=["k"])


def extend(state: list[str] | None, writes: Sequence[list[str]]) -> list[str]:
    out = list(state or [])
    for items in writes:
        out.extend(items)
    return out


class DeltaState(TypedDict):
    log: Annotated[list[str], DeltaChannel(extend, snapshot_frequency=3)]
    n: int


def delta_graph(checkpointer: Any) -> Any:
    """A graph whose ``log`` is a DeltaChannel (rebuilt from the delta history on every
    run) and whose steps fan out with Sends."""

    def step(state: DeltaState) -> dict[str, Any]:
        return {"log": [f"step{state['n']}"], "n": state["n"] + 1}

    def fan(state: DeltaState) -> list[Send]:
        return [Send("work", {"i": i, "n": state["n"]}) for i in range(2)]

    def work(arg: Any) -> dict[str, Any]:
        return {"log": [f"work{arg['n']}.{arg['i']}"]}

    graph = StateGraph(DeltaState)
    graph.add_node("step", step)
    graph.add_node("work", cast(Any, work))  # takes a Send's argument, not the state
    graph.add_edge(START, "step")
    graph.add_conditional_edges("step", fan, ["work"])
    graph.add_edge("work", END)
    return graph.compile(checkpointer=checkpointer)


@pytest.mark.parametrize("mode", ["tail", "flushed"])
async def test_a_delta_channel_graph_runs_as_on_async_postgres_saver(
    mode: str, nats_url: str, schemas: tuple[str, str]
) -> None:
    """LangGraph rebuilds a DeltaChannel from `aget_delta_channel_history`: the same
    runs give the same states and history on both savers."""
    tid = f"t-{uuid.uuid4().hex[:8]}"
    config: RunnableConfig = {"configurable": {"thread_id": tid}}
    async with pair(nats_url, schemas, mode) as both:
        states = []
        for saver in (both.ref, both.buf):
            graph = delta_graph(saver)
            for i in range(7):
                await graph.ainvoke({"log": [f"in{i}"], "n": i}, config)
                if mode == "flushed" and saver is both.buf and i % 3 == 1:
                    await both.buf.force_flush(tid)
            history = [s.values async for s in graph.aget_state_history(config)]
            states.append(((await graph.aget_state(config)).values, history))
        assert states[0] == states[1]
        assert len(states[0][0]["log"]) == 7 * 4
