"""`curve`: latency against offered load. Each side's maximum sustainable rate with 64
threads (closed loop; the buffered side with its flusher running, and its write path alone),
then paced runs of both sides at 25%, 50% and 90% of direct's maximum, and of the buffered
side at 50% of its own (the flush-lag point). Steps call append() by default (--api)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter

from ..harness import Bench
from ..report import fmt
from ..sides import Phase, SeededSide, SidePlan, measure_phase, read_flush_lag, seed_side
from ..targets import ratio, target
from ..workload import Workload, make_threads
from . import Outcome
from .common import api, backlog_growing, backlog_trend, judge_flush_lag, side_get
from .raw import run_raw

DESCRIPTION = (
    "64 threads, each from a 200-message history growing by 2 messages (~300 bytes each) "
    "per step; every step calls `append()` with its new messages only, on both sides (the "
    "call an append-only agent loop makes; `--api checkpoint` sends full snapshots "
    "instead). First each side's maximum: closed loop (every thread calls again as soon as "
    "its call returned), direct Postgres, then the buffered store with a flusher process "
    "(its maximum counts as sustainable only if the WAL backlog stays flat; when it grows, "
    "the flusher's rate, the achieved rate minus the backlog's growth, is taken). Then "
    "paced open-loop runs (each thread at 1/64 of the rate; slots a thread falls behind on "
    "are skipped, not made up) of both sides at 25%, 50% and 90% of direct's maximum, and "
    "of the buffered side at 50% of its own maximum. The raw publish + KV CAS loop of the "
    "`raw` scenario runs paced at the same three loads: the latency floor of any write path "
    "that makes those two round trips on this machine. Then the buffered write path alone "
    "(no flusher process) paced at the judged 50% and 90% of direct's maximum, what the "
    "buffered latency is without the flusher and Postgres sharing the cores; last, "
    "closed loop. Each run is a measured phase of its own with freshly opened "
    "stores, on threads of its own seeded with the same history in the side's seed phase. "
    "Maximum phases last 15 s, paced ones 20 s (`--duration-s` sets the paced ones; the "
    "maximum ones take the shorter of it and 15 s)."
)

FRACTIONS = (0.25, 0.5, 0.9)
"""Offered loads, as fractions of direct's maximum, run on both sides."""
JUDGED = (0.5, 0.9)
"""The fractions whose latencies are judged (loads the direct store sustains); the
buffered write path alone (no flusher) runs paced at each of them too."""
OWN_FRACTION = 0.5
"""Offered load of the buffered side's flush-lag point, as a fraction of its own maximum."""
DIRECT = SidePlan("direct", "direct Postgres", "direct")
BUFFERED = SidePlan("buffered", "buffered + flusher", "buffered")


@dataclass(frozen=True)
class Sizes:
    """Threads, history and phase lengths."""

    threads: int
    max_s: float
    """Length of a closed-loop (maximum) phase."""
    point_s: float
    """Length of a paced phase (`--duration-s`)."""
    seed_messages: int


def sizes(bench: Bench) -> Sizes:
    """Full: 15 s maximum phases, 20 s paced phases; quick: a second or two each."""
    o = bench.options
    if o.quick:
        point = o.duration_s or 1.0
        return Sizes(threads=o.threads or 8, max_s=1.0, point_s=point, seed_messages=20)
    point = o.duration_s or 20.0
    return Sizes(threads=o.threads or 64, max_s=min(15.0, point), point_s=point, seed_messages=200)


def pct(fraction: float) -> str:
    """0.25 -> '25'."""
    return f"{fraction * 100:.0f}"


def alone_key(fraction: float) -> str:
    """The side key of the buffered write path alone, paced at `fraction` of direct's
    maximum."""
    return f"buffered_{pct(fraction)}_alone"


def ran_flusher(key: str) -> bool:
    """Whether the buffered point `key` ran with its flusher process."""
    return key != "buffered_writer_only" and not key.endswith("_alone")


