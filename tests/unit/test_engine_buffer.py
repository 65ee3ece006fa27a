"""`engine.buffer.WriteBuffer` carries a front-end (the toy "notes" one of
`test_engine_second_frontend`) with the decisions the front-ends used to make each on
their own: seeding, the size check, force_flush, the ordered close with its drain; and
the errors a caller branches on are the ones named for that decision."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from buffered_store.config import BufferedStoreConfig
from buffered_store.engine.buffer import WriteBuffer
from buffered_store.engine.cursors import Cursor, Seeded
from buffered_store.engine.flushing import ApplyOutcome, ApplyStatus
from buffered_store.engine.threadlog import WALK_DIRECT_GETS, flush_thread
from buffered_store.errors import (
    ConflictError,
    DatabaseUnavailableError,
    FlushFailedError,
    PayloadTooLargeError,
    SchemaError,
    StoreClosedError,
    StoreError,
    WalEntriesMissingError,
)
from buffered_store.testing import MemoryJetStream, MemoryWal
from tests.unit.test_engine_second_frontend import FMT, T0, Note, NoteHot, NotesSink

CONFIG = BufferedStoreConfig(
    stream_name="NOTES", hot_bucket="notes-hot", consumer_name="n", request_timeout_s=0.5
)
NotesBuffer = WriteBuffer[Note, NoteHot, int]


class RefusingSink(NotesSink):
    """Refuses the first `times` calls (every call when None), retriable or not, or as
    refused by what is gone already (`retry_now`); then applies as `NotesSink` does."""

    def __init__(
        self,
        *,
        retriable: bool = True,
        retry_now: bool = False,
        times: int | None = None,
        error: str = "no",
    ) -> None:
        super().__init__()
        self.retriable, self.retry_now, self.left, self.error = retriable, retry_now, times, error
        self.calls = 0

    async def apply(self, batches: Sequence[Sequence[Note]]) -> list[ApplyOutcome]:
        self.calls += 1
        if self.left is not None:
            if self.left == 0:
                return await super().apply(batches)
            self.left -= 1
        return [
            ApplyOutcome(
                b[0].thread_id,
                ApplyStatus.FAILED,
                0,
                error=self.error,
                retriable=self.retriable,
                retry_now=self.retry_now,
            )
            for b in batches
        ]


async def write(buffer: NotesBuffer, thread_id: str, text: str) -> Note:
    def build(cursor: Cursor[NoteHot, int]) -> tuple[Note, bytes]:
        note = Note(thread_id, cursor.seq + 1, T0, text, buffer.writer.nonce(), cursor.jump)
        return note, FMT.encode(note)

    note, _ = await buffer.write(thread_id, build, None)
    return note


def notes_buffer(sink: NotesSink, wal: MemoryWal | None = None, **kwargs: object) -> NotesBuffer:
    wal = wal or MemoryWal(CONFIG, MemoryJetStream())
    return WriteBuffer(wal, CONFIG, FMT, sink, **kwargs)  # type: ignore[arg-type]


async def test_a_thread_new_to_the_wal_continues_the_seqs_the_sink_holds() -> None:
    async def seed(thread_id: str) -> Seeded[NoteHot, int]:
        return Seeded(7, NoteHot(7, 0, count=7), 7)

    buffer = notes_buffer(NotesSink(), seed=seed)
    assert (await write(buffer, "t", "x")).seq == 8
    await buffer.close()


async def test_an_unavailable_sink_makes_the_first_entry_jump() -> None:
    async def seed(thread_id: str) -> Seeded[NoteHot, int]:
        raise DatabaseUnavailableError("down")

    buffer = notes_buffer(NotesSink(), seed=seed)
    note = await write(buffer, "t", "x")
    assert note.jump
    assert note.seq > 1_000_000
    await buffer.close()


async def test_a_sink_refusing_otherwise_is_not_taken_for_an_outage() -> None:
    """Before, any `StoreError` of the seed read meant "database down" and the thread
    was written as new (its seqs restarted): a schema error now reaches the caller."""

    async def seed(thread_id: str) -> Seeded[NoteHot, int]:
        raise SchemaError("no tables")

    buffer = notes_buffer(NotesSink(), seed=seed)
    with pytest.raises(SchemaError):
        await write(buffer, "t", "x")
    assert await buffer.wal.last_seq() == 0
    await buffer.close()


async def test_the_size_check_speaks_the_front_ends_words_and_writes_nothing() -> None:
    wal = MemoryWal(CONFIG, MemoryJetStream(max_payload=64 * 1024))
    buffer = notes_buffer(
        NotesSink(), wal, too_large=lambda e, size, limit: f"note {e.seq}: {size} > {limit}"
    )
    with pytest.raises(PayloadTooLargeError, match=r"^note 1: \d+ > \d+$"):
        await write(buffer, "t", "x" * 70_000)
    assert await wal.last_seq() == 0
    await buffer.close()


@pytest.mark.parametrize("retriable", [True, False])
async def test_a_failed_flush_keeps_the_refusals_retriable(retriable: bool) -> None:
    buffer = notes_buffer(RefusingSink(retriable=retriable))
    await write(buffer, "t", "x")
    with pytest.raises(FlushFailedError) as caught:
        await buffer.force_flush("t", timeout_s=5)
    assert caught.value.retriable is retriable
    assert caught.value.thread_id == "t"
    await buffer.close()


def raced_sink(times: int) -> RefusingSink:
    """Refuses a thread's batch `times` times as refused by what is gone already."""
    return RefusingSink(retry_now=True, times=times, error="raced")


