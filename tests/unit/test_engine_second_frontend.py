"""The engine carries a front-end it has never heard of: a toy "notes" front-end, written
here in a few dozen lines, appends through the engine's `Writer`, is flushed by the
`flusher.Flusher` and inline by `flush_thread`, over the in-memory WAL. If the engine
still assumed thread-run entries anywhere on these paths, this would fail.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime

import orjson
import pytest

from buffered_store.config import BufferedStoreConfig
from buffered_store.engine.appender import Writer
from buffered_store.engine.cursors import Cursor
from buffered_store.engine.entries import Header, chain_after, header_json, parse_entry
from buffered_store.engine.flushing import ApplyOutcome, ApplyStatus
from buffered_store.engine.threadlog import ThreadLog, flush_thread
from buffered_store.errors import CorruptEntryError, PayloadTooLargeError
from buffered_store.testing import MemoryJetStream, MemoryWal
from flusher import Flusher

T0 = datetime(2026, 1, 1, tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class Note:
    thread_id: str
    seq: int
    at: datetime
    text: str
    writer: str = ""
    jump: bool = False
    stream_seq: int = 0

    @property
    def deletes(self) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class NoteHot:
    seq: int
    stream_seq: int
    recent: tuple[tuple[int, int], ...] = ()
    deleted_seq: int = 0
    chain_from: int = 1
    count: int = 0


class NotesFormat:
    """Entries carry one text; the hot record counts them; the cursor state is the count."""

    def decode_entry(self, payload: bytes, *, stream_seq: int = 0) -> Note:
        header, data = parse_entry(payload)
        if header.kind != "note" or not isinstance(data.get("x"), str):
            raise CorruptEntryError("not a note")
        return Note(
            header.thread_id, header.seq, header.at, data["x"], header.writer, False, stream_seq
        )

    def encode(self, note: Note) -> bytes:
        head = header_json(Header(note.thread_id, note.seq, "note", note.at, note.writer))
        return orjson.dumps({**head, "x": note.text})

    def decode_hot(self, data: bytes) -> NoteHot:
        raw = orjson.loads(data)
        return NoteHot(raw["s"], raw["ss"], tuple(tuple(p) for p in raw["r"]), 0, 1, raw["n"])

    def encode_hot(self, record: NoteHot, *, limit: int) -> bytes:
        raw = {"s": record.seq, "ss": record.stream_seq, "r": record.recent, "n": record.count}
        return orjson.dumps(raw)

    def advance_hot(
        self, previous: NoteHot | None, entry: Note, stream_seq: int, *, window: int
    ) -> NoteHot:
        recent = ((previous.recent if previous else ()) + ((entry.seq, stream_seq),))[-window:]
        count = (previous.count if previous else 0) + 1
        return NoteHot(entry.seq, stream_seq, recent, count=count)

    def with_recent(self, record: NoteHot, recent: Sequence[tuple[int, int]]) -> NoteHot:
        return replace(record, recent=tuple(recent))

    def placed(self, entry: Note, stream_seq: int) -> Note:
        return replace(entry, stream_seq=stream_seq)

    def known_state(self, hot: NoteHot | None, same_seq: int | None) -> int | None:
        return 0 if hot is None else hot.count

    def state_after(self, state: int | None, entry: Note, *, owned: bool) -> int | None:
        return None if state is None else state + 1

    def state_bytes(self, state: int) -> int:
        return 8

    def added_bytes(self, entry: Note) -> int:
        return 0


class NotesSink:
    """Each thread's texts and watermark, applied in seq order with no gap."""

    def __init__(self) -> None:
        self.texts: dict[str, list[str]] = {}
        self.marks: dict[str, int] = {}
        self.cycle_texts: list[int] = []
        """Characters of text each apply call was given."""

    async def apply(self, batches: Sequence[Sequence[Note]]) -> list[ApplyOutcome]:
        self.cycle_texts.append(sum(len(note.text) for batch in batches for note in batch))
        outcomes = []
        for batch in batches:
            thread_id = batch[0].thread_id
            mark = self.marks.get(thread_id, 0)
            chain = chain_after(batch, mark)
            if not any(note.seq > mark for note in batch):
                outcomes.append(ApplyOutcome(thread_id, ApplyStatus.STALE, mark))
            elif not chain:
                outcomes.append(ApplyOutcome(thread_id, ApplyStatus.GAP, mark, mark + 1))
            else:
                self.texts.setdefault(thread_id, []).extend(note.text for note in chain)
                self.marks[thread_id] = chain[-1].seq
                outcomes.append(ApplyOutcome(thread_id, ApplyStatus.APPLIED, chain[-1].seq))
        return outcomes

    async def flushed_seqs(self, thread_ids: Sequence[str]) -> dict[str, int]:
        return {thread_id: self.marks.get(thread_id, 0) for thread_id in thread_ids}


