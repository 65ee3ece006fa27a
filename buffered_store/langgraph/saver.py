"""`BufferedCheckpointSaver`: a LangGraph checkpointer that appends every write to the
WAL and answers reads by folding the unflushed tail on LangGraph's own Postgres tables.

After a flush the tables hold what `AsyncPostgresSaver` (langgraph-checkpoint-postgres)
would have written for the same calls, so an application can switch between the two
(see docs/how-to/langgraph.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from types import TracebackType
from typing import Any, TypeVar, cast

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    get_checkpoint_id,
    get_serializable_checkpoint_metadata,
)
from langgraph.checkpoint.postgres.base import BasePostgresSaver
from langgraph.checkpoint.serde.base import SerializerProtocol
from langgraph.checkpoint.serde.types import _DeltaSnapshot

from buffered_store.config import ReadConsistency
from buffered_store.engine.appender import Cursor, Seeded, ThreadLocks, Writer
from buffered_store.engine.ids import utcnow
from buffered_store.engine.pending import PendingIndex
from buffered_store.engine.ports import Wal
from buffered_store.engine.threadlog import (
    FlushProgress,
    flush_thread,
    force_flush,
    force_flush_all,
)
from buffered_store.errors import (
    DatabaseUnavailableError,
    PayloadTooLargeError,
    StoreClosedError,
    StoreError,
    ThreadOwnershipError,
    ValidationError,
)
from buffered_store.langgraph import overlay
from buffered_store.langgraph.config import LangGraphConfig
from buffered_store.langgraph.entry import LG_FORMAT, LgEntry, LgHot, b64, encode_entry
from buffered_store.langgraph.sink import LangGraphSink
from buffered_store.langgraph.validation import check_json, check_text
from buffered_store.nats import NatsWal
from buffered_store.opening import Opening

T = TypeVar("T")
MAX_READ_ATTEMPTS = 5
"""Reads that find a logical entry (runs, prune, copy) pending flush the thread and read
again; a thread that keeps receiving them is reported rather than read forever."""


class BufferedCheckpointSaver(BasePostgresSaver):
    """LangGraph checkpointer buffered in a NATS JetStream WAL in front of LangGraph's
    Postgres tables.

    Open it with ``async with BufferedCheckpointSaver.connect(config) as saver`` (or
    ``saver = await BufferedCheckpointSaver.connect(config)`` and ``await
    saver.close()``); call ``await saver.setup()`` once per database. Writes return once
    the WAL holds them; a flusher (embedded `flusher.Flusher(saver.sink, config,
    fmt=LG_FORMAT)` or `force_flush`) moves them to Postgres.

    The synchronous methods (``put``, ``get_tuple``, ``list``, ...) bridge onto the event
    loop the saver was opened on, as AsyncPostgresSaver's do: call them from another
    thread while that loop runs. Called on the loop's own thread they raise
    `asyncio.InvalidStateError` (every one of them, where AsyncPostgresSaver checks
    only some and can deadlock).
    """

    def __init__(
        self,
        sink: LangGraphSink,
        wal: Wal,
        config: LangGraphConfig,
        *,
        serde: SerializerProtocol | None = None,
    ) -> None:
        """The saver on an open sink and WAL (`connect` opens both; tests may pass a
        `buffered_store.testing.MemoryWal`). Closing the saver closes both."""
        super().__init__(serde=serde)
        self.sink = sink
        self.wal = wal
        self.settings = config
        self._writer: Writer[LgEntry, LgHot, bool] = Writer(wal, config, LG_FORMAT, seed=self._seed)
        self._log = self._writer.log
        self._pending = PendingIndex(wal, sink.flushed_seqs, LG_FORMAT)
        self._locks = ThreadLocks()
        self._closed = False
        self.loop = asyncio.get_running_loop()
        self.supports_pipeline = False
        self._stats = {
            "entries": 0,
            "inline_flushes": 0,
            "overlay_reads": 0,
            "db_reads": 0,
            "wal_only_reads": 0,
        }

    @classmethod
    def connect(
        cls, config: LangGraphConfig | None = None, *, serde: SerializerProtocol | None = None
    ) -> Opening[BufferedCheckpointSaver]:
        """Open the WAL (creating its stream, buckets and consumer if needed) and the
        Postgres pool. `config` defaults to `LangGraphConfig.from_env()`."""
        return Opening(cls._open(config or LangGraphConfig.from_env(), serde))

    @classmethod
    async def _open(
        cls, config: LangGraphConfig, serde: SerializerProtocol | None
    ) -> BufferedCheckpointSaver:
        sink = await LangGraphSink.open(
            config.conninfo,
            min_size=config.pool_min_size,
            max_size=config.pool_max_size,
            timeout_s=config.db_timeout_s,
        )
        try:
            wal = await NatsWal.connect(config, name="bufstore-langgraph")
        except BaseException:
            await sink.close()
            raise
        return cls(sink, wal, config, serde=serde)

    async def __aenter__(self) -> BufferedCheckpointSaver:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def setup(self) -> None:
        """Create LangGraph's tables (AsyncPostgresSaver's own migrations) and the
        watermark table ``bufstore_lg_threads``. Idempotent."""
        self._check_open()
        await self.sink.setup()

    async def close(self) -> None:
        """Flush the threads this instance wrote (best effort, bounded by
        ``drain_timeout_s``, when ``drain_on_close``), then close the WAL and the pool."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.settings.drain_on_close:
                threads = self._writer.cursors.threads()
                try:
                    async with asyncio.timeout(self.settings.drain_timeout_s):
                        for thread_id in threads:
                            await flush_thread(self._log, self.sink, thread_id)
                except (StoreError, TimeoutError):
                    pass  # the entries stay in the WAL; a flusher applies them
        finally:
            await self.wal.close()
            await self.sink.close()

    aclose = close

    def stats(self) -> dict[str, int]:
        """Counters of this instance: ``entries`` written, ``inline_flushes``,
        ``overlay_reads`` (a tail was folded) and ``db_reads`` (Postgres alone answered),
        ``cas_conflicts``, ``commit_unknown``, ``wal_bytes``."""
        return {
            **self._stats,
            "cas_conflicts": self._writer.conflicts,
            "commit_unknown": self._writer.commit_unknown,
            "wal_bytes": self._writer.wal_bytes,
        }

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the checkpoint saver is closed")

    # -- the write path ---------------------------------------------------------------

    async def _seed(self, thread_id: str) -> Seeded[LgHot, bool] | None:
        try:
            async with asyncio.timeout(self.settings.request_timeout_s):
                seq = (await self.sink.flushed_seqs([thread_id]))[thread_id]
        except (StoreError, TimeoutError):
            return None
        if seq == 0:
            return Seeded(0, None, True)
        return Seeded(seq, LgHot(seq=seq, stream_seq=0, chain_from=1), True)

    async def _append(
        self, thread_id: str, kind: str, body: dict[str, Any], *, check_owner: bool = True
    ) -> LgEntry:
        self._check_open()
        nonce = self._writer.nonce()
        owner = self.settings.owner

        def build(cursor: Cursor[LgHot, bool]) -> tuple[LgEntry, bytes]:
            hot = cursor.hot
            if check_owner and hot is not None and hot.owner is not None and hot.owner != owner:
                raise ThreadOwnershipError(
                    f"thread {thread_id!r} was claimed by {hot.owner!r}; this saver "
                    f"(owner {owner!r}) may no longer write to it",
                    thread_id=thread_id,
                    owner=hot.owner,
                )
            entry = LgEntry(
                thread_id=thread_id,
                seq=cursor.seq + 1,
                kind=kind,
                at=utcnow(),
                body=body,
                writer=nonce,
                jump=cursor.jump,
            )
            try:
                payload = encode_entry(entry)
            except TypeError as exc:  # validation let something through orjson refuses
                raise ValidationError(f"{kind} of thread {thread_id!r}: {exc}") from exc
            if len(payload) > self._writer.max_entry_bytes:
                raise PayloadTooLargeError(
                    f"{kind} of thread {thread_id!r} needs a {len(payload)}-byte WAL entry; "
                    f"the NATS server accepts {self._writer.max_entry_bytes} (max_payload); "
                    "see docs/how-to/langgraph.md#the-payload-limit"
                )
            return entry, payload

        async def write() -> LgEntry:
            deadline = asyncio.get_running_loop().time() + self.settings.checkpoint_timeout_s
            entry, _ = await self._writer.write(thread_id, build, True, deadline=deadline)
            return entry

        entry: LgEntry = await self._locks.run(thread_id, write)
        self._stats["entries"] += 1
        if self.settings.flush_each_write:
            await self.force_flush(thread_id)
        return entry

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """Append a checkpoint. Values AsyncPostgresSaver would store inline stay in
        the checkpoint JSON; the others are serialised here into blobs, as it does."""
        configurable = config["configurable"]
        thread_id = check_text(str(configurable["thread_id"]), "thread_id")
        ns = check_text(configurable.get("checkpoint_ns", ""), "checkpoint_ns")
        parent = configurable.get("checkpoint_id")
        if parent is not None:
            check_text(parent, "parent checkpoint_id")
        cid = check_text(checkpoint["id"], "checkpoint id")
        copy: dict[str, Any] = dict(checkpoint)
        copy["channel_values"] = dict(copy["channel_values"])
        blob_values: dict[str, Any] = {}
        for k, v in checkpoint["channel_values"].items():
            if isinstance(v, _DeltaSnapshot):
                blob_values[k] = copy["channel_values"].pop(k)
                copy["channel_values"][k] = True
            elif v is None or isinstance(v, str | int | float | bool):
                pass
            else:
                blob_values[k] = copy["channel_values"].pop(k)
        blob_versions = {k: v for k, v in new_versions.items() if k in blob_values}
        blobs = (
            await asyncio.to_thread(self._dump_blobs, thread_id, ns, blob_values, blob_versions)
            if blob_versions
            else []
        )
        md = get_serializable_checkpoint_metadata(config, metadata)
        check_json(copy, "checkpoint")
        check_json(md, "metadata")
        rows = [
            [check_text(ch, "channel"), check_text(str(ver), "version"), typ, b64(blob)]
            for _, _, ch, ver, typ, blob in blobs
        ]
        body = {"ns": ns, "id": cid, "pid": parent, "cp": copy, "md": md, "b": rows}
        await self._append(thread_id, "put", body)
        return {
            "configurable": {
                "thread_id": configurable["thread_id"],
                "checkpoint_ns": ns,
                "checkpoint_id": cid,
            }
        }

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        """Append a task's writes (special writes replace, the others are kept once)."""
        if not writes:
            return
        configurable = config["configurable"]
        thread_id = check_text(str(configurable["thread_id"]), "thread_id")
        ns = check_text(configurable.get("checkpoint_ns", ""), "checkpoint_ns")
        cid = check_text(configurable["checkpoint_id"], "checkpoint_id")
        check_text(task_id, "task_id")
        check_text(task_path, "task_path")
        upsert = all(w[0] in WRITES_IDX_MAP for w in writes)
        dumped = await asyncio.to_thread(
            self._dump_writes, thread_id, ns, cid, task_id, task_path, writes
        )
        rows = [
            [idx, check_text(ch, "channel"), typ, b64(blob)]
            for _, _, _, _, _, idx, ch, typ, blob in dumped
        ]
        body = {"ns": ns, "id": cid, "task": task_id, "path": task_path, "up": upsert, "rows": rows}
        await self._append(thread_id, "w", body)

    async def adelete_thread(self, thread_id: str) -> None:
        """Delete the thread (every namespace); entries written before are never
        flushed back in. Allowed whoever claimed the thread."""
        await self._append(check_text(str(thread_id), "thread_id"), "del", {}, check_owner=False)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """``keep_latest``: keep each namespace's latest checkpoint (with its writes and
        the blobs it refers to), as AsyncPostgresSaver does when the entry is flushed;
        ``delete``: delete the threads. Threads using a DeltaChannel are refused before
        anything is written (NotImplementedError, as AsyncPostgresSaver)."""
        if isinstance(thread_ids, str):
            raise TypeError("thread_ids must be a sequence of thread IDs, not a str")
        if strategy not in ("keep_latest", "delete"):
            raise ValueError(f"Unknown prune strategy: {strategy!r}")
        ids = [check_text(str(tid), "thread_id") for tid in thread_ids]
        if strategy == "keep_latest" and ids:
            for tid in ids:
                await self.force_flush(tid)
            if delta := await self.sink.delta_threads(ids):
                raise NotImplementedError(
                    "keep_latest can't prune threads that use a DeltaChannel: " + ", ".join(delta)
                )
        kind = "del" if strategy == "delete" else "prune"
        for tid in ids:
            await self._append(tid, kind, {}, check_owner=False)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Delete every checkpoint whose metadata ``run_id`` is one of `run_ids`, with
        its writes and the blobs no remaining checkpoint refers to. One entry per
        affected thread (flushed or pending), applied when flushed."""
        runs = [check_text(str(r), "run_id") for r in run_ids]
        if not runs:
            return
        self._check_open()
        threads = await self.sink.threads_with_runs(runs)
        for pending in await self._pending.scan():
            entries = await self._log.entries_between(
                pending.thread_id, pending.flushed_seq, pending.record.seq, pending.record
            )
            if any(e.kind == "put" and e.body["md"].get("run_id") in runs for e in entries):
                threads.add(pending.thread_id)
        for tid in sorted(threads):
            await self._append(tid, "runs", {"runs": runs}, check_owner=False)

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy every checkpoint, write and blob of the source thread (flushed first) to
        the target, as one entry of the target (rows with the same keys are replaced)."""
        src = check_text(str(source_thread_id), "source_thread_id")
        dst = check_text(str(target_thread_id), "target_thread_id")
        await self.force_flush(src)
        body = await self.sink.copy_body(src)
        if body["cps"]:
            await self._append(dst, "copy", body)

    async def claim(self, thread_id: str) -> None:
        """Make this saver's ``owner`` the only writer of the thread from now on: savers
        with another owner (or none) get `ThreadOwnershipError` on put and put_writes.
        Delete, prune, delete_for_runs and another claim stay open to anyone."""
        if self.settings.owner is None:
            raise ValidationError("claim needs a saver configured with an owner")
        tid = check_text(str(thread_id), "thread_id")
        await self._append(tid, "claim", {"owner": self.settings.owner}, check_owner=False)

    # -- flushing -----------------------------------------------------------------------

    async def force_flush(self, thread_id: str, *, timeout: float = 10.0) -> int:  # noqa: ASYNC109
        """Apply every entry of the thread acknowledged before the call to Postgres now
        (with or without a flusher running); returns the thread's flushed seq."""
        self._check_open()
        check_text(thread_id, "thread_id")
        self._stats["inline_flushes"] += 1
        return await force_flush(self._log, self.sink, thread_id, timeout_s=timeout)

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
        return await force_flush_all(
            self._log, self.sink, self._pending, timeout_s=timeout, parallel=8, progress=progress
        )

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

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        """Checkpoints of a thread, newest first, with the unflushed tail applied.

        Without a thread (``config=None``) the search spans every thread: it runs
        `force_flush_all` first (unless ``read_consistency`` is EVENTUAL), then reads
        Postgres alone, so it costs a flush of every pending thread.
        """
        self._check_open()
        if config is None:
            if self.settings.read_consistency is not ReadConsistency.EVENTUAL:
                await self.force_flush_all()
            where, args = self._search_where(None, filter, before)
            for row in await self.sink.search(where, args, limit=limit):
                yield self._to_tuple(row)
            return
        cfg: RunnableConfig = {"configurable": dict(config["configurable"])}
        cfg["configurable"]["thread_id"] = str(cfg["configurable"]["thread_id"])
        for found in await self._read(cfg, filter, before, limit):
            yield found

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
        for _ in range(MAX_READ_ATTEMPTS):
            try:
                hot, (flushed, rows) = await asyncio.gather(
                    self._log.hot(thread_id), self.sink.read(thread_id, where, params, limit=limit)
                )
            except DatabaseUnavailableError as exc:
                return await self._read_without_db(thread_id, config, flt, before, limit, exc)
            if hot is None or hot.record.seq <= flushed:
                self._stats["db_reads"] += 1
                return [self._to_tuple(r) for r in rows]
            record = hot.record
            if record.logical_seq <= flushed:
                entries = await self._log.entries_between(thread_id, flushed, record.seq, record)
                break
            await self.force_flush(thread_id)  # a logical op is pending: apply it first
        else:
            raise StoreError(f"thread {thread_id!r} kept changing while being read")
        self._stats["overlay_reads"] += 1
        tail = overlay.fold(entries)
        if not tail.deleted and overlay.needs_more_rows(rows, tail, limit):
            assert limit is not None
            _, rows = await self.sink.read(
                thread_id, where, params, limit=limit + len(tail.checkpoints)
            )
        chosen = self._merge(rows, tail, thread_id, config, flt, before, limit)
        blob_keys, write_keys = overlay.wanted(chosen, tail)
        if tail.deleted:
            stored_blobs: dict[overlay.BlobKey, tuple[str, bytes | None]] = {}
            stored_writes: dict[overlay.WriteKey, list[overlay.StoredWrite]] = {}
        else:
            stored_blobs, stored_writes = await asyncio.gather(
                self.sink.blobs(thread_id, blob_keys), self.sink.writes(thread_id, write_keys)
            )
        return [
            self._to_tuple(overlay.complete(row, tail, stored_blobs, stored_writes))
            for row in chosen
        ]

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
        hot = await self._log.hot(thread_id)
        if hot is None:
            self._stats["wal_only_reads"] += 1
            return []
        record = hot.record
        if record.chain_from < 1 or record.logical_seq >= record.chain_from:
            raise error
        try:
            entries = await self._log.entries_between(thread_id, 0, record.seq, record)
        except StoreError:
            raise error from None  # part of the chain left the stream: Postgres holds it
        if not entries or entries[0].seq != record.chain_from:
            raise error
        tail = overlay.fold(entries)
        chosen = self._merge([], tail, thread_id, config, flt, before, limit)
        self._stats["wal_only_reads"] += 1
        return [self._to_tuple(overlay.complete(row, tail, {}, {})) for row in chosen]

    @staticmethod
    def _merge(
        rows: list[dict[str, Any]],
        tail: overlay.Tail,
        thread_id: str,
        config: RunnableConfig,
        flt: dict[str, Any] | None,
        before: RunnableConfig | None,
        limit: int | None,
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
        )

    def _to_tuple(self, value: dict[str, Any]) -> CheckpointTuple:
        parent = value["parent_checkpoint_id"]
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

    # -- sync API: bridged onto the saver's loop, from other threads only ------------------

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
