"""`FlusherStats`: the derived figures of its snapshot."""

from __future__ import annotations

from flusher.stats import FlusherStats, cpu_per_entry


def test_cpu_per_entry_is_cpu_seconds_over_applied_entries() -> None:
    stats = FlusherStats(cpu_s=1.5, entries_applied=3000, threads_applied=100)
    snapshot = stats.as_dict()
    assert snapshot["cpu_per_entry_s"] == 0.0005
    assert snapshot["coalesced_entries"] == 2900


def test_cpu_per_entry_before_any_entry_is_zero() -> None:
    assert cpu_per_entry(0.25, 0) == 0.0
    assert FlusherStats(cpu_s=0.25).as_dict()["cpu_per_entry_s"] == 0.0
