"""The trimming of flushed entries, without servers: which floor is safe to purge below
(`FloorHistory`, `plan_keep`), and `Trimmer` over a `MemoryWal` (quarantined messages
kept, one purge per run, nothing unflushed ever removed)."""

from __future__ import annotations

from buffered_store.engine.ports import ConsumerState
from buffered_store.testing import MemoryJetStream, MemoryWal
from flusher.config import FlusherConfig
from flusher.stats import FlusherStats
from flusher.trim import FloorHistory, Trimmer, plan_keep, quarantined_floor


def state(ack_floor: int, *, first: int = 1, last: int = 100, size: int = 0) -> ConsumerState:
    return ConsumerState(
        num_pending=0,
        num_ack_pending=0,
        num_redelivered=0,
        ack_floor=ack_floor,
        last_seq=last,
        messages=last - first + 1,
        first_seq=first,
        bytes=size,
    )


def test_a_floor_counts_once_it_was_observed_a_window_ago() -> None:
    history = FloorHistory()
    history.observe(0.0, 10)
    history.observe(5.0, 40)
    assert history.settled(9.9, 10.0) == 0
    assert history.settled(10.0, 10.0) == 10
    assert history.settled(14.0, 10.0) == 10
    assert history.settled(15.0, 10.0) == 40
    history.observe(16.0, 5)  # a re-created consumer starts lower: never purge less safely
    assert history.settled(30.0, 10.0) == 40


def test_the_kept_seq_never_passes_the_ack_floor_nor_a_quarantined_message() -> None:
    assert plan_keep(state(50), settled_floor=30, max_bytes=None) == 31
    assert plan_keep(state(20), settled_floor=30, max_bytes=None) == 21
    assert plan_keep(state(50), settled_floor=30, max_bytes=None, protected=12) == 12
    # Under pressure (half of wal_max_bytes), the current ack floor: room at once.
    assert plan_keep(state(50, size=600), settled_floor=30, max_bytes=1000) == 51
    assert plan_keep(state(50, size=400), settled_floor=30, max_bytes=1000) == 31


async def test_the_trimmer_purges_flushed_entries_and_keeps_quarantined_ones() -> None:
    server = MemoryJetStream()
    config = FlusherConfig(retain_flushed_s=10.0)
    wal = MemoryWal(config, server)
    for n in range(10):
        await wal.append(f"{config.stream_name}.t.a{n % 3}", b"entry")
    delivery = await wal.subscribe()
    for delivered in await delivery.fetch(8, 0.1):
        await delivered.ack()
    await wal.quarantine.create("m.6", b"{}")
    now = [0.0]
    stats = FlusherStats()
    trimmer = Trimmer(wal, config, stats, monotonic=lambda: now[0])
    assert await trimmer.run_once() == 0  # acked, but not yet for a window
    now[0] = 10.0
    assert await trimmer.run_once() == 6  # up to the quarantined message
    assert (await wal.consumer_state()).first_seq == 6
    assert await wal.get(5) is None
    assert await wal.get(6) is not None
    assert await quarantined_floor(wal) == 6
    await wal.quarantine.delete("m.6")
    now[0] = 20.0
    assert await trimmer.run_once() == 9  # never past the unacknowledged 9 and 10
    assert [m.seq for m in await wal.read_range(1, 10)] == [9, 10]
    assert stats.trims == 2
    assert stats.trim_runs == 3


async def test_an_empty_stream_is_not_purged() -> None:
    config = FlusherConfig(retain_flushed_s=0.001)
    wal = MemoryWal(config, MemoryJetStream())
    stats = FlusherStats()
    trimmer = Trimmer(wal, config, stats, monotonic=lambda: 10.0)
    assert await trimmer.run_once() == 0
    assert stats.trims == 0
