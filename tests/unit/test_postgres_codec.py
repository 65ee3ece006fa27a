"""Parameters of the Postgres write statement (pure: no database)."""

from __future__ import annotations

from typing import Any

import orjson

from buffered_store.engine.ids import utcnow
from buffered_store.model.checkpointing import build_checkpoint_entry, validate_checkpoint
from buffered_store.model.planning import coalesce
from buffered_store.model.records import RunRecord
from buffered_store.stores import postgres_codec as codec

TRICKY: list[dict[str, Any]] = [
    {"role": "user", "content": 'quotes " and \\ backslashes, {braces}, "commas", NULL'},
    {"role": "assistant", "content": "ünïcødé ✓ \u2028 \t tab", "meta": {"n": 1e16, "m": [1, 2]}},
    {"role": "tool", "content": "", "meta": {"empty": [], "none": None}},
    # Text that looks like what is spelled out, and a message boundary, inside strings.
    {"role": "user", "content": 'not numbers: 1e+16, "},{" 2e+17', "meta": {"n": 2e17}},
]


def _write(messages: list[dict[str, Any]]) -> codec.Write:
    run = RunRecord(run_id="r1", thread_id="t", agent_id="agent")
    call = validate_checkpoint("t", messages, run, None)
    entry = build_checkpoint_entry(call, previous=None, previous_messages=None, seq=1, now=utcnow())
    return codec.build_write(
        coalesce([entry], stored_count=0), expected_seq=0, stored_count=0, at=entry.at
    )


def test_messages_are_one_json_array_parameter() -> None:
    params = _write(TRICKY).params
    assert isinstance(params["p_messages"], str)
    decoded = orjson.loads(params["p_messages"])
    assert [m["content"] for m in decoded] == [m["content"] for m in TRICKY]
    # Integral floats jsonb would print as integers keep a fraction (`jsonb_text`).
    assert '"n":10000000000000000.0' in params["p_messages"]
    assert decoded[1]["meta"]["n"] == 1e16
    assert decoded[2]["meta"] == {"empty": [], "none": None}
    assert decoded[3]["meta"]["n"] == 2e17
    assert '"n":200000000000000000.0' in params["p_messages"]


def test_run_records_are_one_json_array_aligned_with_their_seqs() -> None:
    params = _write(TRICKY[:1]).params
    records = orjson.loads(params["p_run_records"])
    assert [record["run_id"] for record in records] == params["p_run_ids"] == ["r1"]
    assert params["p_run_seqs"] == [1]


def test_json_array() -> None:
    assert codec.json_array([]) == "[]"
    assert orjson.loads(codec.json_array(['{"a":"[,]"}', "1", '"x"'])) == [{"a": "[,]"}, 1, "x"]
