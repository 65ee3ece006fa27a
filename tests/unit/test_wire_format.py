# ruff: noqa: E501 (the pinned bytes are kept on one line each, as they were written)
"""The wire format of WAL entries and hot records, pinned byte for byte.

The bytes below were produced by the code before the engine extraction (commit c9901f4,
`buffered_store.entry`): entries and hot records already in a WAL must keep reading, and
new ones must read in older processes during a rolling upgrade.
"""

from __future__ import annotations

from datetime import UTC, datetime

from buffered_store.threadrun.entry import (
    EntryKind,
    WalEntry,
    advance_hot,
    decode_entry,
    decode_hot,
    encode_entry,
    encode_hot,
)
from buffered_store.threadrun.records import RunRecord, RunStatus

T = datetime(2026, 3, 4, 5, 6, 7, 890123, tzinfo=UTC)
RUN = RunRecord(
    run_id="r1",
    thread_id="th \u00fc",
    agent_id="a",
    status=RunStatus.DONE,
    created_at=T,
    updated_at=T,
    finished_at=T,
    steps=3,
    input_tokens=5,
    output_tokens=7,
    output={"x": [1, 2]},
    metadata={"k": "v"},
)
CP = WalEntry(
    thread_id="th \u00fc",
    seq=7,
    kind=EntryKind.CHECKPOINT,
    at=T,
    keep=2,
    messages=(b'{"content":"hi","role":"user"}',),
    message_count=3,
    run=RUN,
    created_at=T,
    parent_thread_id="p",
    metadata={"m": 1},
    writer="w1",
)
JUMPED = WalEntry(
    thread_id="th \u00fc",
    seq=1700000000000000,
    kind=EntryKind.CHECKPOINT,
    at=T,
    messages=(b'{"role":"a"}',),
    message_count=1,
    writer="w2",
    jump=True,
    created_at=T,
)
DELETED = WalEntry(thread_id="th \u00fc", seq=8, kind=EntryKind.DELETE, at=T, writer="w3")

CHECKPOINT: bytes = b'{"v":1,"t":"th \xc3\xbc","s":7,"k":"cp","at":"2026-03-04T05:06:07.890123+00:00","w":"w1","keep":2,"n":3,"run":{"run_id":"r1","thread_id":"th \xc3\xbc","agent_id":"a","status":"done","parent_run_id":null,"parent_thread_id":null,"created_at":"2026-03-04T05:06:07.890123+00:00","updated_at":"2026-03-04T05:06:07.890123+00:00","finished_at":"2026-03-04T05:06:07.890123+00:00","steps":3,"input_tokens":5,"output_tokens":7,"error":null,"output":{"x":[1,2]},"metadata":{"k":"v"}},"c":"2026-03-04T05:06:07.890123+00:00","p":"p","md":{"m":1},"m":[{"content":"hi","role":"user"}]}'
JUMP: bytes = b'{"v":1,"t":"th \xc3\xbc","s":1700000000000000,"k":"cp","at":"2026-03-04T05:06:07.890123+00:00","w":"w2","j":true,"keep":0,"n":1,"run":null,"c":"2026-03-04T05:06:07.890123+00:00","p":null,"md":{},"m":[{"role":"a"}]}'
DELETE: bytes = b'{"v":1,"t":"th \xc3\xbc","s":8,"k":"del","at":"2026-03-04T05:06:07.890123+00:00","w":"w3","m":[]}'
HOT: bytes = b'{"s":7,"ss":41,"th":{"thread_id":"th \xc3\xbc","parent_thread_id":"p","metadata":{"m":1},"created_at":"2026-03-04T05:06:07.890123+00:00","updated_at":"2026-03-04T05:06:07.890123+00:00","latest_run_id":"r1","message_count":3},"r":[[7,41]],"ru":[[{"run_id":"r1","thread_id":"th \xc3\xbc","agent_id":"a","status":"done","parent_run_id":null,"parent_thread_id":null,"created_at":"2026-03-04T05:06:07.890123+00:00","updated_at":"2026-03-04T05:06:07.890123+00:00","finished_at":"2026-03-04T05:06:07.890123+00:00","steps":3,"input_tokens":5,"output_tokens":7,"error":null,"output":{"x":[1,2]},"metadata":{"k":"v"}},7]],"rf":7,"ds":0,"cf":7}'
HOT_DELETED: bytes = b'{"s":8,"ss":42,"th":null,"r":[[7,41],[8,42]],"ru":[],"rf":8,"ds":8,"cf":7}'


def test_entries_encode_to_the_bytes_older_versions_wrote() -> None:
    assert encode_entry(CP) == CHECKPOINT
    assert encode_entry(JUMPED) == JUMP
    assert encode_entry(DELETED) == DELETE


def test_entries_older_versions_wrote_decode_to_the_same_entries() -> None:
    assert decode_entry(CHECKPOINT, stream_seq=41) == CP.__class__(
        **{**{f: getattr(CP, f) for f in CP.__slots__}, "stream_seq": 41}
    )
    assert decode_entry(JUMP) == JUMPED
    assert decode_entry(DELETE) == DELETED


def test_hot_records_keep_their_bytes() -> None:
    first = advance_hot(None, CP, 41, window=4)
    assert encode_hot(first) == HOT
    assert encode_hot(advance_hot(first, DELETED, 42, window=4)) == HOT_DELETED
    assert decode_hot(HOT) == first
