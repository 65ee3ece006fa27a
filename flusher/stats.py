"""Counters of a flusher, exposed by `Flusher.stats()` with no metrics dependency.

A metrics exporter (Prometheus, logs) reads the dict; counters only ever grow, gauges
(`held`, `last_*`) describe the latest cycle.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(slots=True)
class FlusherStats:
    """Mutable counters of one `Flusher` (one process may run several)."""

    cycles: int = 0
    """Collection windows that fetched at least one message."""
    messages: int = 0
    """WAL messages fetched (redeliveries included)."""
    entries: int = 0
    """Fetched messages that decoded into entries."""
    redeliveries: int = 0
    """Fetched messages delivered more than once (num_delivered > 1)."""
    transactions: int = 0
    """Calls of `FlushTarget.apply` (one transaction each; retries included)."""
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
    db_retries: int = 0
    """Apply calls retried because the database was unavailable."""
    db_retry_episodes: int = 0
    """Periods of database unavailability (each logs one WARNING and one INFO)."""
    quarantined_messages: int = 0
    """Messages terminated into quarantine (undecodable payloads and entries)."""
    quarantined_threads: int = 0
    """Threads newly quarantined by this flusher."""
    dropped_unrecorded: int = 0
    """Undecodable messages terminated although their quarantine record could not be written."""
    mark_failures: int = 0
    """KV flushed watermarks that could not be raised (their messages stayed unacked)."""
    nats_errors: int = 0
    """Fetch or settle failures other than the normal fetch timeout."""
    resubscribes: int = 0
    """Pull subscriptions re-created (after a reconnect or a fetch error)."""
    cycle_errors: int = 0
    """Cycles aborted by an unexpected error (their messages were given back)."""
    held: int = 0
    """Messages the current cycle holds."""
    last_flush_duration_s: float = 0.0
    """Time from the end of collection to the last settle of the latest cycle."""
    last_lag_s: float = 0.0
    """Age of the oldest entry of the latest cycle when it was settled."""
    max_lag_s: float = 0.0

    def as_dict(self) -> dict[str, int | float]:
        """A snapshot, plus `coalesced_entries` (entries saved by coalescing)."""
        out: dict[str, int | float] = dataclasses.asdict(self)
        out["coalesced_entries"] = max(0, self.entries_applied - self.threads_applied)
        return out
