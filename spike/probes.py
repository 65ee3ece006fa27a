"""SPIKE probes: what Postgres rejects (AsyncPostgresSaver vs ours), write ownership, and a
real graph interrupted in this process and resumed from a second one.

    .venv/bin/python spike/probes.py
"""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import uuid
from typing import Any, TypedDict

from langgraph.checkpoint.conformance.test_utils import generate_checkpoint
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt

from buffered_store.langgraph.saver import BufferedCheckpointSaver, OwnershipError, lg_config
from buffered_store.langgraph.sink import LangGraphSink
from buffered_store.nats import NatsWal
from buffered_store.stores.urls import to_libpq_url


class State(TypedDict):
    items: list[str]
    answer: str


def build_graph(checkpointer: Any) -> Any:
    def ask(state: State) -> dict[str, Any]:
        answer = interrupt({"question": "approve?", "items": state["items"]})
        return {"answer": answer}

    def finish(state: State) -> dict[str, Any]:
        return {"items": [*state["items"], f"done:{state['answer']}"]}

    g = StateGraph(State)
    g.add_node("ask", ask)
    g.add_node("finish", finish)
    g.add_edge(START, "ask")
    g.add_edge("ask", "finish")
    g.add_edge("finish", END)
    return g.compile(checkpointer=checkpointer)


def config_from_env() -> Any:
    return lg_config(nats_url=os.environ["NATS_URL"], stream_name="LGPROBE",
                     hot_bucket="lgprobe-hot", quarantine_bucket="lgprobe-q",
                     consumer_name="lgprobe-fl")


async def open_saver(owner: str | None = None) -> BufferedCheckpointSaver:
    config = config_from_env()
    sink = await LangGraphSink.open(os.environ["PG_DSN"])
    return BufferedCheckpointSaver(sink, await NatsWal.connect(config), config, owner=owner)


async def resume_child(thread_id: str) -> None:
    saver = await open_saver()
    graph = build_graph(saver)
    cfg = {"configurable": {"thread_id": thread_id}}
    out = await graph.ainvoke(Command(resume="yes"), cfg)
    print("CHILD result", out, "stats", saver.stats)
    await saver.aclose()
    await saver.sink.close()


async def rejects(dsn: str) -> None:
    async with AsyncPostgresSaver.from_conn_string(dsn) as ref:
        await ref.setup()
        buf = await open_saver()
        cases = {
            "NUL in an inline channel value": ({"a": "x\x00y"}, {}),
            "NaN inline": ({"a": math.nan}, {}),
            "NUL in nested metadata": ({}, {"deep": {"k": "a\x00"}}),
            "NaN in metadata": ({}, {"score": math.inf}),
            "NUL in top-level metadata (stripped by LangGraph)": ({}, {"note": "a\x00b"}),
        }
        for name, (values, extra_md) in cases.items():
            cp = generate_checkpoint(channel_values=values, channel_versions={k: 1 for k in values})
            md = {"source": "input", "step": 0, "parents": {}, **extra_md}
            cfg = {"configurable": {"thread_id": f"rej-{uuid.uuid4().hex[:6]}", "checkpoint_ns": ""}}
            results = []
            for saver in (ref, buf):
                try:
                    await saver.aput(cfg, cp, md, {k: 1 for k in values})
                    results.append("accepted")
                except Exception as exc:
                    results.append(f"{type(exc).__module__}.{type(exc).__name__}: {str(exc)[:90]}")
            print(f"REJECT {name}:\n   AsyncPostgresSaver -> {results[0]}\n   buffered          -> {results[1]}")
        cfg = {"configurable": {"thread_id": "bad\x00id", "checkpoint_ns": ""}}
        for saver in (ref, buf):
            try:
                await saver.aput(cfg, generate_checkpoint(), {}, {})
                print("REJECT NUL thread id: accepted")
            except Exception as exc:
                print(f"REJECT NUL thread id: {type(exc).__name__}: {str(exc)[:90]}")
        await buf.aclose()
        await buf.sink.close()


async def ownership() -> None:
    a, b = await open_saver("A"), await open_saver("B")
    tid = f"own-{uuid.uuid4().hex[:6]}"
    cfg = {"configurable": {"thread_id": tid, "checkpoint_ns": ""}}
    await a.claim(tid)
    await a.aput(cfg, generate_checkpoint(), {}, {})
    await b.claim(tid)
    try:
        await a.aput(cfg, generate_checkpoint(), {}, {})  # A's cursor is stale: CAS, reload
        print("OWNERSHIP: stale owner's put ACCEPTED (bad)")
    except OwnershipError as exc:
        print(f"OWNERSHIP: stale owner's put refused: {exc}")
    await b.aput(cfg, generate_checkpoint(), {}, {})
    print("OWNERSHIP: new owner's put accepted;",
          len([t async for t in b.alist({"configurable": {"thread_id": tid}})]), "checkpoints")
    for s in (a, b):
        await s.aclose()
        await s.sink.close()


async def graph_across_processes(dsn: str) -> None:
    saver = await open_saver()
    graph = build_graph(saver)
    tid = f"graph-{uuid.uuid4().hex[:6]}"
    cfg = {"configurable": {"thread_id": tid}}
    out = await graph.ainvoke({"items": ["a"], "answer": ""}, cfg)
    print("PARENT interrupted:", out.get("__interrupt__"), "stats", saver.stats)
    env = {**os.environ}
    proc = subprocess.run(
        [sys.executable, __file__, "--resume", tid], env=env, capture_output=True, text=True,
        timeout=120,
    )
    print(proc.stdout.strip(), proc.stderr.strip()[-2000:])
    state = await graph.aget_state(cfg)
    print("PARENT sees after child resumed:", state.values, "next", state.next)
    flushed = await saver.force_flush_all()
    async with AsyncPostgresSaver.from_conn_string(dsn) as ref:
        ref_state = await build_graph(ref).aget_state(cfg)
        print(f"AsyncPostgresSaver after force_flush_all ({flushed} threads):", ref_state.values,
              "same" if ref_state.values == state.values else "DIFFERENT")
        history = [h async for h in build_graph(ref).aget_state_history(cfg)]
        mine = [h async for h in graph.aget_state_history(cfg)]
        print("history lengths ref/buffered:", len(history), len(mine),
              "equal configs:", [h.config for h in history] == [h.config for h in mine])
    await saver.aclose()
    await saver.sink.close()


async def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--resume":
        await resume_child(sys.argv[2])
        return
    from buffered_store.dev.services import start_services

    services = start_services()
    try:
        dsn = to_libpq_url(services.database_url)
        os.environ["NATS_URL"] = services.nats_url
        os.environ["PG_DSN"] = dsn
        sink = await LangGraphSink.open(dsn)
        await sink.setup()
        await sink.close()
        await rejects(dsn)
        await ownership()
        await graph_across_processes(dsn)
    finally:
        services.close()


if __name__ == "__main__":
    asyncio.run(main())
