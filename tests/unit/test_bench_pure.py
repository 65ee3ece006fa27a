"""Pure parts of the benchmark harness: the workload's store call, warm-call latencies,
the curve scenario's maximum rates, the writer-cpu scenario's flatness figures and the
langgraph scenario's pacing, step latencies, CPU per step and judging."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import pytest

from buffered_store.model.protocol import ThreadRunStore
from buffered_store.stores.memory import InMemoryThreadRunStore

# The harness is installed as `buffered_store.benchmarks`; mypy checks the repository's
# folder as the top-level package `benchmarks` (pyproject [tool.mypy] packages).
if TYPE_CHECKING:
    from benchmarks.flush import backlog_figures, troughs
    from benchmarks.harness import Bench, Options
    from benchmarks.measure import (
        IN_GC,
        WAITED,
        CpuMeter,
        Laps,
        LatencyLog,
        Timeline,
        cpu_delta,
        descendants,
        process_cpu,
        runqueue_wait_s,
        wait_or_stop,
    )
    from benchmarks.report import speed_line, target_counts, targets_table
    from benchmarks.scenarios.common import backlog_growing, backlog_trend, judge_latency
    from benchmarks.scenarios.curve import curve_points, maximum
    from benchmarks.scenarios.curve import judge as judge_curve
    from benchmarks.scenarios.hot_threads import floor_rounds, floor_rounds_table
    from benchmarks.scenarios.langgraph_onetrip import OnePublishSaver, stream_seq
    from benchmarks.scenarios.langgraph_pacing import (
        Slots,
        StepLog,
        paced_runs,
        phase_cpu,
        run_times,
        thread_slots,
    )
    from benchmarks.scenarios.langgraph_report import compare, judge
    from benchmarks.scenarios.spark_split import (
        SPLIT_STEPS,
        cost_split,
        cpu_medians,
        cpu_meter,
        cpu_used,
    )
    from benchmarks.scenarios.writer_cpu import flatness, paired_flatness, side_figures
    from benchmarks.sides import add_flusher_cpu, sample_loop
    from benchmarks.workload import Workload, make_threads, seed, write_step
else:
    from buffered_store.benchmarks.flush import backlog_figures, troughs
    from buffered_store.benchmarks.harness import Bench, Options
    from buffered_store.benchmarks.measure import (
        IN_GC,
        WAITED,
        CpuMeter,
        Laps,
        LatencyLog,
        Timeline,
        cpu_delta,
        descendants,
        process_cpu,
        runqueue_wait_s,
        wait_or_stop,
    )
    from buffered_store.benchmarks.report import speed_line, target_counts, targets_table
    from buffered_store.benchmarks.scenarios.common import (
        backlog_growing,
        backlog_trend,
        judge_latency,
    )
    from buffered_store.benchmarks.scenarios.curve import curve_points, maximum
    from buffered_store.benchmarks.scenarios.curve import judge as judge_curve
    from buffered_store.benchmarks.scenarios.hot_threads import floor_rounds, floor_rounds_table
    from buffered_store.benchmarks.scenarios.langgraph_onetrip import OnePublishSaver, stream_seq
    from buffered_store.benchmarks.scenarios.langgraph_pacing import (
        Slots,
        StepLog,
        paced_runs,
        phase_cpu,
        run_times,
        thread_slots,
    )
    from buffered_store.benchmarks.scenarios.langgraph_report import compare, judge
    from buffered_store.benchmarks.scenarios.spark_split import (
        SPLIT_STEPS,
        cost_split,
        cpu_medians,
        cpu_meter,
        cpu_used,
    )
    from buffered_store.benchmarks.scenarios.writer_cpu import (
        flatness,
        paired_flatness,
        side_figures,
    )
    from buffered_store.benchmarks.sides import add_flusher_cpu, sample_loop
    from buffered_store.benchmarks.workload import Workload, make_threads, seed, write_step


class Recording(InMemoryThreadRunStore):
    """Counts the messages each call hands over."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[str, int]] = []

    async def checkpoint(self, thread_id: str, messages: Any, run: Any, **kw: Any) -> Any:
        self.sent.append(("checkpoint", len(messages)))
        return await super().checkpoint(thread_id, messages, run, **kw)

    async def append(self, thread_id: str, messages: Any, run: Any, **kw: Any) -> Any:
        self.sent.append(("append", len(messages)))
        return await super().append(thread_id, messages, run, **kw)


@pytest.mark.parametrize("api", ["checkpoint", "append"])
async def test_a_step_sends_the_snapshot_or_only_the_new_messages(
    api: Literal["checkpoint", "append"],
) -> None:
    workload = Workload(threads=1, seed_messages=10, messages_per_step=2, api=api)
    store = Recording()
    [state] = make_threads("t", workload)
    await seed(store, [state])
    for _ in range(3):
        state.advance(workload, 0.0)
        await write_step(store, state, workload.api)

    sizes = (2, 2, 2) if api == "append" else (12, 14, 16)
    assert store.sent == [("checkpoint", 10), *((api, n) for n in sizes)]
    assert await store.load_messages(state.thread_id) == state.history


async def test_an_append_after_a_failed_one_resends_what_was_not_acknowledged() -> None:
    workload = Workload(threads=1, seed_messages=4, messages_per_step=2, api="append")
    store = Recording()
    [state] = make_threads("t", workload)
    await seed(store, [state])
    state.advance(workload, 0.0)

    class Down(InMemoryThreadRunStore):
        async def append(self, *args: Any, **kw: Any) -> Any:
            raise ConnectionError("down")

    down: ThreadRunStore = Down()
    with pytest.raises(ConnectionError):
        await write_step(down, state, "append")
    state.advance(workload, 0.0)
    await write_step(store, state, "append")

    assert store.sent[-1] == ("append", 4)
    assert await store.load_messages(state.thread_id) == state.history


def test_warm_latencies_leave_out_each_threads_first_call() -> None:
    log = LatencyLog()
    log.ok(0.0, 50.0, cold=True)
    log.ok(0.1, 1.0)
    log.ok(0.1, 40.0, cold=True)
    log.ok(0.2, 2.0)
    assert log.warm_ms() == [1.0, 2.0]
    assert list(log.durations_ms) == [50.0, 1.0, 40.0, 2.0]


def closed_loop(kind: str, achieved: float, slope: float | None) -> dict[str, Any]:
    backlog = {"slope_per_s_second_half": slope, "at_end_of_writes": 10}
    return {"kind": kind, "throughput_per_s": achieved, "flush": {"backlog": backlog}}


