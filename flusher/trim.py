"""Trimming the WAL: flushed entries leave the stream once their retention window is over.

The stream is a buffer, not an archive. Its durable consumer's ack floor is, by
construction, below every unflushed entry: a message is acked only after its data and
watermark are committed (or after it was quarantined, whose records keep it). So every
message at or below an ack floor *observed* `retain_flushed_s` ago has been flushed for
at least that long, and one purge request (``{"seq": N}``: keep N and above) removes them
all, whatever their threads. The stream then holds the unflushed backlog plus about
`retain_flushed_s` of writes, never days of them.

Why "observed that long ago" and not "written that long ago": a read that began before
a flush overlays the entries above the watermark it read; they must stay until such a
read is surely over, counted from their flush, not from their write (entries of a long
outage are old when they are flushed).

Quarantined messages were terminated (so they sit below the ack floor) but `replay`
re-reads them from the stream: the floor never passes the oldest of them.

When the stream nears `wal_max_bytes` (`PRESSURE`), the window is given up and the
stream is trimmed to the current ack floor, so writes refused with `WalFullError` work
again as soon as the flushers have drained, not `retain_flushed_s` later.

The decisions are pure (`FloorHistory`, `plan_keep`); `Trimmer` only awaits.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

import orjson

from buffered_store.config import EngineConfig
from buffered_store.engine.ports import ConsumerState, Wal
from flusher.stats import FlusherStats

log = logging.getLogger("flusher.trim")

PRESSURE = 0.5
"""Share of `wal_max_bytes` past which the retention window of flushed entries is given
up: the stream is trimmed to the ack floor at once."""


class FloorHistory:
    """Ack floors observed over time, to tell which one was observed long enough ago.

    Keeps the samples of the last window only (a few hundred at one per trim interval).
    """

    def __init__(self) -> None:
        self._samples: deque[tuple[float, int]] = deque()
        self._settled = 0
        """The newest floor observed at least one window ago (by the last `settled`)."""

    def observe(self, now: float, ack_floor: int) -> None:
        """Record the ack floor read at `now` (seconds, monotonic)."""
        self._samples.append((now, ack_floor))

    def settled(self, now: float, window_s: float) -> int:
        """The highest ack floor observed at or before ``now - window_s`` (0: none yet).

        Every message at or below it was acked at least `window_s` ago.
        """
        horizon = now - window_s
        while self._samples and self._samples[0][0] <= horizon:
            self._settled = max(self._settled, self._samples.popleft()[1])
        return self._settled


def plan_keep(
    state: ConsumerState,
    *,
    settled_floor: int,
    max_bytes: int | None,
    protected: int | None = None,
) -> int:
    """The first stream seq to keep: everything below it may be purged.

    `settled_floor` is the ack floor observed a retention window ago, `protected` the
    oldest stream seq that must stay (quarantined messages; None: none). Under pressure
    (the stream holds `PRESSURE` of `max_bytes` or more) the current ack floor is used.
    Returns a seq at or below ``state.first_seq`` when there is nothing to purge.
    """
    floor = settled_floor
    if max_bytes is not None and state.bytes >= PRESSURE * max_bytes:
        floor = state.ack_floor
    keep = min(floor, state.ack_floor) + 1
    if protected is not None:
        keep = min(keep, protected)
    return keep


async def quarantined_floor(wal: Wal) -> int | None:
    """The oldest stream seq a quarantine record refers to (None: the quarantine is
    empty): message records name theirs in the key, thread records list them."""
    oldest: int | None = None
    bucket = wal.quarantine
    for key in await bucket.keys():
        seqs: list[int] = []
        if key.startswith("m."):
            seqs = [int(key[2:])] if key[2:].isdigit() else []
        elif key.startswith("t."):
            value = await bucket.get(key)
            if value is not None:
                try:
                    seqs = [int(s) for s in orjson.loads(value.value).get("stream_seqs", ())]
                except (ValueError, TypeError, AttributeError):
                    seqs = []
        for seq in seqs:
            oldest = seq if oldest is None else min(oldest, seq)
    return oldest


class Trimmer:
    """One flusher's trimming of the WAL: `run_once` every trim interval.

    Several flushers trimming the same stream is harmless: a purge below a seq the stream
    already starts at removes nothing.
    """

    def __init__(
        self,
        wal: Wal,
        config: EngineConfig,
        stats: FlusherStats,
        *,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.wal = wal
        self.config = config
        self.stats = stats
        self._monotonic = monotonic
        self.history = FloorHistory()

    async def run_once(self) -> int:
        """Read the consumer, purge what has been flushed long enough; returns the first
        seq kept (0 when nothing was purged)."""
        started = time.process_time()
        try:
            return await self._run()
        finally:
            self.stats.trim_cpu_s += time.process_time() - started

    async def _run(self) -> int:
        stats = self.stats
        state = await self.wal.consumer_state()
        now = self._monotonic()
        self.history.observe(now, state.ack_floor)
        stats.trim_runs += 1
        stats.wal_messages = state.messages
        stats.wal_bytes = state.bytes
        stats.wal_first_seq = state.first_seq
        settled = self.history.settled(now, self.config.retain_flushed_s)
        keep = plan_keep(state, settled_floor=settled, max_bytes=self.config.wal_max_bytes)
        first = max(state.first_seq, 1)  # an empty stream may report 0
        if keep <= first:
            return 0
        # Read after the consumer: a message terminated before that read was recorded in
        # the quarantine before it was terminated.
        protected = await quarantined_floor(self.wal)
        keep = plan_keep(
            state,
            settled_floor=settled,
            max_bytes=self.config.wal_max_bytes,
            protected=protected,
        )
        if keep <= first:
            return 0
        await self.wal.purge_below(keep)
        stats.trims += 1
        stats.trimmed_messages += keep - first
        log.debug(
            "trimmed the WAL below %d",
            keep,
            extra={"action": "wal_trimmed", "stream_seq": keep},
        )
        return keep
