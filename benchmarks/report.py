"""Writing a run's results: `results.json`, `report.md` and PNG plots (matplotlib, Agg).

The JSON holds every raw figure with its method; the Markdown puts the sides next to
each other and the DESIGN section 6 targets this scenario judges next to the measured
ratios; the plots show the latency CDF of every side, and throughput and backlog over
time.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from .machine import SPEED_LOOP_ADDITIONS, SPEED_SLEEP_S

Row = tuple[str, Callable[[dict[str, Any]], Any], str]


def at(*path: str) -> Callable[[dict[str, Any]], Any]:
    """Reader of the figure at `path` in a side (None when missing), for a `Row`."""

    def read(side: dict[str, Any]) -> Any:
        value: Any = side
        for key in path:
            if not isinstance(value, dict) or value.get(key) is None:
                return None
            value = value[key]
        return value

    return read


SIDE_ROWS: list[Row] = [
    ("checkpoints (ok)", at("checkpoints"), "int"),
    ("failed checkpoints", at("failed"), "int"),
    ("offered checkpoints/s", at("offered_per_s"), "rate"),
    ("achieved checkpoints/s", at("throughput_per_s"), "rate"),
    ("latency p50 ms", at("latency_ms", "p50"), "ms"),
    ("latency p95 ms", at("latency_ms", "p95"), "ms"),
    ("latency p99 ms", at("latency_ms", "p99"), "ms"),
    ("latency max ms", at("latency_ms", "max"), "ms"),
    ("PG transactions / checkpoint", at("pg", "transactions_per_checkpoint"), "ratio"),
    ("PG tuple writes / checkpoint", at("pg", "tuple_writes_per_checkpoint"), "ratio"),
    ("PG WAL bytes / checkpoint", at("pg", "pg_wal_bytes_per_checkpoint"), "bytes"),
    (
        "NATS round trips / checkpoint (steady)",
        at("nats", "requests_per_checkpoint_steady"),
        "ratio",
    ),
    ("NATS round trips / checkpoint (all)", at("nats", "requests_per_checkpoint"), "ratio"),
    (
        "NATS WAL bytes / checkpoint (steady)",
        at("nats", "wal_bytes_per_checkpoint_steady"),
        "bytes",
    ),
    ("flush lag from call start p50 ms", at("flush", "lag_ms", "p50"), "ms"),
    ("flush lag from call start p99 ms", at("flush", "lag_ms", "p99"), "ms"),
    ("flush lag from call start max ms", at("flush", "lag_ms", "max"), "ms"),
    ("flush lag from ack p50 ms", at("flush", "lag_from_ack_ms", "p50"), "ms"),
    ("flush lag from ack p99 ms", at("flush", "lag_from_ack_ms", "p99"), "ms"),
    ("backlog max (entries)", at("flush", "backlog", "max"), "int"),
    (
        "backlog trend, 2nd half, troughs (entries/s)",
        at("flush", "backlog", "trough_slope_per_s_second_half"),
        "ratio",
    ),
    (
        "backlog trend, 2nd half, every sample (entries/s)",
        at("flush", "backlog", "slope_per_s_second_half"),
        "ratio",
    ),
    ("drain after writes s", at("flush", "drain_s"), "s"),
    ("flusher CPU µs / flushed entry", at("flush", "cpu_us_per_entry"), "ratio"),
    *(
        (
            f"  {stage} CPU µs / flushed entry",
            at("flush", "cpu_us_per_entry_by_stage", stage),
            "ratio",
        )
        for stage in ("intake", "decode", "apply", "settle")
    ),
    ("flusher entries / transaction", at("flush", "entries_per_transaction"), "ratio"),
    ("CPU s total", at("cpu", "seconds", "total"), "s"),
    (
        "CPU s / 1k checkpoints (all processes)",
        at("cpu", "seconds_per_1k_checkpoints", "total"),
        "s",
    ),
    ("  this process (writers)", at("cpu", "seconds_per_1k_checkpoints", "harness"), "s"),
    (
        "    of it, its garbage collector",
        at("cpu", "gc_seconds_per_1k_checkpoints", "harness"),
        "s",
    ),
    ("  flusher process", at("cpu", "seconds_per_1k_checkpoints", "flusher"), "s"),
    ("  nats-server", at("cpu", "seconds_per_1k_checkpoints", "nats_server"), "s"),
    ("  postgres", at("cpu", "seconds_per_1k_checkpoints", "postgres"), "s"),
    (
        "CPU s of other processes on the machine meanwhile",
        at("cpu", "seconds", "other_processes"),
        "s",
    ),
]


def fmt(value: Any, kind: str = "ratio") -> str:
    """A figure for a table cell."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if not isinstance(value, int | float) or math.isnan(value):
        return str(value)
    if kind == "int":
        return f"{value:,.0f}"
    if kind == "rate":
        return f"{value:,.0f}"
    if kind == "ms":
        return f"{value:,.2f}" if value < 100 else f"{value:,.0f}"
    if kind == "bytes":
        return f"{value:,.0f}"
    if kind == "s":
        return f"{value:,.3f}" if value < 10 else f"{value:,.1f}"
    return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"