def test_the_maximum_of_a_direct_side_is_its_achieved_rate() -> None:
    assert maximum(closed_loop("direct", 500.0, None))["sustainable_per_s"] == 500.0


def test_a_buffered_maximum_counts_only_while_the_backlog_stays_flat() -> None:
    flat = maximum(closed_loop("buffered", 1000.0, 5.0))
    assert flat["sustainable_per_s"] == 1000.0
    assert "flat" in flat["how"]
    growing = maximum(closed_loop("buffered", 1000.0, 300.0))
    assert growing["sustainable_per_s"] == 700.0  # the flusher's rate
    assert "flusher" in growing["how"]


def test_the_write_path_alone_has_no_flusher_to_keep_up() -> None:
    alone = maximum(closed_loop("buffered", 2000.0, 2000.0), flusher=False)
    assert alone["sustainable_per_s"] == 2000.0


def paced_point(kind: str, p99_ms: float, offered: float = 400.0) -> dict[str, Any]:
    return {
        "kind": kind,
        "label": kind,
        "offered_per_s": offered,
        "throughput_per_s": offered,
        "latency_ms": {"p50": p99_ms / 4, "p95": p99_ms / 2, "p99": p99_ms},
        "latency_warm_ms": {"p50": p99_ms / 4, "p95": p99_ms / 2, "p99": p99_ms},
    }


def test_curve_judges_buffered_against_direct_and_shows_the_write_path_alone_beside() -> None:
    sides = {
        "direct_max": closed_loop("direct", 800.0, None),
        "direct_50": paced_point("direct", 11.0),
        "direct_90": paced_point("direct", 90.0, 720.0),
        "raw_50": paced_point("raw", 2.2),
        "raw_90": paced_point("raw", 2.0, 720.0),
        "buffered_max": closed_loop("buffered", 6000.0, 5.0),
        "buffered_50": paced_point("buffered", 4.4),
        "buffered_90": paced_point("buffered", 3.0, 720.0),
        "buffered_50_own": paced_point("buffered", 5.0, 3000.0),
        "buffered_50_alone": paced_point("buffered", 2.7),
        "buffered_90_alone": paced_point("buffered", 2.5, 720.0),
        "buffered_writer_only": closed_loop("buffered", 8000.0, 8000.0),
    }
    sides["buffered_50_own"]["flush"] = {"backlog": {}, "lag_from_ack_ms": {"p99": 500.0}}
    for key, side in sides.items():
        side.setdefault("label", key)
    maxima = {
        "direct": maximum(sides["direct_max"]),
        "buffered": maximum(sides["buffered_max"]),
        "buffered_writer_only": maximum(sides["buffered_writer_only"], flusher=False),
    }
    judged = judge_curve(sides, maxima, 0.5, "buffered_50_own", "append")
    half, most = (t for t in judged if t["id"] == "load_p99")
    # The ratio judged stays buffered with its flusher against direct ...
    assert half["ratio"] == pytest.approx(11.0 / 4.4)
    assert half["met"] is False
    assert most["ratio"] == pytest.approx(30.0)
    assert most["met"] is True
    # ... and the write path alone at the same load is reported beside it.
    assert (
        "write path alone at this load (no flusher process sharing the cores) 2.70 ms"
        in (half["measured"])
    )
    assert "2.50 ms" in most["measured"]
    flags = {r["key"]: r["flusher"] for r in curve_points(sides) if r["side"] == "buffered"}
    assert flags == {
        "buffered_max": True,
        "buffered_50": True,
        "buffered_90": True,
        "buffered_50_own": True,
        "buffered_50_alone": False,
        "buffered_90_alone": False,
        "buffered_writer_only": False,
    }


def test_a_latency_judged_beside_its_floor_reports_what_the_floor_leaves_to_gain() -> None:
    direct, buffered, raw = (
        paced_point("direct", 240.0),
        paced_point("buffered", 60.0),
        paced_point("raw", 50.0),
    )
    plain = judge_latency("p99", "p99", direct, buffered)
    beside = judge_latency(
        "p99",
        "p99",
        direct,
        buffered,
        "sync_interval: always",
        floor=raw,
        alone=paced_point("buffered", 30.0),
    )
    # The ratio judged is the same with or without the floor: direct over buffered.
    assert plain["ratio"] == beside["ratio"] == pytest.approx(4.0)
    assert plain["met"] is beside["met"] is False
    assert "raw publish" not in plain["measured"]
    assert "own p99 on the same nats-server at this load 50.00 ms" in beside["measured"]
    assert "(direct/raw = 4.800:" in beside["measured"]
    assert "the buffered write path alone there" in beside["measured"]
    assert beside["measured"].endswith("sharing the cores) 30.00 ms")
    assert beside["figure"].endswith("(sync_interval: always)")


def test_floor_rounds_pair_each_alone_run_with_its_raw_run_and_take_the_median() -> None:
    def side(p99: float, harness: float, server: float) -> dict[str, Any]:
        point = paced_point("raw", p99)
        point["cpu"] = {"seconds_per_1k_checkpoints": {"harness": harness, "nats_server": server}}
        return point

    floor = floor_rounds(
        [
            ("alone", side(20.0, 0.35, 0.41), side(30.0, 0.39, 0.42)),
            ("raw", side(50.0, 0.34, 0.41), side(40.0, 0.40, 0.46)),
            ("alone", side(16.0, 0.34, 0.40), side(32.0, 0.41, 0.47)),
        ]
    )
    rows = floor["rounds"]
    assert [r["alone_over_raw_p99"] for r in rows] == pytest.approx([1.5, 0.8, 2.0])
    assert floor["median_alone_over_raw_p99"] == pytest.approx(1.5)
    assert floor["raw_p99_ms_range"] == [16.0, 50.0]
    assert floor["alone_p99_ms_range"] == [30.0, 40.0]
    assert rows[1]["alone_cpu_ms"] == {"harness": 0.40, "nats_server": 0.46}
    assert rows[0]["raw_p50_ms"] == 5.0
    table = floor_rounds_table(floor)
    assert "| 2 | raw | 12.50 / 50.00 | 10.00 / 40.00 | 0.800 |" in table
    assert "Over 3 rounds the raw loop's p99 ranged 16.00 to 50.00 ms" in table
    assert "median alone/raw 1.500" in table
    # One round: its row, and no spread to speak of.
    single = floor_rounds_table(
        floor_rounds([("alone", side(20.0, 0.3, 0.4), side(30.0, 0.3, 0.4))])
    )
    assert "| 1 | alone |" in single
    assert "ranged" not in single


