"""The synchronous methods of `BufferedCheckpointSaver` (``put``, ``get_tuple``,
``list``, ...), bridged onto the event loop the saver was opened on, as
AsyncPostgresSaver's are: callable from another thread while that loop runs.

(`langgraph.sync.SyncBufferedCheckpointSaver` is the other way round: a saver on a loop
of its own, for applications without one.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    DeltaChannelHistory,
)

T = TypeVar("T")


class SyncBridge(BaseCheckpointSaver[str]):
    """The sync API of a saver whose async one runs on `loop`. Called on the loop's own
    thread, every method raises `asyncio.InvalidStateError` (waiting there would hang)."""

    loop: asyncio.AbstractEventLoop

    def _sync(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            coro.close()
            raise asyncio.InvalidStateError(
                "synchronous calls to BufferedCheckpointSaver are only allowed from another "
                "thread than its event loop's; on the loop, use the async methods "
                "(await saver.aget_tuple(...), await graph.ainvoke(...))"
            )
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        return self._sync(self.aget_tuple(config))

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        async def collect() -> list[CheckpointTuple]:
            return [t async for t in self.alist(config, filter=filter, before=before, limit=limit)]

        yield from self._sync(collect())

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        return self._sync(self.aput(config, checkpoint, metadata, new_versions))

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        self._sync(self.aput_writes(config, writes, task_id, task_path))

    def delete_thread(self, thread_id: str) -> None:
        self._sync(self.adelete_thread(thread_id))

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        self._sync(self.adelete_for_runs(run_ids))

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        self._sync(self.acopy_thread(source_thread_id, target_thread_id))

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        self._sync(self.aprune(thread_ids, strategy=strategy))

    def get_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        return self._sync(self.aget_delta_channel_history(config=config, channels=channels))
