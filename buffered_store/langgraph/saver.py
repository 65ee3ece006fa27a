"""`BufferedCheckpointSaver`: a LangGraph checkpointer that appends every write to the
WAL and answers reads by folding the unflushed tail on LangGraph's own Postgres tables.

After a flush the tables hold what `AsyncPostgresSaver` (langgraph-checkpoint-postgres)
would have written for the same calls, so an application can switch between the two
(see docs/how-to/langgraph.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any

import orjson
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    get_serializable_checkpoint_metadata,
)
from langgraph.checkpoint.serde.base import SerializerProtocol
from langgraph.checkpoint.serde.types import _DeltaSnapshot

from buffered_store.engine.buffer import WriteBuffer
from buffered_store.engine.cursors import Cursor, Seeded
from buffered_store.engine.frontend import LANGGRAPH
from buffered_store.engine.groupcommit import GroupCommit
from buffered_store.engine.ids import utcnow
from buffered_store.engine.ports import Wal
from buffered_store.errors import (
    PayloadTooLargeError,
    ThreadOwnershipError,
    ValidationError,
)
from buffered_store.langgraph.bridge import SyncBridge
from buffered_store.langgraph.config import LangGraphConfig
from buffered_store.langgraph.drafts import Drafter, Item, PutDraft
from buffered_store.langgraph.entry import (
    Claim,
    Delete,
    LgEntry,
    Op,
    Prune,
    Put,
    Runs,
    WriteRow,
    Writes,
    encode_entry,
    kind_of,
)
from buffered_store.langgraph.format import (
    LG_FORMAT,
    NO_BASES,
    LgHot,
    LgState,
)
from buffered_store.langgraph.listing import SaverListing
from buffered_store.langgraph.sink import LangGraphSink
from buffered_store.langgraph.validation import check_key, check_text, json_bytes
from buffered_store.nats import NatsWal
from buffered_store.opening import Opening


class BufferedCheckpointSaver(SyncBridge, SaverListing):
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
        # A write is acknowledged after its publish: the hot record follows in the
        # background, and reads look at the subject's last entry beside it.
        self._buffer: WriteBuffer[LgEntry, LgHot, LgState] = WriteBuffer(
            wal,
            config,
            LG_FORMAT,
            sink,
            seed=self._seed,
            too_large=_too_large,
            check_retained=False,
            background_hot=True,
            hot_linger_s=config.hot_linger_s,
            flush_parallel=8,
            what="the checkpoint saver",
        )
        self._writer = self._buffer.writer
        self._log = self._buffer.log
        self._writes: GroupCommit[tuple[tuple[Item, ...], bool], LgEntry] = GroupCommit(
            self._publish,
            linger_s=config.write_linger_s,
            max_inflight=config.max_inflight_writes,
        )
        self.loop = asyncio.get_running_loop()
        self.supports_pipeline = False
        self._stats = {
            "entries": 0,
            "inline_flushes": 0,
            "overlay_reads": 0,
            "db_reads": 0,
            "wal_only_reads": 0,
            "delta_blobs": 0,
            "deltas_refused": 0,
            "deltas_dropped": 0,
        }
        self._drafter = Drafter(self.serde, check_deltas=config.check_deltas, stats=self._stats)

    @classmethod
    def connect(
        cls, config: LangGraphConfig | None = None, *, serde: SerializerProtocol | None = None
    ) -> Opening[BufferedCheckpointSaver]:
        """Open the WAL (creating its stream, buckets and consumer if needed) and the
        Postgres pool. `config` defaults to `LangGraphConfig.from_env()`."""
        return Opening(cls._open(config or LangGraphConfig.from_env(), serde))

    @classmethod
    @asynccontextmanager
    async def from_conn_string(
        cls,
        conn_string: str,
        *,
        nats_url: str | None = None,
        pipeline: bool = False,
        serde: SerializerProtocol | None = None,
        **settings: Any,
    ) -> AsyncIterator[BufferedCheckpointSaver]:
        """``async with BufferedCheckpointSaver.from_conn_string(url) as saver``, as with
        AsyncPostgresSaver: the saver on the Postgres database at `conn_string` and the
        NATS servers at `nats_url`, closed (and drained) on exit.

        The other settings are `LangGraphConfig.from_env()`'s (so `nats_url` defaults to
        ``$BUFSTORE_LG_NATS_URL``, ``$BUFSTORE_NATS_URL``, then ``$NATS_URL``); keyword
        `settings` (any `LangGraphConfig` field) win. `pipeline` is accepted for
        AsyncPostgresSaver's signature and changes nothing: a write is one WAL round trip.
        """
        del pipeline
        if nats_url is not None:
            settings["nats_url"] = nats_url
        config = LangGraphConfig.from_env(database_url=conn_string, **settings)
        async with cls.connect(config, serde=serde) as saver:
            yield saver

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
            wal = await NatsWal.connect(config, name="bufstore-langgraph", front_end=LANGGRAPH)
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
        try:
            await self._buffer.close(settle=self._writes.settled)
        finally:
            await self.sink.close()

    aclose = close

    def stats(self) -> dict[str, int]:
        """Counters of this instance: ``entries`` written (``joined_writes``: calls whose
        operations went into another call's entry), ``inline_flushes``,
        ``overlay_reads`` (a tail was folded) and ``db_reads`` (Postgres alone answered),
        ``delta_blobs`` (list values written as their new items only) and ``deltas_dropped``
        (written whole after all: another writer wrote the thread meanwhile),
        ``cas_conflicts``, ``commit_unknown``, ``wal_bytes``."""
        return {
            **self._stats,
            "joined_writes": self._writes.joined,
            "cas_conflicts": self._writer.conflicts,
            "commit_unknown": self._writer.commit_unknown,
            "wal_bytes": self._writer.wal_bytes,
        }

    # -- the write path ---------------------------------------------------------------

    async def _seed(self, thread_id: str) -> Seeded[LgHot, LgState]:
        seq = (await self.sink.flushed_seqs([thread_id]))[thread_id]
        if seq == 0:
            return Seeded(0, None, NO_BASES)
        return Seeded(seq, LgHot(seq=seq, stream_seq=0, chain_from=1), None)

    async def _append(
        self, thread_id: str, ops: Sequence[Item], *, check_owner: bool = True, urgent: bool = True
    ) -> LgEntry:
        """Write `ops` to the thread's WAL; returns once the entry holding them is
        acknowledged. Puts and writes may share an entry with the thread's other puts and
        writes queued at the same moment (`GroupCommit`); a write that is not `urgent`
        lingers a little for a put that follows it."""
        self._buffer.check_open()
        simple = all(isinstance(op, PutDraft | Writes) for op in ops)
        entry = await self._writes.submit(
            thread_id,
            (tuple(ops), check_owner),
            joins=simple and check_owner and self.settings.wal_format == 2,
            urgent=urgent,
        )
        if self.settings.flush_each_write:
            await self.force_flush(thread_id)
        return entry

    async def _publish(
        self, thread_id: str, items: Sequence[tuple[tuple[Item, ...], bool]]
    ) -> LgEntry:
        """One entry of every operation of `items`, appended to the thread's WAL."""
        ops = tuple(op for item_ops, _ in items for op in item_ops)
        check_owner = any(check for _, check in items)
        try:
            return await self._write_entry(thread_id, ops, check_owner)
        except PayloadTooLargeError:
            if len(items) == 1:
                raise
        # Together too large for one entry: one entry each, in order.
        entry: LgEntry | None = None
        for item_ops, check in items:
            entry = await self._write_entry(thread_id, item_ops, check)
        assert entry is not None
        return entry

    async def _write_entry(
        self, thread_id: str, items: tuple[Item, ...], check_owner: bool
    ) -> LgEntry:
        nonce = self._writer.nonce()
        owner = self.settings.owner
        wal_format = self.settings.wal_format
        states: dict[int, LgState | None] = {}

        def build(cursor: Cursor[LgHot, LgState]) -> tuple[LgEntry, bytes]:
            hot = cursor.hot
            if check_owner and hot is not None and hot.owner is not None and hot.owner != owner:
                raise ThreadOwnershipError(
                    f"thread {thread_id!r} was claimed by {hot.owner!r}; this saver "
                    f"(owner {owner!r}) may no longer write to it",
                    thread_id=thread_id,
                    owner=hot.owner,
                )
            ops, states[cursor.seq + 1] = self._drafter.resolve(items, cursor.state)
            kind = kind_of(ops)
            entry = LgEntry(
                thread_id=thread_id,
                seq=cursor.seq + 1,
                kind=kind,
                at=utcnow(),
                ops=ops,
                writer=nonce,
                jump=cursor.jump,
            )
            try:
                payload = encode_entry(entry, wal_format=wal_format)
            except TypeError as exc:  # validation let something through orjson refuses
                raise ValidationError(f"{kind} of thread {thread_id!r}: {exc}") from exc
            return entry, payload

        deadline = asyncio.get_running_loop().time() + self.settings.checkpoint_timeout_s
        entry, _ = await self._writer.write(
            thread_id, build, None, deadline=deadline, state_of=lambda e: states.get(e.seq)
        )
        self._stats["entries"] += 1
        return entry

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """Append a checkpoint. Values AsyncPostgresSaver would store inline stay in
        the checkpoint JSON; the others are serialised here into blobs, as it does (a
        list that extends the one this saver put last in its channel: only its new
        items, see `Drafter.draft`)."""
        configurable = config["configurable"]
        thread_id = check_key(str(configurable["thread_id"]), "thread_id")
        ns = check_key(configurable.get("checkpoint_ns", ""), "checkpoint_ns")
        parent = configurable.get("checkpoint_id")
        if parent is not None:
            check_key(parent, "checkpoint_id")
        cid = check_key(checkpoint["id"], "checkpoint_id")
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
        md = get_serializable_checkpoint_metadata(config, metadata)
        cursor = self._writer.cursors.get(thread_id)
        draft = self._drafter.draft(
            cursor.state if cursor is not None else None,
            ns,
            {k: v for k, v in new_versions.items() if k in blob_values},
            blob_values,
        )
        op = Put(
            ns,
            cid,
            parent,
            json_bytes(copy, "checkpoint"),
            json_bytes(md, "metadata"),
            draft.blobs,
        )
        await self._append(thread_id, [draft.with_op(op)])
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
        thread_id = check_key(str(configurable["thread_id"]), "thread_id")
        ns = check_key(configurable.get("checkpoint_ns", ""), "checkpoint_ns")
        cid = check_key(configurable["checkpoint_id"], "checkpoint_id")
        check_key(task_id, "task_id")
        check_text(task_path, "task_path")
        upsert = all(w[0] in WRITES_IDX_MAP for w in writes)
        rows = tuple(
            WriteRow(idx, check_key(ch, "channel"), typ, blob)
            for _, _, _, _, _, idx, ch, typ, blob in self._dump_writes(
                thread_id, ns, cid, task_id, task_path, writes
            )
        )
        # LangGraph saves a task's writes in the background and the step's checkpoint
        # right after, so they may linger for it and share its entry.
        await self._append(
            thread_id, [Writes(ns, cid, task_id, task_path, upsert, rows)], urgent=False
        )

    async def adelete_thread(self, thread_id: str) -> None:
        """Delete the thread (every namespace); entries written before are never
        flushed back in. Allowed whoever claimed the thread."""
        await self._append(check_key(str(thread_id), "thread_id"), [Delete()], check_owner=False)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """``keep_latest``: keep each namespace's latest checkpoint (with its writes and
        the blobs it refers to), as AsyncPostgresSaver does when the entry is flushed;
        ``delete``: delete the threads. Threads using a DeltaChannel are refused before
        anything is written (NotImplementedError, as AsyncPostgresSaver)."""
        if isinstance(thread_ids, str):
            raise TypeError("thread_ids must be a sequence of thread IDs, not a str")
        if strategy not in ("keep_latest", "delete"):
            raise ValueError(f"Unknown prune strategy: {strategy!r}")
        ids = [check_key(str(tid), "thread_id") for tid in thread_ids]
        if strategy == "keep_latest" and ids:
            for tid in ids:
                await self.force_flush(tid)
            if delta := await self.sink.delta_threads(ids):
                raise NotImplementedError(
                    "keep_latest can't prune threads that use a DeltaChannel: " + ", ".join(delta)
                )
        op: Op = Delete() if strategy == "delete" else Prune()
        for tid in ids:
            await self._append(tid, [op], check_owner=False)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Delete every checkpoint whose metadata ``run_id`` is one of `run_ids`, with
        its writes and the blobs no remaining checkpoint refers to. One entry per
        affected thread (flushed or pending), applied when flushed."""
        runs = [check_text(str(r), "run_id") for r in run_ids]
        if not runs:
            return
        self._check_open()
        # The unflushed entries first, Postgres after: a checkpoint a flusher commits
        # meanwhile is then in one or the other. (The other way round, one committed
        # between the two reads is in neither: it was not in Postgres yet, and is no
        # longer pending.)
        threads: set[str] = set()
        for pending in await self._scan_pending():
            entries = await self._log.entries_between(
                pending.thread_id, pending.flushed_seq, pending.record.seq, pending.record
            )
            if any(
                isinstance(op, Put) and orjson.loads(op.metadata).get("run_id") in runs
                for e in entries
                for op in e.ops
            ):
                threads.add(pending.thread_id)
        threads |= await self.sink.threads_with_runs(runs)
        for tid in sorted(threads):
            await self._append(tid, [Runs(tuple(runs))], check_owner=False)

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy every checkpoint, write and blob of the source thread (flushed first) to
        the target, as one entry of the target (rows with the same keys are replaced)."""
        src = check_key(str(source_thread_id), "thread_id")
        dst = check_key(str(target_thread_id), "thread_id")
        await self.force_flush(src)
        copy = await self.sink.copy_rows(src)
        if copy.checkpoints:
            await self._append(dst, [copy])

    async def claim(self, thread_id: str) -> None:
        """Make this saver's ``owner`` the only writer of the thread from now on: savers
        with another owner (or none) get `ThreadOwnershipError` on put and put_writes.
        Delete, prune, delete_for_runs and another claim stay open to anyone."""
        if self.settings.owner is None:
            raise ValidationError("claim needs a saver configured with an owner")
        tid = check_key(str(thread_id), "thread_id")
        await self._append(tid, [Claim(self.settings.owner)], check_owner=False)


def _too_large(entry: LgEntry, size: int, limit: int) -> str:
    return (
        f"{entry.kind} of thread {entry.thread_id!r} needs a {size}-byte WAL entry; the NATS "
        f"server accepts {limit} (max_payload); see docs/how-to/langgraph.md#the-payload-limit"
    )