def test_a_backlog_grows_above_one_percent_of_the_rate() -> None:
    assert not backlog_growing(None, 100.0)
    assert not backlog_growing(1.0, 100.0)
    assert backlog_growing(1.5, 100.0)


def probe_case(
    side: str, api: str, threads: int, history: int, cpu: float, round_: int = 0
) -> dict[str, Any]:
    return {
        "side": side,
        "api": api,
        "threads": threads,
        "history": history,
        "history_end": history + 40,
        "round": round_,
        "checkpoints": 20,
        "cpu_us": cpu,
        "wall_us": cpu * 2,
        "nats_requests": 2.0,
        "durations_ms": [cpu / 1000],
    }


def test_writer_cpu_figures_keep_each_side_apart_and_take_the_median_of_rounds() -> None:
    cases = [
        probe_case("buffered", "append", 64, h, cpu)
        for h, cpus in ((50, (100, 110, 300)), (500, (105, 104, 103)), (2000, (118, 120, 119)))
        for cpu in cpus
    ] + [probe_case("raw", "raw", 64, h, 50.0) for h in (50, 500, 2000)]

    append = side_figures("append", cases)
    raw = side_figures("raw", cases)

    assert append["checkpoints"] == 9 * 20
    assert [r["cpu_us"]["median"] for r in append["cases"]] == [110, 104, 119]
    medians, spread = flatness(append, 64)
    assert medians == [110, 104, 119]
    assert spread == pytest.approx(119 / 104)
    assert [r["cpu_us"]["median"] for r in raw["cases"]] == [50.0, 50.0, 50.0]
    assert flatness(raw, 1) == ([], None)


def drifting_rounds(growth: dict[int, float]) -> list[dict[str, Any]]:
    """Three rounds on a machine whose speed moves from case to case (up to 1.6x slower,
    most in the second round); in each case the raw loop and append() run at the same
    speed. The raw loop's work is the same at every history length, append()'s costs
    `growth[history]` times 1.5 the raw loop's."""
    speed = {(0, 50): 1.0, (0, 500): 1.1, (0, 2000): 1.0, (1, 50): 1.5, (1, 500): 1.4}
    speed |= {(1, 2000): 1.6, (2, 50): 1.0, (2, 500): 1.5, (2, 2000): 1.0}
    cases = []
    for (round_, history), slow in speed.items():
        cases.append(probe_case("raw", "raw", 64, history, 80 * slow, round_))
        cases.append(
            probe_case("buffered", "append", 64, history, 120 * slow * growth[history], round_)
        )
    return cases


def test_writer_cpu_is_judged_against_the_raw_loop_of_the_same_round() -> None:
    flat = drifting_rounds({50: 1.0, 500: 1.0, 2000: 1.0})
    # The CPU per call itself moves with the machine (its medians 1.4x apart) ...
    _, absolute = flatness(side_figures("append", flat), 64)
    assert absolute == pytest.approx(1.4)
    # ... its ratio to the raw loop beside it does not.
    medians, spread = paired_flatness(flat, "append", 64)
    assert medians == pytest.approx([1.5, 1.5, 1.5])
    assert spread == pytest.approx(1.0)

    # A write path whose cost grows with the history is still seen through the drift.
    growing = drifting_rounds({50: 1.0, 500: 1.1, 2000: 1.4})
    medians, spread = paired_flatness(growing, "append", 64)
    assert medians == pytest.approx([1.5, 1.65, 2.1])
    assert spread == pytest.approx(1.4)

    # A round whose raw case is missing gives no ratio; no other side is mixed in.
    partial = [c for c in flat if not (c["side"] == "raw" and c["round"] == 1)]
    assert paired_flatness(partial, "append", 64)[0] == pytest.approx([1.5, 1.5, 1.5])
    assert paired_flatness(flat, "checkpoint", 64) == ([], None)
    assert paired_flatness(flat, "append", 1) == ([], None)


def sawtooth(growth_per_s: float, *, seconds: float = 20.0) -> tuple[list[float], list[float]]:
    """Backlog samples every 0.25 s: 0.5 s flush windows filling at 800 entries/s and
    emptied by each cycle, plus `growth_per_s` the flusher leaves behind."""
    t = [i * 0.25 for i in range(int(seconds / 0.25))]
    return t, [800 * (x % 0.5) * 2 + 200 + growth_per_s * x for x in t]


def test_backlog_trend_of_a_sawtooth_reads_its_troughs() -> None:
    t, flat = sawtooth(0.0)
    figures = backlog_figures(t, flat, writes_end_s=20.0, warm_s=2.0)
    assert figures["trough_slope_per_s_second_half"] == pytest.approx(0.0, abs=1e-9)
    t, growing = sawtooth(50.0)
    figures = backlog_figures(t, growing, writes_end_s=20.0, warm_s=2.0)
    assert figures["trough_slope_per_s_second_half"] == pytest.approx(50.0, rel=0.05)


def test_a_backlog_too_short_for_three_troughs_has_no_trend() -> None:
    # A flat sawtooth for 2.1 s, sampled every 0.27 s: the slope of every sample over
    # the second half is where the samples fell in the last flush windows (here +119
    # entries/s), which a short closed loop used to report as a growing backlog.
    t = [i * 0.27 for i in range(8)]
    flat = [800 * (x % 0.5) * 2 + 200 for x in t]
    figures = backlog_figures(t, flat, writes_end_s=2.1, warm_s=0.42)
    assert figures["trough_slope_per_s_second_half"] is None
    assert figures["slope_per_s_second_half"] > 100
    assert backlog_trend({"flush": {"backlog": figures}}) is None
    old_results = {"slope_per_s_second_half": 12.0}  # before troughs were kept
    assert backlog_trend({"flush": {"backlog": old_results}}) == 12.0


