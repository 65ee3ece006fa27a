"""The `langgraph` scenario's fourth side: LangGraph's `InMemorySaver` that acknowledges
each checkpoint only after one JetStream publish of it has returned.

It is the least any checkpointer can cost that answers a step after one round trip to
NATS, measured where the buffered saver's steps are: in the same graphs, in the same
process, at the same pace. Its p50 over InMemorySaver's is what that round trip adds there
(the wire, the server, and the graphs' process waking from idle for the reply), and the
buffered saver's p50 over *its* p50 is what the buffered saver's own code adds. The bare
publishes that `profile_langgraph.publish_floor` times beside the judged point leave out
the graphs' process; this side does not.

What it publishes is the checkpoint as InMemorySaver stored it (the checkpoint without
its channel values, and its metadata, as LangGraph's serializer encoded them): the
buffered saver's entry carries a step's new values too, so this side's payload is the
smaller one. `aput_writes` stays in memory: the buffered saver sends a task's writes in
its checkpoint's entry, so it too makes one round trip per step.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import nats
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import ChannelVersions, Checkpoint, CheckpointMetadata
from langgraph.checkpoint.memory import InMemorySaver
from nats.js import JetStreamContext
from nats.js.api import StorageType, StreamConfig

from buffered_store.engine.keys import encode_token


class OnePublishSaver(InMemorySaver):
    """`InMemorySaver` whose `aput` returns once one JetStream publish of the stored
    checkpoint has been acknowledged (on `prefix.<thread token>`)."""

    def __init__(self, js: JetStreamContext, prefix: str) -> None:
        super().__init__()
        self._js = js
        self._prefix = prefix
        self.publishes = 0
        self.published_bytes = 0

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        stored = self.put(config, checkpoint, metadata, new_versions)
        where = stored["configurable"]
        thread, ns = where["thread_id"], where["checkpoint_ns"]
        (_, body), (_, meta), _parent = self.storage[thread][ns][where["checkpoint_id"]]
        payload = body + meta
        await self._js.publish(f"{self._prefix}.{encode_token(thread)}", payload)
        self.publishes += 1
        self.published_bytes += len(payload)
        return stored


@contextlib.asynccontextmanager
async def open_one_publish(nats_url: str, phase: str) -> AsyncIterator[OnePublishSaver]:
    """A `OnePublishSaver` on a file stream of its own (as the WAL is), deleted on exit."""
    name = f"ONETRIP_{phase}_{uuid.uuid4().hex[:8]}"
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        await js.add_stream(
            StreamConfig(name=name, subjects=[f"{name}.>"], storage=StorageType.FILE)
        )
        try:
            yield OnePublishSaver(js, name)
        finally:
            await js.delete_stream(name)
    finally:
        await nc.close()


def one_publish_figures(saver: Any, steps: int) -> dict[str, Any]:
    """Publishes and bytes per step of a phase of this side."""
    publishes, sent = int(saver.publishes), int(saver.published_bytes)
    return {
        "publishes": publishes,
        "publishes_per_step": publishes / steps if steps else None,
        "bytes_per_publish": sent / publishes if publishes else None,
    }
