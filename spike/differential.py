"""SPIKE: the same random calls to AsyncPostgresSaver and BufferedCheckpointSaver (each in
its own schema of one database); reads compared after every call, the three tables row
for row after force_flush_all.

    .venv/bin/python spike/differential.py [--wal nats] [--steps 400] [--seed 1]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import uuid
from typing import Any

import psycopg
from langgraph.checkpoint.base import WRITES_IDX_MAP
from langgraph.checkpoint.conformance.test_utils import generate_checkpoint
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from langgraph.checkpoint.serde.types import ERROR, INTERRUPT, RESUME

from buffered_store.dev.services import start_services
from buffered_store.langgraph.saver import BufferedCheckpointSaver, lg_config
from buffered_store.langgraph.sink import LangGraphSink
from buffered_store.stores.urls import to_libpq_url

TABLES = {
    "checkpoints": "thread_id, checkpoint_ns, checkpoint_id",
    "checkpoint_blobs": "thread_id, checkpoint_ns, channel, version",
    "checkpoint_writes": "thread_id, checkpoint_ns, checkpoint_id, task_id, idx",
}


def norm(t: Any) -> Any:
    if t is None:
        return None
    return (t.config, t.checkpoint, t.metadata, t.parent_config, t.pending_writes)


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--wal", choices=["memory", "nats"], default="memory")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rnd = random.Random(args.seed)
    services = start_services(nats=args.wal == "nats")
    try:
        dsn = to_libpq_url(services.database_url)
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            for schema in ("ref", "buf"):
                await conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
                await conn.execute(f"CREATE SCHEMA {schema}")
        sep = "&" if "?" in dsn else "?"
        ref_dsn = f"{dsn}{sep}options=-csearch_path%3Dref"
        buf_dsn = f"{dsn}{sep}options=-csearch_path%3Dbuf"
        run = uuid.uuid4().hex[:6]
        extra = {"nats_url": services.nats_url} if args.wal == "nats" else {}
        config = lg_config(
            stream_name=f"LG{run}", hot_bucket=f"lg-hot-{run}", quarantine_bucket=f"lg-q-{run}",
            consumer_name=f"lg-fl-{run}", **extra,
        )
        if args.wal == "nats":
            from buffered_store.nats import NatsWal

            wal: Any = await NatsWal.connect(config)
        else:
            from buffered_store.testing import MemoryWal

            wal = MemoryWal(config)
        sink = await LangGraphSink.open(buf_dsn)
        await sink.setup()
        buf = BufferedCheckpointSaver(sink, wal, config)
        async with AsyncPostgresSaver.from_conn_string(ref_dsn) as ref:
            await ref.setup()
            threads = ["t1", "t2", "t3"]
            namespaces = ["", "child:1"]
            heads: dict[tuple[str, str], str | None] = {}
            versions: dict[tuple[str, str, str], str | None] = {}
            ids: dict[tuple[str, str], list[str]] = {}
            current: dict[tuple[str, str, str], Any] = {}
            mismatches = 0
            counts: dict[str, int] = {}
            for step in range(args.steps):
                op = rnd.choices(
                    ["put", "writes", "flush", "delete", "prune"], weights=[40, 40, 8, 2, 2]
                )[0]
                tid, ns = rnd.choice(threads), rnd.choice(namespaces)
                counts[op] = counts.get(op, 0) + 1
                if op == "put":
                    chans = rnd.sample(["a", "b", "c", "msgs"], k=rnd.randint(0, 4))
                    new_versions = {}
                    cv = {}
                    values: dict[str, Any] = {}
                    for ch in ["a", "b", "c", "msgs"]:
                        key = (tid, ns, ch)
                        if ch in chans:
                            versions[key] = ref.get_next_version(versions.get(key), None)
                            new_versions[ch] = versions[key]
                        if ch in chans:
                            current[key] = (
                                [{"role": "user", "n": i} for i in range(rnd.randint(0, 3))]
                                if ch == "msgs"
                                else rnd.choice([1, "x", 2.5, None, False, {"k": [1, 2]}])
                            )
                        if versions.get(key) is not None:
                            cv[ch] = versions[key]
                            values[ch] = current[key]
                    cp = generate_checkpoint(channel_values=values, channel_versions=cv)
                    md = {"source": rnd.choice(["input", "loop"]), "step": step,
                          "parents": {}, "run_id": rnd.choice(["r1", "r2"])}
                    cfg: dict[str, Any] = {"configurable": {"thread_id": tid, "checkpoint_ns": ns}}
                    if heads.get((tid, ns)):
                        cfg["configurable"]["checkpoint_id"] = heads[(tid, ns)]
                    a = await ref.aput(cfg, cp, md, new_versions)
                    b = await buf.aput(cfg, cp, md, new_versions)
                    assert a == b, (a, b)
                    heads[(tid, ns)] = cp["id"]
                    ids.setdefault((tid, ns), []).append(cp["id"])
                elif op == "writes" and ids.get((tid, ns)):
                    cid = rnd.choice(ids[(tid, ns)][-3:])
                    task = rnd.choice(["task1", "task2"])
                    chans = rnd.choice([["x"], ["x", "y"], [ERROR], [INTERRUPT, RESUME], ["x", ERROR]])
                    writes = [(ch, rnd.choice(["v1", {"v": 2}, 3])) for ch in chans]
                    cfg = {"configurable": {"thread_id": tid, "checkpoint_ns": ns, "checkpoint_id": cid}}
                    path = rnd.choice(["", "p:1"])
                    await ref.aput_writes(cfg, writes, task, path)
                    await buf.aput_writes(cfg, writes, task, path)
                elif op == "flush":
                    await buf.force_flush(tid)
                elif op == "delete":
                    await ref.adelete_thread(tid)
                    await buf.adelete_thread(tid)
                    for k in [k for k in heads if k[0] == tid]:
                        heads.pop(k)
                        ids.pop(k, None)
                    for k in [k for k in versions if k[0] == tid]:
                        versions.pop(k)
                elif op == "prune":
                    await ref.aprune([tid])
                    await buf.aprune([tid])
                    for k in [k for k in ids if k[0] == tid]:
                        ids[k] = ids[k][-1:]
                # Reads, compared.
                probes: list[tuple[str, Any, Any]] = [
                    ("get", {"configurable": {"thread_id": tid, "checkpoint_ns": ns}}, None)
                ]
                if ids.get((tid, ns)):
                    some = rnd.choice(ids[(tid, ns)])
                    probes.append(("get", {"configurable": {"thread_id": tid, "checkpoint_ns": ns, "checkpoint_id": some}}, None))
                    probes.append(("list", {"configurable": {"thread_id": tid}},
                                   {"before": {"configurable": {"checkpoint_id": some}}, "limit": 2}))
                probes.append(("list", {"configurable": {"thread_id": tid, "checkpoint_ns": ns}},
                               {"filter": {"source": "loop", "run_id": "r1"}}))
                probes.append(("list", {"configurable": {"thread_id": tid}}, {"limit": 3}))
                for kind, cfg, kw in probes:
                    if kind == "get":
                        ra, rb = norm(await ref.aget_tuple(cfg)), norm(await buf.aget_tuple(cfg))
                    else:
                        ra = [norm(t) async for t in ref.alist(cfg, **kw)]
                        rb = [norm(t) async for t in buf.alist(cfg, **kw)]
                    if ra != rb:
                        mismatches += 1
                        if mismatches <= 5:
                            print(f"step {step} {op} {kind} {cfg} {kw}\n  ref={ra}\n  buf={rb}")
            flushed = await buf.force_flush_all()
            table_diffs = 0
            async with await psycopg.AsyncConnection.connect(dsn) as conn:
                for table, key in TABLES.items():
                    q = "SELECT * FROM {s}.%s ORDER BY %s" % (table, key)
                    ra = await (await conn.execute(q.format(s="ref"))).fetchall()
                    rb = await (await conn.execute(q.format(s="buf"))).fetchall()
                    same = ra == rb
                    table_diffs += not same
                    print(f"table {table}: ref {len(ra)} rows, buf {len(rb)} rows, equal={same}")
            print(f"ops {counts}; read mismatches {mismatches}; threads flushed at the end {flushed}; "
                  f"saver stats {buf.stats}")
        await buf.aclose()
        await sink.close()
        return 1 if mismatches or table_diffs else 0
    finally:
        services.close()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