def maximum(figures: dict[str, Any], *, flusher: bool = True) -> dict[str, Any]:
    """The sustainable rate of a closed-loop phase, and how it was decided."""
    achieved = figures.get("throughput_per_s")
    out: dict[str, Any] = {"achieved_per_s": achieved, "sustainable_per_s": achieved}
    if figures["kind"] != "buffered" or achieved is None:
        out["how"] = "synchronous writes: the achieved rate"
        return out
    out["backlog_at_end_of_writes"] = side_get(figures, "flush", "backlog", "at_end_of_writes")
    out["drain_s"] = side_get(figures, "flush", "drain_s")
    if not flusher:
        out["how"] = "no flusher: the achieved rate of the write path alone"
        return out
    slope = backlog_trend(figures)
    out["backlog_slope_per_s"] = slope
    if slope is None:
        out["how"] = "backlog trend unknown (too few samples): the achieved rate"
    elif not backlog_growing(slope, achieved):
        out["how"] = "flat backlog: the achieved rate"
    else:
        # Backlog growth = write rate - flush rate. Measured while the writers take all the
        # CPU they can: with writers at that rate the flusher would get more.
        out["sustainable_per_s"] = max(0.0, achieved - slope)
        out["how"] = (
            f"backlog grew {slope:,.0f} entries/s: the flusher's rate (achieved minus the "
            "backlog's growth, while competing with writers at full speed)"
        )
    return out


class SideRun:
    """The points of one side: one seed phase, then one measured phase per point, each on
    threads of its own (seeded alike), so every point starts from the same history."""

    def __init__(self, bench: Bench, plan: SidePlan, keys: Sequence[str], base: Workload):
        self.bench = bench
        self.plan = plan
        self.threads = {key: make_threads(key, base) for key in keys}
        self.phases: list[Phase] = []
        self._seeded: SeededSide | None = None

    async def seed(self) -> None:
        """Create the side's database and WAL and write every point's starting history."""
        self._seeded = await seed_side(self.bench, self.plan, list(self.threads.values()))

    async def point(
        self, key: str, label: str, workload: Workload, *, flusher: bool = True
    ) -> dict[str, Any]:
        """One measured phase on the point's threads; its figures (lags read later)."""
        assert self._seeded is not None, "seed() first"
        plan = replace(self.plan, key=key, label=label, flusher=flusher)
        last = key == list(self.threads)[-1]
        phase = await measure_phase(
            self.bench, self._seeded, self.threads[key], workload, plan=plan, keep_wal=not last
        )
        if flusher:
            self.phases.append(phase)
        else:
            phase.figures["unavailable"]["flush_lag"] = "no flusher ran in this phase"
        return phase.figures

    async def read_lags(self) -> None:
        """Flush (or commit) lags of every phase, now that no phase is left to count the
        query among its Postgres transactions."""
        assert self._seeded is not None
        for phase in self.phases:
            await read_flush_lag(self._seeded, phase)


