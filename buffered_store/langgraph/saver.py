"""`BufferedCheckpointSaver`: a LangGraph checkpointer that appends every write to the
WAL and answers reads by folding the unflushed tail on LangGraph's own Postgres tables.

After a flush the tables hold what `AsyncPostgresSaver` (langgraph-checkpoint-postgres)
would have written for the same calls, so an application can switch between the two
(see docs/how-to/langgraph.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import operator
from collections.abc import AsyncIterator, Coroutine, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from types import MappingProxyType, TracebackType
from typing import Any, TypeAlias, TypeVar, cast

import orjson
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    DeltaChannelHistory,
    get_checkpoint_id,
    get_serializable_checkpoint_metadata,
)
from langgraph.checkpoint.postgres.base import BasePostgresSaver
from langgraph.checkpoint.serde.base import SerializerProtocol
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.checkpoint.serde.types import TASKS, _DeltaSnapshot

from buffered_store.config import ReadConsistency
from buffered_store.engine.appender import Cursor, Seeded
from buffered_store.engine.buffer import WriteBuffer
from buffered_store.engine.frontend import LANGGRAPH
from buffered_store.engine.groupcommit import GroupCommit
from buffered_store.engine.ids import utcnow
from buffered_store.engine.pending import PendingThread
from buffered_store.engine.ports import Wal
from buffered_store.engine.threadlog import (
    FlushProgress,
)
from buffered_store.errors import (
    ConflictError,
    DatabaseUnavailableError,
    PayloadTooLargeError,
    ThreadOwnershipError,
    ValidationError,
    WalEntriesMissingError,
)
from buffered_store.langgraph import history, overlay, search
from buffered_store.langgraph.config import LangGraphConfig
from buffered_store.langgraph.entry import (
    LG_FORMAT,
    NO_BASES,
    BlobRow,
    Claim,
    Delete,
    LgEntry,
    LgHot,
    LgState,
    ListBase,
    Op,
    Prune,
    Put,
    Runs,
    WriteRow,
    Writes,
    delta_blob,
    encode_entry,
    kind_of,
    msgpack_list_start,
)
from buffered_store.langgraph.sink import LangGraphSink
from buffered_store.langgraph.validation import check_key, check_text, json_bytes
from buffered_store.nats import NatsWal
from buffered_store.opening import Opening

log = logging.getLogger("buffered_store.langgraph")
T = TypeVar("T")
MAX_READ_ATTEMPTS = 5
"""Reads that find a logical entry (runs, prune, copy) pending flush the thread and read
again; a thread that keeps receiving them is reported rather than read forever."""
SEARCH_FETCHES = 64
"""Pending threads whose entries a search across threads fetches at once."""


def _full(base: ListBase, items: bytes, value: list[Any]) -> bytes | None:
    """The whole blob of a delta, kept only while deltas are checked."""
    return None if base.full is None else delta_blob(base.full, len(value), items)


@dataclass(frozen=True, slots=True)
class PutDraft:
    """A put made before its entry: its blobs, deltas among them, assume the thread's
    cursor was at `based_on` (the entry is built on the cursor it finds)."""

    blobs: tuple[BlobRow, ...]
    based_on: LgState | None
    bases: dict[str, ListBase]
    """channel -> the list value put, for the cursor state after the entry."""
    op: Put | None = None

    def with_op(self, op: Put) -> PutDraft:
        return replace(self, op=op)


Item: TypeAlias = PutDraft | Op
"""What a write call hands to the group commit: a put still to be built, or an
operation."""


def _extends(value: Any, items: tuple[Any, ...]) -> bool:
    """Whether the list `value` starts with exactly these objects (identity, a C-level
    pass: in-place changes of an item are not seen, see docs/how-to/langgraph.md)."""
    return (
        isinstance(value, list)
        and len(value) >= len(items)
        and all(map(operator.is_, value, items))
    )


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
            flush_parallel=8,
            what="the checkpoint saver",
        )
        self._writer = self._buffer.writer
        self._deltas = type(self.serde) is JsonPlusSerializer
        """Whether list values may be written as deltas: only with LangGraph's own
        serializer, whose msgpack list is its items' encodings one after the other."""
        self._log = self._buffer.log
        self._pending = self._buffer.pending
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

    def _check_open(self) -> None:
        self._buffer.check_open()

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
        self._check_open()
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
            ops, states[cursor.seq + 1] = self._resolve(items, cursor.state)
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

    def _resolve(
        self, items: Sequence[Item], state: LgState | None
    ) -> tuple[tuple[Op, ...], LgState | None]:
        """The operations of an entry built on a cursor at `state`, and the state after
        it. A put's deltas assumed the state it saw when it was called; on another one
        (another writer wrote the thread meanwhile) its blobs are written whole."""
        ops: list[Op] = []
        for item in items:
            if isinstance(item, PutDraft):
                put = item.op
                assert put is not None
                bases = item.bases
                if state is not item.based_on and any(b.base is not None for b in put.blobs):
                    put, bases = self._whole(put, item)
                    self._stats["deltas_dropped"] += 1
                ops.append(put)
                after = dict(state or {})
                for blob in put.blobs:
                    after.pop((put.ns, blob.channel), None)
                after.update(((put.ns, channel), base) for channel, base in bases.items())
                state = MappingProxyType(after)
            else:
                ops.append(item)
                if isinstance(item, Delete):
                    state = NO_BASES
                elif not isinstance(item, Writes | Claim):
                    state = None  # runs, prune, copy: which versions remain is not known here
        return tuple(ops), state

    def _whole(self, put: Put, draft: PutDraft) -> tuple[Put, dict[str, ListBase]]:
        """`put` with every delta blob serialised whole."""
        blobs: list[BlobRow] = []
        bases = dict(draft.bases)
        for blob in put.blobs:
            if blob.base is None:
                blobs.append(blob)
                continue
            value = list(bases[blob.channel].items)
            typ, data = self.serde.dumps_typed(value)
            blobs.append(BlobRow(blob.channel, blob.version, typ, data))
            bases[blob.channel] = ListBase(blob.version, tuple(value), len(data))
        return replace(put, blobs=tuple(blobs)), bases

    def _delta_holds(self, channel: str, value: list[Any], base: ListBase, items: bytes) -> bool:
        """False when ``check_deltas`` finds that the delta would not rebuild the list
        serialised whole (an item of the base was changed in place after it was saved)."""
        if not self.settings.check_deltas or base.full is None:
            return True
        if delta_blob(base.full, len(value), items) == self.serde.dumps_typed(value)[1]:
            return True
        self._stats["deltas_refused"] += 1
        log.warning(
            "an item of list channel %r was changed in place after it was saved; "
            "its value is written whole (see docs/how-to/langgraph.md)",
            channel,
            extra={"action": "delta_refused"},
        )
        return False

    def _put_draft(
        self, thread_id: str, ns: str, versions: Mapping[str, Any], values: Mapping[str, Any]
    ) -> PutDraft:
        """The blobs of a put, each list value that extends what this writer put last in
        its channel as a delta (only the new items serialised: O(new items), however long
        the list), the others whole, as AsyncPostgresSaver serialises them."""
        cursor = self._writer.cursors.get(thread_id)
        based_on = cursor.state if cursor is not None else None
        blobs: list[BlobRow] = []
        bases: dict[str, ListBase] = {}
        for channel, version in versions.items():
            check_key(channel, "channel")
            ver = check_key(str(version), "version")
            if channel not in values:
                blobs.append(BlobRow(channel, ver, "empty", None))
                continue
            value = values[channel]
            base = based_on.get((ns, channel)) if based_on is not None else None
            if self._deltas and base is not None and _extends(value, base.items):
                typ, data = self.serde.dumps_typed(value[len(base.items) :])
                if typ == "msgpack":
                    items = data[msgpack_list_start(data) :]
                    if self._delta_holds(channel, value, base, items):
                        blob = BlobRow(
                            channel, ver, typ, items, base=base.version, count=len(value)
                        )
                        blobs.append(blob)
                        self._stats["delta_blobs"] += 1
                        bases[channel] = ListBase(
                            ver, tuple(value), base.size + len(items), _full(base, items, value)
                        )
                        continue
            typ, data = self.serde.dumps_typed(value)
            blobs.append(BlobRow(channel, ver, typ, data))
            if self._deltas and typ == "msgpack" and isinstance(value, list):
                full = data if self.settings.check_deltas else None
                bases[channel] = ListBase(ver, tuple(value), len(data), full)
        return PutDraft(tuple(blobs), based_on, bases)

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
        items, see `_put_draft`)."""
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
        draft = self._put_draft(
            thread_id,
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
            stored_blobs: dict[overlay.BlobKey, tuple[str, bytes | None]] = {}
            stored_writes: dict[overlay.WriteKey, list[overlay.StoredWrite]] = {}
            at_parents: list[overlay.ParentWrite] = []
        else:
            stored_blobs, (stored_writes, stored_parents), at_parents = await asyncio.gather(
                self.sink.blobs(thread_id, blob_keys),
                self.sink.writes(thread_id, write_keys),
                self.sink.parent_writes(thread_id, parents, overlay.tail_write_keys(tail, parents)),
            )
            overlay.keep_stored_parents(chosen, stored_parents)
            if missing := sorted(set(overlay.sends_to_assemble(chosen, tail)) - set(parents)):
                # A checkpoint put again over a stored one with another parent (rare).
                parents = [*parents, *missing]
                at_parents = [
                    *at_parents,
                    *await self.sink.parent_writes(
                        thread_id, missing, overlay.tail_write_keys(tail, missing)
                    ),
                ]
        await self._assemble_sends(chosen, tail, parents, at_parents)
        return [
            self._to_tuple(overlay.complete(row, tail, stored_blobs, stored_writes))
            for row in chosen
        ]

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
        """The pending threads: the KV scan, with this saver's own threads whose hot
        records are still being advanced in the background, or whose update failed
        (`hot_behind`), taken at their latest (the wait for those updates is bounded:
        with the KV down they would never land)."""
        updates = self._writer.hot_updates
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.settings.request_timeout_s):
                await updates.settled()
        pending = {p.thread_id: p for p in await self._pending.scan()}
        local: dict[str, LgHot] = {}
        for thread_id, cursor in self._writer.cursors.behind().items():
            known = pending.get(thread_id)
            if cursor.hot is not None and (known is None or cursor.hot.seq > known.record.seq):
                local[thread_id] = cursor.hot
        if local:
            flushed = await self.sink.flushed_seqs(list(local))
            for thread_id, record in local.items():
                if record.seq > flushed[thread_id]:
                    pending[thread_id] = PendingThread(thread_id, record, flushed[thread_id])
        return [pending[t] for t in sorted(pending)]

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

    def get_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        return self._sync(self.aget_delta_channel_history(config=config, channels=channels))

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


def _too_large(entry: LgEntry, size: int, limit: int) -> str:
    return (
        f"{entry.kind} of thread {entry.thread_id!r} needs a {size}-byte WAL entry; the NATS "
        f"server accepts {limit} (max_payload); see docs/how-to/langgraph.md#the-payload-limit"
    )
