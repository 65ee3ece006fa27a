"""The dependency-free histogram behind the latency and lag stats."""

from __future__ import annotations

import math
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from buffered_store.metrics_core import (
    CHECKPOINT_BUCKETS_S,
    FLUSH_DURATION_BUCKETS_S,
    LAG_BUCKETS_S,
    Histogram,
    HistogramSnapshot,
)


def test_values_land_in_the_first_bucket_whose_bound_is_not_below_them() -> None:
    h = Histogram([1.0, 2.0, 5.0])
    for value in (0.0, 1.0, 1.5, 2.0, 4.9, 5.0, 5.1, 100.0, -1.0):
        h.observe(value)
    snap = h.snapshot()
    assert snap.counts == (3, 2, 2, 2)  # (<=1: 0, 1, -1) (<=2: 1.5, 2) (<=5: 4.9, 5) (>5)
    assert snap.count == 9
    assert snap.sum == pytest.approx(0 + 1 + 1.5 + 2 + 4.9 + 5 + 5.1 + 100 - 1)


def test_cumulative_series_ends_with_inf_and_the_total() -> None:
    h = Histogram([0.1, 1.0])
    for value in (0.05, 0.5, 0.5, 3.0):
        h.observe(value)
    assert h.snapshot().cumulative() == [(0.1, 1), (1.0, 3), (math.inf, 4)]


def test_non_finite_values_are_ignored() -> None:
    h = Histogram([1.0])
    h.observe(math.nan)
    h.observe(math.inf)
    h.observe(-math.inf)
    assert h.snapshot().count == 0
    assert h.snapshot().sum == 0.0


def test_snapshot_is_a_copy() -> None:
    h = Histogram([1.0])
    before = h.snapshot()
    h.observe(0.5)
    assert before.count == 0
    assert h.snapshot().count == 1


@pytest.mark.parametrize(
    "bounds",
    [[], [1.0, 1.0], [2.0, 1.0], [1.0, math.inf], [math.nan]],
)
def test_bad_bounds_are_rejected(bounds: list[float]) -> None:
    with pytest.raises(ValueError, match="bound"):
        Histogram(bounds)


def test_quantiles_interpolate_inside_buckets() -> None:
    h = Histogram([1.0, 2.0, 4.0])
    for _ in range(50):
        h.observe(0.5)
    for _ in range(50):
        h.observe(3.0)
    snap = h.snapshot()
    assert snap.quantile(0.5) == pytest.approx(1.0)
    assert snap.quantile(0.75) == pytest.approx(3.0)  # halfway through (2, 4]
    assert snap.quantile(1.0) == pytest.approx(4.0)
    assert snap.quantile(0.0) == pytest.approx(0.0)
    assert snap.mean == pytest.approx(1.75)


def test_quantile_of_overflow_reports_the_largest_bound() -> None:
    h = Histogram([1.0])
    h.observe(50.0)
    assert h.snapshot().quantile(0.99) == 1.0


def test_quantile_of_empty_histogram_is_zero_and_q_is_checked() -> None:
    snap = Histogram([1.0]).snapshot()
    assert snap.quantile(0.5) == 0.0
    assert snap.mean == 0.0
    with pytest.raises(ValueError, match="quantile"):
        snap.quantile(1.5)


def test_merge_adds_counts_and_sums() -> None:
    a, b = Histogram([1.0, 2.0]), Histogram([1.0, 2.0])
    a.observe(0.5)
    b.observe(1.5)
    b.observe(9.0)
    merged = a.snapshot().merge(b.snapshot())
    assert merged == HistogramSnapshot((1.0, 2.0), (1, 1, 1), 11.0)
    with pytest.raises(ValueError, match="different buckets"):
        merged.merge(Histogram([1.0]).snapshot())


@pytest.mark.parametrize("bounds", [CHECKPOINT_BUCKETS_S, FLUSH_DURATION_BUCKETS_S, LAG_BUCKETS_S])
def test_shipped_bucket_sets_are_valid(bounds: tuple[float, ...]) -> None:
    assert Histogram(bounds).bounds == bounds


# -- the Prometheus exporter over these stats ------------------------------------------------


class FakeSource:
    def __init__(self, stats: dict[str, float], histograms: dict[str, HistogramSnapshot]) -> None:
        self._stats = stats
        self._histograms = histograms

    def stats(self) -> dict[str, float]:
        return self._stats

    def histograms(self) -> dict[str, HistogramSnapshot]:
        return self._histograms


class Broken:
    def stats(self) -> dict[str, float]:
        raise RuntimeError("closed")


def lag(*values: float) -> HistogramSnapshot:
    h = Histogram(LAG_BUCKETS_S)
    for value in values:
        h.observe(value)
    return h.snapshot()


def flusher_source(**stats: float) -> FakeSource:
    return FakeSource({"cycles": 1, **stats}, {"flush_lag_seconds": lag(0.2, 0.3)})


