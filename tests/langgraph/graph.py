"""A small LangGraph graph that stops on an interrupt, and a process that resumes it:

    python -m tests.langgraph.graph [--sync] THREAD_ID ANSWER

With ``--sync`` it resumes with ``graph.invoke`` through `SyncBufferedCheckpointSaver`,
from plain synchronous code. The child reads its `LangGraphConfig` from
``BUFSTORE_LG_*`` variables, resumes the thread with ``Command(resume=ANSWER)``, prints
the final state as JSON and exits without draining (``drain_on_close`` false), so its
writes stay in the WAL alone.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any, TypedDict

from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.types import Command, interrupt

from buffered_store.langgraph import (
    BufferedCheckpointSaver,
    LangGraphConfig,
    SyncBufferedCheckpointSaver,
)


class State(TypedDict):
    items: list[str]
    answer: str


def build_graph(checkpointer: BaseCheckpointSaver[Any]) -> CompiledStateGraph[Any]:
    def ask(state: State) -> dict[str, Any]:
        return {"answer": interrupt({"question": "approve?", "items": state["items"]})}

    def finish(state: State) -> dict[str, Any]:
        return {"items": [*state["items"], f"done:{state['answer']}"]}

    graph = StateGraph(State)
    graph.add_node("ask", ask)
    graph.add_node("finish", finish)
    graph.add_edge(START, "ask")
    graph.add_edge("ask", "finish")
    graph.add_edge("finish", END)
    return graph.compile(checkpointer=checkpointer)


async def resume(thread_id: str, answer: str) -> dict[str, Any]:
    config = LangGraphConfig.from_env(drain_on_close=False)
    async with BufferedCheckpointSaver.connect(config) as saver:
        result: dict[str, Any] = await build_graph(saver).ainvoke(
            Command(resume=answer), {"configurable": {"thread_id": thread_id}}
        )
        return result


def resume_sync(thread_id: str, answer: str) -> dict[str, Any]:
    config = LangGraphConfig.from_env(drain_on_close=False)
    with SyncBufferedCheckpointSaver.connect(config) as saver:
        result: dict[str, Any] = build_graph(saver).invoke(
            Command(resume=answer), {"configurable": {"thread_id": thread_id}}
        )
        return result


if __name__ == "__main__":
    if sys.argv[1] == "--sync":
        print(json.dumps(resume_sync(sys.argv[2], sys.argv[3])))
    else:
        print(json.dumps(asyncio.run(resume(sys.argv[1], sys.argv[2]))))
