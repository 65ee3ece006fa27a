"""Flush figures of a buffered side: the lag of every checkpoint to its Postgres commit,
read back from commit timestamps, and the WAL backlog over time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg

from .harness import SideDb
from .measure import summarize

LAG_METHOD = (
    "for every checkpoint: commit time of the Postgres transaction that inserted its first "
    "new message row (pg_xact_commit_timestamp(xmin), track_commit_timestamp=on) minus the "
    "wall-clock time the checkpoint call started (stored in the message): lag_ms; minus "
    "the time the call returned (the entry was acknowledged by the WAL): lag_from_ack_ms, "
    "which leaves out the time the call waited for CPU in the writing process"
)


def flusher_figures(stats: dict[str, Any]) -> dict[str, Any]:
    """Cost figures of the flusher from its final `Flusher.stats()`: CPU per flushed entry
    and entries per transaction (None when the flusher reported nothing)."""
    cpu_per_entry = stats.get("cpu_per_entry_s")
    entries = stats.get("entries_applied") or 0
    transactions = stats.get("transactions") or 0
    return {
        "cpu_us_per_entry": cpu_per_entry * 1e6 if cpu_per_entry else None,
        "entries_per_transaction": entries / transactions if transactions else None,
        "cpu_us_per_entry_by_stage": {
            stage: stats[f"cpu_per_entry_{stage}_s"] * 1e6
            for stage in ("intake", "decode", "apply", "settle")
            if stats.get(f"cpu_per_entry_{stage}_s") is not None
        },
        "overlapped_cycles": stats.get("overlapped_cycles"),
        "cycles": stats.get("cycles"),
        "cpu_method": "the flusher's cpu_s stat (time.process_time of its process, summed "
        "cycle by cycle while the drain loop runs) over entries_applied",
    }


def backlog_figures(
    t_s: Sequence[float],
    backlog: Sequence[float | None],
    writes_end_s: float,
    warm_s: float,
    window_s: float = 1.0,
) -> dict[str, Any]:
    """Max backlog while writing and its trend over the second half of the writes."""
    pairs = [(t, b) for t, b in zip(t_s, backlog, strict=False) if b is not None]
    writing = [(t, b) for t, b in pairs if warm_s <= t <= writes_end_s]
    half = [(t, b) for t, b in writing if t >= (warm_s + writes_end_s) / 2]
    return {
        "max": max((b for _, b in writing), default=None),
        "mean": sum(b for _, b in writing) / len(writing) if writing else None,
        "at_end_of_writes": writing[-1][1] if writing else None,
        "slope_per_s_second_half": _slope(half),
        "trough_slope_per_s_second_half": _slope(troughs(half, window_s)),
        "method": "consumer info (num_pending + num_ack_pending) of the flusher's durable "
        "consumer, on a separate NATS connection, sampled; the backlog is a sawtooth (it "
        f"fills for a flush window, then a cycle empties it), so its trend is the slope of "
        f"the troughs (the lowest sample of every {window_s:g} s) over the second half of "
        "the writes: a flusher that falls behind leaves more after each cycle. The slope of "
        "every sample is kept too; against the sawtooth it swings by about a window's "
        "entries over the half's length",
    }


def troughs(points: Sequence[tuple[float, float]], window_s: float) -> list[tuple[float, float]]:
    """The lowest point of every whole `window_s` of `points` (sorted by time). A last
    window the samples stop short of (by more than their mean spacing) is left out: its
    lowest sample may lie anywhere on the sawtooth, not at a trough."""
    if not points:
        return []
    start, end = points[0][0], points[-1][0]
    spacing = (end - start) / (len(points) - 1) if len(points) > 1 else 0.0
    lowest: dict[int, tuple[float, float]] = {}
    for t, b in points:
        slot = int((t - start) // window_s)
        if slot not in lowest or b < lowest[slot][1]:
            lowest[slot] = (t, b)
    return [lowest[k] for k in sorted(lowest) if start + (k + 1) * window_s <= end + spacing]


def _slope(points: Sequence[tuple[float, float]]) -> float | None:
    if len(points) < 3:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mb = sum(b for _, b in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (b - mb) for t, b in points) / var if var else None


async def flush_lag(
    db: SideDb,
    since_wall: float,
    acks: dict[tuple[str, int], float],
    *,
    until_wall: float | None = None,
) -> dict[str, Any] | None:
    """Per-checkpoint lag to the Postgres commit, from the call's start and from its
    acknowledgement, of the checkpoints started from `since_wall` (to `until_wall`) (None
    when commit timestamps cannot be read)."""
    query = (
        "SELECT thread_id, (message->'meta'->>'step')::int, (message->>'t')::float8, "
        "extract(epoch from pg_xact_commit_timestamp(xmin))::float8 "
        f"FROM \"{db.schema}\".messages WHERE message ? 't' "
        "AND (message->>'t')::float8 >= %s"
    )
    params = [since_wall]
    if until_wall is not None:
        query += " AND (message->>'t')::float8 <= %s"
        params.append(until_wall)
    try:
        async with await psycopg.AsyncConnection.connect(db.libpq_url) as conn:
            cur = await conn.execute(query, params)
            rows = await cur.fetchall()
    except psycopg.Error:
        return None
    from_start: list[tuple[float, float]] = []
    from_ack: list[float] = []
    for thread_id, step, t, commit in rows:
        if commit is None:
            continue
        from_start.append((float(t), (float(commit) - float(t)) * 1000))
        acked = acks.get((str(thread_id), int(step)))
        if acked is not None:
            from_ack.append((float(commit) - acked) * 1000)
    buckets: dict[int, list[float]] = {}
    for t, lag in from_start:
        buckets.setdefault(int(t - since_wall), []).append(lag)
    timeline: dict[str, list[float | None]] = {"t_s": [], "p50": [], "p99": [], "max": []}
    for second in sorted(buckets):
        summary = summarize(buckets[second])
        timeline["t_s"].append(float(second))
        for key in ("p50", "p99", "max"):
            value = summary[key]
            timeline[key].append(None if value is None else float(value))
    return {
        "lag_ms": summarize([lag for _, lag in from_start]),
        "lag_from_ack_ms": summarize(from_ack),
        "timeline": timeline,
    }
