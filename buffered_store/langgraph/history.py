"""``aget_delta_channel_history`` of the LangGraph front-end: AsyncPostgresSaver's walk
(langgraph-checkpoint-postgres 3.2.0: `_build_delta_stage1_sql`, `_try_advance_walks`,
`_build_delta_channels_writes_history`) over the rows Postgres holds with the thread's
unflushed tail laid over them, in a constant number of round trips. Pure: the SQL, its
parameters and the folding of its rows are here; the saver executes.

1. *The walk* (one statement, `walk_sql`): from the target checkpoint (the namespace's
   latest when none is named) up its parents, through stored rows and the tail's
   checkpoints alike, among ids ``<=`` the target in the database's collation, until
   every channel has met a stored value: a blob that is not ``empty``, or an inline
   value other than JSON ``null`` (AsyncPostgresSaver reads ``null`` as "nothing
   stored" and walks on). Its rows are those AsyncPostgresSaver's stage 1 pages
   through, so AsyncPostgresSaver's own `_try_advance_walks` decides chains and seeds.
2. *The values* (one round trip): each chain's writes of its channel, stored and
   unflushed (applied as the flush would apply them), and each seed's blob.

While Postgres is down, `tail_walk` makes the walk's rows from a tail that holds the
thread's whole history.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from langgraph.checkpoint.postgres.base import BasePostgresSaver

from buffered_store.langgraph.entry import delta_blob
from buffered_store.langgraph.overlay import BlobKey, Tail, WriteState, apply_writes

MAX_DEPTH = 1_000_000
"""Longest walk, a bound only a cycle of parents reaches (AsyncPostgresSaver's walk
never ends on one)."""

_CYCLE = "\x00cycle"
"""A parent no row has: the walk stops there, as at a parent it has not read."""


def _probe(i: int) -> str:
    """Channel `i` at checkpoint ``n``: its version, whether a blob that is not
    ``empty`` holds it (stored, or else unflushed), and its inline JSON value."""
    version = f"n.cp -> 'channel_versions' ->> %(ch_{i})s"
    return (
        f"{version} AS ver_{i}, "
        "coalesce((SELECT b.type <> 'empty' FROM checkpoint_blobs b WHERE %(stored)s "
        "AND b.thread_id = %(thread)s AND b.checkpoint_ns = %(ns)s "
        f"AND b.channel = %(ch_{i})s AND b.version = {version}), "
        "EXISTS (SELECT 1 FROM unnest(%(bch)s::text[], %(bver)s::text[]) AS x(ch, ver) "
        f"WHERE x.ch = %(ch_{i})s AND x.ver = {version})) AS hb_{i}, "
        f"n.cp -> 'channel_values' -> %(ch_{i})s AS inline_{i}"
    )


def _node(at: str) -> str:
    """The checkpoint with id `at` of the namespace: the tail's if it holds one, else
    the stored row (unless the tail deletes the thread)."""
    return (
        "SELECT checkpoint_id AS cid, parent_checkpoint_id AS pid, checkpoint AS cp "
        "FROM checkpoints WHERE %(stored)s AND thread_id = %(thread)s "
        f"AND checkpoint_ns = %(ns)s AND checkpoint_id = {at} "
        "AND checkpoint_id <> ALL(%(tids)s::text[]) "
        # A checkpoint put again keeps its stored parent (the flush's upsert keeps it).
        "UNION ALL SELECT t.cid, CASE WHEN s.found THEN s.pid ELSE t.pid END, t.cp::jsonb "
        "FROM unnest(%(tids)s::text[], %(tpids)s::text[], %(tcps)s::text[]) AS t(cid, pid, cp) "
        "LEFT JOIN LATERAL (SELECT true AS found, parent_checkpoint_id AS pid "
        "FROM checkpoints WHERE %(stored)s AND thread_id = %(thread)s "
        "AND checkpoint_ns = %(ns)s AND checkpoint_id = t.cid) AS s ON true "
        f"WHERE t.cid = {at}"
    )


def walk_sql(channels: int, *, named: bool) -> str:
    """The walk for `channels` channels from the target named by ``%(target)s`` (or,
    not `named`, the namespace's latest checkpoint); parameters from `walk_params`."""
    n = range(channels)
    seeded = ", ".join(
        f"(q.hb_{i} OR (q.inline_{i} IS NOT NULL AND jsonb_typeof(q.inline_{i}) <> 'null')) "
        f"AS st_{i}"
        for i in n
    )
    probes = (
        f"LATERAL (SELECT q.*, {seeded} FROM (SELECT {', '.join(_probe(i) for i in n)}) AS q) AS p"
    )
    cols = ", ".join(f"ver_{i}, hb_{i}, inline_{i}" for i in n)
    values = ", ".join(f"p.ver_{i}, p.hb_{i}, p.inline_{i}" for i in n)
    flags = ", ".join(f"s_{i}" for i in n)
    target = (
        "SELECT %(target)s::text AS id"
        if named
        else "SELECT id FROM (SELECT checkpoint_id AS id FROM checkpoints WHERE %(stored)s "
        "AND thread_id = %(thread)s AND checkpoint_ns = %(ns)s "
        "UNION ALL SELECT unnest(%(tids)s::text[])) AS ids ORDER BY id DESC LIMIT 1"
    )
    return (
        f"WITH RECURSIVE target AS ({target}), walk(cid, pid, depth, {cols}, {flags}) AS ("
        f"SELECT n.cid, n.pid, 0, {values}, {', '.join('false' for _ in n)} "
        f"FROM target, LATERAL ({_node('target.id')}) AS n, {probes} "
        f"UNION ALL SELECT n.cid, n.pid, w.depth + 1, {values}, "
        f"{', '.join(f'w.s_{i} OR p.st_{i}' for i in n)} "
        f"FROM walk w, LATERAL ({_node('w.pid')}) AS n, {probes} "
        f"WHERE NOT ({' AND '.join(f'w.s_{i}' for i in n)}) AND w.depth < {MAX_DEPTH} "
        "AND n.cid <= (SELECT id FROM target)) "
        f"SELECT cid AS checkpoint_id, pid AS parent_checkpoint_id, {cols} FROM walk "
        "ORDER BY depth"
    )


def walk_params(
    thread_id: str, ns: str, target: str | None, channels: Sequence[str], tail: Tail | None
) -> dict[str, Any]:
    """The walk's parameters: the tail's checkpoints of the namespace and the blobs it
    holds (not ``empty``); no tail: Postgres alone."""
    tids: list[str] = []
    tpids: list[str | None] = []
    tcps: list[str] = []
    bch: list[str] = []
    bver: list[str] = []
    if tail is not None:
        for (cns, cid), put in tail.checkpoints.items():
            if cns == ns:
                tids.append(cid)
                tpids.append(put.parent_id)
                tcps.append(put.checkpoint.decode())
        for (bns, ch, ver), (type_, _) in tail.blobs.items():
            if bns == ns and type_ != "empty":
                bch.append(ch)
                bver.append(ver)
        for bns, ch, ver in tail.deltas:
            if bns == ns:
                bch.append(ch)
                bver.append(ver)
    params: dict[str, Any] = {
        "thread": thread_id,
        "ns": ns,
        "target": target,
        "stored": tail is None or not tail.deleted,
        "tids": tids,
        "tpids": tpids,
        "tcps": tcps,
        "bch": bch,
        "bver": bver,
    }
    params.update({f"ch_{i}": ch for i, ch in enumerate(channels)})
    return params


def _json_text(value: Any) -> str | None:
    """A JSON value as Postgres's ``->>`` gives it (None for absent or null)."""
    if value is None or isinstance(value, str):
        return value
    return orjson.dumps(value).decode()


def tail_walk(
    tail: Tail, ns: str, target: str | None, channels: Sequence[str]
) -> list[dict[str, Any]]:
    """The walk statement's rows computed from a tail that holds the thread's whole
    history (Postgres is down), ids compared by code point."""
    nodes = {cid: put for (cns, cid), put in tail.checkpoints.items() if cns == ns}
    if target is None:
        target = max(nodes, default=None)
    if target is None or target not in nodes:
        return []
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    seeded = [False] * len(channels)
    cid: str | None = target
    while cid is not None and cid in nodes and cid <= target:
        if cid in seen:
            rows[-1] = {**rows[-1], "parent_checkpoint_id": _CYCLE}
            break
        seen.add(cid)
        put = nodes[cid]
        cp = orjson.loads(put.checkpoint)
        row: dict[str, Any] = {"checkpoint_id": cid, "parent_checkpoint_id": put.parent_id}
        for i, ch in enumerate(channels):
            version = _json_text(cp.get("channel_versions", {}).get(ch))
            key = (ns, ch, version or "")
            blob = tail.blobs.get(key)
            has_blob = version is not None and (
                (blob is not None and blob[0] != "empty") or key in tail.deltas
            )
            inline = cp.get("channel_values", {}).get(ch)
            row.update({f"ver_{i}": version, f"hb_{i}": has_blob, f"inline_{i}": inline})
            if rows:  # the target's own value does not end the walk
                seeded[i] = seeded[i] or has_blob or inline is not None
        rows.append(row)
        if len(rows) > 1 and all(seeded):
            break
        cid = put.parent_id
    return rows


@dataclass(slots=True)
class Walk:
    """Per channel, the chain of checkpoint ids (target's parent first) and the seed:
    AsyncPostgresSaver's stage 1 outcome."""

    chains: dict[str, list[str]]
    seed_versions: dict[str, str | None]
    seed_inline: dict[str, Any] = field(default_factory=dict)


def walk(rows: Sequence[Mapping[str, Any]], channels: Sequence[str]) -> Walk:
    """AsyncPostgresSaver's walk over the walk statement's rows (target first)."""
    chains: dict[str, list[str]] = {ch: [] for ch in channels}
    seeds: dict[str, str | None] = dict.fromkeys(channels)
    found = Walk(chains, seeds)
    if not rows:
        return found
    seen: set[str] = set()
    kept: list[Mapping[str, Any]] = []
    for row in rows:
        if row["checkpoint_id"] in seen:
            kept[-1] = {**kept[-1], "parent_checkpoint_id": _CYCLE}
            break
        seen.add(row["checkpoint_id"])
        kept.append(row)
    parent_of: dict[str, str | None] = {}
    versions: list[dict[str, str | None]] = [{} for _ in channels]
    blobs: list[dict[str, bool]] = [{} for _ in channels]
    inline: list[dict[str, Any]] = [{} for _ in channels]
    BasePostgresSaver._ingest_stage1_page(kept, channels, parent_of, versions, blobs, inline)
    BasePostgresSaver._try_advance_walks(
        kept[0]["checkpoint_id"],
        channels,
        parent_of,
        versions,
        blobs,
        inline,
        chains,
        seeds,
        found.seed_inline,
        {},
        set(),
    )
    return found


def wanted(
    found: Walk, ns: str, tail: Tail | None
) -> tuple[list[tuple[str, str]], list[tuple[str, str, int]], list[BlobKey]]:
    """What the values round trip reads: (channel, checkpoint id) of every chain's
    writes, the (checkpoint id, task, idx) keys of unflushed writes on those
    checkpoints (a stored write there may be kept or replaced), and the seeds' blobs
    (with the stored bases of unflushed deltas)."""
    pairs = [(ch, cid) for ch, chain in found.chains.items() for cid in chain]
    cids = {cid for _, cid in pairs}
    touched: list[tuple[str, str, int]] = []
    blobs: list[BlobKey] = []
    if tail is not None:
        touched = sorted(
            {
                (w.checkpoint_id, w.task_id, w.idx)
                for w in tail.writes
                if w.ns == ns and w.checkpoint_id in cids
            }
        )
    for ch, version in found.seed_versions.items():
        if version is None:
            continue
        key = (ns, ch, version)
        blobs.append(key)
        if tail is not None and key in tail.deltas:
            blobs.append(tail.deltas[key].base)
    return pairs, touched, sorted(set(blobs))


def stage2_rows(
    found: Walk,
    ns: str,
    tail: Tail | None,
    stored_writes: Sequence[tuple[str, str, int, str, str, bytes, str]],
    stored_blobs: Mapping[BlobKey, tuple[str, bytes | None]],
) -> list[dict[str, Any]]:
    """The rows AsyncPostgresSaver's stage 2 would read after a flush: the chains'
    writes ((checkpoint id, task, idx, channel, type, blob, path) stored, with the
    tail's applied) and the seeds' blobs."""
    deleted = tail is not None and tail.deleted
    states: dict[str, WriteState] = {}
    if not deleted:
        for cid, task, idx, ch, type_, data, path in stored_writes:
            states.setdefault(cid, {})[(task, idx)] = (ch, type_, data, path)
    wanted_pairs = {(ch, cid) for ch, chain in found.chains.items() for cid in chain}
    rows: list[dict[str, Any]] = []
    for cid in sorted({cid for _, cid in wanted_pairs}):
        state = states.setdefault(cid, {})
        if tail is not None:
            apply_writes(state, tail, (ns, cid))
        for (task, idx), (ch, type_, blob, path) in state.items():
            if (ch, cid) in wanted_pairs:
                rows.append(
                    {
                        "_kind": "w",
                        "checkpoint_id": cid,
                        "channel": ch,
                        "type": type_,
                        "blob": blob,
                        "task_id": task,
                        "task_path": path,
                        "idx": idx,
                    }
                )
    for ch, version in found.seed_versions.items():
        if version is None:
            continue
        key = (ns, ch, version)
        got = None if deleted else stored_blobs.get(key)
        if got is None and tail is not None:
            got = tail.blobs.get(key)
            if got is None and key in tail.deltas:
                delta = tail.deltas[key]
                base = None if deleted else stored_blobs.get(delta.base)
                if base is not None and base[1] is not None:
                    got = (delta.type, delta_blob(base[1], delta.count, delta.tail))
        if got is not None:
            rows.append(
                {"_kind": "b", "channel": ch, "version": version, "type": got[0], "blob": got[1]}
            )
    return rows