def test_a_last_window_the_samples_stop_short_of_is_no_trough() -> None:
    # The closed loop of a `langgraph --db-delay-ms 2` run (2026-11-27, b9f9a7a): 6.49 s
    # of writes, a flat sawtooth between about 60 and 470 entries, drained 0.41 s after
    # the writes. The second half's last window held two samples, both high on the
    # sawtooth; read as a trough it made a trend of +97 entries/s ("growing").
    t = [0.03, 0.3, 0.57, 0.84, 1.12, 1.41, 1.68, 1.96, 2.23, 2.56, 2.87, 3.15, 3.42]
    t += [3.69, 3.98, 4.28, 4.55, 4.82, 5.11, 5.39, 5.67, 5.94, 6.22, 6.48]
    b = [0, 0, 64, 305, 512, 221, 107, 299, 467, 254, 82, 226, 192, 391, 221, 57, 256]
    b += [192, 286, 126, 229, 157, 349, 272]
    figures = backlog_figures(t, b, writes_end_s=6.49, warm_s=1.298)
    assert figures["trough_slope_per_s_second_half"] is None  # two whole windows
    assert troughs([(0.0, 5.0), (0.5, 1.0), (1.0, 4.0), (1.25, 9.0)], 1.0) == [(0.5, 1.0)]
    # Samples that reach the window's end within their spacing make it whole.
    assert troughs([(0.0, 5.0), (0.5, 1.0), (1.0, 4.0), (1.5, 2.0)], 1.0) == [
        (0.5, 1.0),
        (1.5, 2.0),
    ]


def test_backlog_trend_ignores_where_the_sampling_falls_in_the_cycle() -> None:
    # Samples drifting against the cycle: every sample's slope swings, the troughs' does not.
    t = [i * 0.27 for i in range(74)]
    b = [800 * (x % 0.5) * 2 + 200 for x in t]
    figures = backlog_figures(t, b, writes_end_s=20.0, warm_s=2.0)
    # Within 1% of the 1,600 entries/s the sawtooth fills at: flat, either way.
    assert abs(figures["trough_slope_per_s_second_half"]) < 16
    assert not backlog_growing(figures["trough_slope_per_s_second_half"], 1600.0)
    assert figures["max"] > 900


def test_laps_time_each_step_from_the_end_of_the_one_before() -> None:
    ticks = iter([10.0, 10.5, 12.0, 12.25])
    laps = Laps(clock=lambda: next(ticks))
    laps.mark("receive")
    laps.mark("decode")
    laps.mark("arrow")
    assert laps.seconds == {"receive": 0.5, "decode": 1.5, "arrow": 0.25}
    with pytest.raises(ValueError, match="already marked"):
        laps.mark("decode")


def split_run(plain: float, union: float, receive: float = 0.2) -> dict[str, Any]:
    run = {step: 0.01 for step in SPLIT_STEPS}
    run.update(entries=10, bounds_s=0.005, receive_s=receive, parse_json_s=0.045)
    run.update(plain_scan_s=plain, union_scan_s=union)
    return run


def test_the_spark_floor_adds_bounds_receive_parse_and_the_union_is_the_median_pair() -> None:
    # Union costs per pair: 0.5, 0.1, 0.05 -> median 0.1; the scans' medians apart
    # (1.45 - 1.2) would say 0.25: the pairs are what is compared.
    runs = [split_run(1.0, 1.5), split_run(1.2, 1.3), split_run(1.4, 1.45)]
    split = cost_split(runs, plain=1.0)
    assert split["repeats"] == 3
    assert split["entries"] == 10
    assert split["union_cost_s"] == pytest.approx(0.1)
    assert split["floor_over_plain_s"] == pytest.approx(0.005 + 0.2 + 0.045)
    assert split["tail_floor_ratio"] == pytest.approx(1.25)
    assert split["median_s"]["plain_scan_s"] == pytest.approx(1.2)
    assert cost_split([], plain=1.0) == {}


def test_a_read_cpu_is_the_difference_of_two_samples_and_its_total_needs_every_part() -> None:
    before = {"spark_s": 1.0, "postgres_s": 2.0, "nats_s": None}
    after = {"spark_s": 1.5, "postgres_s": 2.25, "nats_s": None}
    assert cpu_used(before, after) == {"spark_s": 0.5, "postgres_s": 0.25, "nats_s": None}
    full = [{"cpu": {"spark_s": s, "postgres_s": 0.5, "nats_s": 0.125}} for s in (1, 3, 2)]
    assert cpu_medians(full) == {
        "spark_s": 2.0,
        "postgres_s": 0.5,
        "nats_s": 0.125,
        "total_s": 2.625,
    }
    # A server the run did not start (an external URL) has no figure, nor has the total.
    partial = [{"cpu": {"spark_s": 1.0, "postgres_s": None, "nats_s": 0.1}}]
    assert cpu_medians(partial)["total_s"] is None


def test_the_cpu_meter_counts_this_process_and_skips_servers_not_started() -> None:
    meter = cpu_meter({"nats_server": None, "postgres": None})
    first = meter()
    sum(i * i for i in range(300_000))  # some CPU in this process
    used = cpu_used(first, meter())
    assert used["spark_s"] is not None
    assert used["spark_s"] >= 0
    assert used["postgres_s"] is None
    assert used["nats_s"] is None


async def test_a_sampler_ends_on_its_event_even_when_its_probe_swallows_a_cancellation(
    tmp_path: Path,
) -> None:
    """nats-py's requests wait with `asyncio.wait_for`, which on Python 3.11 can swallow a
    cancellation that lands as the reply arrives: a sampler stopped by `cancel()` then ran
    on forever (a `langgraph` run hung so). The samplers end on an event instead."""
    bench = Bench("unit", Options(output=tmp_path))
    task = bench.task("sampling", total=1.0)
    timeline = Timeline()
    stop = asyncio.Event()
    probes = 0

    async def probe() -> dict[str, float | None]:
        nonlocal probes
        probes += 1
        with contextlib.suppress(asyncio.CancelledError):  # swallowed, as wait_for's race does
            await asyncio.sleep(0.005)
        return {"checkpoints": float(probes)}

    sampler = asyncio.create_task(
        sample_loop(bench, task, timeline, 0.0, probe, interval_s=0.01, total_s=1.0, stop=stop)
    )
    await asyncio.sleep(0.1)
    assert probes > 2
    stop.set()
    await asyncio.wait_for(sampler, 2)  # ends at its next pause
    assert len(timeline.t_s) == probes


async def test_wait_or_stop_waits_its_interval_or_until_stopped() -> None:
    stop = asyncio.Event()
    assert await wait_or_stop(stop, 0.01) is False
    asyncio.get_running_loop().call_later(0.05, stop.set)
    began = time.monotonic()
    assert await wait_or_stop(stop, 30) is True
    assert time.monotonic() - began < 10
    assert await wait_or_stop(stop, 30) is True  # already set: at once


# -- langgraph: pacing, step latencies, CPU per step, judging ------------------------------


