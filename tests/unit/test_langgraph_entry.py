# ruff: noqa: E501 (the pinned bytes are kept on one line each, as they were written)
"""The LangGraph front-end's WAL entries: format 2 (operations, binary values after the
JSON object) round trips, format 1 as earlier versions wrote it still reads, anything
malformed is refused when decoded (so the flusher quarantines it instead of failing its
flush), and a delta blob rebuilds exactly the msgpack list LangGraph's serializer makes."""

from __future__ import annotations

from datetime import UTC, datetime

import orjson
import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

from buffered_store.errors import CorruptEntryError
from buffered_store.langgraph.decoding import (
    decode_entry,
)
from buffered_store.langgraph.entry import (
    BlobRow,
    Claim,
    Copy,
    Delete,
    LgEntry,
    Put,
    Runs,
    WriteRow,
    Writes,
    delta_blob,
    encode_entry,
    kind_of,
    msgpack_list_header,
    msgpack_list_start,
)
from buffered_store.langgraph.format import (
    LG_FORMAT,
)

T = datetime(2026, 3, 4, 5, 6, 7, 890123, tzinfo=UTC)

# Written by the format-1 encoder of commit 137e543 (buffered_store/langgraph/entry.py).
V1_PUT = b'{"v":1,"t":"th \xc3\xbc","s":3,"k":"put","at":"2026-03-04T05:06:07.890123+00:00","w":"w1","ns":"","id":"c2","pid":"c1","cp":{"v":4,"id":"c2","channel_values":{"n":1},"channel_versions":{"n":2,"m":"00002"}},"md":{"source":"loop","step":1},"b":[["m","00002","msgpack","kgEC"],["e","3","empty",null]]}'
V1_WRITES = b'{"v":1,"t":"th \xc3\xbc","s":4,"k":"w","at":"2026-03-04T05:06:07.890123+00:00","w":"w1","j":true,"ns":"child:1","id":"c2","task":"task1","path":"p:1","up":false,"rows":[[0,"x","json","InYxIg=="],[-1,"__error__","msgpack","oWU="]]}'
V1_COPY = b'{"v":1,"t":"t2","s":9,"k":"copy","at":"2026-03-04T05:06:07.890123+00:00","w":"","cps":[["","c1",null,{"v":4},{"step":0}]],"bl":[["","m","1","msgpack","kA=="]],"ws":[["","c1","tk","",0,"x","json","MQ=="]]}'
V1_RUNS = b'{"v":1,"t":"t2","s":10,"k":"runs","at":"2026-03-04T05:06:07.890123+00:00","w":"","runs":["r1","r2"]}'
V1_CLAIM = b'{"v":1,"t":"t2","s":11,"k":"claim","at":"2026-03-04T05:06:07.890123+00:00","w":"","owner":"w-1"}'

PUT = Put(
    ns="",
    checkpoint_id="c2",
    parent_id="c1",
    checkpoint=b'{"v":4,"id":"c2","channel_values":{"n":1},"channel_versions":{"n":2,"m":"00002"}}',
    metadata=b'{"source":"loop","step":1}',
    blobs=(
        BlobRow("m", "00002", "msgpack", b"\x92\x01\x02"),
        BlobRow("e", "3", "empty", None),
    ),
)
WRITES = Writes(
    ns="child:1",
    checkpoint_id="c2",
    task_id="task1",
    task_path="p:1",
    upsert=False,
    rows=(WriteRow(0, "x", "json", b'"v1"'), WriteRow(-1, "__error__", "msgpack", b"\xa1e")),
)


def entry(*ops: object, seq: int = 3, jump: bool = False) -> LgEntry:
    return LgEntry(
        thread_id="th \u00fc",
        seq=seq,
        kind=kind_of(ops),  # type: ignore[arg-type]
        at=T,
        ops=ops,  # type: ignore[arg-type]
        writer="w1",
        jump=jump,
    )


def test_format_1_entries_read_as_the_operations_they_held() -> None:
    put = decode_entry(V1_PUT, stream_seq=12)
    assert (put.kind, put.seq, put.stream_seq, put.thread_id) == ("put", 3, 12, "th \u00fc")
    [op] = put.ops
    assert isinstance(op, Put)
    assert orjson.loads(op.checkpoint) == orjson.loads(PUT.checkpoint)
    assert (op.ns, op.checkpoint_id, op.parent_id, op.blobs) == ("", "c2", "c1", PUT.blobs)
    writes = decode_entry(V1_WRITES)
    assert writes.jump
    assert writes.ops == (WRITES,)
    [copy] = decode_entry(V1_COPY).ops
    assert copy == Copy(
        checkpoints=(("", "c1", None, b'{"v":4}', b'{"step":0}'),),
        blobs=(("", "m", "1", "msgpack", b"\x90"),),
        writes=(("", "c1", "tk", "", 0, "x", "json", b"1"),),
    )
    assert decode_entry(V1_RUNS).ops == (Runs(("r1", "r2")),)
    assert decode_entry(V1_CLAIM).ops == (Claim("w-1"),)


