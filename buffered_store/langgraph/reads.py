"""The read side of `BufferedCheckpointSaver`: LangGraph's rows in Postgres with the
thread's unflushed tail folded on them (`langgraph.overlay`), as ``read_consistency``
asks; while Postgres is down, from the WAL alone when it holds the thread's whole
history. Searches across threads are `langgraph.listing`'s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any, cast

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    Checkpoint,
    CheckpointTuple,
    DeltaChannelHistory,
    get_checkpoint_id,
)
from langgraph.checkpoint.postgres.base import BasePostgresSaver
from langgraph.checkpoint.serde.types import TASKS

from buffered_store.config import ReadConsistency
from buffered_store.engine.buffer import WriteBuffer
from buffered_store.engine.threadlog import FlushProgress, ThreadLog
from buffered_store.errors import (
    ConflictError,
    DatabaseUnavailableError,
    WalEntriesMissingError,
)
from buffered_store.langgraph import history, overlay
from buffered_store.langgraph.config import LangGraphConfig
from buffered_store.langgraph.entry import (
    LgEntry,
)
from buffered_store.langgraph.format import (
    LgHot,
    LgState,
)
from buffered_store.langgraph.sink import LangGraphSink
from buffered_store.langgraph.sink_reads import TailRows
from buffered_store.langgraph.validation import check_text

MAX_READ_ATTEMPTS = 5
"""Reads that find a logical entry (runs, prune, copy) pending flush the thread and read
again; a thread that keeps receiving them is reported rather than read forever."""


class SaverReads(BasePostgresSaver):
    """Per-thread reads and flushes of the saver, over its sink and its engine."""

    sink: LangGraphSink
    settings: LangGraphConfig
    _buffer: WriteBuffer[LgEntry, LgHot, LgState]
    _log: ThreadLog[LgEntry, LgHot]
    _stats: dict[str, int]

    def _check_open(self) -> None:
        self._buffer.check_open()

    # -- flushing -----------------------------------------------------------------------

    async def force_flush(self, thread_id: str, *, timeout: float = 10.0) -> int:  # noqa: ASYNC109
        """Apply every entry of the thread acknowledged before the call to Postgres now
        (with or without a flusher running); returns the thread's flushed seq."""
        self._check_open()
        check_text(thread_id, "thread_id")
        self._stats["inline_flushes"] += 1
        return await self._buffer.force_flush(thread_id, timeout_s=timeout)

    async def force_flush_all(
        self,
        *,
        timeout: float = 60.0,  # noqa: ASYNC109
        progress: FlushProgress | None = None,
    ) -> int:
        """Flush every thread with unflushed entries; returns how many were flushed.
        Afterwards AsyncPostgresSaver reads exactly what this saver reads. `progress` and
        the `FlushTimeoutError` on timeout as in `BufferedThreadRunStore.force_flush_all`."""
        self._check_open()
        return await self._buffer.force_flush_all(timeout_s=timeout, progress=progress)

    # -- reads ----------------------------------------------------------------------------

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """The checkpoint named by ``checkpoint_id``, or the thread's latest one in the
        namespace, with the unflushed tail applied (see ``read_consistency``)."""
        configurable = config["configurable"]
        cfg: RunnableConfig = {
            "configurable": {
                "thread_id": str(configurable["thread_id"]),
                "checkpoint_ns": configurable.get("checkpoint_ns", ""),
                **({"checkpoint_id": cid} if (cid := get_checkpoint_id(config)) else {}),
            }
        }
        found = await self._read(cfg, None, None, 1)
        return found[0] if found else None

    async def _read(
        self,
        config: RunnableConfig,
        flt: dict[str, Any] | None,
        before: RunnableConfig | None,
        limit: int | None,
    ) -> list[CheckpointTuple]:
        self._check_open()
        thread_id: str = config["configurable"]["thread_id"]
        where, params = self._search_where(config, flt, before)
        consistency = self.settings.read_consistency
        if consistency is ReadConsistency.STRONG:
            await self.force_flush(thread_id)
        if consistency is not ReadConsistency.READ_YOUR_WRITES:
            _, rows = await self.sink.read(thread_id, where, params, limit=limit)
            self._stats["db_reads"] += 1
            return [self._to_tuple(r) for r in rows]
        try:
            return await self._overlay_read(thread_id, config, flt, before, limit, where, params)
        except DatabaseUnavailableError as exc:
            # Found down, or lost half-way (the tail's blobs and writes, a longer page, a
            # flush of a logical operation): the read answers as one that found it down.
            return await self._read_without_db(thread_id, config, flt, before, limit, exc)

    async def _overlay_read(
        self,
        thread_id: str,
        config: RunnableConfig,
        flt: dict[str, Any] | None,
        before: RunnableConfig | None,
        limit: int | None,
        where: str,
        params: list[Any],
    ) -> list[CheckpointTuple]:
        """The READ_YOUR_WRITES read: the thread's rows with its unflushed tail folded on."""
        for _ in range(MAX_READ_ATTEMPTS):
            # The subject's last entry beside the hot record: the record may lag the
            # entries just acknowledged (it is advanced in the background).
            (hot, upto), (flushed, rows) = await asyncio.gather(
                self._log.latest(thread_id),
                self.sink.read(thread_id, where, params, limit=limit),
            )
            if upto <= flushed:
                self._stats["db_reads"] += 1
                return [self._to_tuple(r) for r in rows]
            record = hot.record if hot is not None else None
            if record is None or record.logical_seq <= flushed:
                entries = await self._log.entries_between(thread_id, flushed, upto, record)
                if all(e.simple for e in entries):
                    break
            await self.force_flush(thread_id)  # a logical op is pending: apply it first
        else:
            raise ConflictError(f"thread {thread_id!r} kept changing while being read")
        self._stats["overlay_reads"] += 1
        tail = overlay.fold(entries)
        if not tail.deleted and overlay.needs_more_rows(rows, tail, limit):
            assert limit is not None
            _, rows = await self.sink.read(
                thread_id, where, params, limit=limit + len(tail.checkpoints)
            )
        order = await self._order(rows, tail, config, before)
        chosen = self._merge(rows, tail, thread_id, config, flt, before, limit, order)
        blob_keys, write_keys = overlay.wanted(chosen, tail)
        parents = overlay.sends_to_assemble(chosen, tail)
        if tail.deleted:
            stored = TailRows()
        else:
            # One round trip on one connection for the three kinds of rows.
            stored = await self.sink.tail_rows(
                thread_id,
                blob_keys=blob_keys,
                write_keys=write_keys,
                parents=parents,
                touched=overlay.tail_write_keys(tail, parents),
            )
            overlay.keep_stored_parents(chosen, stored.parents)
            if missing := sorted(set(overlay.sends_to_assemble(chosen, tail)) - set(parents)):
                # A checkpoint put again over a stored one with another parent (rare).
                parents = [*parents, *missing]
                stored.at_parents += await self.sink.parent_writes(
                    thread_id, missing, overlay.tail_write_keys(tail, missing)
                )
        await self._assemble_sends(chosen, tail, parents, stored.at_parents)
        return [
            self._to_tuple(overlay.complete(row, tail, stored.blobs, stored.writes))
            for row in chosen
        ]

    async def _order(
        self,
        rows: list[dict[str, Any]],
        tail: overlay.Tail,
        config: RunnableConfig,
        before: RunnableConfig | None,
    ) -> overlay.Order:
        """The database's order of the ids a merge compares: the stored rows' own order
        when no unflushed checkpoint takes part (Postgres sorted them), else code
        points, or (under another collation) the ranks Postgres gives them, in one
        round trip."""
        found = overlay.candidates(
            tail,
            ns=config["configurable"].get("checkpoint_ns"),
            checkpoint_id=get_checkpoint_id(config),
        )
        if not found:
            return overlay.Order({r["checkpoint_id"]: -i for i, r in enumerate(rows)})
        if await self.sink.collation():
            return overlay.CODE_POINT
        ids = [key[1] for key in found] + [r["checkpoint_id"] for r in rows]
        if before is not None and (before_id := get_checkpoint_id(before)):
            ids.append(before_id)
        return overlay.Order(await self.sink.collation_ranks(ids))

    async def _assemble_sends(
        self,
        chosen: list[dict[str, Any]],
        tail: overlay.Tail,
        parents: Sequence[str],
        stored: Sequence[overlay.ParentWrite],
        *,
        ask_db: bool = True,
    ) -> None:
        """Set the pending sends (``_sends``) of the rows whose parent's sends were not
        read with them: the parents' ``__pregel_tasks`` writes, stored and unflushed,
        in the database's order of (task_path, task_id, idx) (by code point without
        `ask_db`: the caller checked that the collation allows it)."""
        if not parents:
            return
        groups = {p: overlay.sends(p, tail, stored, TASKS) for p in parents}
        order = overlay.CODE_POINT
        if ask_db and any(len(g) > 1 for g in groups.values()) and not await self.sink.collation():
            texts = [text for g in groups.values() for w in g for text in w[:2]]
            order = overlay.Order(await self.sink.collation_ranks(texts))
        for group in groups.values():
            group.sort(key=lambda w: (order.key(w[0]), order.key(w[1]), w[2]))
        for row in chosen:
            parent = row["parent_checkpoint_id"]
            if parent in groups and overlay.migrates_sends(row):
                row["_sends"] = [(w[3].encode(), w[4]) for w in groups[parent]]

    async def aget_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        """AsyncPostgresSaver's delta-channel history (the same walk, chains, seeds and
        write order) over the unflushed tail and Postgres: one statement walks the
        parents, one round trip reads the writes and seeds (see `langgraph.history`).
        While Postgres is down it answers from the WAL alone, as reads do, when the WAL
        holds the thread's whole history; otherwise it raises `DatabaseUnavailableError`."""
        if not channels:
            return {}
        self._check_open()
        names = list(channels)
        configurable = config["configurable"]
        thread_id = str(configurable["thread_id"])
        ns = configurable.get("checkpoint_ns", "")
        target = get_checkpoint_id(config) or None
        try:
            tail = await self._pending_tail(thread_id)
            rows = await self.sink.history_walk(
                history.walk_sql(len(names), named=target is not None),
                history.walk_params(thread_id, ns, target, names, tail),
            )
            found = history.walk(rows, names)
            pairs, touched, blob_keys = history.wanted(found, ns, tail)
            stored_writes, stored_blobs = await asyncio.gather(
                self.sink.history_writes(thread_id, ns, pairs, touched),
                self.sink.blobs(thread_id, blob_keys),
            )
        except DatabaseUnavailableError as exc:
            whole = await self._whole_tail(thread_id, exc)
            if whole is None:
                return {ch: {"writes": []} for ch in names}
            if self.sink.code_point_order is False and len(whole.checkpoints) > 1:
                raise  # only the database can order the ids (see docs/how-to/langgraph.md)
            tail, stored_writes, stored_blobs = whole, [], {}
            found = history.walk(history.tail_walk(tail, ns, target, names), names)
            if any((ns, ch, v) in tail.deltas for ch, v in found.seed_versions.items() if v):
                raise  # a seed is a delta on a blob only Postgres holds
        return self._build_delta_channels_writes_history(
            channels=names,
            chain_by_ch=found.chains,
            seed_ver_by_ch=found.seed_versions,
            seed_inline_by_ch=found.seed_inline,
            stage2_rows=cast(
                Any, history.stage2_rows(found, ns, tail, stored_writes, stored_blobs)
            ),
        )

    async def _pending_tail(self, thread_id: str) -> overlay.Tail | None:
        """The thread's unflushed tail as ``read_consistency`` sees it (None: nothing
        to lay over Postgres). A pending logical operation is flushed first, as for
        `_read`."""
        consistency = self.settings.read_consistency
        if consistency is ReadConsistency.STRONG:
            await self.force_flush(thread_id)
        if consistency is not ReadConsistency.READ_YOUR_WRITES:
            return None
        for _ in range(MAX_READ_ATTEMPTS):
            (hot, upto), marks = await asyncio.gather(
                self._log.latest(thread_id), self.sink.flushed_seqs([thread_id])
            )
            flushed = marks[thread_id]
            if upto <= flushed:
                return None
            record = hot.record if hot is not None else None
            if record is None or record.logical_seq <= flushed:
                entries = await self._log.entries_between(thread_id, flushed, upto, record)
                if all(e.simple for e in entries):
                    return overlay.fold(entries)
            await self.force_flush(thread_id)
        raise ConflictError(f"thread {thread_id!r} kept changing while being read")

    async def _read_without_db(
        self,
        thread_id: str,
        config: RunnableConfig,
        flt: dict[str, Any] | None,
        before: RunnableConfig | None,
        limit: int | None,
        error: DatabaseUnavailableError,
    ) -> list[CheckpointTuple]:
        """A read while Postgres is down, from the WAL alone, when the WAL holds the
        thread's whole history; else `error` is raised.

        - The WAL never saw the thread: it is read as new (nothing), as the write path
          treats it when Postgres cannot say (its first entry then jumps): a graph on a
          new thread runs through an outage. A thread that only Postgres holds (written
          before the switch, or flushed and expired from the stream) reads as new too
          until Postgres is back: see docs/how-to/langgraph.md.
        - Its entries since the start of its chain are all in the stream (the chain
          starts at seq 1, or with a jump made while Postgres was down) and none of them
          is a logical operation (runs, prune, copy): they are folded on nothing.
        """
        tail = await self._whole_tail(thread_id, error)
        if tail is None:
            self._stats["wal_only_reads"] += 1
            return []
        found = overlay.candidates(
            tail,
            ns=config["configurable"].get("checkpoint_ns"),
            checkpoint_id=get_checkpoint_id(config),
        )
        if len(found) > 1 and self.sink.code_point_order is False:
            raise error  # only the database can order them (see docs/how-to/langgraph.md)
        chosen = self._merge([], tail, thread_id, config, flt, before, limit)
        if overlay.needs_stored_bases(chosen, tail):
            raise error  # a value is a delta on a blob only Postgres holds
        parents = overlay.sends_to_assemble(chosen, tail)
        if self.sink.code_point_order is False and any(
            len(overlay.sends(p, tail, [], TASKS)) > 1 for p in parents
        ):
            raise error
        await self._assemble_sends(chosen, tail, parents, [], ask_db=False)
        self._stats["wal_only_reads"] += 1
        return [self._to_tuple(overlay.complete(row, tail, {}, {})) for row in chosen]

    async def _whole_tail(
        self, thread_id: str, error: DatabaseUnavailableError
    ) -> overlay.Tail | None:
        """The thread's whole history from the WAL alone (see `_read_without_db`); None
        when the WAL never saw the thread; `error` raised when Postgres holds part of
        it."""
        hot, upto = await self._log.latest(thread_id)
        if upto == 0:
            return None
        record = hot.record if hot is not None else None
        try:
            entries = await self._log.entries_between(thread_id, 0, upto, record)
        except WalEntriesMissingError:
            raise error from None  # part of the chain left the stream: Postgres holds it
        if (
            not entries
            or not (entries[0].seq == 1 or entries[0].jump)
            or not all(e.simple for e in entries)
            or (record is not None and record.chain_from > entries[0].seq)
        ):
            raise error
        return overlay.fold(entries)

    @staticmethod
    def _merge(
        rows: list[dict[str, Any]],
        tail: overlay.Tail,
        thread_id: str,
        config: RunnableConfig,
        flt: dict[str, Any] | None,
        before: RunnableConfig | None,
        limit: int | None,
        order: overlay.Order = overlay.CODE_POINT,
    ) -> list[dict[str, Any]]:
        """`overlay.merge` with the read's selection taken from its arguments."""
        return overlay.merge(
            rows,
            tail,
            thread_id,
            ns=config["configurable"].get("checkpoint_ns"),
            checkpoint_id=get_checkpoint_id(config),
            before_id=get_checkpoint_id(before) if before else None,
            metadata_filter=flt,
            limit=limit,
            order=order,
        )

    def _to_tuple(self, value: dict[str, Any]) -> CheckpointTuple:
        parent = value["parent_checkpoint_id"]
        if sends := value.get("_sends"):
            # A checkpoint before format 4: its parent's pending sends become a channel.
            if value["channel_values"] is None:
                value["channel_values"] = []
            self._migrate_pending_sends(sends, value["checkpoint"], value["channel_values"])
        # The stored checkpoint JSON is a Checkpoint with its blob values taken out.
        checkpoint = cast(
            Checkpoint,
            {
                **value["checkpoint"],
                "channel_values": {
                    **(value["checkpoint"].get("channel_values") or {}),
                    **self._load_blobs(value["channel_values"]),
                },
            },
        )
        return CheckpointTuple(
            {
                "configurable": {
                    "thread_id": value["thread_id"],
                    "checkpoint_ns": value["checkpoint_ns"],
                    "checkpoint_id": value["checkpoint_id"],
                }
            },
            checkpoint,
            value["metadata"],
            (
                {
                    "configurable": {
                        "thread_id": value["thread_id"],
                        "checkpoint_ns": value["checkpoint_ns"],
                        "checkpoint_id": parent,
                    }
                }
                if parent
                else None
            ),
            self._load_writes(value["pending_writes"]),
        )