def test_a_paced_node_waits_for_its_slot_and_the_next_slot_is_one_interval_later() -> None:
    slots = Slots(interval_s=0.5, due_s=0.2)
    assert slots.wait_s(0.0) == pytest.approx(0.2)
    assert slots.wait_s(0.3) == pytest.approx(0.4)  # the step took 0.1 s: 0.4 s to 0.7
    assert slots.wait_s(1.25) == 0.0  # 0.05 s late: starts at once, no slot skipped
    assert slots.wait_s(1.3) == pytest.approx(0.4)  # back on the schedule: 1.7
    assert slots.late_slots == 0


def test_a_thread_more_than_one_interval_behind_skips_the_slots_it_missed() -> None:
    slots = Slots(interval_s=0.5, due_s=0.0)
    assert slots.wait_s(0.0) == 0.0
    assert slots.wait_s(1.8) == 0.0  # due at 0.5: 1.3 s behind, the slots of 0.5 and 1.0 go
    assert slots.late_slots == 2
    assert slots.wait_s(1.9) == pytest.approx(0.1)  # next slot 2.0, no burst to catch up


def test_thread_slots_spread_the_first_slots_over_one_interval_alike_on_every_side() -> None:
    one = thread_slots(32, 100.0, random.Random("slots-50"))
    other = thread_slots(32, 100.0, random.Random("slots-50"))
    assert [s.due_s for s in one] == [s.due_s for s in other]
    assert all(s.interval_s == pytest.approx(0.32) for s in one)
    assert all(0 <= s.due_s < 0.32 for s in one)
    with pytest.raises(ValueError, match="positive rate"):
        thread_slots(4, 0.0, random.Random(1))


def test_a_steps_latency_is_the_time_between_two_updates_minus_the_nodes_think_time() -> None:
    # Called at 10.0; nodes thought 40, 100 and 105 ms; updates at +50, +160, +270 ms.
    times = run_times(10.0, [10.050, 10.160, 10.270], 10.2702, [0.040, 0.100, 0.105])
    assert times.first_ms == pytest.approx(10.0)
    assert times.steps_ms == pytest.approx([10.0, 5.0])
    assert times.end_ms == pytest.approx(0.2)
    assert times.run_ms == pytest.approx(25.2)
    with pytest.raises(ValueError, match="2 updates for 3 node runs"):
        run_times(10.0, [10.1, 10.2], 10.3, [0.0, 0.0, 0.0])


def test_the_step_log_gathers_every_runs_latencies_and_counts_failures_by_kind() -> None:
    log = StepLog()
    log.run(0.0, [0.002, 0.005, 0.009], 0.0095, [0.0, 0.0, 0.0])
    log.run(1.0, [1.011, 1.113], 1.1131, [0.010, 0.1])
    log.fail(TimeoutError())
    log.fail(TimeoutError())
    assert log.nodes == 5
    assert log.steps_ms == pytest.approx([3.0, 4.0, 2.0])
    assert log.first_ms == pytest.approx([2.0, 1.0])
    assert log.failures == {"TimeoutError": 2}
    figures = log.figures()
    assert figures["latency_ms"]["count"] == 3
    assert figures["think_ms"]["max"] == pytest.approx(100.0)


def test_paced_points_run_what_fits_the_judged_points_length_within_the_closed_loops_runs() -> None:
    def runs(max_per_s: float | None) -> int:
        return paced_runs(max_per_s, threads=32, steps=20, runs=3, judged_s=20.0, fraction=0.5)

    assert runs(450.0) == 3  # 7 would fit: no more than the closed loop's
    assert runs(130.0) == 2  # 2 x 640 steps at 65/s: 19.7 s
    assert runs(30.0) == 1  # even one run is longer: one all the same
    assert runs(None) == 1


def test_phase_cpu_adds_the_flusher_and_leaves_the_proxy_out_of_the_total() -> None:
    before = {"harness": 1.0, "postgres": 2.0, "proxy": 0.5, "total": 3.5, "machine_busy": 10.0}
    after = {"harness": 3.0, "postgres": 3.0, "proxy": 1.5, "total": 7.5, "machine_busy": 16.0}
    cpu = phase_cpu(before, after, 1000, flusher_s=0.5, outside_total=("proxy",))
    assert cpu["seconds"]["total"] == pytest.approx(3.5)  # 2 + 1 + 0.5 flusher, no proxy
    assert cpu["seconds"]["proxy"] == pytest.approx(1.0)
    assert cpu["seconds"]["other_processes"] == pytest.approx(1.5)  # 6 busy - 4 - 0.5
    assert cpu["ms_per_step"]["total"] == pytest.approx(3.5)
    assert cpu["ms_per_step"]["flusher"] == pytest.approx(0.5)
    assert phase_cpu(before, after, 0)["ms_per_step"]["total"] is None
    before[IN_GC + "harness"], after[IN_GC + "harness"] = 0.1, 0.35
    cpu = phase_cpu(before, after, 1000, flusher_s=0.5, outside_total=("proxy",))
    assert cpu["gc_ms_per_step"] == {"harness": pytest.approx(0.25)}
    assert cpu["seconds"]["total"] == pytest.approx(3.5)  # within the graphs' CPU


def lg_phase(
    kind: str,
    phase: str,
    *,
    p50: float = 1.0,
    p99: float = 5.0,
    cpu: float = 3.0,
    rate: float = 100.0,
    drain: float | None = None,
    flat: bool | None = None,
    write_s: float = 20.0,
) -> dict[str, Any]:
    return {
        "kind": kind,
        "phase": phase,
        "closed_loop": phase == "max",
        "offered_per_s": None if phase == "max" else rate,
        "throughput_per_s": rate,
        "steps": round(rate * write_s),
        "write_seconds": write_s,
        "latency_ms": {"p50": p50, "p99": p99},
        "cpu": {"ms_per_step": {"total": cpu}},
        "pg": {"transactions_per_step": 2.0 if kind == "direct" else 0.1},
        "flush": {"drain_s": drain, "backlog_flat": flat, "backlog_trend_per_s": 0.0},
    }


