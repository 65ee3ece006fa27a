"""Whose a WAL stream is (`buffered_store.engine.frontend`): the tag, and the judgement of
an untagged stream by its entries."""

from __future__ import annotations

from datetime import UTC, datetime

import orjson

from buffered_store.engine.entries import Header, header_json
from buffered_store.engine.frontend import (
    FRONT_END_KEY,
    LANGGRAPH,
    THREADRUN,
    Verdict,
    front_end_of,
    judge_entry,
    stream_metadata,
    tag_of,
    wrong_front_end,
)
from buffered_store.langgraph import LG_FORMAT
from buffered_store.threadrun.entry import FORMAT

AT = datetime(2026, 11, 26, tzinfo=UTC)


def entry(kind: str, **body: object) -> bytes:
    return orjson.dumps({**header_json(Header("t-1", 1, kind, AT, "w")), **body})


THREADRUN_CP = entry("cp", m=[{"role": "user"}], keep=0, n=1, c=AT.isoformat())
LANGGRAPH_W = entry("w", ns="", id="c1", task="k", path="")
DELETE = entry("del")


def test_formats_name_their_front_end_and_streams_carry_it_in_metadata() -> None:
    assert (front_end_of(FORMAT), front_end_of(LG_FORMAT)) == (THREADRUN, LANGGRAPH)
    assert front_end_of(object()) is None
    assert stream_metadata(LANGGRAPH) == {FRONT_END_KEY: "langgraph"}
    assert stream_metadata(None) is None
    assert tag_of(stream_metadata(THREADRUN)) == THREADRUN
    assert tag_of(None) is None
    assert tag_of({"other": "x"}) is None


def test_an_entry_of_the_other_front_end_is_foreign_and_a_delete_tells_nothing() -> None:
    assert judge_entry(FORMAT, THREADRUN_CP) == (Verdict.OURS, "cp")
    assert judge_entry(LG_FORMAT, THREADRUN_CP) == (Verdict.FOREIGN, "cp")
    assert judge_entry(FORMAT, LANGGRAPH_W)[0] is Verdict.FOREIGN
    # Both front-ends write `del` entries, and each decodes the other's.
    assert judge_entry(FORMAT, DELETE) == (Verdict.UNKNOWN, "del")
    assert judge_entry(LG_FORMAT, DELETE) == (Verdict.UNKNOWN, "del")
    assert judge_entry(FORMAT, b"not an entry") == (Verdict.UNKNOWN, "")


def test_the_refusal_names_the_stream_its_front_end_and_the_right_flusher() -> None:
    text = wrong_front_end("LGWAL", LANGGRAPH, THREADRUN, "its metadata says so")
    assert "stream 'LGWAL' holds the langgraph front-end's entries" in text
    assert "`bufstore flusher --front-end langgraph`" in text
    assert "another front-end's entries" in wrong_front_end("S", None, LANGGRAPH, "its entry 3")