def side_table(sides: dict[str, dict[str, Any]], rows: Sequence[Row] = SIDE_ROWS) -> str:
    """Markdown table: one column per side; rows no side has are left out."""
    keys = list(sides)
    lines = [
        "| figure | " + " | ".join(sides[k].get("label", k) for k in keys) + " |",
        "|---|" + "---:|" * len(keys),
    ]
    for label, read, kind in rows:
        values = [read(sides[k]) for k in keys]
        if all(v is None for v in values):
            continue
        lines.append(f"| {label} | " + " | ".join(fmt(v, kind) for v in values) + " |")
    return "\n".join(lines)


def targets_table(targets: Sequence[dict[str, Any]]) -> str:
    """Markdown table of the DESIGN section 6 targets judged by this run."""
    lines = ["| figure | target | measured | ratio | met |", "|---|---|---|---:|:---:|"]
    for t in targets:
        met = {True: "met", False: "**missed**", None: "n/a"}[t.get("met")]
        lines.append(
            f"| {t['figure']} | {t['target']} | {t['measured']} | {fmt(t.get('ratio'))} | {met} |"
        )
    return "\n".join(lines)


def target_counts(targets: Sequence[dict[str, Any]]) -> str:
    """How many figures `targets_table` shows and how they were judged, in words: a
    count of the table's rows that no reader has to make (its header ends in ``met``)."""
    met = sum(1 for t in targets if t.get("met") is True)
    missed = sum(1 for t in targets if t.get("met") is False)
    unjudged = len(targets) - met - missed
    return (
        f"{len(targets)} figures, {met + missed} judged: {met} met, {missed} missed"
        f" ({unjudged} reported without a target)."
    )


def unavailable_lines(sides: dict[str, dict[str, Any]]) -> list[str]:
    """'figure: reason' for figures a side cannot measure."""
    out = []
    for side in sides.values():
        for figure, reason in (side.get("unavailable") or {}).items():
            out.append(f"- {side.get('label')}: *{figure}* not measurable: {reason}")
    return out


def speed_line(speed: dict[str, dict[str, float]] | None) -> str:
    """The machine's speed at the run's start and end (`machine.speed`), in words."""
    if not speed:
        return "Machine speed: not measured (a run older than the probe)."
    start, end = speed["at_start"], speed["at_end"]
    return (
        f"Machine speed: a plain-Python loop of {SPEED_LOOP_ADDITIONS / 1e6:g} million "
        f"additions took {start['python_loop_s']:.3f} s at the start, "
        f"{end['python_loop_s']:.3f} s at the end; a wake-up from a "
        f"{SPEED_SLEEP_S * 1000:g} ms asyncio sleep cost {start['wake_cpu_us']:.0f} and "
        f"{end['wake_cpu_us']:.0f} µs of CPU (figures of different days compare only "
        "beside these)."
    )


def markdown(result: dict[str, Any], side_rows: Sequence[Row] = SIDE_ROWS) -> str:
    """The whole report of one run."""
    m = result["machine"]
    parts = [
        f"# Benchmark `{result['scenario']}`" + (" (quick mode)" if result.get("quick") else ""),
        "",
        f"Command: `{result['command']}`  ",
        f"Started {result['started_at']}, took {result['elapsed_s']:.0f} s.  ",
        f"Machine: {m['cpu_model']}, {m['logical_cores']} logical cores "
        f"({m.get('usable_cores')} usable), {m['memory_gib']} GiB, Python {m['python']}; "
        f"Postgres {result.get('pg_settings', {}).get('server_version', '?')} "
        f"(fsync={result.get('pg_settings', {}).get('fsync', '?')}, synchronous_commit="
        f"{result.get('pg_settings', {}).get('synchronous_commit', '?')}); "
        f"nats-server {result.get('nats_server_version') or '?'}.  ",
        "Load average (1/5/15 min) at start "
        + "/".join(f"{x:.1f}" for x in result.get("loadavg_1_5_15", {}).get("at_start", ()))
        + ", at end "
        + "/".join(f"{x:.1f}" for x in result.get("loadavg_1_5_15", {}).get("at_end", ()))
        + " (other jobs on the machine disturb the figures; see the CPU rows).  ",
        speed_line(result.get("machine_speed")),
        "",
        f"Parameters: `{json.dumps(result.get('parameters', {}), default=str)}`",
        "",
    ]
    if result.get("description"):
        parts += [result["description"], ""]
    if result.get("targets"):
        parts += [
            "## DESIGN section 6 targets judged by this run",
            "",
            targets_table(result["targets"]),
            "",
        ]
        whys = [f"- {t['figure']}: {t['why']}" for t in result["targets"] if t.get("why")]
        parts += [*whys, ""] if whys else []
    if result.get("sides"):
        parts += ["## Side by side", "", side_table(result["sides"], side_rows), ""]
        missing = unavailable_lines(result["sides"])
        parts += [*missing, ""] if missing else []
    for title, body in result.get("sections", {}).items():
        parts += [f"## {title}", "", body, ""]
    if result.get("plots"):
        parts += ["## Plots", ""] + [f"![{p}]({p})" for p in result["plots"]] + [""]
    if result.get("methods"):
        parts += ["## How the figures are measured", ""]
        parts += [f"- **{k}**: {v}" for k, v in result["methods"].items()] + [""]
    if result.get("notes"):
        parts += ["## Notes", ""] + [f"- {n}" for n in result["notes"]] + [""]
    return "\n".join(parts)


