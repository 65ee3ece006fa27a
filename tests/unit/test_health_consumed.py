"""`bufstore health`'s flusher check: when entries pending count as consumed by no flusher."""

from __future__ import annotations

from buffered_store.cli.health import WalFigures, consumed_check


def figures(backlog: int, waiting: int, idle: float | None) -> WalFigures:
    return WalFigures(
        backlog=backlog,
        lag_s=0.0,
        pending_threads=1,
        complete=True,
        waiting_pulls=waiting,
        idle_s=idle,
    )


def test_nothing_pending_or_a_waiting_pull_request_is_healthy() -> None:
    assert consumed_check(figures(0, 0, None), 60).status == "ok"
    assert consumed_check(figures(5, 1, None), 60).status == "ok"


def test_pending_entries_with_a_recent_delivery_or_ack_are_being_consumed() -> None:
    check = consumed_check(figures(5, 0, 12.0), 60)
    assert check.status == "ok"
    assert check.detail == "last delivery or ack 12.0 s ago"


def test_pending_entries_nobody_pulls_fail() -> None:
    never = consumed_check(figures(5, 0, None), 60)
    assert never.status == "fail"
    assert never.detail.startswith("5 entries pending and no flusher consumes them")
    assert "never active" in never.detail
    stale = consumed_check(figures(5, 0, 61.0), 60)
    assert (stale.status, stale.value, stale.threshold) == ("fail", 61.0, 60)


def test_the_check_can_be_turned_off() -> None:
    assert consumed_check(figures(5, 0, None), None).status == "ok"