async def test_a_flush_refused_by_what_is_gone_already_tries_again_at_once() -> None:
    """The Postgres store refuses a batch whose run another thread's transaction still
    held, and by the time it looks the owner up the run is free (`retry_now`): the same
    entries may apply, so `flush_thread` applies them instead of raising."""
    sink = raced_sink(times=2)
    buffer = notes_buffer(sink)
    await write(buffer, "t", "x")
    assert await buffer.force_flush("t", timeout_s=5) == 1
    assert sink.calls == 3
    await buffer.close()


async def test_a_flush_refused_again_and_again_gives_up() -> None:
    buffer = notes_buffer(raced_sink(times=1_000))
    await write(buffer, "t", "x")
    with pytest.raises(ConflictError, match=r"kept moving .*\(last refused: raced\)$"):
        await buffer.force_flush("t", timeout_s=5)
    await buffer.close()


class PairSink(NotesSink):
    """Applies thread "t" and "o" only together, in one call (each waits for the other,
    as two re-created threads that swapped their runs); `moved_once`: the first call
    holding both says "o" was flushed meanwhile (STALE) and refuses "t"."""

    def __init__(self, *, moved_once: bool = False) -> None:
        super().__init__()
        self.moved_once = moved_once
        self.calls: list[list[str]] = []

    async def apply(self, batches: Sequence[Sequence[Note]]) -> list[ApplyOutcome]:
        ids = [b[0].thread_id for b in batches]
        self.calls.append(ids)
        if {"t", "o"} <= set(ids) and not self.moved_once:
            return await super().apply(batches)
        if {"t", "o"} <= set(ids):
            self.moved_once = False
            return [
                ApplyOutcome("o", ApplyStatus.STALE, 0)
                if t == "o"
                else ApplyOutcome(t, ApplyStatus.FAILED, 0, error="no", waits_for="o")
                for t in ids
            ]
        other = {"t": "o", "o": "t"}
        return [
            ApplyOutcome(t, ApplyStatus.FAILED, 0, error=f"needs {other[t]}", waits_for=other[t])
            for t in ids
        ]


@pytest.mark.parametrize("moved_once", [False, True])
async def test_a_flush_waiting_for_an_owner_applies_both_in_one_call(moved_once: bool) -> None:
    """`flush_thread` flushed the owner alone first and then the thread: two threads that
    each wait for the other could never be flushed. Now the owner joins the thread's
    apply call. An owner found moved meanwhile (STALE) is no reason to give up."""
    sink = PairSink(moved_once=moved_once)
    buffer = notes_buffer(sink)
    await write(buffer, "t", "x")
    await write(buffer, "o", "y")
    assert await buffer.force_flush("t", timeout_s=5) == 1
    assert sink.calls == [["t"], ["t", "o"]] + ([["t", "o"]] if moved_once else [])
    assert sink.texts == {"t": ["x"], "o": ["y"]}
    assert await buffer.force_flush("o", timeout_s=5) == 1
    assert len(sink.calls) == 2 + moved_once  # nothing left to apply for "o"
    await buffer.close()


async def test_a_flush_waiting_for_an_owner_that_cannot_help_fails() -> None:
    sink = PairSink()
    buffer = notes_buffer(sink)
    await write(buffer, "t", "x")  # "o" has nothing in the WAL: it cannot join
    with pytest.raises(FlushFailedError, match="needs o"):
        await buffer.force_flush("t", timeout_s=5)
    assert sink.calls == [["t"], ["t"]]
    await buffer.close()


class KeeperSink(NotesSink):
    """Thread "o" keeps a run "t" claims too: "t" is refused waiting for "o", and with
    "t" in the same call "o" is refused as by what is gone already (`retry_now`), as the
    Postgres store answers when both claims undo each other."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[list[str]] = []

    async def apply(self, batches: Sequence[Sequence[Note]]) -> list[ApplyOutcome]:
        ids = [b[0].thread_id for b in batches]
        self.calls.append(ids)
        return [
            ApplyOutcome(t, ApplyStatus.FAILED, 0, error="no", waits_for="o")
            if t == "t"
            else ApplyOutcome(t, ApplyStatus.FAILED, 0, error="raced", retry_now=True)
            for t in ids
        ]


async def test_a_helper_refused_by_the_threads_own_claim_is_no_reason_to_spin() -> None:
    """A helper's `retry_now` counted as "moved meanwhile": the same call was tried 20
    times and ended in ConflictError ("kept moving"). The thread's refusal tells."""
    sink = KeeperSink()
    buffer = notes_buffer(sink)
    await write(buffer, "t", "x")
    await write(buffer, "o", "y")
    with pytest.raises(FlushFailedError, match="no"):
        await buffer.force_flush("t", timeout_s=5)
    assert sink.calls == [["t"], ["t", "o"]]
    await buffer.close()