async def run(bench: Bench) -> Outcome:
    n = sizes(bench)
    base = Workload(
        api=api(bench, "append"),
        threads=n.threads,
        rate_per_thread=None,
        duration_s=n.max_s,
        seed_messages=n.seed_messages,
    )
    interval = bench.buffered_config(bench.nats_url, "x").flush_interval_s

    def paced(total_per_s: float) -> Workload:
        return replace(base, rate_per_thread=total_per_s / n.threads, duration_s=n.point_s)

    sides: dict[str, dict[str, Any]] = {}
    points = [f"{pct(f)}" for f in FRACTIONS]

    direct = SideRun(bench, DIRECT, ["direct_max", *(f"direct_{p}" for p in points)], base)
    await direct.seed()
    sides["direct_max"] = await direct.point("direct_max", "direct: max (closed loop)", base)
    d_max = maximum(sides["direct_max"])
    d_rate = d_max["sustainable_per_s"] or 0.0
    for f in FRACTIONS:
        key = f"direct_{pct(f)}"
        sides[key] = await direct.point(key, f"direct: {pct(f)}% of direct max", paced(f * d_rate))
    await direct.read_lags()
    # The floor: the two round trips any such write path makes, at the same loads.
    for f in FRACTIONS:
        key = f"raw_{pct(f)}"
        sides[key] = await run_raw(
            bench,
            paced(f * d_rate),
            key=key,
            label=f"raw publish + KV CAS: {pct(f)}% of direct max",
        )

    own = f"buffered_{pct(OWN_FRACTION)}_own"
    buffered = SideRun(
        bench,
        BUFFERED,
        [
            "buffered_max",
            *(f"buffered_{p}" for p in points),
            own,
            *(alone_key(f) for f in JUDGED),
            "buffered_writer_only",
        ],
        base,
    )
    await buffered.seed()
    sides["buffered_max"] = await buffered.point(
        "buffered_max", "buffered: max (closed loop)", base
    )
    b_max = maximum(sides["buffered_max"])
    b_rate = b_max["sustainable_per_s"] or 0.0
    for f in FRACTIONS:
        key = f"buffered_{pct(f)}"
        sides[key] = await buffered.point(
            key, f"buffered: {pct(f)}% of direct max", paced(f * d_rate)
        )
    sides[own] = await buffered.point(
        own, f"buffered: {pct(OWN_FRACTION)}% of buffered max", paced(OWN_FRACTION * b_rate)
    )
    # Without a flusher last: the entries they leave unflushed would otherwise be a later
    # phase's work.
    for f in JUDGED:
        key = alone_key(f)
        sides[key] = await buffered.point(
            key, f"buffered, no flusher: {pct(f)}% of direct max", paced(f * d_rate), flusher=False
        )
    sides["buffered_writer_only"] = await buffered.point(
        "buffered_writer_only", "buffered, no flusher: max (closed loop)", base, flusher=False
    )
    await buffered.read_lags()
    w_max = maximum(sides["buffered_writer_only"], flusher=False)

    maxima = {"direct": d_max, "buffered": b_max, "buffered_writer_only": w_max}
    table = curve_points(sides)
    judged = judge(sides, maxima, interval, own, base.api)
    return Outcome(
        sides=sides,
        targets=judged,
        parameters={
            "threads": n.threads,
            "max_phase_s": n.max_s,
            "paced_phase_s": n.point_s,
            "fractions_of_direct_max": list(FRACTIONS),
            "fraction_of_buffered_max": OWN_FRACTION,
            "api": base.api,
            "flush_interval_s": interval,
            "workload": base.__dict__,
        },
        sections={
            "Maximum rates": maxima_text(maxima, n.threads),
            "Latency against offered load": curve_table(table),
        },
        methods=METHODS,
        figures={"maxima": maxima, "points": table},
        extra_plots=[plotter(table, maxima, base.api)],
    )


METHODS = {
    "points": "each point is one measured phase as every scenario measures a side (fresh "
    "stores, counters read with no backend connected before and after, the buffered side "
    "drained by its flusher before the phase ends), on threads of its own that the side's "
    "seed phase gave the same starting history; one phase's closing counter read is the "
    "next one's opening read; flush lags are read from commit timestamps after the side's "
    "last phase",
    "latency": "from call to return of every append/checkpoint call (service time): a "
    "paced thread that falls behind skips its missed slots (late slots) instead of "
    "queueing them, so above a side's maximum the achieved rate drops below the offered "
    "one while the latency shows the service time, not the wait. *Warm* calls leave out "
    "each thread's first call of the phase (cold: the stores were just opened); with "
    "phases of tens of calls per thread those are more than 1% of the calls and would "
    "decide the p99 on both sides, so the latency targets are judged on warm calls and "
    "both figures are reported",
    "maximum": "closed loop: every thread calls again as soon as its call returned. The "
    "buffered maximum counts with its flusher running only if the WAL backlog's trend over "
    "the second half of the writes stays within 1% of the rate; otherwise the flusher's "
    "rate (achieved minus backlog growth) is taken",
}


