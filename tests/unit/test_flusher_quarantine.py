"""Quarantine records: keys, JSON round trip, what an undecodable payload keeps."""

from __future__ import annotations

from datetime import UTC, datetime

from buffered_store.engine.keys import encode_token
from flusher.policy import PREVIEW_BYTES, Undecodable
from flusher.quarantine import (
    QuarantineKind,
    QuarantineRecord,
    message_key,
    thread_key,
    undecodable_record,
)

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
