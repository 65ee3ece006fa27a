"""Prometheus exporter: reads `stats()` and `histograms()` of the buffered store, the
flusher and the inner store (Postgres or in-memory) at scrape time (the ``metrics``
extra: ``prometheus-client``).

The objects keep plain counters with no metrics dependency; `StatsCollector` turns them
into metric families with the ``bufstore_`` prefix when Prometheus scrapes. Nothing is
labelled per thread (unbounded cardinality); checkpoints and apply outcomes carry one
small label each, and every sample carries ``front_end`` (``threadrun``, ``langgraph``:
a source's ``front_end`` attribute, ``threadrun`` when it has none), so the thread-run
store's and the LangGraph checkpointer's flushers are told apart on one dashboard.
Several sources of one kind and front-end in a process are added up (counters,
histograms, ``sum`` gauges) or maxed (``max`` gauges: lags and the consumer backlog,
which every flusher of a consumer sees alike).

Serve it on its own port (`serve_metrics`, what ``bufstore flusher --metrics-port``
does), or mount it in an application's registry::

    from prometheus_client import REGISTRY
    REGISTRY.register(StatsCollector([store, flusher, inner]))

`prometheus_client` is imported lazily, so this module imports without the extra and
the pure part (`collect_families`) needs no dependency at all.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from buffered_store.errors import ConfigError
from buffered_store.metrics_core import HistogramSnapshot

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import CollectorRegistry

__all__ = [
    "FAMILIES",
    "MetricsServer",
    "StatsCollector",
    "StatsSource",
    "collect_families",
    "metric_names",
    "serve_metrics",
]

log = logging.getLogger("buffered_store.metrics")

Kind = Literal["counter", "gauge", "histogram"]


class StatsSource(Protocol):
    """What the collector reads: `stats()`, and optionally `histograms()`."""

    def stats(self) -> Mapping[str, float]: ...


# -- what is exported ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Series:
    """One stats key exported as a sample of a metric."""

    key: str
    """Key in `stats()` (or in `histograms()` for a histogram)."""
    metric: str
    """Metric name after the prefix, without ``_total``."""
    kind: Kind
    help: str
    labels: tuple[tuple[str, str], ...] = ()
    reduce: Literal["sum", "max"] = "sum"
    """How several sources of one kind are combined (gauges; counters always add up)."""


@dataclass(frozen=True, slots=True)
class Family:
    """The metrics of one kind of source, recognised by a key of its `stats()`."""

    name: str
    marker: str
    series: tuple[Series, ...]


def _c(key: str, metric: str, help_: str, **labels: str) -> Series:
    return Series(key, metric, "counter", help_, tuple(labels.items()))


def _g(key: str, metric: str, help_: str, reduce: Literal["sum", "max"] = "max") -> Series:
    return Series(key, metric, "gauge", help_, reduce=reduce)


def _h(key: str, metric: str, help_: str) -> Series:
    return Series(key, metric, "histogram", help_)


_CHECKPOINTS = "Checkpoint calls of the buffered store, by result."

STORE = Family(
    "store",
    marker="checkpoints_ok",
    series=(
        _c("checkpoints_ok", "store_checkpoints", _CHECKPOINTS, result="ok"),
        _c("checkpoints_invalid", "store_checkpoints", _CHECKPOINTS, result="invalid"),
        _c("checkpoints_unavailable", "store_checkpoints", _CHECKPOINTS, result="unavailable"),
        _c("checkpoints_wal_full", "store_checkpoints", _CHECKPOINTS, result="wal_full"),
        _c(
            "checkpoints_commit_unknown",
            "store_checkpoints",
            _CHECKPOINTS,
            result="commit_unknown",
        ),
        _c("checkpoints_cancelled", "store_checkpoints", _CHECKPOINTS, result="cancelled"),
        _c("checkpoints_error", "store_checkpoints", _CHECKPOINTS, result="error"),
        _c(
            "commit_unknown",
            "store_commit_unknown",
            "Writes (checkpoints and deletes) whose WAL outcome the caller could not learn.",
        ),
        _c("deletes", "store_deletes", "Threads deleted through the buffered store."),
        _c(
            "cas_conflicts",
            "store_cas_conflicts",
            "WAL appends that lost the per-thread compare-and-set to another writer.",
        ),
        _c("wal_bytes", "store_wal_bytes", "Bytes of WAL entries appended."),
        _c("nats_requests", "store_nats_requests", "NATS round trips of the store."),
        _c(
            "hot_updates",
            "store_hot_updates",
            "Hot records advanced in the background (hot_linger_s).",
        ),
        _c(
            "hot_updates_coalesced",
            "store_hot_updates_coalesced",
            "Checkpoints whose background hot record was superseded before it was written.",
        ),
        _h(
            "checkpoint_duration_seconds",
            "store_checkpoint_duration_seconds",
            "Latency of successful checkpoint calls.",
        ),
    ),
)

FLUSHER = Family(
    "flusher",
    marker="cycles",
    series=(
        _c("cycles", "flusher_batches", "Flush cycles (collection windows with messages)."),
        _c("fetched", "flusher_fetched_messages", "WAL messages received from the consumer."),
        _c("messages", "flusher_messages", "WAL messages taken by cycles, redeliveries included."),
        _c("entries", "flusher_entries", "Fetched messages that decoded into entries."),
        _c("redeliveries", "flusher_redeliveries", "Fetched messages delivered more than once."),
        _c("transactions", "flusher_transactions", "Apply transactions (retries included)."),
        _c("threads_applied", "flusher_threads_applied", "Per-thread batches applied."),
        _c("entries_applied", "flusher_entries_applied", "Entries applied to the database."),
        _c(
            "coalesced_entries",
            "flusher_coalesced_entries",
            "Entries applied without a write of their own (coalesced with a later one).",
        ),
        _c("stale_entries", "flusher_stale_entries", "Entries found flushed already."),
        _c("acked", "flusher_acks", "WAL messages acknowledged."),
        _c("naked", "flusher_naks", "WAL messages given back for redelivery."),
        _c("gaps", "flusher_gaps", "Gaps filled by fetching earlier entries from the stream."),
        _c("entries_fetched", "flusher_entries_fetched", "Entries read back to fill gaps."),
        _c("apply_failures", "flusher_apply_failures", "Thread batches the database rejected."),
        _c(
            "applied_with_owner",
            "flusher_applied_with_owner",
            "Refused batches applied with the unflushed entries of their run's owner.",
        ),
        _c("db_retries", "flusher_db_retries", "Apply attempts retried: database unreachable."),
        _c(
            "db_retry_episodes",
            "flusher_db_retry_episodes",
            "Periods during which the database was unreachable.",
        ),
        _c(
            "apply_timeouts",
            "flusher_apply_timeouts",
            "Apply transactions abandoned after apply_timeout_s.",
        ),
        _c(
            "quarantined_messages",
            "flusher_quarantined_messages",
            "WAL messages moved to quarantine.",
        ),
        _c("quarantined_threads", "flusher_quarantined_threads", "Threads quarantined."),
        _c(
            "dropped_unrecorded",
            "flusher_dropped_unrecorded",
            "Undecodable messages dropped without a quarantine record.",
        ),
        _c("nats_errors", "flusher_nats_errors", "Failed fetches or settles."),
        _c("resubscribes", "flusher_resubscribes", "Pull subscriptions re-created."),
        _c(
            "consumers_recreated",
            "flusher_consumers_recreated",
            "Durable consumers found deleted and created again.",
        ),
        _c(
            "consumer_restore_failures",
            "flusher_consumer_restore_failures",
            "Failed attempts to create a deleted durable consumer again.",
        ),
        _c("cycle_errors", "flusher_cycle_errors", "Cycles aborted by an unexpected error."),
        _c(
            "overlapped_cycles",
            "flusher_overlapped_batches",
            "Cycles whose messages were fetched while the previous cycle applied.",
        ),
        _c("cpu_s", "flusher_cpu_seconds", "CPU seconds of the flusher's process while draining."),
        _c(
            "trim_runs", "flusher_trim_runs", "Looks at the WAL by the trimming of flushed entries."
        ),
        _c("trims", "flusher_trims", "Purge requests trimming flushed entries from the WAL."),
        _c(
            "trimmed_messages",
            "flusher_trimmed_messages",
            "Stream seqs purged by trimming (an upper bound on messages removed).",
        ),
        _c("trim_failures", "flusher_trim_failures", "Trim runs that failed."),
        _c(
            "hot_records_forgotten",
            "flusher_hot_records_forgotten",
            "Hot records of idle, flushed threads removed from the hot bucket.",
        ),
        _c(
            "trim_cpu_s",
            "flusher_trim_cpu_seconds",
            "CPU seconds of the process during trim runs (an upper bound).",
        ),
        _g("wal_messages", "flusher_wal_messages", "Messages the WAL stream holds."),
        _g("wal_bytes", "flusher_wal_bytes", "Bytes the WAL stream holds."),
        _g(
            "wal_max_bytes",
            "flusher_wal_max_bytes",
            "The configured wal_max_bytes (0: no limit); writes are refused at it.",
        ),
        *(
            _c(
                f"cpu_{stage}_s",
                "flusher_stage_cpu_seconds",
                "CPU seconds of the flusher's cycles, by stage (decode, apply, settle).",
                stage=stage,
            )
            for stage in ("decode", "apply", "settle")
        ),
        _g(
            "cpu_per_entry_s",
            "flusher_cpu_per_entry_seconds",
            "CPU seconds per flushed entry since the start (cpu_seconds / entries_applied).",
        ),
        _c(
            "backlog_poll_failures",
            "flusher_backlog_poll_failures",
            "Failed polls of the consumer backlog.",
        ),
        _g("running", "flusher_running", "Flushers whose drain loop runs.", reduce="sum"),
        _g("held", "flusher_held_messages", "Messages held by running cycles.", reduce="sum"),
        _g(
            "last_flush_duration_s",
            "flusher_last_flush_duration_seconds",
            "Duration of the latest flush cycle.",
        ),
        _g(
            "last_lag_s",
            "flusher_last_lag_seconds",
            "Age of the oldest entry of the latest cycle when it was settled.",
        ),
        _g("max_lag_s", "flusher_max_lag_seconds", "Largest cycle lag since the start."),
        _g(
            "consumer_pending",
            "flusher_consumer_pending_messages",
            "WAL messages not delivered to any flusher yet.",
        ),
        _g(
            "consumer_ack_pending",
            "flusher_consumer_ack_pending_messages",
            "WAL messages delivered and not acknowledged yet.",
        ),
        _g(
            "consumer_redelivered",
            "flusher_consumer_redelivered_messages",
            "Unacknowledged WAL messages delivered more than once.",
        ),
        _g("backlog", "flusher_backlog_messages", "WAL entries waiting to be flushed."),
        _g(
            "pending_threads",
            "flusher_pending_threads",
            "Threads with entries in the unacknowledged WAL tail.",
        ),
        _g(
            "oldest_pending_age_s",
            "flusher_oldest_pending_age_seconds",
            "Age of the oldest unacknowledged WAL entry at the last backlog poll.",
        ),
        _g(
            "backlog_polled_at",
            "flusher_backlog_polled_timestamp_seconds",
            "Unix time of the last successful backlog poll.",
        ),
        _h(
            "flush_duration_seconds",
            "flusher_flush_duration_seconds",
            "Duration of flush cycles, collection end to last ack.",
        ),
        _h(
            "flush_lag_seconds",
            "flusher_flush_lag_seconds",
            "Per applied entry: time from its checkpoint to the commit that applied it.",
        ),
    ),
)

_OUTCOMES = "Per-thread outcomes of the inner store's apply calls."

INNER = Family(
    "inner",
    marker="apply_calls",
    series=(
        _c("transactions", "inner_transactions", "Postgres write transactions committed."),
        _c("statements", "inner_statements", "Postgres statements executed."),
        _c(
            "round_trips",
            "inner_round_trips",
            "Round trips to Postgres (an apply call: two in the steady state).",
        ),
        _c("checkpoints", "inner_checkpoints", "Direct checkpoint calls (no buffering)."),
        _c("apply_calls", "inner_apply_calls", "Flush batches applied (one transaction each)."),
        _c(
            "conflict_retries",
            "inner_conflict_retries",
            "Apply transactions run again after a deadlock or serialization failure.",
        ),
        _c("thread_applications", "inner_apply_outcomes", _OUTCOMES, outcome="applied"),
        _c("stale", "inner_apply_outcomes", _OUTCOMES, outcome="stale"),
        _c("gaps", "inner_apply_outcomes", _OUTCOMES, outcome="gap"),
        _c("failed", "inner_apply_outcomes", _OUTCOMES, outcome="failed"),
        _c("applied_entries", "inner_applied_entries", "WAL entries applied."),
        _c("messages_written", "inner_messages_written", "Message rows written."),
        _c("runs_written", "inner_runs_written", "Run rows written."),
    ),
)

FAMILIES: tuple[Family, ...] = (STORE, FLUSHER, INNER)
"""Every kind of source the collector understands, checked in this order."""


# -- the pure part: stats -> families -------------------------------------------------------


DEFAULT_FRONT_END = "threadrun"
"""The ``front_end`` label of a source that names none."""

Labels = tuple[tuple[str, str], ...]
Reading = tuple[Mapping[str, Any], Mapping[str, HistogramSnapshot]]
"""One source's `stats()` and `histograms()`."""


