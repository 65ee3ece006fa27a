"""`SyncBufferedCheckpointSaver`: the buffered checkpointer for synchronous applications
(``graph.invoke``, ``graph.get_state``), as `PostgresSaver` is for AsyncPostgresSaver.

    with SyncBufferedCheckpointSaver.from_conn_string(DATABASE_URL, nats_url=NATS_URL) as saver:
        saver.setup()
        graph = builder.compile(checkpointer=saver)
        graph.invoke(inputs, {"configurable": {"thread_id": "t-1"}})

It owns a private event loop on a daemon thread, where a `BufferedCheckpointSaver`
lives (NATS and psycopg clients are asyncio); every call runs there and the calling
thread waits for its answer. Any number of threads may call it at once (LangGraph saves a
step's writes from worker threads). Its async methods run there too, so an async caller
on another loop may use it as well.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import AsyncIterator, Collection, Coroutine, Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import TracebackType
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
from langgraph.checkpoint.serde.base import SerializerProtocol

from buffered_store.errors import StoreClosedError
from buffered_store.langgraph.config import LangGraphConfig
from buffered_store.langgraph.saver import BufferedCheckpointSaver

T = TypeVar("T")
STOP_TIMEOUT_S = 10.0
"""Longest wait for the loop thread to end once the saver is closed."""


class LoopThread:
    """An event loop running forever on a daemon thread, and a way to run coroutines on it
    from other threads."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def on_loop(self) -> bool:
        """Whether the caller runs on the loop's own thread (where waiting would hang)."""
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
        """`coro` scheduled on the loop; the caller's future (on the caller's loop when
        it runs in one: awaitable there)."""
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the loop and wait for its result in this thread."""
        if self.on_loop():
            coro.close()
            raise asyncio.InvalidStateError(
                "SyncBufferedCheckpointSaver was called on its own event loop's thread"
            )
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        """End the loop: cancel what still runs on it, stop it, wait for the thread, close
        it. Idempotent."""
        if self.loop.is_closed():
            return
        if self._thread.is_alive():
            self.run(_cancel_others())
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(STOP_TIMEOUT_S)
        if not self._thread.is_alive():
            self.loop.close()


async def _collect(
    saver: BufferedCheckpointSaver,
    config: RunnableConfig | None,
    flt: dict[str, Any] | None,
    before: RunnableConfig | None,
    limit: int | None,
) -> list[CheckpointTuple]:
    """`alist`'s answer as a list (the saver reads it whole anyway)."""
    return [t async for t in saver.alist(config, filter=flt, before=before, limit=limit)]


async def _cancel_others() -> None:
    """Cancel every task on the running loop but this one, and let them finish."""
    me = asyncio.current_task()
    others = [t for t in asyncio.all_tasks() if t is not me]
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_asyncgens()