def curve_points(sides: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per point: offered and achieved rates, latencies, flush lag, backlog."""
    rows = []
    for key, s in sides.items():
        warm = s.get("latency_warm_ms") or {}
        rows.append(
            {
                "key": key,
                "side": s["kind"] if s["kind"] in ("direct", "raw") else "buffered",
                "label": s["label"],
                "closed_loop": s.get("offered_per_s") is None,
                "flusher": s["kind"] == "buffered" and ran_flusher(key),
                "offered_per_s": s.get("offered_per_s"),
                "achieved_per_s": s.get("throughput_per_s"),
                "checkpoints": s.get("checkpoints"),
                "late_slots": s.get("late_slots"),
                "failed": s.get("failed"),
                "latency_ms": {q: side_get(s, "latency_ms", q) for q in ("p50", "p95", "p99")},
                "latency_warm_ms": {q: warm.get(q) for q in ("p50", "p95", "p99")},
                "cold_calls_left_out": warm.get("cold_calls_left_out"),
                "flush_lag_from_ack_p99_ms": side_get(s, "flush", "lag_from_ack_ms", "p99"),
                "flush_lag_from_start_p99_ms": side_get(s, "flush", "lag_ms", "p99"),
                "backlog_slope_per_s": backlog_trend(s),
                "backlog_max": side_get(s, "flush", "backlog", "max"),
            }
        )
    return rows


def curve_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: the points side by side."""
    lines = [
        "| point | offered/s | achieved/s | late slots | p50 ms | p95 ms | p99 ms | "
        "p99 ms, warm calls | flush lag p99 ms (from ack) | backlog trend /s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lat, warm = r["latency_ms"], r["latency_warm_ms"]
        offered = "closed loop" if r["closed_loop"] else fmt(r["offered_per_s"], "rate")
        lines.append(
            f"| {r['label']} | {offered} | {fmt(r['achieved_per_s'], 'rate')} | "
            f"{fmt(r['late_slots'], 'int')} | {fmt(lat['p50'], 'ms')} | "
            f"{fmt(lat['p95'], 'ms')} | {fmt(lat['p99'], 'ms')} | {fmt(warm['p99'], 'ms')} | "
            f"{fmt(r['flush_lag_from_ack_p99_ms'], 'ms')} | {fmt(r['backlog_slope_per_s'])} |"
        )
    return "\n".join(lines)


def maxima_text(maxima: dict[str, dict[str, Any]], threads: int) -> str:
    """The maximum rates, how each was decided."""
    names = {
        "direct": "direct Postgres",
        "buffered": "buffered, flusher running",
        "buffered_writer_only": "buffered write path alone (no flusher)",
    }
    lines = [f"Closed loop, {threads} threads:", ""]
    for key, m in maxima.items():
        lines.append(
            f"- {names[key]}: **{fmt(m['sustainable_per_s'], 'rate')}/s** sustainable "
            f"(achieved {fmt(m['achieved_per_s'], 'rate')}/s; {m['how']})"
        )
    return "\n".join(lines)


def judge(
    sides: dict[str, dict[str, Any]],
    maxima: dict[str, dict[str, Any]],
    interval_s: float,
    own: str,
    api_name: str,
) -> list[dict[str, Any]]:
    """Latency at loads direct sustains, the maximum rates, the flush lag at half load."""
    out = []
    for f in JUDGED:
        d, b = sides[f"direct_{pct(f)}"], sides[f"buffered_{pct(f)}"]
        dq, bq = side_get(d, "latency_warm_ms", "p99"), side_get(b, "latency_warm_ms", "p99")
        rq = side_get(sides.get(f"raw_{pct(f)}", {}), "latency_warm_ms", "p99")
        aq = side_get(sides.get(alone_key(f), {}), "latency_warm_ms", "p99")
        r = ratio(dq, bq)
        out.append(
            target(
                "load_p99",
                f"p99 of warm calls: direct {fmt(dq, 'ms')} ms vs buffered {fmt(bq, 'ms')} ms "
                f"at {fmt(d.get('offered_per_s'), 'rate')}/s offered (achieved: direct "
                f"{fmt(d.get('throughput_per_s'), 'rate')}/s, buffered "
                f"{fmt(b.get('throughput_per_s'), 'rate')}/s); all calls: direct "
                f"{fmt(side_get(d, 'latency_ms', 'p99'), 'ms')} ms vs buffered "
                f"{fmt(side_get(b, 'latency_ms', 'p99'), 'ms')} ms; the raw publish + KV CAS "
                f"loop's own p99 at this load {fmt(rq, 'ms')} ms (direct/raw = "
                f"{fmt(ratio(dq, rq))}: the most any two-round-trip write path can gain here); "
                f"the buffered write path alone at this load (no flusher process sharing the "
                f"cores) {fmt(aq, 'ms')} ms",
                ratio=r,
                met=None if r is None else r >= 5,
                suffix=f"{pct(f)}% of direct's maximum, {api_name}()",
            )
        )
    d_max, b_max = maxima["direct"], maxima["buffered"]
    w_rate = maxima["buffered_writer_only"]["sustainable_per_s"]
    r = ratio(b_max["sustainable_per_s"], d_max["sustainable_per_s"])
    out.append(
        target(
            "max_rate",
            f"buffered with flusher {fmt(b_max['sustainable_per_s'], 'rate')}/s "
            f"({b_max['how']}; achieved {fmt(b_max['achieved_per_s'], 'rate')}/s) vs direct "
            f"{fmt(d_max['sustainable_per_s'], 'rate')}/s; buffered write path alone "
            f"{fmt(w_rate, 'rate')}/s ({fmt(ratio(w_rate, d_max['sustainable_per_s']))}x direct)",
            ratio=r,
            met=None if r is None else r >= 3,
            suffix=f"{api_name}()",
        )
    )
    offered = side_get(sides[own], "offered_per_s")
    out.append(
        judge_flush_lag(
            sides[own],
            interval_s,
            f"at {pct(OWN_FRACTION)}% of buffered's maximum: {fmt(offered, 'rate')}/s offered, "
            f"{api_name}()",
        )
    )
    return out


def plotter(
    rows: list[dict[str, Any]], maxima: dict[str, dict[str, Any]], api_name: str
) -> Callable[[Path], str | None]:
    """The latency-against-throughput plot, for `Outcome.extra_plots`."""

    def draw(out: Path) -> str | None:
        return plot_curve(rows, maxima, api_name, out)

    return draw


def plot_curve(
    rows: list[dict[str, Any]], maxima: dict[str, dict[str, Any]], api_name: str, out: Path
) -> str | None:
    """Warm-call latency p50 and p99 (log) against achieved throughput, both sides, with
    the maximum rates marked."""
    usable = [r for r in rows if r["achieved_per_s"] and r["latency_warm_ms"]["p99"]]
    if not usable:
        return None
    fig, ax = plt.subplots(figsize=(12, 6))
    styles = {
        "direct": ("C0", "direct Postgres"),
        "buffered": ("C1", "buffered + flusher"),
        "raw": ("C7", "raw publish + KV CAS loop (floor)"),
    }
    for side, (color, name) in styles.items():
        curve = sorted(
            (r for r in usable if r["side"] == side and r["flusher"] == (side == "buffered")),
            key=lambda r: r["achieved_per_s"],
        )
        xs = [r["achieved_per_s"] for r in curve]
        ax.plot(xs, [r["latency_warm_ms"]["p99"] for r in curve], "-o", color=color)
        ax.plot(xs, [r["latency_warm_ms"]["p50"] for r in curve], "--s", color=color, alpha=0.7)
        ax.plot([], [], "-o", color=color, label=f"{name} p99")
        ax.plot([], [], "--s", color=color, alpha=0.7, label=f"{name} p50")
        for r in curve:
            short = r["label"].split(": ", 1)[-1].replace(" (closed loop)", "")
            ax.annotate(
                short,
                (r["achieved_per_s"], r["latency_warm_ms"]["p99"]),
                textcoords="offset points",
                xytext=(4, 5),
                fontsize=7,
                color=color,
            )
    alone = [
        r for r in usable if r["side"] == "buffered" and not r["flusher"] and not r["closed_loop"]
    ]
    if alone:
        ax.plot(
            [r["achieved_per_s"] for r in alone],
            [r["latency_warm_ms"]["p99"] for r in alone],
            "x",
            color="C2",
            markersize=8,
            label="buffered write path alone, paced: p99",
        )
    for r in usable:
        if r["key"] == "buffered_writer_only":
            x = r["achieved_per_s"]
            ax.plot([x], [r["latency_warm_ms"]["p99"]], "^", color="C2", markersize=8)
            ax.plot([x], [r["latency_warm_ms"]["p50"]], "v", color="C2", markersize=8)
            ax.plot([], [], "^", color="C2", label="buffered write path alone, max: p99 ▲, p50 ▼")
    marks = (
        ("direct", "C0", "direct max"),
        ("buffered", "C1", "buffered max (flusher keeps up)"),
    )
    for key, color, name in marks:
        rate = maxima[key]["sustainable_per_s"]
        if rate:
            ax.axvline(rate, color=color, linestyle=":", linewidth=1.2)
            ax.plot([], [], ":", color=color, label=f"{name}: {rate:,.0f}/s")
    ax.set_yscale("log")
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.tick_params(axis="y", which="minor", labelsize=7)
    ax.set_xlim(left=0)
    ax.set_xlabel("achieved checkpoints/s (all threads)")
    ax.set_ylabel("latency of warm calls (ms, log)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(f"curve: latency against throughput, {api_name}()")
    fig.tight_layout()
    fig.savefig(out / "latency_vs_load.png", dpi=110)
    plt.close(fig)
    return "latency_vs_load.png"
