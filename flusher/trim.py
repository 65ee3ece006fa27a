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

The hot bucket is bounded the same way (`Trimmer.forget_idle`): the hot record of a
thread idle for `hot_idle_s` (7 days), flushed up to it (deleted threads included: the
inner store's tombstone keeps the watermark) and with no entry left on its subject is
removed, marker included. Nothing needed it: reads find such a thread in the inner
store, and its next writer seeds its cursor from there (one read of the thread), as for
a thread the WAL never saw. The least recently written records are looked at first,
`HOT_GC_BATCH` per pass.

The decisions are pure (`FloorHistory`, `plan_keep`); `Trimmer` only awaits.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import orjson

from buffered_store.engine.entries import Format
from buffered_store.engine.flushing import FlushSink
from buffered_store.engine.keys import decode_token, wal_subject
from buffered_store.engine.ports import ConsumerState, Wal
from buffered_store.errors import CorruptEntryError, ValidationError
from flusher.config import FlusherConfig
from flusher.stats import FlusherStats

log = logging.getLogger("flusher.trim")

HOT_GC_BATCH = 256
"""Least recently written hot records one pass of `Trimmer.forget_idle` looks at."""
HOT_GC_MAX_INTERVAL_S = 60.0
"""Longest pause between two such passes."""
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
        config: FlusherConfig,
        stats: FlusherStats,
        *,
        target: FlushSink[Any] | None = None,
        fmt: Format[Any, Any] | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.wal = wal
        self.config = config
        self.stats = stats
        self._target = target
        self._fmt = fmt
        self._monotonic = monotonic
        self._wall = wall
        self.history = FloorHistory()
        self._next_gc = 0.0

    async def run_once(self) -> int:
        """Read the consumer, purge what has been flushed long enough; returns the first
        seq kept (0 when nothing was purged)."""
        started = time.process_time()
        try:
            return await self._run()
        finally:
            try:
                await self._maybe_forget_idle()
            finally:
                self.stats.trim_cpu_s += time.process_time() - started

    async def _maybe_forget_idle(self) -> None:
        idle_s = self.config.hot_idle_s
        if not idle_s or self._target is None or self._fmt is None:
            return
        now = self._monotonic()
        if now < self._next_gc:
            return
        self._next_gc = now + min(HOT_GC_MAX_INTERVAL_S, max(idle_s / 10, 0.1))
        await self.forget_idle()

    async def forget_idle(self) -> int:
        """Remove the hot records of threads idle for `hot_idle_s`, flushed up to them and
        with no entry left on their subjects (among the `HOT_GC_BATCH` least recently
        written); returns how many were removed."""
        assert self._target is not None
        assert self._fmt is not None
        oldest = await self.wal.hot_oldest("h.", HOT_GC_BATCH)
        now = self._wall()
        idle: dict[str, tuple[str, int, int]] = {}
        for value in oldest:
            if now - value.written_at < self.config.hot_idle_s:
                break  # least recently written first: the rest are younger
            try:
                thread_id = decode_token(value.key[2:])
                seq = self._fmt.decode_hot(value.value).seq
            except (CorruptEntryError, ValidationError, ValueError):
                continue  # not ours to judge: kept
            idle[thread_id] = (value.key, value.revision, seq)
        if not idle:
            return 0
        flushed = await self._target.flushed_seqs(list(idle))
        forgotten = 0
        for thread_id, (key, revision, seq) in idle.items():
            if flushed.get(thread_id, 0) < seq:
                continue  # not flushed yet (a stopped flusher, a quarantined thread)
            subject = wal_subject(self.config.stream_name, thread_id)
            if await self.wal.last_on(subject) is not None:
                continue  # entries still in the stream: a writer would walk them
            if await self.wal.kv_forget(key, revision):
                forgotten += 1
        self.stats.hot_records_forgotten += forgotten
        if forgotten:
            log.debug(
                "forgot the hot records of %d idle flushed threads",
                forgotten,
                extra={"action": "hot_records_forgotten"},
            )
        return forgotten

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
