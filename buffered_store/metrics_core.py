"""Dependency-free histograms for the stats of the store and the flusher.

`stats()` of the store and the flusher return plain counters and gauges; latencies and
lags need distributions, which a total cannot give. A `Histogram` counts observations
in fixed buckets (Prometheus semantics: a value lands in the first bucket whose upper
bound is at least the value), so an exporter can publish it as a native histogram and a
test or a benchmark can read quantiles from it without any metrics library.

Pure: no I/O, no clock. Observing is O(log buckets) and allocation-free, cheap enough
for every checkpoint and every flushed entry.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

CHECKPOINT_BUCKETS_S: tuple[float, ...] = (
    0.0005,
    0.001,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.02,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
"""Checkpoint latency: a steady-state checkpoint costs two NATS round trips (about a
millisecond on a LAN); the upper buckets catch reconnects and CAS retries."""

FLUSH_DURATION_BUCKETS_S: tuple[float, ...] = (
    0.002,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
"""Flush cycle duration: from the end of collection to the last ack of the cycle."""

LAG_BUCKETS_S: tuple[float, ...] = (
    0.05,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    1.5,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
    900.0,
    3600.0,
)
"""Flush lag: from the checkpoint (the entry's `at`) to the commit of its transaction.
The target is flush_interval + 250 ms; the long tail shows outages."""


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """An immutable copy of a histogram: what exporters and tests read."""

    bounds: tuple[float, ...]
    """Upper bounds of the finite buckets, ascending."""
    counts: tuple[int, ...]
    """Observations per bucket (not cumulative); one more than `bounds`: the last one
    counts values above the largest bound."""
    sum: float
    """Sum of all observed values."""

    @property
    def count(self) -> int:
        """Number of observations."""
        return sum(self.counts)

    @property
    def mean(self) -> float:
        """Average observation (0.0 when empty)."""
        count = self.count
        return self.sum / count if count else 0.0

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations at or below it) per bucket, ending with (+inf, count):
        the Prometheus ``le`` series."""
        out: list[tuple[float, int]] = []
        running = 0
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            running += count
            out.append((bound, running))
        return out

    def quantile(self, q: float) -> float:
        """Estimate of the q-quantile (0 <= q <= 1), interpolating linearly inside the
        bucket like Prometheus' ``histogram_quantile``; values above the largest bound
        report that bound. 0.0 when empty."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile must be within [0, 1], got {q!r}")
        total = self.count
        if total == 0:
            return 0.0
        rank = q * total
        running = 0
        lower = 0.0
        for index, count in enumerate(self.counts):
            if index == len(self.bounds):
                return self.bounds[-1] if self.bounds else 0.0
            upper = self.bounds[index]
            if count and running + count >= rank:
                return lower + (upper - lower) * max(0.0, rank - running) / count
            running += count
            lower = upper
        return self.bounds[-1] if self.bounds else 0.0  # pragma: no cover - loop returns

    def merge(self, other: HistogramSnapshot) -> HistogramSnapshot:
        """The histogram of both sets of observations (the bounds must be equal)."""
        if other.bounds != self.bounds:
            raise ValueError("cannot merge histograms with different buckets")
        counts = tuple(a + b for a, b in zip(self.counts, other.counts, strict=True))
        return HistogramSnapshot(self.bounds, counts, self.sum + other.sum)


class Histogram:
    """Counts observations in fixed buckets; see the module docstring.

    Not locked: one event loop observes, and a snapshot taken from another thread (an
    exporter's HTTP thread) is at worst one observation behind in its sum.
    """

    __slots__ = ("_bounds", "_counts", "_sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        checked = tuple(float(b) for b in bounds)
        if not checked:
            raise ValueError("a histogram needs at least one bucket bound")
        if any(not math.isfinite(b) for b in checked):
            raise ValueError("bucket bounds must be finite (+inf is implied)")
        if any(b >= c for b, c in pairwise(checked)):
            raise ValueError("bucket bounds must be strictly ascending")
        self._bounds = checked
        self._counts = [0] * (len(checked) + 1)
        self._sum = 0.0

    @property
    def bounds(self) -> tuple[float, ...]:
        """Upper bounds of the finite buckets."""
        return self._bounds

    def observe(self, value: float) -> None:
        """Count one observation. NaN and infinities are ignored: they would poison the
        sum, and only a bug produces them."""
        if not math.isfinite(value):
            return
        self._counts[bisect_left(self._bounds, value)] += 1
        self._sum += value

    def snapshot(self) -> HistogramSnapshot:
        """An immutable copy of the current counts."""
        return HistogramSnapshot(self._bounds, tuple(self._counts), self._sum)
