"""Smoke test of the benchmark harness: every scenario runs in ``--quick`` mode and writes
its JSON, Markdown and PNG output with the expected keys.

No timing is asserted: the DESIGN targets are judged from full runs (docs/benchmarks.md),
never by timed tests. Each scenario runs as the user runs it,
``python -m buffered_store.benchmarks`` in a process of its own, starting its own NATS and
Postgres (so commit timestamps are on and `pg-outage` may stop its Postgres).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BENCH = "buffered_store.benchmarks"
"""The harness's import name: the repository's `benchmarks/` folder, installed under ours."""

CURVE_POINTS = ("max", "25", "50", "90")
"""The curve scenario's points run on both sides: the maximum, then % of direct's."""
LG_SIDES = ("floor", "onetrip", "direct", "buffered")
"""The langgraph scenario's checkpointers: InMemorySaver, the same with one publish per
checkpoint, AsyncPostgresSaver, buffered."""
LG_PHASES = ("max", "25", "50", "90")
"""Its phases on every side: closed loop, then % of AsyncPostgresSaver's maximum."""

# scenario -> (side keys, extra plots)
SCENARIOS: dict[str, tuple[set[str], set[str]]] = {
    "hot-threads": (
        {"direct", "buffered", "buffered_durable", "buffered_durable_alone", "raw_durable"},
        {"timeline.png"},
    ),
    "saturate": ({"direct", "buffered"}, {"timeline.png"}),
    "remote-db": ({"direct", "buffered"}, {"timeline.png"}),
    "pg-outage": ({"direct", "buffered"}, {"timeline.png"}),
    "large-thread": ({"direct", "buffered"}, {"timeline.png", "wal_bytes_vs_history.png"}),
    "force-flush": ({"writer", "other"}, set()),
    "raw": ({"raw", "buffered_writer_only", "buffered", "direct"}, {"timeline.png"}),
    "spark-overlay": (
        {"plain", "overlay_warm", "overlay_restarted", "overlay_rewritten"},
        {"spark_reads.png"},
    ),
    "curve": (
        {
            *(f"{side}_{point}" for side in ("direct", "buffered") for point in CURVE_POINTS),
            *(f"raw_{point}" for point in CURVE_POINTS[1:]),
            "buffered_50_own",
            "buffered_50_alone",
            "buffered_90_alone",
            "buffered_writer_only",
        },
        {"timeline.png", "latency_vs_load.png"},
    ),
    "writer-cpu": ({"append", "checkpoint", "raw"}, {"writer_cpu.png"}),
    "soak": ({"buffered"}, {"timeline.png", "wal_size.png"}),
    "langgraph": (
        {f"{side}_{phase}" for side in LG_SIDES for phase in LG_PHASES},
        {"timeline.png", "latency_vs_load.png"},
    ),
}
TOP_KEYS = {
    "scenario",
    "command",
    "machine",
    "machine_speed",
    "versions",
    "pg_settings",
    "parameters",
    "targets",
    "sides",
    "plots",
}