FMT = NotesFormat()


async def write_note(writer: Writer[Note, NoteHot, int], thread_id: str, text: str) -> Note:
    def build(cursor: Cursor[NoteHot, int]) -> tuple[Note, bytes]:
        note = Note(thread_id, cursor.seq + 1, T0, text, writer.nonce())
        return note, FMT.encode(note)

    deadline = asyncio.get_running_loop().time() + 5
    note, _ = await writer.write(thread_id, build, None, deadline=deadline)
    return note


async def test_a_foreign_front_end_appends_and_the_flusher_drains_it() -> None:
    server = MemoryJetStream()
    config = BufferedStoreConfig(
        stream_name="NOTES", hot_bucket="notes-hot", consumer_name="notes", flush_interval_s=0.05
    )
    wal = MemoryWal(config, server)
    writer: Writer[Note, NoteHot, int] = Writer(wal, config, FMT)
    written = [await write_note(writer, t, f"{t}-{i}") for i in range(3) for t in ("a", "b")]
    assert [n.seq for n in written if n.thread_id == "a"] == [1, 2, 3]
    hot = await ThreadLog(wal, config, FMT).hot("a")
    assert hot is not None
    assert (hot.record.seq, hot.record.count) == (3, 3)

    sink = NotesSink()
    async with Flusher(sink, config, wal=MemoryWal(config, server), fmt=FMT) as flusher:
        await flusher.wait_idle(timeout_s=5)
    assert sink.texts == {"a": ["a-0", "a-1", "a-2"], "b": ["b-0", "b-1", "b-2"]}
    state = await wal.consumer_state()
    assert (state.num_pending, state.num_ack_pending, state.ack_floor) == (0, 0, 6)
    assert await sink.flushed_seqs(["a", "b"]) == {"a": 3, "b": 3}
    await wal.close()


async def test_a_backlog_of_large_entries_is_flushed_in_cycles_of_flush_batch_bytes() -> None:
    """24 entries of about 10 KB with `flush_batch_bytes` at 32 KB: every cycle holds
    at most the budget plus one entry (the one that reaches it), and all are flushed."""
    server = MemoryJetStream()
    config = BufferedStoreConfig(
        stream_name="NOTES",
        hot_bucket="notes-hot",
        consumer_name="notes",
        flush_interval_s=0.05,
        flush_batch_bytes=32 * 1024,
    )
    wal = MemoryWal(config, server)
    writer: Writer[Note, NoteHot, int] = Writer(wal, config, FMT)
    for i in range(12):
        for thread in ("a", "b"):
            await write_note(writer, thread, f"{i:02d}" + "x" * 10_000)
    sink = NotesSink()
    async with Flusher(sink, config, wal=MemoryWal(config, server), fmt=FMT) as flusher:
        await flusher.wait_idle(timeout_s=5)
    assert [len(sink.texts[t]) for t in ("a", "b")] == [12, 12]
    assert sum(sink.cycle_texts) == 24 * 10_002
    assert len(sink.cycle_texts) >= 6
    assert max(sink.cycle_texts) <= 32 * 1024 + 10_002
    await wal.close()


async def test_flush_thread_applies_a_foreign_front_ends_entries_inline() -> None:
    config = BufferedStoreConfig(stream_name="NOTES", hot_bucket="notes-hot", consumer_name="n")
    wal = MemoryWal(config, MemoryJetStream())
    writer: Writer[Note, NoteHot, int] = Writer(wal, config, FMT)
    for i in range(4):
        await write_note(writer, "t", f"n{i}")
    sink = NotesSink()
    assert await flush_thread(ThreadLog(wal, config, FMT), sink, "t") == 4
    assert sink.texts["t"] == ["n0", "n1", "n2", "n3"]
    # A second writer instance continues the thread's seqs from the WAL, not from 1.
    other: Writer[Note, NoteHot, int] = Writer(MemoryWal(config, wal.server), config, FMT)
    assert (await write_note(other, "t", "n4")).seq == 5
    await wal.close()


async def test_an_entry_larger_than_the_wal_accepts_is_refused_as_not_written() -> None:
    """Refused before it is sent: `PayloadTooLargeError`, never "commit unknown"."""
    config = BufferedStoreConfig(stream_name="NOTES", hot_bucket="notes-hot", consumer_name="n")
    wal = MemoryWal(config, MemoryJetStream(max_payload=64 * 1024))
    writer: Writer[Note, NoteHot, int] = Writer(wal, config, FMT)
    with pytest.raises(PayloadTooLargeError):
        await write_note(writer, "t", "x" * 70_000)
    assert writer.commit_unknown == 0
    assert await wal.last_seq() == 0
    assert (await write_note(writer, "t", "small")).seq == 1
    await wal.close()