class SyncBufferedCheckpointSaver(BaseCheckpointSaver[str]):
    """`BufferedCheckpointSaver` for synchronous code, as `PostgresSaver` is for
    `AsyncPostgresSaver`: ``graph.invoke`` with it from plain synchronous code, without
    an event loop of your own.

    Open it with ``with SyncBufferedCheckpointSaver.from_conn_string(url) as saver`` or
    ``SyncBufferedCheckpointSaver.connect(config)`` (then ``close()``, or ``with``). The
    async saver it runs is `saver`; reads, writes, flushes and closing behave as
    documented there (docs/how-to/langgraph.md).
    """

    def __init__(self, saver: BufferedCheckpointSaver, runner: LoopThread) -> None:
        """Wraps a saver opened on `runner`'s loop (`connect` makes both)."""
        super().__init__(serde=saver.serde)
        self.saver = saver
        """The async saver, living on the private loop (call it only through this one)."""
        self._runner = runner

    @classmethod
    def connect(
        cls, config: LangGraphConfig | None = None, *, serde: SerializerProtocol | None = None
    ) -> SyncBufferedCheckpointSaver:
        """Start the private loop and open the saver on it (`BufferedCheckpointSaver.connect`;
        `config` defaults to `LangGraphConfig.from_env()`). Close it with `close()` or use
        it as a context manager."""
        runner = LoopThread("bufstore-langgraph-sync")

        async def opening() -> BufferedCheckpointSaver:
            return await BufferedCheckpointSaver.connect(
                config or LangGraphConfig.from_env(), serde=serde
            )

        try:
            saver = runner.run(opening())
        except BaseException:
            runner.stop()
            raise
        return cls(saver, runner)

    @classmethod
    @contextmanager
    def from_conn_string(
        cls,
        conn_string: str,
        *,
        nats_url: str | None = None,
        pipeline: bool = False,
        serde: SerializerProtocol | None = None,
        **settings: Any,
    ) -> Iterator[SyncBufferedCheckpointSaver]:
        """``with SyncBufferedCheckpointSaver.from_conn_string(url) as saver``, as with
        PostgresSaver; arguments as `BufferedCheckpointSaver.from_conn_string`."""
        del pipeline
        if nats_url is not None:
            settings["nats_url"] = nats_url
        with cls.connect(
            LangGraphConfig.from_env(database_url=conn_string, **settings), serde=serde
        ) as saver:
            yield saver

    def __enter__(self) -> SyncBufferedCheckpointSaver:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the saver (it drains the threads it wrote, see
        `BufferedCheckpointSaver.close`), then end the private loop and its thread."""
        if self._runner.loop.is_closed():
            return
        try:
            self._runner.run(self.saver.close())
        finally:
            self._runner.stop()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._runner.loop.is_closed():
            coro.close()
            raise StoreClosedError("the checkpoint saver is closed")
        return self._runner.run(coro)

    async def _arun(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._runner.loop.is_closed():
            coro.close()
            raise StoreClosedError("the checkpoint saver is closed")
        return await self._runner.submit(coro)

    @property
    def settings(self) -> LangGraphConfig:
        return self.saver.settings

    def setup(self) -> None:
        """`BufferedCheckpointSaver.setup`: LangGraph's tables and ours. Idempotent."""
        self._run(self.saver.setup())

    def stats(self) -> dict[str, int]:
        """`BufferedCheckpointSaver.stats`."""
        return self.saver.stats()

    def force_flush(self, thread_id: str, *, timeout: float = 10.0) -> int:
        """`BufferedCheckpointSaver.force_flush`."""
        return self._run(self.saver.force_flush(thread_id, timeout=timeout))

    def force_flush_all(self, *, timeout: float = 60.0) -> int:
        """`BufferedCheckpointSaver.force_flush_all`: before switching to PostgresSaver."""
        return self._run(self.saver.force_flush_all(timeout=timeout))

    def claim(self, thread_id: str) -> None:
        """`BufferedCheckpointSaver.claim`."""
        self._run(self.saver.claim(thread_id))

    def with_allowlist(
        self, extra_allowlist: Collection[tuple[str, ...]]
    ) -> SyncBufferedCheckpointSaver:
        """A clone whose saver deserialises with the allowlist (LangGraph calls this when
        it compiles a graph); it shares the loop and the connections."""
        inner = self.saver.with_allowlist(extra_allowlist)
        if inner is self.saver:
            return self
        clone = copy.copy(self)
        clone.saver = inner  # type: ignore[assignment]
        clone.serde = inner.serde
        return clone

    def get_next_version(self, current: str | None, channel: None) -> str:
        return self.saver.get_next_version(current, channel)

    # -- the checkpointer API, run on the private loop --------------------------------------

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        return self._run(self.saver.aget_tuple(config))

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        yield from self._run(_collect(self.saver, config, filter, before, limit))

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        return self._run(self.saver.aput(config, checkpoint, metadata, new_versions))

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        self._run(self.saver.aput_writes(config, writes, task_id, task_path))

    def delete_thread(self, thread_id: str) -> None:
        self._run(self.saver.adelete_thread(thread_id))

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        self._run(self.saver.adelete_for_runs(run_ids))

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        self._run(self.saver.acopy_thread(source_thread_id, target_thread_id))

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        self._run(self.saver.aprune(thread_ids, strategy=strategy))

    def get_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        return self._run(self.saver.aget_delta_channel_history(config=config, channels=channels))

    # -- the async API, also run on the private loop (callable from any other loop) ---------

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        return await self._arun(self.saver.aget_tuple(config))

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        for found in await self._arun(_collect(self.saver, config, filter, before, limit)):
            yield found

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        return await self._arun(self.saver.aput(config, checkpoint, metadata, new_versions))

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        await self._arun(self.saver.aput_writes(config, writes, task_id, task_path))

    async def adelete_thread(self, thread_id: str) -> None:
        await self._arun(self.saver.adelete_thread(thread_id))

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        await self._arun(self.saver.adelete_for_runs(run_ids))

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        await self._arun(self.saver.acopy_thread(source_thread_id, target_thread_id))

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        await self._arun(self.saver.aprune(thread_ids, strategy=strategy))

    async def aget_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        return await self._arun(
            self.saver.aget_delta_channel_history(config=config, channels=channels)
        )