def lg_phases(**buffered: Any) -> dict[str, dict[str, Any]]:
    """Closed loop and the 50% point: floor 0.8 ms p50, with one publish 1.1 ms;
    AsyncPostgresSaver 4 / 20 ms, 3 ms of CPU, 150 steps/s closed loop; the buffered side
    as given."""
    closed = {
        "floor_max": lg_phase("floor", "max", rate=900.0),
        "direct_max": lg_phase("direct", "max", rate=150.0),
        "buffered_max": lg_phase(
            "buffered",
            "max",
            rate=buffered.pop("rate", 500.0),
            drain=buffered.pop("drain", 0.4),
            flat=buffered.pop("flat", True),
            write_s=buffered.pop("write_s", 20.0),
        ),
    }
    return {
        **closed,
        "floor_50": lg_phase("floor", "50", p50=0.8, p99=3.0, cpu=1.0),
        "onetrip_50": lg_phase("onetrip", "50", p50=1.1, p99=4.0, cpu=1.5),
        "direct_50": lg_phase("direct", "50", p50=4.0, p99=20.0, cpu=3.0),
        "buffered_50": lg_phase("buffered", "50", **buffered),
    }


def test_langgraph_loopback_targets_judge_p50_against_the_floor_p99_and_cpu_against_direct() -> (
    None
):
    judged = judge(lg_phases(p50=1.2, p99=18.0, cpu=2.9), delay_ms=0.0)
    verdicts = {t["id"]: t["met"] for t in judged}
    assert verdicts == {
        "lg_p50": True,
        "lg_p50_own": None,
        "lg_p99": True,
        "lg_cpu": True,
        "lg_pg_tx": None,
        "lg_rate": None,
    }
    p50 = judged[0]
    assert p50["ratio"] == pytest.approx(4.0 / 1.2)  # AsyncPostgresSaver's p50 over buffered
    assert "+0.40 ms; limit +0.5 ms" in p50["measured"]

    missed = judge(lg_phases(p50=1.31, p99=20.5, cpu=3.1), delay_ms=0.0)
    assert {t["id"]: t["met"] for t in missed if t["met"] is not None} == {
        "lg_p50": False,
        "lg_p99": False,
        "lg_cpu": False,
    }


def test_the_one_publish_side_splits_the_p50_margin_into_the_round_trip_and_the_saver() -> None:
    phases = lg_phases(p50=1.25)
    phases["onetrip_50"]["cpu"]["runqueue_wait_seconds"] = {"harness": 0.2}
    phases["buffered_50"]["cpu"]["runqueue_wait_seconds"] = {"harness": 0.4}
    phases["floor_50"]["cpu"]["runqueue_wait_seconds"] = {"harness": 0.02}
    judged = {t["id"]: t for t in judge(phases, delay_ms=0.0)}
    margin = judged["lg_p50"]["measured"]
    assert "+0.45 ms; limit +0.5 ms" in margin
    assert "after one JetStream publish, in the same graphs: p50 1.10 ms (+0.30 ms)" in margin
    assert "0.20 ms per step (InMemorySaver's 0.01 ms, with one publish 0.10 ms)" in margin
    own = judged["lg_p50_own"]
    assert own["met"] is None  # reported: the judged limit is the one over InMemorySaver
    assert own["ratio"] == pytest.approx(1.25 / 1.1)
    assert "(+0.15 ms: the buffered saver's own code" in own["measured"]
    assert "that round trip over InMemorySaver +0.30 ms" in own["measured"]

    # A results folder from before the fourth side: judged as it was, nothing invented.
    del phases["onetrip_50"]
    older = {t["id"]: t for t in judge(phases, delay_ms=0.0)}
    assert "lg_p50_own" not in older
    assert "one JetStream publish, in the same graphs" not in older["lg_p50"]["measured"]
    assert "with one publish" not in older["lg_p50"]["measured"]


def test_the_one_publish_side_answers_a_checkpoint_only_once_its_publish_returned() -> None:
    from langgraph.checkpoint.base import empty_checkpoint

    from buffered_store.engine.keys import encode_token

    async def scenario() -> None:
        sent: list[tuple[str, bytes]] = []
        ack: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def publish(subject: str, payload: bytes) -> int:
            sent.append((subject, payload))
            return await ack

        saver = OnePublishSaver(publish, "ONETRIP_50_x")
        config: Any = {"configurable": {"thread_id": "lg-50-0001", "checkpoint_ns": ""}}
        checkpoint = empty_checkpoint()
        put = asyncio.ensure_future(
            saver.aput(config, checkpoint, {"source": "loop", "step": 1}, {})
        )
        for _ in range(5):
            await asyncio.sleep(0)
        assert not put.done()  # stored, but not answered before the publish returns
        assert saver.publishes == 0
        ack.set_result(7)
        stored = await put
        assert stored["configurable"]["checkpoint_id"] == checkpoint["id"]
        (_, body), (_, meta), _ = saver.storage["lg-50-0001"][""][checkpoint["id"]]
        # One publish, of what InMemorySaver stored, on the thread's own subject.
        assert sent == [(f"ONETRIP_50_x.{encode_token('lg-50-0001')}", body + meta)]
        assert (saver.publishes, saver.published_bytes) == (1, len(body + meta))

    asyncio.run(scenario())
    assert stream_seq(b'{"stream":"ONETRIP_50_x","seq":42}') == 42
    with pytest.raises(RuntimeError, match="maximum bytes exceeded"):
        stream_seq(
            b'{"error":{"code":400,"err_code":10054,"description":"maximum bytes exceeded"}}'
        )


