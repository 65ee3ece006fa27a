"""The same random calls to AsyncPostgresSaver and `BufferedCheckpointSaver`, each in its
own schema of one database: every read compared after every call (the buffered one
mostly answering from its unflushed tail), then, after `force_flush_all`, LangGraph's
three tables compared row for row.

Beyond puts, writes, flushes, deletes and prunes, the calls cover what issue 24 names:
checkpoints put again with another parent, checkpoints of format versions before 4
whose parents hold pending sends
(``__pregel_tasks`` writes), delta-channel histories (inline values, JSON ``null``,
`_DeltaSnapshot` blobs, growing lists written as deltas) read after every step, deletes
racing a flush, and, as in the thread-run model test (tests/integration/test_model.py),
faults at the buffered saver's WAL seam (a lost publish ack, a lost hot-record update,
the KV down for hot-record updates) and a flusher stopped and started again (with or
without draining) in the middle of the sequence. Every fault leaves the call
acknowledged (the writer finds its own entry; hot records are advanced in the
background), so both savers see the same calls and every read must be equal.

delete_for_runs and copy_thread are left out: AsyncPostgresSaver 3.2.0 does not
implement them (their semantics here are ours; the conformance suite covers them).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import CheckpointMetadata, CheckpointTuple
from langgraph.checkpoint.conformance.test_utils import generate_checkpoint
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from langgraph.checkpoint.serde.types import ERROR, INTERRUPT, RESUME, TASKS, _DeltaSnapshot
from langgraph.types import Send

from buffered_store.engine.keys import hot_key
from buffered_store.engine.ports import Wal
from buffered_store.errors import WalUnavailableError
from buffered_store.langgraph import LG_FORMAT, BufferedCheckpointSaver
from flusher import Flusher
from tests.langgraph.helpers import fresh_config, icu_schemas_of, two_schemas

SEEDS = ((1, "C"), (2, "C"), (3, "C"), (4, "C"), (5, "icu"))
"""(random seed, database collation): under ICU ``en-US`` the checkpoint ids are not
uuid6 but mixed-case words whose order there differs from their code point order."""
ICU_WORDS = ("a", "B", "c", "D", "e-", "E", "f_")
STEPS = 200
TABLES = {
    "checkpoints": "thread_id, checkpoint_ns, checkpoint_id",
    "checkpoint_blobs": "thread_id, checkpoint_ns, channel, version",
    "checkpoint_writes": "thread_id, checkpoint_ns, checkpoint_id, task_id, idx",
}
THREADS = ("t1", "t2", "t3")
NAMESPACES = ("", "child:1")
CHANNELS = ("a", "b", "c", "msgs")
HISTORY_CHANNELS = ["a", "c", "msgs", "x", TASKS]
FAULTS = ("ack_lost", "hot_lost", "kv_down")
WRITE_CHANNELS = (
    ["x"],
    ["x", "y"],
    [ERROR],
    [INTERRUPT, RESUME],
    ["x", ERROR],
    [TASKS],
    [TASKS, "x"],
    [TASKS, TASKS],
)


def norm(t: CheckpointTuple | None) -> Any:
    if t is None:
        return None
    checkpoint: dict[str, Any] = dict(t.checkpoint)
    versions = dict(checkpoint["channel_versions"])
    if list(versions) == [TASKS]:
        # Migrated sends of a checkpoint without channel versions get a random one
        # (AsyncPostgresSaver's `_migrate_pending_sends`).
        versions[TASKS] = "random"
    checkpoint["channel_versions"] = versions
    return (t.config, checkpoint, t.metadata, t.parent_config, t.pending_writes)


class Faults:
    """Faults at the buffered saver's WAL seam, armed for one thread at a time:

    * ``ack_lost``: the next publish lands and its ack is lost (the writer's retry must
      find its own entry);
    * ``hot_lost``: the next hot-record update lands and its answer is lost;
    * ``kv_down``: every hot-record update of the thread fails until disarmed.
    """

    def __init__(self, wal: Wal) -> None:
        self.kind: str | None = None
        self.key = ""
        self.tripped = 0
        real_publish, real_swap = wal.publish, wal.kv_swap

        async def publish(subject: str, payload: bytes, **kw: Any) -> tuple[int, bool]:
            result = await real_publish(subject, payload, **kw)
            if self.kind == "ack_lost":
                self.kind = None
                self.tripped += 1
                raise WalUnavailableError("publish ack lost (injected)")
            return result

        async def kv_swap(key: str, value: bytes, *, revision: int | None) -> int:
            if key == self.key and self.kind == "kv_down":
                self.tripped += 1
                raise WalUnavailableError("KV unreachable (injected)")
            answer = await real_swap(key, value, revision=revision)
            if key == self.key and self.kind == "hot_lost":
                self.kind = None
                self.tripped += 1
                raise WalUnavailableError("KV answer lost (injected)")
            return answer

        wal.publish = publish  # type: ignore[method-assign]
        wal.kv_swap = kv_swap  # type: ignore[method-assign]

    def arm(self, kind: str | None, thread_id: str) -> None:
        self.kind, self.key = kind, hot_key(thread_id)


@dataclass
class Model:
    """What the calls so far created: heads, channel versions and values, checkpoint ids."""

    heads: dict[tuple[str, str], str] = field(default_factory=dict)
    versions: dict[tuple[str, str, str], str] = field(default_factory=dict)
    values: dict[tuple[str, str, str], Any] = field(default_factory=dict)
    ids: dict[tuple[str, str], list[str]] = field(default_factory=dict)

    def forget(self, tid: str) -> None:
        for key in [k for k in self.heads if k[0] == tid]:
            self.heads.pop(key)
            self.ids.pop(key, None)
        for vkey in [k for k in self.versions if k[0] == tid]:
            self.versions.pop(vkey)


@pytest.fixture
async def db_schemas(request: pytest.FixtureRequest, pg_dsn: str) -> AsyncIterator[tuple[str, str]]:
    """Two fresh schemas of the test database, or of a new ICU-collated one."""
    if request.param == "icu":
        async with icu_schemas_of(pg_dsn) as found:
            yield found
    else:
        async with two_schemas(pg_dsn) as found:
            yield found


@pytest.mark.parametrize(("seed", "db_schemas"), SEEDS, indirect=["db_schemas"])
async def test_buffered_saver_reads_and_writes_what_async_postgres_saver_does(
    seed: int, nats_url: str, db_schemas: tuple[str, str]
) -> None:
    ref_dsn, buf_dsn = db_schemas
    words = ICU_WORDS if seed == 5 else None
    rnd = random.Random(seed)
    across_rnd = random.Random(-seed)
    config = fresh_config(nats_url, buf_dsn, drain_on_close=False)
    async with (
        AsyncPostgresSaver.from_conn_string(ref_dsn) as ref,
        BufferedCheckpointSaver.connect(config) as buf,
    ):
        await ref.setup()
        await buf.setup()
        faults = Faults(buf.wal)
        flusher: Flusher | None = None
        model = Model()
        mismatches: list[str] = []
        ops: dict[str, int] = {}
        for step in range(STEPS):
            op = rnd.choices(
                ["put", "writes", "flush", "delete", "prune", "delete_race", "flusher", "again"],
                [40, 40, 8, 2, 2, 3, 4, 3],
            )[0]
            tid, ns = rnd.choice(THREADS), rnd.choice(NAMESPACES)
            ops[op] = ops.get(op, 0) + 1
            fault = rnd.choice(FAULTS) if op in ("put", "writes") and rnd.random() < 0.15 else None
            faults.arm(fault, tid)
            if fault is not None:
                ops[fault] = ops.get(fault, 0) + 1
            if op == "put":
                await both_put(ref, buf, model, rnd, tid, ns, step, words=words)
            elif op == "again" and model.ids.get((tid, ns)):
                await both_put(ref, buf, model, rnd, tid, ns, step, again=True)
            elif op == "writes" and model.ids.get((tid, ns)):
                cid = rnd.choice(model.ids[(tid, ns)][-3:])
                chans = rnd.choice(WRITE_CHANNELS)
                writes = [
                    (ch, Send("node", {"step": step}) if ch == TASKS else rnd.choice(["v1", 3]))
                    for ch in chans
                ]
                wcfg: RunnableConfig = {
                    "configurable": {"thread_id": tid, "checkpoint_ns": ns, "checkpoint_id": cid}
                }
                task, path = rnd.choice(["task1", "task2"]), rnd.choice(["", "p:1"])
                await ref.aput_writes(wcfg, writes, task, path)
                await buf.aput_writes(wcfg, writes, task, path)
            elif op == "flush":
                await buf.force_flush(tid)
            elif op == "delete":
                await ref.adelete_thread(tid)
                await buf.adelete_thread(tid)
                model.forget(tid)
            elif op == "delete_race":
                # The delete is appended while the thread's entries are being flushed.
                await ref.adelete_thread(tid)
                await asyncio.gather(buf.force_flush(tid), buf.adelete_thread(tid))
                model.forget(tid)
            elif op == "flusher":
                if flusher is None:
                    flusher = Flusher(buf.sink, buf.settings, fmt=LG_FORMAT, backlog_poll_s=0)
                    await flusher.start()
                else:
                    await flusher.stop(drain=rnd.random() < 0.5)
                    flusher = None
            elif op == "prune":
                try:
                    await ref.aprune([tid])
                except NotImplementedError:  # the thread holds a _DeltaSnapshot
                    with pytest.raises(NotImplementedError):
                        await buf.aprune([tid])
                else:
                    await buf.aprune([tid])
                    for key in [k for k in model.ids if k[0] == tid]:
                        model.ids[key] = model.ids[key][-1:]
            for kind, rcfg, kwargs in probes(rnd, model, tid, ns, across_rnd):
                if kind == "get":
                    assert rcfg is not None
                    a, b = norm(await ref.aget_tuple(rcfg)), norm(await buf.aget_tuple(rcfg))
                elif kind == "history":
                    assert rcfg is not None
                    a = await ref.aget_delta_channel_history(config=rcfg, channels=HISTORY_CHANNELS)
                    b = await buf.aget_delta_channel_history(config=rcfg, channels=HISTORY_CHANNELS)
                else:
                    a = [norm(t) async for t in ref.alist(rcfg, **kwargs)]
                    b = [norm(t) async for t in buf.alist(rcfg, **kwargs)]
                if a != b:
                    mismatches.append(f"step {step} after {op}/{fault}: {kind} {rcfg} {kwargs}")
            faults.arm(None, tid)
        if flusher is not None:
            await flusher.stop(drain=True)
        assert mismatches == []
        assert faults.tripped > 0
        assert ops["flusher"] > 0
        stats = buf.stats()
        assert stats["overlay_reads"] > STEPS  # most reads folded an unflushed tail
        assert stats["delta_blobs"] > 5  # growing lists went as deltas
        assert ops["put"] > STEPS // 4
        await buf.force_flush_all()
    async with (
        await psycopg.AsyncConnection.connect(ref_dsn) as ra,
        await psycopg.AsyncConnection.connect(buf_dsn) as rb,
    ):
        for table, order in TABLES.items():
            query = f"SELECT * FROM {table} ORDER BY {order}"
            ref_rows = await (await ra.execute(query)).fetchall()
            buf_rows = await (await rb.execute(query)).fetchall()
            assert ref_rows == buf_rows, table
            assert ref_rows or table != "checkpoints"


async def both_put(
    ref: AsyncPostgresSaver,
    buf: BufferedCheckpointSaver,
    model: Model,
    rnd: random.Random,
    tid: str,
    ns: str,
    step: int,
    *,
    again: bool = False,
    words: Sequence[str] | None = None,
) -> None:
    """A new checkpoint on the namespace's head; `again`: an existing checkpoint put
    again, with another parent (its first one stays). `words`: ids made of them (and
    the step) instead of uuid6."""
    chosen = rnd.sample(CHANNELS, k=rnd.randint(0, len(CHANNELS)))
    new_versions: dict[str, str | int | float] = {}
    versions: dict[str, str | int | float] = {}
    values: dict[str, Any] = {}
    for ch in CHANNELS:
        key = (tid, ns, ch)
        if ch in chosen:
            model.versions[key] = ref.get_next_version(model.versions.get(key), None)
            new_versions[ch] = model.versions[key]
            previous = model.values.get(key)
            if ch == "msgs" and isinstance(previous, list) and rnd.random() < 0.7:
                # The history grows as LangGraph's add_messages grows it: a new list of
                # the same item objects plus new ones (the buffered saver writes a delta).
                model.values[key] = previous + [
                    {"role": "user", "n": step, "i": i} for i in range(rnd.randint(0, 2))
                ]
            else:
                model.values[key] = (
                    [{"role": "user", "n": i} for i in range(rnd.randint(0, 3))]
                    if ch == "msgs"
                    else rnd.choice([1, "x", 2.5, None, None, False, {"k": [1, 2]}])
                )
                if ch == "c" and rnd.random() < 0.3:
                    model.values[key] = _DeltaSnapshot([step])
        if key in model.versions:
            versions[ch] = model.versions[key]
            values[ch] = model.values[key]
    known = model.ids.get((tid, ns), [])
    new_id = f"{rnd.choice(words)}{step:03d}" if words else None
    cp = generate_checkpoint(
        checkpoint_id=rnd.choice(known) if again else new_id,
        channel_values=values,
        channel_versions=versions,
    )
    # Before format 4 (langgraph-checkpoint's own empty_checkpoint stamps 2) a
    # checkpoint's pending sends are read from its parent's __pregel_tasks writes.
    cp["v"] = rnd.choice([1, 2, 3, 4])
    md: CheckpointMetadata = {"source": rnd.choice(["input", "loop"]), "step": step, "parents": {}}
    md["run_id"] = rnd.choice(["r1", "r2"])
    pcfg: RunnableConfig = {"configurable": {"thread_id": tid, "checkpoint_ns": ns}}
    parent = rnd.choice([None, *known]) if again else model.heads.get((tid, ns))
    if parent is not None:
        pcfg["configurable"]["checkpoint_id"] = parent
    assert await ref.aput(pcfg, cp, md, new_versions) == await buf.aput(pcfg, cp, md, new_versions)
    if not again:
        model.heads[(tid, ns)] = cp["id"]
        model.ids.setdefault((tid, ns), []).append(cp["id"])


ACROSS_SHARE = 0.25
"""Share of the steps that also search across threads (`list(None, ...)`)."""


def probes(
    rnd: random.Random, model: Model, tid: str, ns: str, across_rnd: random.Random
) -> list[tuple[str, RunnableConfig | None, dict[str, Any]]]:
    """Reads of the thread just written: latest, one by id, pages, a metadata filter."""
    found: list[tuple[str, RunnableConfig | None, dict[str, Any]]] = [
        ("get", {"configurable": {"thread_id": tid, "checkpoint_ns": ns}}, {})
    ]
    if model.ids.get((tid, ns)):
        some = rnd.choice(model.ids[(tid, ns)])
        by_id: RunnableConfig = {
            "configurable": {"thread_id": tid, "checkpoint_ns": ns, "checkpoint_id": some}
        }
        found.append(("get", by_id, {}))
        before: RunnableConfig = {"configurable": {"checkpoint_id": some}}
        found.append(("list", {"configurable": {"thread_id": tid}}, {"before": before, "limit": 2}))
    found.append(("history", {"configurable": {"thread_id": tid, "checkpoint_ns": ns}}, {}))
    if model.ids.get((tid, ns)):
        some = rnd.choice(model.ids[(tid, ns)])
        at: RunnableConfig = {
            "configurable": {"thread_id": tid, "checkpoint_ns": ns, "checkpoint_id": some}
        }
        found.append(("history", at, {}))
    flt = {"filter": {"source": "loop", "run_id": "r1"}}
    found.append(("list", {"configurable": {"thread_id": tid, "checkpoint_ns": ns}}, flt))
    found.append(("list", {"configurable": {"thread_id": tid}}, {"limit": 3}))
    # A search across every thread (the schema is the test's own), pending ones included;
    # drawn from its own generator, so the seeds' scenarios stay what they were. One step
    # in four: a search that meets a checkpoint before format 4 flushes every thread.
    if across_rnd.random() >= ACROSS_SHARE:
        return found
    across: dict[str, Any] = across_rnd.choice([{}, {"limit": 4}, {**flt, "limit": 2}])
    if model.ids.get((tid, ns)) and across_rnd.random() < 0.5:
        some = across_rnd.choice(model.ids[(tid, ns)])
        across["before"] = {"configurable": {"checkpoint_id": some}}
    found.append(("list", None, across))
    return found


async def test_a_second_front_ends_flusher_refuses_to_start(
    nats_url: str, schemas: tuple[str, str]
) -> None:
    """Issue 24 item 7: a thread-run flusher pointed at the LangGraph saver's stream (a
    ``BUFSTORE_STREAM_NAME`` meant for the saver, say) refuses to start, naming the
    stream's front-end, instead of quarantining and acknowledging every entry; nothing
    is quarantined or consumed, and the saver's own flusher then writes what
    AsyncPostgresSaver wrote."""
    from buffered_store.errors import ConfigError
    from buffered_store.langgraph import LG_FORMAT
    from buffered_store.stores.memory import InMemoryThreadRunStore
    from flusher import Flusher, FlusherConfig

    ref_dsn, buf_dsn = schemas
    rnd = random.Random(24)
    config = fresh_config(nats_url, buf_dsn, drain_on_close=False)
    async with (
        AsyncPostgresSaver.from_conn_string(ref_dsn) as ref,
        BufferedCheckpointSaver.connect(config) as buf,
    ):
        await ref.setup()
        await buf.setup()
        model = Model()
        for step in range(40):
            await both_put(ref, buf, model, rnd, rnd.choice(THREADS), rnd.choice(NAMESPACES), step)
        before = await buf.wal.consumer_state()

        wrong = Flusher(
            InMemoryThreadRunStore(),
            FlusherConfig(nats_url=nats_url, stream_name=config.stream_name, flush_interval_s=0.05),
            backlog_poll_s=0,
        )
        with pytest.raises(ConfigError) as refused:
            await wrong.start()
        message = str(refused.value)
        assert f"stream {config.stream_name!r} holds the langgraph front-end's entries" in message
        assert "--front-end langgraph" in message
        assert not wrong.running
        assert await buf.wal.quarantine.keys() == []
        assert await buf.wal.consumer_state() == before  # nothing consumed, nothing acked

        async with Flusher(buf.sink, config, fmt=LG_FORMAT, backlog_poll_s=0):
            deadline = asyncio.get_running_loop().time() + 30  # the right flusher drains it
            while (state := await buf.wal.consumer_state()).ack_floor < state.last_seq:
                assert asyncio.get_running_loop().time() < deadline, state
                await asyncio.sleep(0.02)
    async with (
        await psycopg.AsyncConnection.connect(ref_dsn) as ra,
        await psycopg.AsyncConnection.connect(buf_dsn) as rb,
    ):
        for table, order in TABLES.items():
            query = f"SELECT * FROM {table} ORDER BY {order}"
            assert (
                await (await ra.execute(query)).fetchall()
                == await (await rb.execute(query)).fetchall()
            ), table