def test_sources_of_one_kind_are_combined() -> None:
    from buffered_store.metrics import collect_families

    families = {
        f.name: f
        for f in collect_families(
            [
                flusher_source(entries=3, backlog=7, held=2),
                flusher_source(entries=4, backlog=9, held=1),
                FakeSource({"checkpoints_ok": 5, "checkpoints_invalid": 1}, {}),
                Broken(),
                object(),
            ]
        )
    }
    threadrun = (("front_end", "threadrun"),)  # sources that name no front-end
    assert families["bufstore_flusher_entries"].samples == {threadrun: 7.0}
    assert families["bufstore_flusher_batches"].samples == {threadrun: 2.0}
    assert families["bufstore_flusher_backlog_messages"].samples == {threadrun: 9.0}  # max
    assert families["bufstore_flusher_held_messages"].samples == {threadrun: 3.0}  # sum
    histogram = families["bufstore_flusher_flush_lag_seconds"].histogram
    assert histogram is not None
    assert histogram.count == 4
    checkpoints = families["bufstore_store_checkpoints"].samples
    assert checkpoints[(("result", "ok"), *threadrun)] == 5.0
    assert checkpoints[(("result", "invalid"), *threadrun)] == 1.0
    assert checkpoints[(("result", "error"), *threadrun)] == 0.0  # missing keys read 0
    assert not any(name.startswith("bufstore_inner") for name in families)


def test_scrape_serves_only_known_names_without_thread_labels() -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from buffered_store.metrics import StatsCollector, metric_names

    collector = StatsCollector([flusher_source(entries=3)])
    collector.add(FakeSource({"checkpoints_ok": 1}, {}))
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    assert {s.name for s in samples} <= metric_names()
    assert {label for s in samples for label in s.labels} <= {"result", "stage", "le", "front_end"}
    by_name = {(s.name, s.labels.get("le")): s.value for s in samples}
    assert by_name[("bufstore_flusher_entries_total", None)] == 3.0
    assert by_name[("bufstore_flusher_flush_lag_seconds_count", None)] == 2.0
    assert by_name[("bufstore_flusher_flush_lag_seconds_bucket", "0.25")] == 1.0
    assert by_name[("bufstore_flusher_flush_lag_seconds_bucket", "+Inf")] == 2.0


def test_serve_metrics_over_http() -> None:
    from urllib.request import urlopen

    from buffered_store.metrics import StatsCollector, serve_metrics

    server = serve_metrics(0, StatsCollector([flusher_source()]), addr="127.0.0.1")
    try:
        with urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as response:
            body = response.read().decode()
    finally:
        server.close()
    assert 'bufstore_flusher_batches_total{front_end="threadrun"} 1.0' in body
    assert "process_cpu_seconds_total" in body or sys.platform != "linux"


def test_exported_keys_exist_in_the_real_stats() -> None:
    """Every series the exporter maps must be a key the objects really report."""

    from sqlalchemy.ext.asyncio import create_async_engine

    from buffered_store.config import BufferedStoreConfig
    from buffered_store.metrics import FLUSHER, INNER, STORE
    from buffered_store.stores.memory import InMemoryThreadRunStore
    from buffered_store.stores.postgres import PostgresThreadRunStore
    from buffered_store.threadrun.store import BufferedThreadRunStore
    from flusher.stats import FlusherStats

    memory = InMemoryThreadRunStore()
    wal: Any = SimpleNamespace(max_payload=1024 * 1024, requests=0)
    store = BufferedThreadRunStore(memory, memory, wal, BufferedStoreConfig())
    flusher_stats = {**FlusherStats().as_dict(), "running": 0}
    engine = create_async_engine("postgresql+psycopg://nobody@127.0.0.1:1/none")
    postgres = PostgresThreadRunStore(engine)
    for family, stats, histograms in (
        (STORE, store.stats(), store.histograms()),
        (FLUSHER, flusher_stats, FlusherStats().histograms()),
        (INNER, postgres.stats(), {}),
    ):
        for series in family.series:
            found = histograms if series.kind == "histogram" else stats
            assert series.key in found, (family.name, series.key)


def test_every_sample_carries_its_front_end_and_front_ends_are_not_added_up() -> None:
    """Issue 24: the thread-run store's and the LangGraph checkpointer's flushers in one
    process (or one dashboard) stay apart, histograms included; the LangGraph sink
    exports the inner-store metrics under the thread-run store's names."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from buffered_store.langgraph.sink import SinkMetrics
    from buffered_store.metrics import StatsCollector

    langgraph = flusher_source(entries=4)
    langgraph.front_end = "langgraph"  # type: ignore[attr-defined]
    sink: Any = SimpleNamespace(
        transactions=3,
        stats={"statements": 9, "round_trips": 6, "conflict_retries": 1},
        outcomes={"apply_calls": 3, "thread_applications": 5, "applied_entries": 7},
    )
    collector = StatsCollector([flusher_source(entries=3), langgraph, SinkMetrics(sink)])
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    samples = {
        (s.name, s.labels.get("front_end"), s.labels.get("outcome"), s.labels.get("le")): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert samples[("bufstore_flusher_entries_total", "threadrun", None, None)] == 3.0
    assert samples[("bufstore_flusher_entries_total", "langgraph", None, None)] == 4.0
    assert samples[("bufstore_flusher_flush_lag_seconds_count", "langgraph", None, None)] == 2.0
    assert samples[("bufstore_inner_transactions_total", "langgraph", None, None)] == 3.0
    assert samples[("bufstore_inner_round_trips_total", "langgraph", None, None)] == 6.0
    assert samples[("bufstore_inner_apply_outcomes_total", "langgraph", "applied", None)] == 5.0
    assert samples[("bufstore_inner_applied_entries_total", "langgraph", None, None)] == 7.0
    assert not any(k[0].startswith("bufstore_inner") and k[1] == "threadrun" for k in samples)
