"""The step timeline's attribution: each stage of a step that ran alone, steps that
overlapped left out."""

from __future__ import annotations

import pytest

from benchmarks.step_timeline import MARKS, STAGES, stage_times


def step(start: float, gaps_us: list[float]) -> list[tuple[float, str]]:
    """One step's marks: `MARKS` at `start` (s) and then `gaps_us` apart."""
    assert len(gaps_us) == len(MARKS) - 1
    marks, at = [(start, MARKS[0])], start
    for name, gap in zip(MARKS[1:], gaps_us, strict=True):
        at += gap / 1e6
        marks.append((at, name))
    return marks


def test_each_stage_is_the_time_to_the_next_mark_median_and_mean_over_steps() -> None:
    fast = [10.0] * len(STAGES)
    slow = [30.0] * len(STAGES)
    slower = [20.0] * len(STAGES)
    marks = step(1.0, fast) + step(2.0, slow) + step(3.0, slower)
    # Background traffic between steps and inside one: a hot record's update goes out
    # through the same client and socket, and its reply comes back.
    marks += [(1.5, "published"), (1.5001, "sending"), (1.5002, "sent"), (2.00001, "received")]
    times = stage_times(marks[::-1])  # the order given does not matter: sorted by time
    assert [name for name, _ in STAGES] == list(times)
    for name, _ in STAGES:
        assert times[name]["steps"] == 3
        assert times[name]["p50_us"] == pytest.approx(20.0, abs=0.05)
        assert times[name]["mean_us"] == pytest.approx(20.0, abs=0.05)


def test_steps_that_overlap_or_miss_a_mark_are_left_out() -> None:
    alone = step(1.0, [10.0] * len(STAGES))
    # Two steps in flight at once: the second starts before the first returned.
    first = step(2.0, [100.0] * len(STAGES))
    second = step(2.0005, [100.0] * len(STAGES))
    # A step whose reply never came (its write timed out): no "received" mark.
    lost = [m for m in step(3.0, [10.0] * len(STAGES)) if m[1] != "received"]
    # Another step's aput (the input checkpoint, without writes) inside a step's window.
    crossed = [*step(4.0, [50.0] * len(STAGES)), (4.0001, "aput"), (4.0002, "end")]
    times = stage_times(alone + first + second + lost + crossed)
    assert times["writes"]["steps"] == 1
    assert times["recorded"]["p50_us"] == pytest.approx(10.0, abs=0.05)


def test_no_step_no_stage() -> None:
    assert stage_times([]) == {}
    assert stage_times([(1.0, "aput"), (1.1, "end")]) == {}