# -- plots ---------------------------------------------------------------------------------


def plot_latency_cdf(
    sides: dict[str, dict[str, Any]], path: Path, title: str, what: str = "checkpoint"
) -> bool:
    """Latency CDF (left) and tail (right, 1 - F on a log scale) of every side; `what`
    names what the latencies time."""
    with_data = {k: s for k, s in sides.items() if s.get("latency_cdf_ms")}
    if not with_data:
        return False
    fig, (ax, tail) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {key: f"C{i}" for i, key in enumerate(sides)}
    for key, side in with_data.items():
        xs = [max(p[0], 1e-3) for p in side["latency_cdf_ms"]]
        ys = [p[1] for p in side["latency_cdf_ms"]]
        ax.plot(xs, ys, label=side.get("label"), color=colors[key])
        floor = 1 / max(1, side.get("latency_ms", {}).get("count") or 1)
        tail.plot(xs, [max(1 - y, floor) for y in ys], label=side.get("label"), color=colors[key])
    ax.set_xscale("log")
    ax.set_xlabel(f"{what} latency (ms, log)")
    ax.set_ylabel(f"fraction of {what}s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    tail.set_xscale("log")
    tail.set_yscale("log")
    tail.set_xlabel(f"{what} latency (ms, log)")
    tail.set_ylabel("fraction slower (1 - CDF)")
    tail.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"{title}: {what} latency")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_timeline(
    sides: dict[str, dict[str, Any]],
    path: Path,
    title: str,
    events: bool = True,
    what: str = "checkpoint",
) -> bool:
    """Throughput (top), WAL backlog (middle) and flush lag p99 (bottom) over time."""
    with_data = {k: s for k, s in sides.items() if s.get("timeline", {}).get("t_s")}
    if not with_data:
        return False
    fig, (top, mid, low) = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    colors = {key: f"C{i}" for i, key in enumerate(sides)}  # one colour per side everywhere
    annotated: set[str] = set()
    for key, side in with_data.items():
        tl = side["timeline"]
        label, color = side.get("label"), colors[key]
        top.plot(tl["t_s"], _none_to_nan(tl.get("checkpoints_per_s", [])), label=label, color=color)
        if any(v is not None for v in tl.get("backlog", [])):
            mid.plot(tl["t_s"], _none_to_nan(tl["backlog"]), label=label, color=color)
        lag = (side.get("flush") or {}).get("lag_timeline") or {}
        if lag.get("t_s"):
            low.plot(lag["t_s"], _none_to_nan(lag["p99"]), label=f"{label} p99", color=color)
        for event in side.get("events", []) if events else []:
            for ax in (top, mid, low):
                ax.axvline(event["began_s"], color="grey", linestyle=":", linewidth=1)
            if event["label"] not in annotated:  # each side has its own, at about the same time
                annotated.add(event["label"])
                top.annotate(event["label"], (event["began_s"], 0), fontsize=7, rotation=90)
    top.set_ylabel(f"{what}s/s")
    mid.set_ylabel("WAL backlog (entries)")
    low.set_ylabel("flush lag p99 (ms)")
    low.set_xlabel("time since the measured phase started (s)")
    for ax in (top, mid, low):
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"{title}: throughput, backlog and flush lag over time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _none_to_nan(values: Sequence[float | None]) -> list[float]:
    return [math.nan if v is None else float(v) for v in values]


def write_all(
    result: dict[str, Any],
    out: Path,
    extra_plots: Sequence[Callable[[Path], str | None]] = (),
    side_rows: Sequence[Row] | None = None,
) -> list[Path]:
    """Write plots, then `results.json` and `report.md`; return the files written.
    `side_rows` replaces `SIDE_ROWS` in the side-by-side table."""
    out.mkdir(parents=True, exist_ok=True)
    plots: list[str] = list(result.get("plots", []))
    sides = result.get("sides", {})
    what = str(result.get("latency_of") or "checkpoint")
    if plot_latency_cdf(sides, out / "latency_cdf.png", result["scenario"], what):
        plots.append("latency_cdf.png")
    if plot_timeline(sides, out / "timeline.png", result["scenario"], what=what):
        plots.append("timeline.png")
    for plot in extra_plots:
        name = plot(out)
        if name:
            plots.append(name)
    result["plots"] = plots
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "report.md").write_text(markdown(result, side_rows or SIDE_ROWS))
    return [out / "results.json", out / "report.md", *(out / p for p in plots)]