def test_langgraph_remote_targets_need_the_flusher_to_keep_up_for_the_rate() -> None:
    judged = judge(lg_phases(p50=1.1, p99=9.0), delay_ms=2.0)
    verdicts = {t["id"]: t["met"] for t in judged}
    assert verdicts == {
        "lg_p50": True,
        "lg_p50_own": None,
        "lg_remote_p99": True,
        "lg_remote_rate": True,
        "lg_pg_tx": None,
    }
    assert all("+2 ms link" in t["figure"] for t in judged)
    floor = {"floor_bytes": 3000.0, "floor_gap_ms": 13.33, "floor_wall_p50_us": 812.4}
    with_floor = {t["id"]: t for t in judge(lg_phases(), delay_ms=2.0, round_trip=floor)}
    assert (
        "one bare JetStream publish of 3,000 bytes from idle at this pace (13.33 ms apart): "
        "p50 0.81 ms" in with_floor["lg_p50"]["measured"]
    )

    assert "waited for a core" not in with_floor["lg_p50"]["measured"]
    assert "waiting for a core" not in with_floor["lg_p50"]["measured"]
    waited = {
        t["id"]: t
        for t in judge(lg_phases(), delay_ms=2.0, round_trip={**floor, "floor_wait_us": 215.0})
    }
    assert (
        "p50 0.81 ms (waiting for a core 0.21 ms, mean), on its own" in waited["lg_p50"]["measured"]
    )

    # Each side's run-queue wait of the graphs' process, per step (2,000 steps a phase).
    waits = lg_phases()
    waits["buffered_50"]["cpu"]["runqueue_wait_seconds"] = {"harness": 0.6, "postgres": 9.0}
    waits["floor_50"]["cpu"]["runqueue_wait_seconds"] = {"harness": 0.05}
    p50_waits = judge(waits, delay_ms=0.0)[0]["measured"]
    assert (
        "the graphs' process waited for a core 0.30 ms per step (InMemorySaver's 0.03 ms)"
        in p50_waits
    )

    slow_drain = {t["id"]: t for t in judge(lg_phases(drain=2.5), delay_ms=2.0)}
    assert slow_drain["lg_remote_rate"]["ratio"] == pytest.approx(10_000 / 22.5 / 150)
    assert slow_drain["lg_remote_rate"]["met"] is False
    # A short closed loop: written at 3.3x, but durable (to the last step in Postgres,
    # the drain included) only 1000 steps / 3.5 s = 1.9x; no trend could be judged.
    short = judge(lg_phases(write_s=2.0, drain=1.5, flat=None), delay_ms=2.0)
    rate = next(t for t in short if t["id"] == "lg_remote_rate")
    assert rate["ratio"] == pytest.approx(1000 / 3.5 / 150)
    assert rate["met"] is False
    assert "trend not judged" in rate["measured"]
    quick = judge(lg_phases(rate=600.0, write_s=2.0, drain=0.3, flat=None), delay_ms=2.0)
    assert next(t for t in quick if t["id"] == "lg_remote_rate")["met"] is True
    growing = {t["id"]: t["met"] for t in judge(lg_phases(flat=False), delay_ms=2.0)}
    assert growing["lg_remote_rate"] is False
    too_slow = {t["id"]: t["met"] for t in judge(lg_phases(rate=400.0, p99=11.0), delay_ms=2.0)}
    assert too_slow["lg_remote_rate"] is False
    assert too_slow["lg_remote_p99"] is False  # 20 / 11 < 2


def test_the_correctness_check_compares_every_side_with_asyncpostgressaver() -> None:
    expected = {"lg-max-0000": 44, "lg-50-0000": 22}
    same = {"lg-max-0000": (44, 42), "lg-50-0000": (22, 21)}
    check = compare({"direct": same, "buffered": dict(same), "floor": dict(same)}, expected)
    assert check["ok"], check["summary"]
    assert check["checkpoints"] == {"direct": 66, "buffered": 66, "floor": 66}

    lost = {**same, "lg-50-0000": (21, 20)}
    check = compare({"direct": same, "buffered": lost, "floor": dict(same)}, expected)
    assert not check["ok"]
    assert check["threads_differing"] == {"buffered": ["lg-50-0000"], "floor": []}
    assert check["threads_not_as_expected"]["buffered"] == ["lg-50-0000"]


def test_the_report_gives_the_machines_speed_at_both_ends_of_the_run() -> None:
    line = speed_line(
        {
            "at_start": {"python_loop_s": 0.142, "wake_cpu_us": 88.9},
            "at_end": {"python_loop_s": 0.48, "wake_cpu_us": 197.8},
        }
    )
    assert "took 0.142 s at the start, 0.480 s at the end" in line
    assert "cost 89 and 198 µs of CPU" in line
    assert speed_line(None) == "Machine speed: not measured (a run older than the probe)."


def test_the_summary_counts_its_figures_not_its_header() -> None:
    targets = [
        {"figure": f"f{i}", "target": "t", "measured": "m", "ratio": 1.0, "met": met}
        for i, met in enumerate([True, True, False, None, True])
    ]
    # The table's header ends in "met": a count of lines holding "| met |" is one too many.
    table = targets_table(targets)
    assert table.count("| met |") == 4
    assert target_counts(targets) == (
        "5 figures, 4 judged: 3 met, 1 missed (1 reported without a target)."
    )
    assert (
        target_counts([]) == "0 figures, 0 judged: 0 met, 0 missed (0 reported without a target)."
    )


def test_cpu_deltas_keep_each_processs_wait_for_a_core_apart_from_its_cpu() -> None:
    before = {"harness": 1.0, "nats_server": 0.5, "total": 1.5, "machine_busy": 10.0}
    after = {"harness": 3.0, "nats_server": 1.5, "total": 4.5, "machine_busy": 13.5}
    before[WAITED + "harness"] = 0.25
    after[WAITED + "harness"] = 0.75
    after[WAITED + "nats_server"] = 0.5  # first seen at the end: no wait counted
    cpu = cpu_delta(before, after, 1000)
    assert cpu["seconds"] == {
        "harness": 2.0,
        "nats_server": 1.0,
        "total": 3.0,
        "other_processes": 0.5,
    }
    assert cpu["runqueue_wait_seconds"] == {"harness": 0.5, "nats_server": 0.0}
    assert cpu["seconds_per_1k_checkpoints"]["harness"] == 2.0


def test_the_flusher_reports_cpu_in_every_figure_per_checkpoint() -> None:
    """Its own report joins the total and leaves the machine's other processes, per
    1,000 checkpoints too (those figures were once left as they were before it)."""
    before = {"harness": 1.0, "total": 1.0, "machine_busy": 5.0}
    after = {"harness": 3.0, "total": 3.0, "machine_busy": 8.5}
    cpu = cpu_delta(before, after, 500)
    add_flusher_cpu(cpu, 1.25, 500)
    assert cpu["seconds"] == {
        "harness": 2.0,
        "total": 3.25,
        "other_processes": 0.25,
        "flusher": 1.25,
    }
    assert cpu["seconds_per_1k_checkpoints"] == {
        "harness": 4.0,
        "total": 6.5,
        "other_processes": 0.5,
        "flusher": 2.5,
    }


@pytest.mark.skipif(not Path("/proc/self/schedstat").exists(), reason="Linux schedstat only")
def test_two_busy_processes_on_one_core_each_wait_for_it() -> None:
    import subprocess
    import sys

    busy = "import time\nend = time.process_time() + 0.4\nwhile time.process_time() < end: pass"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{0}})\n{busy}"]
        )
        for _ in range(2)
    ]
    waits: list[float] = []
    while any(p.poll() is None for p in procs):
        waits = [runqueue_wait_s(p.pid) or 0.0 for p in procs]
        time.sleep(0.05)
    # Each needed 0.4 s of one core that the other wanted too: while one ran, the
    # other waited (most of the time, for the ~0.4 s they overlapped).
    assert max(waits) > 0.1
    assert runqueue_wait_s(os.getpid()) is not None
    assert runqueue_wait_s(2**22 + 12345) is None


