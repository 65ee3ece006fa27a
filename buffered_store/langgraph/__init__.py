"""The LangGraph front-end: `BufferedCheckpointSaver`, a LangGraph checkpointer over the
engine's WAL, in front of LangGraph's own Postgres tables (optional extra ``langgraph``).

    async with BufferedCheckpointSaver.connect(LangGraphConfig(...)) as saver:
        await saver.setup()
        graph = builder.compile(checkpointer=saver)

`LG_FORMAT` is the front-end's format for the engine: ``Flusher(saver.sink, config,
fmt=LG_FORMAT)`` drains its WAL (see docs/how-to/langgraph.md). Synchronous applications
(``graph.invoke``) use `SyncBufferedCheckpointSaver`, as `PostgresSaver` beside
AsyncPostgresSaver.
"""

from __future__ import annotations

from buffered_store.langgraph.config import LangGraphConfig
from buffered_store.langgraph.format import (
    LG_FORMAT,
)
from buffered_store.langgraph.saver import BufferedCheckpointSaver
from buffered_store.langgraph.sink import LangGraphSink
from buffered_store.langgraph.sync import SyncBufferedCheckpointSaver

__all__ = [
    "LG_FORMAT",
    "BufferedCheckpointSaver",
    "LangGraphConfig",
    "LangGraphSink",
    "SyncBufferedCheckpointSaver",
]