def test_format_1_is_still_written_for_rolling_upgrades() -> None:
    for payload, op in ((V1_PUT, PUT), (V1_WRITES, WRITES)):
        old = decode_entry(payload)
        again = encode_entry(
            LgEntry(
                thread_id=old.thread_id,
                seq=old.seq,
                kind=kind_of([op]),
                at=T,
                ops=(op,),
                writer="w1",
                jump=old.jump,
            ),
            wal_format=1,
        )
        assert orjson.loads(again) == orjson.loads(payload)


def test_format_2_carries_values_as_raw_bytes_and_round_trips() -> None:
    delta = BlobRow("messages", "00004", "msgpack", b"\xa1a\xa1b", base="00003", count=5)
    put = Put("", "c3", "c2", b'{"v":4}', b"{}", (delta, BlobRow("e", "1", "empty", None)))
    original = entry(PUT, WRITES, put, jump=True)
    payload = encode_entry(original)
    json_part, _, attached = payload.partition(b"\x00")
    assert b"kgEC" not in payload
    assert b"\x92\x01\x02" in attached
    assert orjson.loads(json_part)["k"] == "o"
    decoded = decode_entry(payload, stream_seq=7)
    assert decoded.ops == original.ops
    assert (decoded.seq, decoded.jump, decoded.stream_seq, decoded.writer) == (3, True, 7, "w1")


def test_logical_operations_keep_their_own_kinds() -> None:
    for op, kind in ((Delete(), "del"), (Runs(("r",)), "runs"), (Claim("me"), "claim")):
        payload = encode_entry(entry(op))
        assert b"\x00" not in payload
        decoded = decode_entry(payload)
        assert (decoded.kind, decoded.ops) == (kind, (op,))
    assert decode_entry(encode_entry(entry(Delete()))).deletes
    with pytest.raises(ValueError, match="puts and writes"):
        kind_of([PUT, Delete()])


def _mangled(edit: object) -> bytes:
    payload = encode_entry(entry(PUT, WRITES))
    json_part, _, attached = payload.partition(b"\x00")
    data = orjson.loads(json_part)
    edit(data)  # type: ignore[operator]
    return orjson.dumps(data) + b"\x00" + attached


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (_mangled(lambda d: d["o"][0].pop()), "malformed"),  # a put missing its blobs
        (_mangled(lambda d: d["o"][0].__setitem__(4, 10_000)), "past the end"),
        (_mangled(lambda d: d["o"][1].__setitem__(5, "yes")), "upsert"),
        (_mangled(lambda d: d["o"][0].__setitem__(1, "n" * 1025)), "checkpoint_ns is longer"),
        (_mangled(lambda d: d["o"][0].__setitem__(1, "a\x00b")), "checkpoint_ns must be"),
        (_mangled(lambda d: d["o"].append(["x"])), "unknown operation"),
        (_mangled(lambda d: d["o"][1][6][0].__setitem__(3, -7)), "attachment length"),
        (encode_entry(entry(PUT)) + b"junk", "no operation names"),
        (V1_PUT.replace(b'"md":{"source":"loop","step":1},', b""), "malformed 'put'"),
        (V1_WRITES.replace(b'"oWU="', b'"not base64!"'), "not base64"),
        (V1_RUNS + b"\x00extra", "no attachments"),
        (V1_CLAIM.replace(b'"k":"claim"', b'"k":"nope"'), "unknown LangGraph entry kind"),
    ],
)
def test_entries_that_cannot_be_applied_are_refused_when_decoded(payload: bytes, why: str) -> None:
    with pytest.raises(CorruptEntryError, match=why):
        LG_FORMAT.decode_entry(payload)


@pytest.mark.parametrize("count", [0, 1, 15, 16, 17, 300, 70_000])
def test_msgpack_list_headers(count: int) -> None:
    header = msgpack_list_header(count)
    assert msgpack_list_start(header + b"\xc0") == len(header)


@pytest.mark.parametrize("base_len", [0, 3, 14, 15, 16, 40])
def test_a_delta_rebuilds_the_list_the_serializer_makes(base_len: int) -> None:
    serde = JsonPlusSerializer()
    history = [
        (HumanMessage if i % 2 else AIMessage)(content=f"m{i} " + "é" * i, id=f"id{i}")
        for i in range(base_len + 3)
    ]
    typ, base = serde.dumps_typed(history[:base_len])
    typ_tail, tail = serde.dumps_typed(history[base_len:])
    assert typ == typ_tail == "msgpack"
    items = tail[msgpack_list_start(tail) :]
    assert delta_blob(base, len(history), items) == serde.dumps_typed(history)[1]
    assert serde.loads_typed((typ, delta_blob(base, len(history), items))) == history
