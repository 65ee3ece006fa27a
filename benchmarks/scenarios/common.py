"""Judging the targets several scenarios share, from the figures of their sides."""

from __future__ import annotations

from typing import Any, Literal

from ..harness import Bench
from ..report import fmt
from ..targets import ratio, target


def api(
    bench: Bench, default: Literal["checkpoint", "append"] = "checkpoint"
) -> Literal["checkpoint", "append"]:
    """The store call of each workload step: `--api`, else the scenario's default."""
    return "append" if (bench.options.api or default) == "append" else "checkpoint"


def api_ignored(bench: Bench, why: str) -> None:
    """Say in the report that `--api` does not apply to this scenario."""
    if bench.options.api is not None:
        bench.note(f"--api {bench.options.api} ignored: {why}")


def side_get(side: dict[str, Any], *path: str) -> Any:
    """A nested figure, or None."""
    value: Any = side
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def judge_pg_tx(
    direct: dict[str, Any], buffered: dict[str, Any], suffix: str = ""
) -> dict[str, Any]:
    """Postgres transactions per checkpoint, direct over buffered (>= 10)."""
    d = side_get(direct, "pg", "transactions_per_checkpoint")
    b = side_get(buffered, "pg", "transactions_per_checkpoint")
    r = ratio(d, b)
    return target(
        "pg_tx",
        f"direct {fmt(d)} vs buffered {fmt(b)} per checkpoint",
        ratio=r,
        met=None if r is None else r >= 10,
        suffix=suffix,
    )


def judge_latency(
    key: str,
    q: str,
    direct: dict[str, Any],
    buffered: dict[str, Any],
    suffix: str = "",
    *,
    floor: dict[str, Any] | None = None,
    alone: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Latency quantile `q`, direct over buffered (>= 5). Reported beside it: `floor`, the
    raw publish + KV CAS loop run on the buffered side's nats-server at the same load,
    with direct's quantile over the floor's (the most a write path of those two round
    trips could gain); `alone`, the buffered write path at that load without a flusher."""
    d = side_get(direct, "latency_ms", q)
    b = side_get(buffered, "latency_ms", q)
    r = ratio(d, b)
    beside = ""
    if floor is not None:
        f = side_get(floor, "latency_ms", q)
        beside += (
            f"; the raw publish + KV CAS loop's own {q} on the same nats-server at this load "
            f"{fmt(f, 'ms')} ms (direct/raw = {fmt(ratio(d, f))}: the most any "
            "two-round-trip write path can gain here)"
        )
    if alone is not None:
        a = side_get(alone, "latency_ms", q)
        beside += (
            f"; the buffered write path alone there (no flusher process writing its acks "
            f"and trims to that server, nor sharing the cores) {fmt(a, 'ms')} ms"
        )
    return target(
        key,
        f"{q}: direct {fmt(d, 'ms')} ms vs buffered {fmt(b, 'ms')} ms{beside}",
        ratio=r,
        met=None if r is None else r >= 5,
        suffix=suffix,
    )


def judge_round_trips(buffered: dict[str, Any], suffix: str = "") -> dict[str, Any]:
    """NATS requests per steady-state checkpoint (<= 2)."""
    steady = side_get(buffered, "nats", "requests_per_checkpoint_steady")
    overall = side_get(buffered, "nats", "requests_per_checkpoint")
    return target(
        "round_trips",
        f"{fmt(steady)} steady ({fmt(overall)} including each thread's cold first checkpoint)",
        met=None if steady is None else steady <= 2.0 + 1e-9,
        suffix=suffix,
    )


def backlog_trend(side: dict[str, Any]) -> float | None:
    """Entries/s the WAL backlog gained over the second half of the writes: the slope of
    its troughs (see `flush.backlog_figures`); None when the half was too short for three
    troughs (a closed loop of a couple of seconds: a slope of every sample would measure
    where the samples fell in the sawtooth, not a trend). The slope of every sample only
    for results that predate the troughs."""
    backlog = side_get(side, "flush", "backlog") or {}
    if "trough_slope_per_s_second_half" in backlog:
        return backlog["trough_slope_per_s_second_half"]  # type: ignore[no-any-return]
    return backlog.get("slope_per_s_second_half")


def backlog_growing(slope_per_s: float | None, rate_per_s: float) -> bool:
    """A backlog grows when its trend exceeds 1% of the checkpoint rate (the rest is noise
    of the sampling against the flush cycles)."""
    return slope_per_s is not None and slope_per_s > 0.01 * rate_per_s


def judge_flush_lag(
    buffered: dict[str, Any], flush_interval_s: float, suffix: str = ""
) -> dict[str, Any]:
    """Flush lag p99 within flush_interval + 250 ms, and a backlog that does not grow."""
    p99 = side_get(buffered, "flush", "lag_from_ack_ms", "p99")
    p99_start = side_get(buffered, "flush", "lag_ms", "p99")
    slope = backlog_trend(buffered)
    rate = side_get(buffered, "throughput_per_s") or 0.0
    limit = flush_interval_s * 1000 + 250
    growing = backlog_growing(slope, rate)
    met = None if p99 is None else (p99 <= limit and not growing)
    return target(
        "flush_lag",
        f"p99 {fmt(p99, 'ms')} ms from acknowledgement ({fmt(p99_start, 'ms')} ms from the "
        f"call's start; limit {limit:.0f} ms); backlog trend (troughs) "
        f"{fmt(slope)} entries/s over the second half ({'growing' if growing else 'flat'})",
        met=met,
        ratio=ratio(p99, limit),
        suffix=suffix,
    )