@dataclass(slots=True)
class FamilyValue:
    """One metric family with its samples, before it becomes a Prometheus object."""

    name: str
    kind: Kind
    help: str
    samples: dict[Labels, float] = field(default_factory=dict)
    histograms: dict[Labels, HistogramSnapshot] = field(default_factory=dict)
    """A histogram family's snapshot per label set (its front-end)."""

    @property
    def histogram(self) -> HistogramSnapshot | None:
        """A histogram family's snapshots merged (None when it has none)."""
        merged: HistogramSnapshot | None = None
        for snapshot in self.histograms.values():
            merged = snapshot if merged is None else merged.merge(snapshot)
        return merged


def front_end_label(source: object) -> str:
    """The ``front_end`` label of a source's samples."""
    name = getattr(source, "front_end", None)
    return name if isinstance(name, str) and name else DEFAULT_FRONT_END


def family_of(stats: Mapping[str, Any]) -> Family | None:
    """The kind of source these stats come from, or None when unknown."""
    return next((f for f in FAMILIES if f.marker in stats), None)


def collect_families(sources: Iterable[object], *, prefix: str = "bufstore") -> list[FamilyValue]:
    """Read every source once and combine them into metric families.

    Sources of an unknown kind, or whose `stats()` raises, are skipped (a scrape never
    fails because of one object). Families of the kinds present are complete even when
    a key is missing (it reads 0), so dashboards always find every series.
    """
    readings: dict[str, dict[str, list[Reading]]] = {}
    for source in sources:
        try:
            stats = source.stats()  # type: ignore[attr-defined]
            histograms_of: Callable[[], Mapping[str, HistogramSnapshot]] | None = getattr(
                source, "histograms", None
            )
            histograms = histograms_of() if histograms_of is not None else {}
        except Exception as exc:
            log.debug("stats of %r failed: %r", source, exc, extra={"action": "stats_failed"})
            continue
        family = family_of(stats)
        if family is not None:
            by_front_end = readings.setdefault(family.name, {})
            by_front_end.setdefault(front_end_label(source), []).append((stats, histograms))
    out: list[FamilyValue] = []
    for family in FAMILIES:
        present = readings.get(family.name)
        if present is not None:
            out.extend(_combine(family, present, prefix))
    return out