async def test_entries_gone_from_the_stream_raise_their_own_error() -> None:
    buffer = notes_buffer(NotesSink())
    for i in range(3):
        await write(buffer, "t", f"n{i}")
    wal = MemoryWal(CONFIG, buffer.wal.server)  # type: ignore[attr-defined]
    await wal.purge_below(3)
    other = notes_buffer(NotesSink(), wal)  # another process: no entries cached
    with pytest.raises(WalEntriesMissingError) as caught:
        await other.log.entries_between("t", 0, 3, None)
    assert (caught.value.thread_id, caught.value.reached, caught.value.upto) == ("t", 0, 3)
    with pytest.raises(WalEntriesMissingError):
        await flush_thread(other.log, NotesSink(), "t")
    await other.close()
    await buffer.close()


async def test_a_long_unflushed_tail_is_read_in_a_few_round_trips() -> None:
    """A reader without the entries cached (another process, or a tail longer than the
    cache keeps) walks the subject: a few direct gets, then the rest in one scan."""
    buffer = notes_buffer(NotesSink())
    for i in range(40):
        await write(buffer, "t", f"n{i}")
        if i % 10 == 0:
            await write(buffer, "u", f"other{i}")  # another thread's entries in between
    wal = MemoryWal(CONFIG, buffer.wal.server)  # type: ignore[attr-defined]
    other = notes_buffer(NotesSink(), wal)
    before = wal.requests
    chain = await other.log.entries_between("t", 0, 40, None)
    assert [n.text for n in chain] == [f"n{i}" for i in range(40)]
    # 4 direct gets and a scan (a consumer made and deleted); one get per entry took 40.
    assert wal.requests - before == WALK_DIRECT_GETS + 2
    # A walk whose caller stops at the first entry (the retention check) makes one get.
    before = wal.requests
    async for _, first in other.log.walk("t", 1):
        assert first is not None
        assert first.text == "n0"
        break
    assert wal.requests - before == 1
    await other.close()
    await buffer.close()


async def test_close_drains_then_closes_and_refuses_afterwards() -> None:
    sink = NotesSink()
    buffer = notes_buffer(sink)
    await write(buffer, "t", "a")
    settled: list[str] = []

    async def settle() -> None:
        settled.append("settled")

    await buffer.close(settle=settle)
    assert settled == ["settled"]
    assert sink.texts == {"t": ["a"]}
    with pytest.raises(StoreClosedError):
        buffer.check_open()
    await buffer.close()  # closing twice is fine


async def test_a_drain_the_sink_refuses_still_closes_the_wal() -> None:
    buffer = notes_buffer(RefusingSink(retriable=False))
    await write(buffer, "t", "a")
    await buffer.close()  # logged, not raised: the entries stay in the WAL
    with pytest.raises(StoreError):
        await buffer.wal.last_seq()


class BrokenSink(NotesSink):
    """A sink whose schema is missing: no thread's fault, no outage either."""

    async def apply(self, batches: Sequence[Sequence[Note]]) -> list[ApplyOutcome]:
        raise SchemaError("the tables are missing")


async def test_a_drain_failing_otherwise_is_raised_once_the_wal_is_closed() -> None:
    buffer = notes_buffer(BrokenSink())
    await write(buffer, "t", "a")
    with pytest.raises(SchemaError):
        await buffer.close()
    with pytest.raises(StoreError):
        await buffer.wal.last_seq()  # closed all the same


async def test_force_flush_all_flushes_every_pending_thread() -> None:
    sink = NotesSink()
    buffer = notes_buffer(sink)
    for t in ("a", "b", "c"):
        await write(buffer, t, t)
    assert await buffer.force_flush_all(timeout_s=5) == 3
    assert sink.marks == {"a": 1, "b": 1, "c": 1}
    await asyncio.sleep(0)
    await buffer.close()


async def test_lingering_hot_records_take_one_update_for_the_writes_meanwhile() -> None:
    buffer = notes_buffer(NotesSink(), background_hot=True, hot_linger_s=30.0)
    for text in "abcde":
        await write(buffer, "t", text)
    await asyncio.sleep(0.05)
    updates = buffer.writer.hot_updates
    assert updates.updates == 0  # lingering: nothing written yet
    assert await buffer.log.hot("t") is None
    # settled() cuts the linger short (a 30 s linger would outlast this wait).
    await asyncio.wait_for(updates.settled(), 5)
    assert updates.updates == 1
    assert updates.coalesced == 4
    hot = await buffer.log.hot("t")
    assert hot is not None
    assert hot.record.seq == 5
    await write(buffer, "t", "f")
    await asyncio.wait_for(buffer.close(), 5)  # closing cuts it short too
    assert updates.updates == 2


async def test_without_a_linger_each_write_advances_its_hot_record() -> None:
    buffer = notes_buffer(NotesSink(), background_hot=True)
    for text in "abc":
        await write(buffer, "t", text)
        await buffer.writer.hot_updates.settled()
    assert buffer.writer.hot_updates.updates == 3
    await buffer.close()
