"""`force-flush --all` progress lines off a terminal: the first, one per interval, the last."""

from __future__ import annotations

from buffered_store.cli.store import ProgressLines


def test_progress_lines_are_spaced_by_the_interval() -> None:
    lines = ProgressLines(interval_s=5.0)
    shown = [
        (now, done)
        for now, done in [(0.0, 0), (1.0, 3), (4.9, 7), (5.0, 8), (9.0, 9), (10.1, 12), (10.2, 20)]
        if lines.due(now, done, 20)
    ]
    assert shown == [(0.0, 0), (5.0, 8), (10.1, 12), (10.2, 20)]


def test_the_last_report_is_always_shown() -> None:
    lines = ProgressLines(interval_s=60.0)
    assert lines.due(0.0, 0, 2)
    assert not lines.due(1.0, 1, 2)
    assert lines.due(1.5, 2, 2)
