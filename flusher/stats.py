"""Counters of a flusher, exposed by `Flusher.stats()` with no metrics dependency.

A metrics exporter (Prometheus, logs) reads the dict; counters only ever grow, gauges
(`held`, `last_*`) describe the latest cycle, and the backlog gauges (`consumer_*`,
`backlog`, `pending_threads`, `oldest_pending_age_s`) the latest poll of the consumer.
Distributions (flush duration, flush lag) are histograms, read with `histograms()`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from buffered_store.metrics_core import (
    FLUSH_DURATION_BUCKETS_S,
    LAG_BUCKETS_S,
    Histogram,
    HistogramSnapshot,
)

_HISTOGRAM = {"histogram": True}


@dataclass(slots=True)
class FlusherStats:
    """Mutable counters of one `Flusher` (one process may run several)."""

    cycles: int = 0
    """Collection windows that fetched at least one message."""
    fetched: int = 0
    """WAL messages received from the consumer (counted on arrival; `messages` counts
    them when their cycle starts, so the two differ by what waits for a cycle)."""
    messages: int = 0
    """WAL messages taken by cycles (redeliveries included)."""
    entries: int = 0
    """Fetched messages that decoded into entries."""
    redeliveries: int = 0
    """Fetched messages delivered more than once (num_delivered > 1)."""
    transactions: int = 0
    """Calls of `FlushSink.apply` (one transaction each; retries included)."""
    threads_applied: int = 0
    """Per-thread batches the target reported APPLIED."""
    entries_applied: int = 0
    """Entries up to the new watermark in APPLIED batches (an upper bound when a batch
    also held entries already flushed by someone else)."""
    stale_entries: int = 0
    """Held entries acked because they were at or below the watermark already."""
    acked: int = 0
    naked: int = 0
    gaps: int = 0
    """GAP outcomes, and holes between held entries, filled from the stream."""
    entries_fetched: int = 0
    """Entries read back from the stream to fill gaps."""
    apply_failures: int = 0
    """FAILED outcomes (retriable or not)."""
    applied_with_owner: int = 0
    """Batches refused a run whose owner had unflushed entries, then applied in one call
    with those entries read from the stream (the owner's delete freed the run)."""
    db_retries: int = 0
    """Apply calls retried because the database was unavailable."""
    db_retry_episodes: int = 0
    """Periods of database unavailability (each logs one WARNING and one INFO)."""
    apply_timeouts: int = 0
    """Apply transactions abandoned after `apply_timeout_s` (counted in `db_retries` too)."""
    quarantined_messages: int = 0
    """Messages terminated into quarantine (undecodable payloads and entries)."""
    quarantined_threads: int = 0
    """Threads newly quarantined by this flusher."""
    dropped_unrecorded: int = 0
    """Undecodable messages terminated although their quarantine record could not be written."""
    nats_errors: int = 0
    """Fetch or settle failures other than the normal fetch timeout."""
    resubscribes: int = 0
    """Pull subscriptions re-created (after a reconnect or a fetch error)."""
    consumers_recreated: int = 0
    """Times the durable consumer was found deleted and created again."""
    consumer_restore_failures: int = 0
    """Failed attempts to create a deleted durable consumer again (each logs an ERROR)."""
    overlapped_cycles: int = 0
    """Cycles whose messages were (partly) fetched while the previous cycle applied."""
    cpu_s: float = 0.0
    """CPU seconds of the whole process (`time.process_time`) while the drain loop ran,
    summed cycle by cycle: decoding, applying, settling and the fetching in between."""
    cpu_decode_s: float = 0.0
    """Of `cpu_s`: decoding the cycles' messages into entries (exact: no await inside)."""
    cpu_apply_s: float = 0.0
    """Of `cpu_s`: each round's `apply` call, from the batches to the outcomes (planning,
    parameters, the database client). CPU of other tasks running during its awaits (the
    intake's) counts here too: the stages are spans of one event loop."""
    cpu_settle_s: float = 0.0
    """Of `cpu_s`: what each round does with the outcomes: acks, naks, fetching missing
    entries and quarantine (a rare re-apply included)."""
    cycle_errors: int = 0
    """Cycles aborted by an unexpected error (their messages were given back)."""
    held: int = 0
    """Messages the current cycle holds."""
    last_flush_duration_s: float = 0.0
    """Time from the end of collection to the last settle of the latest cycle."""
    last_lag_s: float = 0.0
    """Age of the oldest entry of the latest cycle when it was settled."""
    max_lag_s: float = 0.0
    consumer_pending: int = 0
    """Messages the durable consumer has not delivered yet (all flushers), last poll."""
    consumer_ack_pending: int = 0
    """Messages delivered and not acknowledged yet (all flushers), last poll."""
    consumer_redelivered: int = 0
    """Messages delivered more than once and not acknowledged yet, last poll."""
    backlog: int = 0
    """`consumer_pending` + `consumer_ack_pending`: WAL entries waiting to be flushed."""
    pending_threads: int = 0
    """Threads with entries in the unacknowledged WAL tail, last poll (counted over at
    most the oldest `BACKLOG_SCAN_LIMIT` entries: a lower bound beyond that)."""
    oldest_pending_age_s: float = 0.0
    """Age of the oldest entry in the unacknowledged WAL tail at the last poll."""
    backlog_polled_at: float = 0.0
    """Unix time of the last successful poll (0: none yet)."""
    backlog_poll_failures: int = 0
    """Polls of the consumer that failed (the gauges keep their previous values)."""
    trim_runs: int = 0
    """Looks at the stream by the trimming of flushed entries (`flusher.trim`)."""
    trims: int = 0
    """Purge requests sent (each removes every flushed entry below a seq)."""
    trimmed_messages: int = 0
    """Stream seqs purged (an upper bound on messages removed)."""
    trim_failures: int = 0
    """Trim runs that failed (retried at the next interval; nothing is lost)."""
    trim_cpu_s: float = 0.0
    """CPU seconds of the process during trim runs (an upper bound of what trimming
    costs: other tasks running during its awaits are counted too)."""
    wal_messages: int = 0
    """Messages the WAL stream holds (flushed ones in their retention window included),
    at the last trim run."""
    wal_bytes: int = 0
    """Bytes the WAL stream holds, at the last trim run."""
    wal_max_bytes: int = 0
    """The configured `wal_max_bytes` (0: no limit): alert before `wal_bytes` reaches it."""
    hot_records_forgotten: int = 0
    """Hot records of idle, flushed threads removed from the hot bucket."""
    wal_first_seq: int = 0
    """The stream's first seq at the last trim run."""
    flush_duration: Histogram = field(
        default_factory=lambda: Histogram(FLUSH_DURATION_BUCKETS_S), metadata=_HISTOGRAM
    )
    """Per cycle: the same span as `last_flush_duration_s`."""
    flush_lag: Histogram = field(
        default_factory=lambda: Histogram(LAG_BUCKETS_S), metadata=_HISTOGRAM
    )
    """Per applied entry: from its checkpoint (`entry.at`) to the commit that applied it."""

    def as_dict(self) -> dict[str, int | float]:
        """A snapshot of the counters and gauges, plus `coalesced_entries` (entries saved
        by coalescing), `cpu_per_entry_s` (`cpu_s` per applied entry) and the same per
        stage: `cpu_per_entry_decode_s`, `_apply_s`, `_settle_s` and `_intake_s` (the
        rest of `cpu_s`: fetching, the loop, timers)."""
        out: dict[str, int | float] = {
            item.name: getattr(self, item.name)
            for item in dataclasses.fields(self)
            if not item.metadata.get("histogram")
        }
        out["coalesced_entries"] = max(0, self.entries_applied - self.threads_applied)
        out["cpu_per_entry_s"] = cpu_per_entry(self.cpu_s, self.entries_applied)
        staged = self.cpu_decode_s + self.cpu_apply_s + self.cpu_settle_s
        for stage, seconds in (
            ("decode", self.cpu_decode_s),
            ("apply", self.cpu_apply_s),
            ("settle", self.cpu_settle_s),
            ("intake", max(0.0, self.cpu_s - staged)),
        ):
            out[f"cpu_per_entry_{stage}_s"] = cpu_per_entry(seconds, self.entries_applied)
        return out

    def histograms(self) -> dict[str, HistogramSnapshot]:
        """Snapshots of the distributions: ``flush_duration_seconds`` (per cycle) and
        ``flush_lag_seconds`` (per applied entry)."""
        return {
            "flush_duration_seconds": self.flush_duration.snapshot(),
            "flush_lag_seconds": self.flush_lag.snapshot(),
        }


def cpu_per_entry(cpu_s: float, entries: int) -> float:
    """CPU seconds per flushed entry (0.0 before any entry was flushed)."""
    return cpu_s / entries if entries > 0 else 0.0
