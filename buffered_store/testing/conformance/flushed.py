"""`FlushedWrites`: how the conformance suite runs against an EVENTUAL buffered store.

EVENTUAL reads the inner store only, so a read right after a write sees it only once it
is flushed; the wrapper makes each write return once its thread is flushed (what an
EVENTUAL user obtains with `force_flush`), and passes every other call through.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from buffered_store import (
    BufferedThreadRunStore,
    CheckpointReceipt,
    Message,
    RunRecord,
    RunStatus,
    Thread,
)


class FlushedWrites:
    """An EVENTUAL buffered store whose checkpoints and deletes return once flushed.

    Every other call goes to the buffered store unchanged, so bad input, closed-store and
    read behaviour are the buffered store's own.
    """

    def __init__(self, store: BufferedThreadRunStore) -> None:
        self.store = store

    async def checkpoint(
        self,
        thread_id: str,
        messages: Sequence[Message],
        run: RunRecord,
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> CheckpointReceipt:
        receipt = await self.store.checkpoint(thread_id, messages, run, metadata=metadata)
        await self.store.force_flush(thread_id)
        return receipt

    async def append(
        self,
        thread_id: str,
        messages: Sequence[Message],
        run: RunRecord,
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> CheckpointReceipt:
        receipt = await self.store.append(thread_id, messages, run, metadata=metadata)
        await self.store.force_flush(thread_id)
        return receipt

    async def delete_thread(self, thread_id: str) -> None:
        await self.store.delete_thread(thread_id)
        await self.store.force_flush(thread_id)

    async def load_thread(self, thread_id: str) -> Thread | None:
        return await self.store.load_thread(thread_id)

    async def load_messages(self, thread_id: str) -> list[Message] | None:
        return await self.store.load_messages(thread_id)

    async def load_run(self, run_id: str) -> RunRecord | None:
        return await self.store.load_run(run_id)

    async def latest_run(self, thread_id: str) -> RunRecord | None:
        return await self.store.latest_run(thread_id)

    async def list_runs(
        self,
        thread_id: str | None = None,
        *,
        status: RunStatus | None = None,
        limit: int = 50,
        offset: int = 0,
    ) -> list[RunRecord]:
        return await self.store.list_runs(thread_id, status=status, limit=limit, offset=offset)

    async def list_threads(self, *, limit: int = 50, offset: int = 0) -> list[Thread]:
        return await self.store.list_threads(limit=limit, offset=offset)

    async def close(self) -> None:
        await self.store.close()
