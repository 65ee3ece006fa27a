"""`buffered_store.threadrun.entry`: the WAL entry codec and the KV records around it."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta, timezone
from types import MappingProxyType
from typing import Any

import orjson
import pytest

from buffered_store.engine.entries import WIRE_VERSION, FlushedMark, decode_flushed, encode_flushed
from buffered_store.errors import CorruptEntryError
from buffered_store.model.changes import (
    EntryKind,
    WalEntry,
)
from buffered_store.model.messages import encode_message
from buffered_store.model.records import RunRecord, RunStatus, Thread
from buffered_store.threadrun.entry import (
    HotRecord,
    advance_hot,
    decode_entry,
    decode_hot,
    encode_entry,
    encode_hot,
    messages_of,
    run_json,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _run(thread_id: str = "t.1", **overrides: Any) -> RunRecord:
    fields: dict[str, Any] = {"run_id": "r1", "thread_id": thread_id, "agent_id": "a"}
    return RunRecord(**(fields | overrides))


def _checkpoint(**overrides: Any) -> WalEntry:
    fields: dict[str, Any] = {
        "thread_id": "t.1",
        "seq": 3,
        "kind": EntryKind.CHECKPOINT,
        "at": T0 + timedelta(seconds=5),
        "keep": 2,
        "messages": (encode_message({"role": "user", "content": "é🧵"}, 0),),
        "message_count": 3,
        "run": _run(
            status=RunStatus.DONE,
            created_at=T0,
            updated_at=T0,
            finished_at=T0,
            output={"x": [1.5, None]},
            metadata={"m": 1},
        ),
        "created_at": T0,
        "parent_thread_id": "parent",
        "metadata": {"k": ["v"]},
        "writer": "nonce",
    }
    return WalEntry(**(fields | overrides))


def _wire(entry: WalEntry, **changes: Any) -> bytes:
    data = orjson.loads(encode_entry(entry))
    data.update(changes)
    return orjson.dumps({k: v for k, v in data.items() if v is not _DROP})


_DROP = object()


def test_checkpoint_entry_round_trips() -> None:
    entry = _checkpoint()
    decoded = decode_entry(encode_entry(entry))
    assert decoded == entry
    assert decoded.messages == entry.messages
    assert decode_entry(encode_entry(entry), stream_seq=42).stream_seq == 42


def test_delete_entry_round_trips() -> None:
    entry = WalEntry(thread_id="t", seq=9, kind=EntryKind.DELETE, at=T0, writer="w")
    decoded = decode_entry(encode_entry(entry))
    assert decoded == entry
    assert decoded.thread is None


def test_entry_without_run_or_messages_round_trips() -> None:
    entry = _checkpoint(run=None, keep=0, messages=(), message_count=0, metadata={})
    assert decode_entry(encode_entry(entry)) == entry


def test_message_bytes_are_canonical_after_decoding() -> None:
    entry = _checkpoint()
    payload = encode_entry(entry).replace(b'{"content"', b'{ "content"')
    assert decode_entry(payload).messages == entry.messages


def test_thread_summary_of_a_checkpoint() -> None:
    entry = _checkpoint()
    assert entry.thread == Thread(
        thread_id="t.1",
        parent_thread_id="parent",
        metadata={"k": ["v"]},
        created_at=T0,
        updated_at=entry.at,
        latest_run_id="r1",
        message_count=3,
    )
    assert _checkpoint(created_at=None).thread is not None
    assert _checkpoint(created_at=None).thread.created_at == entry.at  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "payload",
    [
        b"not-json",
        b"",
        b"[]",
        b"{}",
        b'"string"',
        b'{"v": 1}',
        orjson.dumps({"v": WIRE_VERSION + 1, "t": "t", "s": 1, "k": "del", "at": T0.isoformat()}),
    ],
)
def test_garbage_payloads_are_corrupt(payload: bytes) -> None:
    with pytest.raises(CorruptEntryError):
        decode_entry(payload)


@pytest.mark.parametrize(
    "changes",
    [
        {"k": "bogus"},
        {"t": ""},
        {"t": 5},
        {"s": 0},
        {"s": -1},
        {"s": "1"},
        {"at": "2026-01-01T00:00:00"},  # naive
        {"at": "yesterday"},
        {"keep": -1},
        {"keep": "2"},
        {"n": 99},  # count != keep + len(messages)
        {"m": [{"content": "no role"}]},
        {"m": ["text"]},
        {"m": "text"},
        {"run": {"run_id": "r1"}},
        {"run": _run(thread_id="other").to_json()},
        {"c": _DROP},
        {"keep": _DROP},
        {"m": _DROP},
        {"s": _DROP},
    ],
)
def test_malformed_entries_are_corrupt(changes: dict[str, Any]) -> None:
    with pytest.raises(CorruptEntryError):
        decode_entry(_wire(_checkpoint(), **changes))


def test_hot_record_round_trips_and_advances_its_window() -> None:
    hot: HotRecord | None = None
    entries = [_checkpoint(seq=seq) for seq in range(1, 6)]
    for entry in entries:
        hot = advance_hot(hot, entry, stream_seq=100 + entry.seq, window=3)
    assert hot is not None
    assert (hot.seq, hot.stream_seq, hot.thread) == (5, 105, entries[-1].thread)
    assert hot.recent == ((3, 103), (4, 104), (5, 105))
    assert hot.stream_seq_of(4) == 104
    assert hot.stream_seq_of(2) is None
    assert decode_hot(encode_hot(hot)) == hot


def test_hot_record_of_a_delete_has_no_thread() -> None:
    delete = WalEntry(thread_id="t", seq=2, kind=EntryKind.DELETE, at=T0)
    hot = advance_hot(None, delete, stream_seq=7, window=4)
    assert (hot.thread, tuple(hot.recent)) == (None, ((2, 7),))
    assert decode_hot(encode_hot(hot)) == hot


@pytest.mark.parametrize("payload", [b"not-json", b"{}", b'{"s": "x", "ss": 1}', b"[]"])
def test_corrupt_hot_records(payload: bytes) -> None:
    with pytest.raises(CorruptEntryError):
        decode_hot(payload)


def test_flushed_mark_round_trips() -> None:
    mark = FlushedMark(7, 1234)
    assert decode_flushed(encode_flushed(mark)) == mark


@pytest.mark.parametrize("payload", [b"not-json", b"{}", b'{"s": 1}', b"null"])
def test_corrupt_flushed_marks(payload: bytes) -> None:
    with pytest.raises(CorruptEntryError):
        decode_flushed(payload)


def test_messages_of_decodes_bytes() -> None:
    assert messages_of([b'{"role":"user"}', b'{"a":[1],"role":"tool"}']) == [
        {"role": "user"},
        {"role": "tool", "a": [1]},
    ]


class _Later(datetime):
    """A datetime subclass (orjson refuses those: the codec must not hand it one)."""


@pytest.mark.parametrize(
    "at",
    [
        T0 + timedelta(microseconds=7),
        datetime(2026, 1, 1, 2, tzinfo=timezone(timedelta(hours=2))),
        # orjson would write +05:30 for this offset, another instant.
        datetime(2026, 1, 1, tzinfo=timezone(timedelta(hours=5, minutes=30, seconds=15))),
        _Later(2026, 1, 1, tzinfo=UTC),
    ],
)
@pytest.mark.parametrize("metadata", [{"k": 1}, MappingProxyType({"k": 1})])
def test_times_and_records_are_written_as_their_isoformat_and_to_json(
    at: datetime, metadata: Mapping[str, Any]
) -> None:
    """Records go to orjson as dataclasses and datetimes as themselves where orjson
    writes what `to_json()` and `isoformat()` would; everywhere else as those."""
    run = _run(created_at=at, updated_at=at, finished_at=at, metadata=metadata)
    entry = _checkpoint(at=at, created_at=at, run=run, metadata=metadata)
    wire = orjson.loads(encode_entry(entry))
    assert (wire["at"], wire["c"], wire["md"]) == (at.isoformat(), at.isoformat(), {"k": 1})
    assert wire["run"] == orjson.loads(orjson.dumps(run.to_json()))
    assert decode_entry(encode_entry(entry)).run == run
    hot = advance_hot(None, entry, stream_seq=9, window=4)
    assert hot.thread is not None
    assert orjson.loads(encode_hot(hot))["th"] == orjson.loads(orjson.dumps(hot.thread.to_json()))
    decoded = decode_hot(encode_hot(hot))
    assert decoded.thread is not None
    assert decoded.thread.created_at == at
    assert decoded.runs[0][0] == run


def test_a_record_subclass_is_written_through_its_own_to_json() -> None:
    """Only the records themselves go to orjson as dataclasses: a subclass may have
    fields or a `to_json` of its own."""

    class Tagged(RunRecord):
        def to_json(self) -> dict[str, Any]:
            return {**super().to_json(), "metadata": {"tagged": True}}

    run = Tagged(run_id="r1", thread_id="t.1", agent_id="a")
    assert orjson.loads(run_json(run)[0])["metadata"] == {"tagged": True}
