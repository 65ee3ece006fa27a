"""Quarantine records: keys, JSON round trip, what an undecodable payload keeps; what a
replay reports when a thread still fails, and when the database is away."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

import pytest

from buffered_store.engine.buffer import WriteBuffer
from buffered_store.engine.flushing import ApplyOutcome, ApplyStatus
from buffered_store.engine.keys import encode_token
from buffered_store.errors import DatabaseUnavailableError, FlushFailedError
from flusher.policy import PREVIEW_BYTES, Undecodable
from flusher.quarantine import (
    Quarantine,
    QuarantineKind,
    QuarantineRecord,
    message_key,
    replay,
    replay_all,
    thread_key,
    undecodable_record,
)
from tests.unit.test_engine_buffer import notes_buffer, write
from tests.unit.test_engine_second_frontend import Note, NoteHot, NotesSink

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_keys_are_kv_safe_for_any_thread_id() -> None:
    assert message_key(42) == "m.42"
    for thread_id in ("a.b", "*", ">", "with space", "ünï"):
        key = thread_key(thread_id)
        assert key == f"t.{encode_token(thread_id)}"
        assert key.count(".") == 1
        assert " " not in key


def test_undecodable_record_keeps_a_short_preview_only() -> None:
    payload = bytes(range(100))
    record = undecodable_record(
        Undecodable("payload is not JSON", "t1"),
        subject="S.t.dDE",
        stream_seq=7,
        data=payload,
        deliveries=2,
        now=T0,
    )
    assert record.key == "m.7"
    assert record.payload_bytes == 100
    assert record.preview_hex == payload[:PREVIEW_BYTES].hex()
    assert record.seq is None
    assert not record.replayable


def test_records_round_trip_through_json() -> None:
    records = [
        QuarantineRecord(
            kind=QuarantineKind.THREAD,
            reason="rejected",
            at=T0,
            thread_id="t1",
            seq=3,
            stream_seqs=(5, 9),
        ),
        QuarantineRecord(
            kind=QuarantineKind.MESSAGE,
            reason="bad",
            at=T0,
            thread_id=None,
            subject="S.x",
            stream_seq=4,
            payload_bytes=3,
            preview_hex="616263",
            deliveries=1,
        ),
    ]
    for record in records:
        assert QuarantineRecord.from_json(record.to_json()) == record
    assert records[0].key == thread_key("t1")
    assert records[0].replayable


class DownSink(NotesSink):
    """A sink whose database is away."""

    async def apply(self, batches: Sequence[Sequence[Note]]) -> list[ApplyOutcome]:
        raise DatabaseUnavailableError("the database is away")


class RefusingSink(NotesSink):
    """Refuses one thread's data, applies the others."""

    def __init__(self, refused: str) -> None:
        super().__init__()
        self.refused = refused

    async def apply(self, batches: Sequence[Sequence[Note]]) -> list[ApplyOutcome]:
        sick = [b for b in batches if b[0].thread_id == self.refused]
        outcomes = await super().apply([b for b in batches if b not in sick])
        return [
            ApplyOutcome(self.refused, ApplyStatus.FAILED, 0, error="bad data", retriable=False)
            for _ in sick
        ] + outcomes


async def quarantined(sink: NotesSink, *threads: str) -> WriteBuffer[Note, NoteHot, int]:
    """A buffer on a memory WAL holding one entry per thread, each thread quarantined."""
    buffer = notes_buffer(sink)
    quarantine = Quarantine(buffer.wal)
    for thread_id in threads:
        await write(buffer, thread_id, "text")
        await quarantine.add_thread(thread_id, reason="sick", seq=1, stream_seqs=[], now=T0)
    return buffer


async def test_a_bulk_replay_reports_each_threads_own_failure_and_goes_on() -> None:
    sink = RefusingSink("sick")
    buffer = await quarantined(sink, "sick", "well")
    bulk = await replay_all(buffer.log, sink)
    assert [r.thread_id for r in bulk.replayed] == ["well"]
    assert [(t, e.split(":")[0]) for t, e in bulk.failed] == [("sick", "FlushFailedError")]
    assert sink.texts == {"well": ["text"]}
    assert await Quarantine(buffer.wal).thread_record("sick") is not None


async def test_replaying_a_thread_that_still_fails_names_it() -> None:
    sink = RefusingSink("sick")
    buffer = await quarantined(sink, "sick")
    with pytest.raises(FlushFailedError) as raised:
        await replay(buffer.log, sink, thread_id="sick")
    assert raised.value.thread_id == "sick"


async def test_a_bulk_replay_ends_when_the_database_is_away() -> None:
    """Every thread would fail the same way: the outage is raised, not listed per thread,
    and every record stays."""
    buffer = await quarantined(DownSink(), "a", "b")
    with pytest.raises(DatabaseUnavailableError):
        await replay_all(buffer.log, DownSink())
    quarantine = Quarantine(buffer.wal)
    assert [r.thread_id for r in await quarantine.records()] == ["a", "b"]