def test_cpu_deltas_report_the_harnesss_garbage_collection_apart_from_the_total() -> None:
    before = {"harness": 1.0, "total": 1.0, "machine_busy": 5.0, IN_GC + "harness": 0.2}
    after = {"harness": 3.0, "total": 3.0, "machine_busy": 7.5, IN_GC + "harness": 0.7}
    cpu = cpu_delta(before, after, 500)
    # Part of the harness's CPU, so neither a process of its own nor added to the total.
    assert cpu["seconds"] == {"harness": 2.0, "total": 2.0, "other_processes": 0.5}
    assert cpu["gc_seconds"] == {"harness": 0.5}
    assert cpu["gc_seconds_per_1k_checkpoints"] == {"harness": 1.0}


def test_the_cpu_meter_times_this_processs_collections_under_its_own_name() -> None:
    import gc

    meter = CpuMeter({"harness": os.getpid, "elsewhere": lambda: None})
    before = meter.sample()
    garbage = []
    for _ in range(20_000):
        cycle: list[object] = []
        cycle.append(cycle)  # reclaimable only by the collector
        garbage.append(cycle)
    del garbage, cycle
    assert gc.collect() > 0
    after = meter.sample()
    assert IN_GC + "elsewhere" not in after
    assert after[IN_GC + "harness"] > before[IN_GC + "harness"]
    assert IN_GC + "harness" not in cpu_delta(before, after, 1)["seconds"]


async def test_a_run_records_the_commit_its_code_came_from_not_the_one_at_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long run's tree can get a commit while it goes on: results.json names the
    commit and tree state taken when the run started (the services and the report are
    stubbed; what is tested is `execute`'s bookkeeping)."""
    if TYPE_CHECKING:
        from benchmarks import cli, report
        from benchmarks.scenarios import Outcome
    else:
        from buffered_store.benchmarks import cli, report
        from buffered_store.benchmarks.scenarios import Outcome
    head = {"git_commit": "before", "git_dirty": False}

    async def run(bench: Bench) -> Outcome:
        head.update(git_commit="after", git_dirty=True)  # committed during the run
        return Outcome(sides={}, targets=[], parameters={})

    @contextlib.asynccontextmanager
    async def running(self: Bench) -> Any:
        yield self

    async def no_settings(self: Bench) -> dict[str, str]:
        return {}

    async def no_server(url: str) -> None:
        return None

    async def quick_speed() -> dict[str, float]:
        return {"python_loop_s": 0.07, "wake_cpu_us": 40.0}

    written: list[dict[str, Any]] = []
    monkeypatch.setattr(cli, "load", lambda name: ("a scenario", run))
    monkeypatch.setattr(cli, "versions", lambda: dict(head))
    monkeypatch.setattr(cli, "speed", quick_speed)
    monkeypatch.setattr(cli, "_nats_version", no_server)
    monkeypatch.setattr(cli, "nats_server_version", lambda: None)
    monkeypatch.setattr(Bench, "running", running)
    monkeypatch.setattr(Bench, "pg_settings", no_settings)
    monkeypatch.setattr(Bench, "nats_url", property(lambda self: "nats://127.0.0.1:1"))
    monkeypatch.setattr(report, "write_all", lambda result, *rest: written.append(result))
    await cli.execute("force-flush", Options(output=tmp_path))
    assert written[0]["versions"] == {"git_commit": "before", "git_dirty": False}


@contextlib.contextmanager
def _parent_with_a_grandchild() -> Any:
    """A process whose child runs a child of its own, which has used about 0.2 s of CPU
    by the time this yields (parent pid, grandchild pid); each ends when its input does."""
    import subprocess
    import sys

    def spawning(inner: str, report: str) -> str:
        return (
            "import subprocess, sys\n"
            f"kid = subprocess.Popen([sys.executable, '-c', {inner!r}], "
            "stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)\n"
            f"print({report}, flush=True)\n"
            "sys.stdin.read()\n"
            "kid.stdin.close()\n"
            "kid.wait()\n"
        )

    grandchild = (
        "import os, sys; sum(i * i for i in range(3_000_000)); "
        "print(os.getpid(), flush=True); sys.stdin.read()"
    )
    child = spawning(grandchild, "kid.stdout.readline().strip()")
    parent = subprocess.Popen(
        [sys.executable, "-c", spawning(child, "kid.stdout.readline().strip()")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None
        yield parent.pid, int(parent.stdout.readline())
    finally:
        assert parent.stdin is not None
        parent.stdin.close()  # each closes its child's input and waits for it
        parent.wait(timeout=10)


def test_descendants_are_every_live_child_and_grandchild_the_process_scan_finds() -> None:
    import psutil

    with _parent_with_a_grandchild() as (parent, grandchild):
        found = descendants(parent)
        scanned = [c.pid for c in psutil.Process(parent).children(recursive=True)]
        assert grandchild in found
        assert sorted(found) == sorted(scanned)
        assert len(found) == 2  # the child and its child
    assert descendants(2**22 + 12345) == []


def test_descendants_fall_back_to_the_process_scan_where_the_kernel_lists_no_children(
    tmp_path: Path,
) -> None:
    with _parent_with_a_grandchild() as (parent, grandchild):
        # A /proc whose task folders hold no `children` file (a kernel built without it).
        (tmp_path / str(parent) / "task" / str(parent)).mkdir(parents=True)
        found = descendants(parent, proc=str(tmp_path))
        assert grandchild in found
        assert len(found) == 2


def test_process_cpu_counts_the_descendants_it_is_given_and_finds_them_otherwise() -> None:
    with _parent_with_a_grandchild() as (parent, grandchild):
        own = process_cpu(grandchild, children=False)
        alone = process_cpu(parent, children=True, kids=[])
        with_kids = process_cpu(parent, children=True)
        given = process_cpu(parent, children=True, kids=descendants(parent))
        assert alone is not None
        assert with_kids is not None
        assert given is not None
        # The grandchild's CPU (its loop, now asleep) counts only where the descendants do
        # (a clock tick of slack: psutil reads them in ticks).
        assert own is not None
        assert own >= 0.05
        assert with_kids >= alone + own - 0.011
        assert given >= alone + own - 0.011
        waited_alone = runqueue_wait_s(parent, children=True, kids=[])
        waited = runqueue_wait_s(parent, children=True)
        assert waited_alone is not None
        assert waited is not None
        assert waited >= waited_alone
