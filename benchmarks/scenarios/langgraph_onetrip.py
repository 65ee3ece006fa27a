"""The `langgraph` scenario's `onetrip` side: LangGraph's `InMemorySaver` that answers
each checkpoint only after one JetStream publish of it has been acknowledged.

It is what a checkpointer answering after one round trip to NATS costs at the least,
measured where the buffered saver's steps are: in the same graphs, in the same process,
at the same pace. Its p50 over InMemorySaver's is what that round trip adds to a step
here (the wire, the server, and the graphs' process handling the reply), and the
buffered saver's p50 over *its* p50 is what the buffered saver's own code adds. The
bare publishes that `profile_langgraph.publish_floor` times beside the judged point
leave out the graphs' process; this side does not.

The publish takes the buffered saver's own route, so that the route is not what the two
sides differ by: one request on a `ReplyInbox` (the reply handed over in the client's
read loop, one shared timer for the deadlines) and the acknowledgement parsed with
orjson, as `WalHandles._js_publish` does, rather than nats-py's `JetStreamContext.publish`
(a callback task per reply and `asyncio.wait_for`: about a third more wall time per
request, docs/benchmarks/history.md, *Stop 45*).

What it publishes is the checkpoint as InMemorySaver stored it (the checkpoint without
its channel values, and its metadata, as LangGraph's serializer encoded them, about
0.6 KB): the buffered saver's entry carries a step's new values too (about 3 KB), so this
side's payload is the smaller one. `aput_writes` stays in memory: the buffered saver
sends a task's writes in its checkpoint's entry, so it too makes one round trip per step.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import ChannelVersions, Checkpoint, CheckpointMetadata
from langgraph.checkpoint.memory import InMemorySaver

from buffered_store.engine.keys import encode_token
from buffered_store.nats.requests import ReplyInbox

from ..processes import scratch_stream

PUBLISH_TIMEOUT_S = 10.0
"""How long one publish may wait for its acknowledgement."""


class OnePublishSaver(InMemorySaver):
    """`InMemorySaver` whose `aput` returns once `publish(subject, payload)` of the
    stored checkpoint has returned (on `prefix.<thread token>`)."""

    def __init__(self, publish: Callable[[str, bytes], Awaitable[int]], prefix: str) -> None:
        super().__init__()
        self._publish = publish
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
        await self._publish(f"{self._prefix}.{encode_token(thread)}", payload)
        self.publishes += 1
        self.published_bytes += len(payload)
        return stored


@contextlib.asynccontextmanager
async def open_one_publish(nats_url: str, phase: str) -> AsyncIterator[OnePublishSaver]:
    """A `OnePublishSaver` on a file stream of its own (as the WAL is), deleted on exit."""
    async with scratch_stream(nats_url, f"ONETRIP_{phase}") as (nc, name):
        replies = ReplyInbox(nc)

        async def publish(subject: str, payload: bytes) -> int:
            msg = await replies.request(subject, payload, None, timeout_s=PUBLISH_TIMEOUT_S)
            return stream_seq(msg.data)

        yield OnePublishSaver(publish, name)


def stream_seq(ack: bytes) -> int:
    """The stream sequence a JetStream publish acknowledgement gives (its error raised)."""
    parsed = orjson.loads(ack)
    error = parsed.get("error")
    if error is not None:
        raise RuntimeError(f"the one-publish side's publish was refused: {error}")
    return int(parsed["seq"])


def one_publish_figures(saver: OnePublishSaver, steps: int) -> dict[str, Any]:
    """Publishes and bytes per step of a phase of this side."""
    publishes, sent = saver.publishes, saver.published_bytes
    return {
        "publishes": publishes,
        "publishes_per_step": publishes / steps if steps else None,
        "bytes_per_publish": sent / publishes if publishes else None,
    }
