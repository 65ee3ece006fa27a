"""``list(None, ...)`` of `BufferedCheckpointSaver`: a search across threads, the
pending threads' unflushed tails folded on their rows (`langgraph.search`), or the rows
Postgres holds (``EVENTUAL``, or ``STRONG`` after flushing every pending thread).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import CheckpointTuple, get_checkpoint_id

from buffered_store.config import ReadConsistency
from buffered_store.engine.pending import PendingThread
from buffered_store.errors import ConflictError
from buffered_store.langgraph import overlay, search
from buffered_store.langgraph.entry import (
    LgEntry,
    Put,
)
from buffered_store.langgraph.format import (
    LgHot,
)
from buffered_store.langgraph.reads import MAX_READ_ATTEMPTS, SaverReads

SEARCH_FETCHES = 64
"""Pending threads whose entries a search across threads fetches at once."""


class SaverListing(SaverReads):
    """`alist`, across threads too."""

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        """Checkpoints of a thread, newest first, with the unflushed tail applied.

        Without a thread (``config=None``) the search spans every thread: the pending
        threads' unflushed entries are folded on their rows, as a read of each would
        (no flush; `_search`). ``STRONG`` flushes every pending thread first and
        ``EVENTUAL`` reads Postgres alone.
        """
        self._check_open()
        if config is None:
            if self.settings.read_consistency is ReadConsistency.READ_YOUR_WRITES:
                for found in await self._search(filter, before, limit):
                    yield found
                return
            if self.settings.read_consistency is ReadConsistency.STRONG:
                await self.force_flush_all()
            for found in await self._search_stored(filter, before, limit):
                yield found
            return
        cfg: RunnableConfig = {"configurable": dict(config["configurable"])}
        cfg["configurable"]["thread_id"] = str(cfg["configurable"]["thread_id"])
        for found in await self._read(cfg, filter, before, limit):
            yield found

    async def _search_stored(
        self, flt: dict[str, Any] | None, before: RunnableConfig | None, limit: int | None
    ) -> list[CheckpointTuple]:
        """``list(None, ...)`` of the rows Postgres holds, as AsyncPostgresSaver reads them."""
        where, args = self._search_where(None, flt, before)
        rows = await self.sink.search(where, args, limit=limit)
        if migrating := [r for r in rows if overlay.migrates_sends(r)]:
            # As AsyncPostgresSaver does: one lookup, in the first row's thread.
            sends = await self.sink.pending_sends(
                rows[0]["thread_id"], [r["parent_checkpoint_id"] for r in migrating]
            )
            for row in migrating:
                row["_sends"] = sends.get(row["parent_checkpoint_id"])
        return [self._to_tuple(row) for row in rows]

    async def _search_order(
        self,
        found: search.Found,
        chains: Mapping[str, Sequence[LgEntry]],
        before: RunnableConfig | None,
    ) -> overlay.Order:
        """The database's order of the ids a search merges: code points, or (under
        another collation) the ranks Postgres gives them, in one more round trip."""
        if await self.sink.collation():
            return overlay.CODE_POINT
        ids = [r["checkpoint_id"] for r in found.other_rows]
        ids += [r["checkpoint_id"] for rows in found.pending_rows.values() for r in rows]
        ids += [
            op.checkpoint_id
            for c in chains.values()
            for e in c
            for op in e.ops
            if isinstance(op, Put)
        ]
        if before is not None and (before_id := get_checkpoint_id(before)):
            ids.append(before_id)
        return overlay.Order(await self.sink.collation_ranks(ids))

    async def _scan_pending(self) -> list[PendingThread[LgHot]]:
        """The pending threads (`WriteBuffer.scan_pending`)."""
        return await self._buffer.scan_pending()

    async def _search(
        self, flt: dict[str, Any] | None, before: RunnableConfig | None, limit: int | None
    ) -> list[CheckpointTuple]:
        """``list(None, ...)`` with the pending threads' tails folded on (see
        `langgraph.search`): a scan of the pending threads, their entries (concurrent
        gets), one statement for every thread's rows and one round for the stored blobs
        and writes of the pending checkpoints."""
        where, params = self._search_where(None, flt, before)
        gate = asyncio.Semaphore(SEARCH_FETCHES)

        async def chain(p: PendingThread[LgHot]) -> list[LgEntry]:
            async with gate:
                return await self._log.entries_between(
                    p.thread_id, p.flushed_seq, p.record.seq, p.record
                )

        for _ in range(MAX_READ_ATTEMPTS):
            pending = await self._scan_pending()
            found = await asyncio.gather(*(chain(p) for p in pending))
            chains = {p.thread_id: chain for p, chain in zip(pending, found, strict=True)}
            logical = [t for t, chain in chains.items() if not all(e.simple for e in chain)]
            if not logical:
                break
            for thread_id in logical:  # applied by SQL on the stored rows: flush them first
                await self.force_flush(thread_id)
        else:
            raise ConflictError("pending threads kept receiving logical operations while listed")
        rows = await search.read_rows(
            self.sink,
            where,
            params,
            {t: search.own_limit(chain, limit) for t, chain in chains.items()},
            limit,
        )
        chosen = search.merge(
            rows,
            chains,
            before_id=get_checkpoint_id(before) if before else None,
            metadata_filter=flt,
            limit=limit,
            order=await self._search_order(rows, chains, before),
        )
        if any(overlay.migrates_sends(c.row) for c in chosen):
            # A checkpoint before format 4 takes its parent's pending sends, which
            # AsyncPostgresSaver looks up in the first row's thread alone: such old
            # checkpoints are answered as it answers them, once everything is flushed.
            for thread_id in chains:
                await self.force_flush(thread_id)
            return await self._search_stored(flt, before, limit)
        blob_keys, write_keys = search.wanted(chosen)
        blobs, (writes, parents) = await asyncio.gather(
            search.read_blobs(self.sink, blob_keys), search.read_writes(self.sink, write_keys)
        )
        for c in chosen:
            if c.tail is not None:
                overlay.keep_stored_parents([c.row], parents.get(c.thread_id, {}))
        self._stats["overlay_reads" if chains else "db_reads"] += 1
        return [
            self._to_tuple(
                c.row
                if c.tail is None
                else overlay.complete(
                    c.row, c.tail, blobs.get(c.thread_id, {}), writes.get(c.thread_id, {})
                )
            )
            for c in chosen
        ]
