"""`BufferedCheckpointSaver`: a LangGraph checkpointer writing to the WAL, read through an
overlay of the unflushed tail on LangGraph's own Postgres tables. SPIKE.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

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

from buffered_store.config import BufferedStoreConfig
from buffered_store.engine.appender import Seeded, ThreadLocks, Writer
from buffered_store.engine.ids import utcnow
from buffered_store.engine.pending import PendingIndex
from buffered_store.engine.ports import Wal
from buffered_store.engine.threadlog import flush_thread
from buffered_store.errors import (
    PayloadTooLargeError,
    StoreError,
    ValidationError,
)
from buffered_store.langgraph.entry import LG_FORMAT, SIMPLE_KINDS, LgEntry, LgHot, b64, encode_entry
from buffered_store.langgraph.sink import LangGraphSink


def lg_config(**overrides: Any) -> BufferedStoreConfig:
    """Our own stream, buckets and consumer (never the thread-run ones)."""
    base: dict[str, Any] = {
        "stream_name": "LGWAL",
        "hot_bucket": "lg-hot",
        "quarantine_bucket": "lg-quarantine",
        "consumer_name": "lg-flusher",
    }
    base.update(overrides)
    return BufferedStoreConfig(**base)


class OwnershipError(StoreError):
    """The thread was claimed by another writer: this saver may no longer put on it."""


# -- validation (what Postgres would reject, rejected in aput) ----------------------------


def check_text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ValidationError(f"{what} must be a string, got {type(value).__name__}")
    if "\x00" in value:
        raise ValidationError(f"{what} contains a NUL character, which Postgres text rejects")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValidationError(f"{what} is not valid Unicode (lone surrogate)") from None
    return value


def check_json(value: Any, where: str) -> None:
    """Refuse what Postgres jsonb refuses: NUL in strings or keys, NaN/Infinity, lone
    surrogates, non-JSON types."""
    stack: list[tuple[Any, str]] = [(value, where)]
    while stack:
        item, path = stack.pop()
        if item is None or isinstance(item, bool | int):
            continue
        if isinstance(item, str):
            check_text(item, path)
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise ValidationError(f"{path} is {item!r}; Postgres jsonb has no NaN/Infinity")
        elif isinstance(item, dict):
            for key, sub in item.items():
                if not isinstance(key, str):
                    raise ValidationError(f"{path} has a non-string key {key!r}")
                check_text(key, f"{path} key")
                stack.append((sub, f"{path}.{key}"))
        elif isinstance(item, list | tuple):
            stack.extend((sub, f"{path}[{i}]") for i, sub in enumerate(item))
        else:
            raise ValidationError(f"{path} is a {type(item).__name__}, not JSON")


# -- jsonb containment (metadata @> filter) ---------------------------------------------


def _scalar_eq(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    return type(a) is type(b) and a == b


def contains(doc: Any, flt: Any) -> bool:
    """jsonb ``doc @> flt`` below the top level."""
    if isinstance(flt, dict):
        return isinstance(doc, dict) and all(k in doc and contains(doc[k], v) for k, v in flt.items())
    if isinstance(flt, list | tuple):
        return isinstance(doc, list | tuple) and all(
            any(contains(d, f) for d in doc) for f in flt
        )
    if isinstance(doc, dict | list | tuple):
        return False
    return _scalar_eq(doc, flt)


# -- the saver ------------------------------------------------------------------------------


class BufferedCheckpointSaver(BasePostgresSaver):
    """LangGraph checkpointer buffered in the WAL in front of LangGraph's Postgres tables."""

    def __init__(
        self,
        sink: LangGraphSink,
        wal: Wal,
        config: BufferedStoreConfig,
        *,
        serde: SerializerProtocol | None = None,
        owner: str | None = None,
        flush_each_write: bool = False,
    ) -> None:
        super().__init__(serde=serde)
        self.sink = sink
        self.wal = wal
        self.bconfig = config
        self.owner = owner
        self.flush_each_write = flush_each_write
        self._writer: Writer[LgEntry, LgHot, bool] = Writer(
            wal, config, LG_FORMAT, seed=self._seed
        )
        self._log = self._writer.log
        self._pending = PendingIndex(wal, sink.flushed_seqs, LG_FORMAT)
        self._locks = ThreadLocks()
        self.loop = asyncio.get_running_loop()
        self.supports_pipeline = False
        self.stats = {"entries": 0, "inline_flushes": 0, "overlay_reads": 0, "db_only_reads": 0}

    async def aclose(self) -> None:
        await self.wal.close()

    # -- the write path ---------------------------------------------------------------

    async def _seed(self, thread_id: str) -> Seeded[LgHot, bool] | None:
        try:
            async with asyncio.timeout(self.bconfig.request_timeout_s):
                seq = (await self.sink.flushed_seqs([thread_id]))[thread_id]
        except (StoreError, TimeoutError):
            return None
        if seq == 0:
            return Seeded(0, None, True)
        return Seeded(seq, LgHot(seq=seq, stream_seq=0, chain_from=1), True)

    async def _append(
        self, thread_id: str, kind: str, body: dict[str, Any], *, check_owner: bool = True
    ) -> LgEntry:
        nonce = self._writer.nonce()

        def build(cursor: Any) -> tuple[LgEntry, bytes]:
            hot: LgHot | None = cursor.hot
            if check_owner and hot is not None and hot.owner is not None and hot.owner != self.owner:
                raise OwnershipError(
                    f"thread {thread_id!r} is owned by {hot.owner!r} since a claim; "
                    f"this saver ({self.owner!r}) may no longer write to it"
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
            payload = encode_entry(entry)
            if len(payload) > self._writer.max_entry_bytes:
                raise PayloadTooLargeError(
                    f"{kind} of thread {thread_id!r} needs a {len(payload)}-byte WAL entry; "
                    f"the server accepts {self._writer.max_entry_bytes}"
                )
            return entry, payload

        async def write() -> LgEntry:
            deadline = asyncio.get_running_loop().time() + self.bconfig.checkpoint_timeout_s
            entry, _ = await self._writer.write(thread_id, build, True, deadline=deadline)
            return entry

        entry: LgEntry = await self._locks.run(thread_id, write)
        self.stats["entries"] += 1
        if self.flush_each_write:
            await self.force_flush(thread_id)
        return entry

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        configurable = config["configurable"]
        thread_id = check_text(str(configurable["thread_id"]), "thread_id")
        ns = check_text(configurable.get("checkpoint_ns", ""), "checkpoint_ns")
        parent = configurable.get("checkpoint_id")
        if parent is not None:
            check_text(parent, "parent checkpoint_id")
        cid = check_text(checkpoint["id"], "checkpoint id")
        # As AsyncPostgresSaver.aput: primitives inline, the rest to checkpoint_blobs.
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
        rows = []
        for _, _, ch, ver, typ, blob in blobs:
            rows.append([check_text(ch, "channel"), check_text(str(ver), "version"), typ, b64(blob)])
        body = {"ns": ns, "id": cid, "pid": parent, "cp": copy, "md": md, "b": rows}
        await self._append(thread_id, "put", body)
        return {"configurable": {"thread_id": configurable["thread_id"], "checkpoint_ns": ns, "checkpoint_id": cid}}

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        if not writes:
            return
        configurable = config["configurable"]
        thread_id = check_text(str(configurable["thread_id"]), "thread_id")
        ns = check_text(configurable.get("checkpoint_ns", ""), "checkpoint_ns")
        cid = check_text(configurable["checkpoint_id"], "checkpoint_id")
        check_text(task_id, "task_id")
        check_text(task_path, "task_path")
        up = all(w[0] in WRITES_IDX_MAP for w in writes)
        dumped = await asyncio.to_thread(
            self._dump_writes, thread_id, ns, cid, task_id, task_path, writes
        )
        rows = [
            [idx, check_text(ch, "channel"), typ, b64(blob)]
            for _, _, _, _, _, idx, ch, typ, blob in dumped
        ]
        body = {"ns": ns, "id": cid, "task": task_id, "path": task_path, "up": up, "rows": rows}
        await self._append(thread_id, "w", body)

    async def adelete_thread(self, thread_id: str) -> None:
        await self._append(check_text(str(thread_id), "thread_id"), "del", {}, check_owner=False)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        if isinstance(thread_ids, str):
            raise TypeError("thread_ids must be a sequence of thread IDs, not a str")
        if strategy not in ("keep_latest", "delete"):
            raise ValueError(f"Unknown prune strategy: {strategy!r}")
        ids = [check_text(str(tid), "thread_id") for tid in thread_ids]
        if strategy == "keep_latest" and ids:
            # As AsyncPostgresSaver: refuse threads using a DeltaChannel, here, before
            # anything is written (in the flusher it would be a poison entry).
            from langgraph.checkpoint.postgres.base import PRUNE_DELTA_THREADS_SQL

            for tid in ids:
                await self.force_flush(tid)
            async with self.sink.pool.connection() as conn:
                cur = await conn.execute(PRUNE_DELTA_THREADS_SQL, (ids, ids))
                if delta := sorted(r["thread_id"] for r in await cur.fetchall()):
                    raise NotImplementedError(
                        "keep_latest can't prune threads that use a DeltaChannel: "
                        + ", ".join(delta)
                    )
        for tid in ids:
            kind = "del" if strategy == "delete" else "prune"
            await self._append(tid, kind, {}, check_owner=False)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        runs = [check_text(str(r), "run_id") for r in run_ids]
        if not runs:
            return
        threads: set[str] = set()
        async with self.sink.pool.connection() as conn:
            cur = await conn.execute(
                "SELECT DISTINCT thread_id FROM checkpoints WHERE metadata ->> 'run_id' = ANY(%s)",
                (runs,),
            )
            threads.update(r["thread_id"] for r in await cur.fetchall())
        for pending in await self._pending.scan():
            entries = await self._log.entries_between(
                pending.thread_id, pending.flushed_seq, pending.record.seq, pending.record
            )
            if any(e.kind == "put" and e.body["md"].get("run_id") in runs for e in entries):
                threads.add(pending.thread_id)
        for tid in sorted(threads):
            await self._append(tid, "runs", {"runs": runs}, check_owner=False)

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        src = check_text(str(source_thread_id), "source_thread_id")
        dst = check_text(str(target_thread_id), "target_thread_id")
        await self.force_flush(src)
        async with self.sink.pool.connection() as conn, conn.cursor(binary=True) as cur:
            await cur.execute(
                "SELECT checkpoint_ns, checkpoint_id, parent_checkpoint_id, checkpoint, metadata "
                "FROM checkpoints WHERE thread_id = %s ORDER BY checkpoint_id",
                (src,),
            )
            cps = [
                [r["checkpoint_ns"], r["checkpoint_id"], r["parent_checkpoint_id"], r["checkpoint"], r["metadata"]]
                for r in await cur.fetchall()
            ]
            await cur.execute(
                "SELECT checkpoint_ns, channel, version, type, blob FROM checkpoint_blobs "
                "WHERE thread_id = %s",
                (src,),
            )
            bl = [
                [r["checkpoint_ns"], r["channel"], r["version"], r["type"], b64(r["blob"])]
                for r in await cur.fetchall()
            ]
            await cur.execute(
                "SELECT checkpoint_ns, checkpoint_id, task_id, task_path, idx, channel, type, blob "
                "FROM checkpoint_writes WHERE thread_id = %s",
                (src,),
            )
            ws = [
                [r["checkpoint_ns"], r["checkpoint_id"], r["task_id"], r["task_path"], r["idx"],
                 r["channel"], r["type"], b64(r["blob"])]
                for r in await cur.fetchall()
            ]
        if not cps:
            return
        await self._append(dst, "copy", {"cps": cps, "bl": bl, "ws": ws})

    async def claim(self, thread_id: str) -> None:
        """Make this saver's `owner` the only writer of the thread from now on."""
        if self.owner is None:
            raise ValidationError("claim needs a saver with an owner")
        await self._append(
            check_text(str(thread_id), "thread_id"), "claim", {"owner": self.owner}, check_owner=False
        )

    # -- flushing -----------------------------------------------------------------------

    async def force_flush(self, thread_id: str, *, timeout: float = 10.0) -> int:  # noqa: ASYNC109
        self.stats["inline_flushes"] += 1
        async with asyncio.timeout(timeout):
            return await flush_thread(self._log, self.sink, thread_id)

    async def force_flush_all(self, *, timeout: float = 60.0) -> int:  # noqa: ASYNC109
        async with asyncio.timeout(timeout):
            threads = [p.thread_id for p in await self._pending.scan()]
            for tid in threads:
                await flush_thread(self._log, self.sink, tid)
            return len(threads)

    # -- reads ----------------------------------------------------------------------------

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
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
        filter: dict[str, Any] | None = None,  # noqa: A002
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        if config is None:
            # SPIKE: across threads, flush first and read Postgres alone.
            await self.force_flush_all()
            where, args = self._search_where(None, filter, before)
            async with self.sink.pool.connection() as conn, conn.cursor(binary=True) as cur:
                from langgraph.checkpoint.postgres.base import SELECT_SQL

                q = SELECT_SQL + where + " ORDER BY checkpoint_id DESC"
                if limit is not None:
                    q += f" LIMIT {int(limit)}"
                await cur.execute(q, args)
                rows = await cur.fetchall()
            for row in rows:
                yield self._to_tuple(row)
            return
        cfg: RunnableConfig = {"configurable": dict(config["configurable"])}
        cfg["configurable"]["thread_id"] = str(cfg["configurable"]["thread_id"])
        for tup in await self._read(cfg, filter, before, limit):
            yield tup

    async def _read(
        self,
        config: RunnableConfig,
        flt: dict[str, Any] | None,
        before: RunnableConfig | None,
        limit: int | None,
    ) -> list[CheckpointTuple]:
        thread_id: str = config["configurable"]["thread_id"]
        ns: str | None = config["configurable"].get("checkpoint_ns")
        cid = get_checkpoint_id(config)
        before_id = get_checkpoint_id(before) if before else None
        where, params = self._search_where(config, flt, before)
        for _ in range(5):
            hot, (flushed, rows) = await asyncio.gather(
                self._log.hot(thread_id), self.sink.read(thread_id, where, params, limit=limit)
            )
            if hot is None or hot.record.seq <= flushed:
                self.stats["db_only_reads"] += 1
                return [self._to_tuple(r) for r in rows]
            record = hot.record
            if record.logical_seq > flushed:
                await self.force_flush(thread_id)  # a logical op is pending: flush it first
                continue
            entries = await self._log.entries_between(thread_id, flushed, record.seq, record)
            self.stats["overlay_reads"] += 1
            break
        else:
            raise StoreError(f"thread {thread_id!r} kept moving while being read")
        cut = max((i for i, e in enumerate(entries) if e.kind == "del"), default=-1)
        deleted, entries = cut >= 0, entries[cut + 1 :]
        # The tail, row by row, as the flush would write it.
        cps: dict[tuple[str, str], dict[str, Any]] = {}
        blobs: dict[tuple[str, str, str], tuple[str, bytes | None]] = {}
        wops: list[tuple[str, str, str, int, str, str, bytes | None, str, bool]] = []
        from buffered_store.langgraph.entry import unb64

        for e in entries:
            b = e.body
            if e.kind == "put":
                cps[(b["ns"], b["id"])] = b
                for ch, ver, typ, blob in b["b"]:
                    blobs.setdefault((b["ns"], ch, ver), (typ, unb64(blob)))
            elif e.kind == "w":
                for idx, ch, typ, blob in b["rows"]:
                    wops.append((b["ns"], b["id"], b["task"], idx, ch, typ, unb64(blob), b["path"], b["up"]))
        if deleted:
            rows = []
        if limit is not None and len(rows) == limit and any(
            (r["checkpoint_ns"], r["checkpoint_id"]) in cps for r in rows
        ):
            _, rows = await self.sink.read(thread_id, where, params, limit=limit + len(cps))
        merged: dict[tuple[str, str], dict[str, Any]] = {
            (r["checkpoint_ns"], r["checkpoint_id"]): r
            for r in rows
            if (r["checkpoint_ns"], r["checkpoint_id"]) not in cps
        }
        for key, b in cps.items():
            if ns is not None and key[0] != ns:
                continue
            if cid is not None and key[1] != cid:
                continue
            if before_id is not None and not key[1] < before_id:
                continue
            if flt and not contains(b["md"], flt):
                continue
            merged[key] = {
                "thread_id": thread_id,
                "checkpoint_ns": key[0],
                "checkpoint_id": key[1],
                "parent_checkpoint_id": b["pid"],
                "checkpoint": b["cp"],
                "metadata": b["md"],
                "channel_values": None,
                "pending_writes": None,
                "_pending": True,
            }
        chosen = sorted(merged.values(), key=lambda r: r["checkpoint_id"], reverse=True)
        if limit is not None:
            chosen = chosen[:limit]
        # Blobs and stored writes the pending rows need.
        want_blobs: set[tuple[str, str, str]] = set()
        want_writes: list[tuple[str, str]] = []
        for r in chosen:
            if r.get("_pending"):
                for ch, ver in r["checkpoint"].get("channel_versions", {}).items():
                    key3 = (r["checkpoint_ns"], ch, str(ver))
                    if key3 not in blobs:
                        want_blobs.add(key3)
                want_writes.append((r["checkpoint_ns"], r["checkpoint_id"]))
        stored_blobs, stored_writes = ({}, {}) if deleted else await asyncio.gather(
            self.sink.blobs(thread_id, sorted(want_blobs)), self.sink.writes(thread_id, want_writes)
        )
        out = []
        for r in chosen:
            key = (r["checkpoint_ns"], r["checkpoint_id"])
            state: dict[tuple[str, int], tuple[str, str, bytes | None, str]] = {}
            if r.get("_pending"):
                values = []
                for ch, ver in r["checkpoint"].get("channel_versions", {}).items():
                    key3 = (key[0], ch, str(ver))
                    got = stored_blobs.get(key3) or blobs.get(key3)
                    if got is not None:
                        values.append([ch.encode(), got[0].encode(), got[1]])
                r["channel_values"] = values
                for task, idx, ch, typ, blob, path in stored_writes.get(key, []):
                    state[(task, idx)] = (ch, typ, blob, path)
            else:
                for w in r["pending_writes"] or []:
                    state[(w[0].decode(), int(w[5]))] = (w[1].decode(), w[2].decode(), w[3], w[4].decode())
            for wns, wcid, task, idx, ch, typ, blob, path, up in wops:
                if (wns, wcid) != key:
                    continue
                old = state.get((task, idx))
                if old is None:
                    state[(task, idx)] = (ch, typ, blob, path)
                elif up:
                    state[(task, idx)] = (ch, typ, blob, old[3])
            r["pending_writes"] = [
                [task.encode(), ch.encode(), typ.encode(), blob, path.encode(), str(idx).encode()]
                for (task, idx), (ch, typ, blob, path) in state.items()
            ]
            out.append(self._to_tuple(r))
        return out

    def _to_tuple(self, value: dict[str, Any]) -> CheckpointTuple:
        return CheckpointTuple(
            {
                "configurable": {
                    "thread_id": value["thread_id"],
                    "checkpoint_ns": value["checkpoint_ns"],
                    "checkpoint_id": value["checkpoint_id"],
                }
            },
            {
                **value["checkpoint"],
                "channel_values": {
                    **(value["checkpoint"].get("channel_values") or {}),
                    **self._load_blobs(value["channel_values"]),
                },
            },
            value["metadata"],
            (
                {
                    "configurable": {
                        "thread_id": value["thread_id"],
                        "checkpoint_ns": value["checkpoint_ns"],
                        "checkpoint_id": value["parent_checkpoint_id"],
                    }
                }
                if value["parent_checkpoint_id"]
                else None
            ),
            self._load_writes(value["pending_writes"]),
        )

    # -- sync API (as AsyncPostgresSaver: bridged onto the saver's loop) -------------------

    def _sync(self, coro: Any) -> Any:
        try:
            if asyncio.get_running_loop() is self.loop:
                raise asyncio.InvalidStateError(
                    "synchronous calls to BufferedCheckpointSaver are only allowed from "
                    "another thread; use the async methods on the event loop"
                )
        except RuntimeError:
            pass
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        return self._sync(self.aget_tuple(config))  # type: ignore[no-any-return]

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,  # noqa: A002
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
        return self._sync(self.aput(config, checkpoint, metadata, new_versions))  # type: ignore[no-any-return]

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