def _combine(family: Family, readings: dict[str, list[Reading]], prefix: str) -> list[FamilyValue]:
    values: dict[str, FamilyValue] = {}
    for series in family.series:
        name = f"{prefix}_{series.metric}"
        value = values.setdefault(name, FamilyValue(name, series.kind, series.help))
        for front_end, of_front_end in sorted(readings.items()):
            labels = (*series.labels, ("front_end", front_end))
            if series.kind == "histogram":
                for _, histograms in of_front_end:
                    snapshot = histograms.get(series.key)
                    if snapshot is None:
                        continue
                    known = value.histograms.get(labels)
                    value.histograms[labels] = snapshot if known is None else known.merge(snapshot)
                continue
            numbers = [_number(stats.get(series.key, 0)) for stats, _ in of_front_end]
            if series.kind == "gauge" and series.reduce == "max":
                value.samples[labels] = max(numbers)
            else:
                value.samples[labels] = math.fsum(numbers)
    return [v for v in values.values() if v.kind != "histogram" or v.histograms]


def _number(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def metric_names(prefix: str = "bufstore") -> set[str]:
    """Every sample name the collector can serve (``_total``, ``_bucket``, ``_count``,
    ``_sum`` included), for checking dashboards and alert rules."""
    names: set[str] = set()
    for family in FAMILIES:
        for series in family.series:
            name = f"{prefix}_{series.metric}"
            if series.kind == "counter":
                names.add(f"{name}_total")
            elif series.kind == "gauge":
                names.add(name)
            else:
                names.update({f"{name}_bucket", f"{name}_count", f"{name}_sum"})
    return names


# -- the Prometheus side -------------------------------------------------------------------


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise ConfigError(
            "the Prometheus exporter needs prometheus-client: "
            "pip install 'buffered-thread-store[metrics]'"
        ) from exc
    return prometheus_client


class StatsCollector:
    """A `prometheus_client` collector over the stats of stores and flushers.

    Args:
        sources: objects with `stats()` (and optionally `histograms()`):
            `BufferedThreadRunStore`, `Flusher`, `PostgresThreadRunStore` (or the
            in-memory store). More can be added later with `add`.
        prefix: metric name prefix.
    """

    def __init__(self, sources: Iterable[object] = (), *, prefix: str = "bufstore") -> None:
        _prometheus()  # fail at construction, not at the first scrape
        self.prefix = prefix
        self._sources: list[object] = list(sources)

    def add(self, source: object) -> None:
        """Export the stats of one more object."""
        if source not in self._sources:
            self._sources.append(source)

    def remove(self, source: object) -> None:
        """Stop exporting an object (e.g. a closed store)."""
        if source in self._sources:
            self._sources.remove(source)

    def describe(self) -> list[Metric]:
        """Nothing: the families depend on the sources present at scrape time (and a
        registry must not call `collect` at registration)."""
        return []

    def collect(self) -> Iterator[Metric]:
        """The metric families, read from the sources now (called by the registry)."""
        core = _prometheus().metrics_core
        for value in collect_families(list(self._sources), prefix=self.prefix):
            labels = sorted({k for key in value.samples for k, _ in key})
            if value.kind == "histogram":
                names = sorted({k for key in value.histograms for k, _ in key})
                histogram = core.HistogramMetricFamily(value.name, value.help, labels=names)
                for key, snap in value.histograms.items():
                    by_name = dict(key)
                    histogram.add_metric(
                        [by_name[label] for label in names],
                        [(_le(bound), count) for bound, count in snap.cumulative()],
                        sum_value=snap.sum,
                    )
                yield histogram
                continue
            metric_type = (
                core.CounterMetricFamily if value.kind == "counter" else core.GaugeMetricFamily
            )
            metric = metric_type(value.name, value.help, labels=labels)
            for key, number in value.samples.items():
                by_name = dict(key)
                metric.add_metric([by_name[label] for label in labels], number)
            yield metric


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))


@dataclass(slots=True)
class MetricsServer:
    """The HTTP server of `serve_metrics` (a daemon thread); `close()` stops it."""

    port: int
    registry: CollectorRegistry
    _server: Any
    _thread: Any

    def close(self) -> None:
        """Stop serving and free the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve_metrics(
    port: int,
    collector: StatsCollector,
    *,
    addr: str = "0.0.0.0",
    process_metrics: bool = True,
) -> MetricsServer:
    """Serve ``/metrics`` for `collector` on `port` (0: a free port, see `.port`).

    Uses a registry of its own, with the process and platform collectors of
    `prometheus_client` when `process_metrics` (CPU, memory, file descriptors).
    """
    prom = _prometheus()
    registry = prom.CollectorRegistry(auto_describe=False)
    registry.register(collector)
    if process_metrics:
        prom.ProcessCollector(registry=registry)
        prom.PlatformCollector(registry=registry)
    server, thread = prom.start_http_server(port, addr=addr, registry=registry)
    return MetricsServer(int(server.server_port), registry, server, thread)