def run_quick(scenario: str, out: Path, *extra: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "DATABASE_URL")}
    done = subprocess.run(
        [sys.executable, "-m", BENCH, scenario, "--quick", "--output", str(out), *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, f"{scenario} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    for name in ("results.json", "report.md"):
        assert (out / name).is_file(), f"{scenario}: {name} missing"
    data: dict[str, Any] = json.loads((out / "results.json").read_text())
    return data


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "scenario",
    [pytest.param(s, marks=pytest.mark.spark) if s == "spark-overlay" else s for s in SCENARIOS],
)
def test_quick_mode_writes_every_output(scenario: str, tmp_path: Path) -> None:
    sides, extra_plots = SCENARIOS[scenario]
    data = run_quick(scenario, tmp_path / scenario)

    assert set(data) >= TOP_KEYS
    assert data["scenario"] == scenario
    assert data["quick"] is True
    assert {"cpu_model", "logical_cores", "memory_gib", "python"} <= set(data["machine"])
    for moment in ("at_start", "at_end"):
        speed = data["machine_speed"][moment]
        assert speed["python_loop_s"] > 0
        assert speed["wake_cpu_us"] > 0
    assert data["pg_settings"].get("server_version")
    assert set(data["sides"]) == sides
    for key, side in data["sides"].items():
        assert side["checkpoints"] > 0, f"{key} did no work"
        assert {"p50", "p95", "p99", "max"} <= set(side["latency_ms"]), key
        assert "unavailable" in side, key
    assert data["targets"], "every scenario judges at least one DESIGN target"
    for judged in data["targets"]:
        assert {"figure", "target", "measured", "met"} <= set(judged)

    plots = set(data["plots"])
    assert {"latency_cdf.png", *extra_plots} <= plots
    for plot in plots:
        assert (tmp_path / scenario / plot).stat().st_size > 0
    report = (tmp_path / scenario / "report.md").read_text()
    assert "DESIGN section 6 targets" in report
    assert "Machine speed: a plain-Python loop of 3 million additions took" in report
    assert "latency_cdf.png" in report
    if scenario in SCENARIO_CHECKS:
        SCENARIO_CHECKS[scenario](data, report)


def check_curve(data: dict[str, Any], report: str) -> None:
    """Maxima, one row per point with its rates and latencies, the four judged targets."""
    maxima = data["figures"]["maxima"]
    assert set(maxima) == {"direct", "buffered", "buffered_writer_only"}
    for m in maxima.values():
        assert {"achieved_per_s", "sustainable_per_s", "how"} <= set(m)
    rows = {row["key"]: row for row in data["figures"]["points"]}
    assert set(rows) == set(data["sides"])
    for key, row in rows.items():
        assert {"offered_per_s", "achieved_per_s", "late_slots"} <= set(row), key
        assert {"p50", "p95", "p99"} <= set(row["latency_ms"]), key
        assert {"p50", "p95", "p99"} <= set(row["latency_warm_ms"]), key
        assert {"flush_lag_from_ack_p99_ms", "backlog_slope_per_s"} <= set(row), key
        assert row["closed_loop"] == key.endswith(("_max", "_writer_only")), key
    for key in ("buffered_25", "buffered_50", "buffered_90", "buffered_50_own"):
        assert data["sides"][key]["flush"]["lag_from_ack_ms"]["count"] > 0, key
    for point in CURVE_POINTS[1:]:
        # The raw loop runs paced at the same offered loads as the two stores.
        raw, direct = rows[f"raw_{point}"], rows[f"direct_{point}"]
        assert raw["side"] == "raw", point
        assert raw["offered_per_s"] == direct["offered_per_s"], point
        assert raw["latency_warm_ms"]["p99"] is not None, point
    assert all("raw publish + KV CAS loop's own p99" in t["measured"] for t in data["targets"][:2])
    assert [t["id"] for t in data["targets"]] == ["load_p99", "load_p99", "max_rate", "flush_lag"]
    assert data["parameters"]["api"] == "append"
    assert "## Latency against offered load" in report
    assert "latency_vs_load.png" in report


def check_hot_threads(data: dict[str, Any], report: str) -> None:
    """The durable side's p99 is reported beside the raw loop's on the same fsyncing
    nats-server, paced at the same load, and beside its write path alone (no flusher);
    the default side's is not."""
    sides = data["sides"]
    raw, direct = sides["raw_durable"], sides["direct"]
    assert raw["kind"] == "raw"
    assert raw["nats_server"] == "sync_interval: always"
    # The docs read the server's CPU beside the raw loop from this row: it is measured.
    assert raw["cpu"]["seconds"]["nats_server"] > 0
    assert raw["offered_per_s"] == direct["offered_per_s"]
    assert sides["buffered_durable_alone"]["offered_per_s"] == direct["offered_per_s"]
    # One round of the floor by default: the sides' own figures, in the report's table.
    (only,) = data["figures"]["durable_floor_rounds"]["rounds"]
    assert only["raw_p99_ms"] == raw["latency_ms"]["p99"]
    assert only["alone_p99_ms"] == sides["buffered_durable_alone"]["latency_ms"]["p99"]
    assert "## The durable write path alone against the raw loop, round by round" in report
    p99 = {t["figure"]: t["measured"] for t in data["targets"] if t["id"] == "p99"}
    assert len(p99) == 2
    for figure, measured in p99.items():
        durable = "sync_interval: always" in figure
        assert ("raw publish + KV CAS loop's own p99 on the same nats-server" in measured) is (
            durable
        ), figure
        assert ("the buffered write path alone there" in measured) is durable, figure


def check_soak(data: dict[str, Any], report: str) -> None:
    """The stream sampled every second, both issue-25 figures judged from it."""
    timeline = data["sides"]["buffered"]["timeline"]
    assert len(timeline["t_s"]) >= 10
    assert any(b for b in timeline["bytes"] if b)
    assert any(m for m in timeline["messages"] if m)
    assert data["sides"]["buffered"]["flusher"]["trims"] > 0
    assert [t["id"] for t in data["targets"]] == ["soak_flat", "soak_trim_cpu"]
    assert data["figures"]["flat_bytes"]["samples"] >= 5
    assert data["figures"]["trim_cpu_share"] is not None
    assert "## Stream size over time" in report
    assert "wal_size.png" in report


def check_writer_cpu(data: dict[str, Any], report: str) -> None:
    """CPU per checkpoint of every side at every thread count and history length."""
    for key, side in data["sides"].items():
        cases = {(c["threads"], c["history"]) for c in side["cases"]}
        assert cases == {(t, h) for t in (1, 8) for h in (50, 500, 2000)}, key
        for case in side["cases"]:
            assert case["cpu_us"]["median"] > 0, (key, case)
    # append() and checkpoint() (full snapshots) are both judged, at each thread count
    assert [t["id"] for t in data["targets"]] == ["writer_cpu"] * 4
    assert ["checkpoint()" in t["figure"] for t in data["targets"]] == [False, False, True, True]
    assert "## Client CPU per checkpoint" in report


def check_spark_overlay(data: dict[str, Any], report: str) -> None:
    """Every WAL tail leaves the same pending entries and rows; warm and restarted writers
    are judged."""
    params = data["parameters"]
    pending = params["threads"] * params["pending_per_thread"]
    tails = data["figures"]["tails"]
    assert set(tails) == {"warm", "restarted", "rewritten"}
    for kind, tail in tails.items():
        assert tail["pending_entries"] == pending, kind
        assert tail["rows_as_expected"], kind
    # A warm writer's entries are deltas, and so are a restarted one's (its first entry per
    # thread proves the stored snapshot by its digest); a rewritten history's first entry
    # per thread is a snapshot.
    assert tails["restarted"]["tail_bytes"] < tails["warm"]["tail_bytes"] * 1.5
    assert tails["rewritten"]["tail_bytes"] > tails["restarted"]["tail_bytes"] * 2
    assert data["figures"]["restarted_data_set_table_alike"]
    # Where the warm read's time goes: every step timed, on the warm tail's entries.
    split = data["figures"]["cost_split"]
    assert split["entries"] == pending
    assert split["repeats"] == params["repeats"]
    assert all(seconds > 0 for seconds in split["median_s"].values()), split
    steps = split["median_s"]
    tail = steps["bounds_s"] + steps["receive_s"] + steps["parse_json_s"]
    assert split["floor_over_plain_s"] == pytest.approx(tail)
    assert split["tail_floor_ratio"] == pytest.approx(1 + tail / data["figures"]["plain_median_s"])
    assert "## Where the overlay read's time goes (warm writers)" in report
    # Each read's CPU, per process group (the run started its own servers).
    cpu = data["figures"]["cpu"]
    assert set(cpu) == {"plain", "overlay_warm", "overlay_restarted", "overlay_rewritten"}
    for key, parts in cpu.items():
        assert parts["spark_s"] > 0, key
        assert parts["postgres_s"] is not None, key
        assert parts["nats_s"] is not None, key
        assert parts["total_s"] is not None, key
    assert "CPU seconds per read" in report
    # Two tails are judged, warm writers against 1.3x, restarted writers against 2.5x;
    # rewritten histories are reported only.
    assert [t["id"] for t in data["targets"]] == ["spark", "spark_restarted"]
    assert [t["target"] for t in data["targets"]] == [
        "at most 1.3x the plain JDBC read",
        "at most 2.5x the plain JDBC read",
    ]
    assert all(isinstance(t["met"], bool) for t in data["targets"])
    assert "warm writers" in report
    assert "restarted writers" in report
    assert "rewritten histories (worst case)" in report


def check_langgraph(data: dict[str, Any], report: str) -> None:
    """Every side in every phase with its steps, latencies and CPU per step, the paced
    points at their fractions of AsyncPostgresSaver's maximum, the loopback targets, and
    the same checkpoints per thread on all four sides after force_flush_all."""
    params = data["parameters"]
    check_langgraph_phases(data)
    assert [t["id"] for t in data["targets"]] == [
        "lg_p50",
        "lg_p50_own",
        "lg_p99",
        "lg_cpu",
        "lg_pg_tx",
        "lg_rate",
    ]
    assert all(t["met"] is None for t in data["targets"][4:])
    assert data["targets"][1]["met"] is None
    assert params["db_delay_ms"] == 0.0
    assert "link" not in params
    assert params["round_trip_from_idle"]["floor_wall_p50_us"] > 0
    assert "from idle at this pace" in data["targets"][0]["measured"]
    for key, side in data["sides"].items():
        assert "proxy" not in side["cpu"]["seconds"], key
    for title in ("Phases side by side", "Flusher", "Correctness after force_flush_all"):
        assert f"## {title}" in report
    assert "PG transactions / step" in report
    assert "latency_vs_load.png" in report


def check_langgraph_phases(data: dict[str, Any]) -> None:
    """What every langgraph run holds, whatever its link."""
    params = data["parameters"]
    d_max = params["asyncpostgressaver_max_per_s"]
    assert d_max == data["sides"]["direct_max"]["throughput_per_s"]
    for key, side in data["sides"].items():
        kind, phase = key.split("_")
        assert (side["kind"], side["phase"]) == (kind, phase)
        runs = params["runs"] if phase == "max" else params["paced_runs"]
        assert side["steps"] == params["threads"] * params["steps"] * runs, key
        assert side["failed"] == 0, (key, side["failure_kinds"])
        assert side["checkpoints"] == params["threads"] * runs * (params["steps"] + 2), key
        for figure in ("latency_ms", "latency_first_ms", "run_latency_ms", "think_ms"):
            assert {"p50", "p99"} <= set(side[figure]), (key, figure)
        assert side["latency_ms"]["count"] == params["threads"] * runs * (params["steps"] - 1)
        if phase == "max":
            assert side["offered_per_s"] is None, key
            assert side["closed_loop"], key
            assert side["think_ms"]["max"] == 0.0, key
        else:
            assert side["offered_per_s"] == pytest.approx(int(phase) / 100 * d_max), key
            assert side["late_slots"] >= 0, key
        cpu = side["cpu"]["ms_per_step"]
        assert {"total", "harness", "postgres"} <= set(cpu), key
        if kind in ("floor", "onetrip"):
            assert "pg" in side["unavailable"], key
        else:
            assert side["pg"]["transactions_per_step"] > 0, key
        if kind == "onetrip":
            # One acknowledged publish per checkpoint LangGraph made, and its server's CPU.
            assert side["one_publish"]["publishes"] == side["checkpoints"], key
            assert "nats_server" in cpu, key
        if kind == "buffered":
            assert {"nats_server", "flusher"} <= set(cpu), key
            flush = side["flush"]
            assert flush["drain_s"] is not None, key
            assert flush["process_cpu_us_per_entry"] > 0, key
            assert {"max", "trough_slope_per_s_second_half"} <= set(flush["backlog"]), key
            assert "backlog_flat" in flush, key
            assert side["nats"]["wal_bytes_per_step"] > 0, key
    check = data["figures"]["correctness"]
    assert check["ok"], check["summary"]
    total = sum(data["figures"]["correctness"]["expected_checkpoints_per_thread"].values())
    assert check["checkpoints"] == {key: total for key in LG_SIDES}


@pytest.mark.timeout(300)
@pytest.mark.timeout(300)
def test_hot_threads_quick_runs_the_durable_floor_in_rounds(tmp_path: Path) -> None:
    """`--floor-rounds 3`: the write path alone and the raw loop run three times on the
    fsyncing server, in ABBA order, each round measured on its own (not as sides)."""
    out = tmp_path / "hot-threads-rounds"
    data = run_quick("hot-threads", out, "--floor-rounds", "3", "--duration-s", "1.5")
    assert set(data["sides"]) == SCENARIOS["hot-threads"][0]
    assert data["parameters"]["floor_rounds"] == 3
    floor = data["figures"]["durable_floor_rounds"]
    assert [r["first"] for r in floor["rounds"]] == ["alone", "raw", "alone"]
    for r in floor["rounds"]:
        assert r["raw_p99_ms"] > 0
        assert r["alone_p99_ms"] > 0
        assert r["raw_cpu_ms"]["nats_server"] > 0
        assert r["alone_cpu_ms"]["harness"] > 0
    p99s = [r["raw_p99_ms"] for r in floor["rounds"]]
    assert floor["raw_p99_ms_range"] == [min(p99s), max(p99s)]
    report = (out / "report.md").read_text()
    assert "Over 3 rounds the raw loop's p99 ranged" in report


def test_langgraph_quick_with_postgres_behind_a_delaying_link(tmp_path: Path) -> None:
    """`--db-delay-ms 2`: every Postgres connection of the sides through the proxy, its
    round trip measured, the remote targets judged instead of the loopback ones."""
    data = run_quick("langgraph", tmp_path / "lg-delay", "--db-delay-ms", "2")
    check_langgraph_phases(data)
    link = data["parameters"]["link"]
    assert data["parameters"]["db_delay_ms"] == 2.0
    assert link["measured_rtt_ms"]["proxied"] > link["measured_rtt_ms"]["plain"]
    assert [t["id"] for t in data["targets"]] == [
        "lg_p50",
        "lg_p50_own",
        "lg_remote_p99",
        "lg_remote_rate",
        "lg_pg_tx",
    ]
    assert all("+2 ms link" in t["figure"] for t in data["targets"])
    for key in ("direct_50", "buffered_50"):
        assert "proxy" in data["sides"][key]["cpu"]["outside_total"], key
    report = (tmp_path / "lg-delay" / "report.md").read_text()
    assert "## The link" in report


SCENARIO_CHECKS: dict[str, Callable[[dict[str, Any], str], None]] = {
    "langgraph": check_langgraph,
    "curve": check_curve,
    "hot-threads": check_hot_threads,
    "spark-overlay": check_spark_overlay,
    "writer-cpu": check_writer_cpu,
    "soak": check_soak,
}


def test_summary_collects_the_targets_of_several_runs(tmp_path: Path) -> None:
    data = run_quick("force-flush", tmp_path / "ff")
    done = subprocess.run(
        [sys.executable, "-m", BENCH, "summary", str(tmp_path / "ff")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "| figure | target | measured | ratio | met |" in done.stdout
    # Each row names its results folder, which tells apart two runs of one scenario.
    assert f"{data['targets'][0]['figure']} [`ff`]" in done.stdout
    # Then the count of what the table holds, so nobody counts its lines by hand.
    judged = [t for t in data["targets"] if t.get("met") is not None]
    met = sum(1 for t in judged if t["met"])
    assert done.stdout.rstrip().endswith(
        f"{len(data['targets'])} figures, {len(judged)} judged: {met} met, "
        f"{len(judged) - met} missed ({len(data['targets']) - len(judged)} reported "
        "without a target)."
    )
