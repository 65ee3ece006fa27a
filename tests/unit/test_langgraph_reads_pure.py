"""The LangGraph front-end's pure read logic: the database's order of ids in a merge,
which collations order by code point, and the delta-history walk's fold of its rows."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from buffered_store.langgraph import history, overlay
from buffered_store.langgraph.entry import Put
from buffered_store.langgraph.sink_reads import orders_by_code_point


def tail_of(*ids: str) -> overlay.Tail:
    tail = overlay.Tail()
    for cid in ids:
        cp = orjson.dumps({"v": 4, "id": cid, "channel_values": {}, "channel_versions": {}})
        tail.checkpoints[("", cid)] = Put("", cid, None, cp, b"{}")
    return tail


def merged(tail: overlay.Tail, order: overlay.Order, before: str | None = None) -> list[str]:
    rows = overlay.merge(
        [],
        tail,
        "t",
        ns="",
        checkpoint_id=None,
        before_id=before,
        metadata_filter=None,
        limit=None,
        order=order,
    )
    return [r["checkpoint_id"] for r in rows]


def test_merge_orders_by_code_point_unless_given_the_databases_ranks() -> None:
    tail = tail_of("a", "B", "c")
    assert merged(tail, overlay.CODE_POINT) == ["c", "a", "B"]
    icu = overlay.Order({"a": 0, "B": 1, "c": 2})  # as en-US sorts them
    assert merged(tail, icu) == ["c", "B", "a"]
    assert merged(tail, icu, before="c") == ["B", "a"]
    assert merged(tail, overlay.CODE_POINT, before="c") == ["a", "B"]


@pytest.mark.parametrize(
    ("db", "code_point"),
    [
        ({"datcollate": "C"}, True),
        ({"datcollate": "POSIX", "datlocprovider": "c"}, True),
        ({"datcollate": "C.UTF-8", "datlocprovider": "c"}, True),
        ({"datcollate": "en_US.UTF-8", "datlocprovider": "c"}, False),
        ({"datcollate": "C", "datlocprovider": "i", "daticulocale": "en-US"}, False),
        ({"datcollate": "C", "datlocprovider": "b", "datlocale": "C.UTF-8"}, True),
    ],
)
def test_code_point_collations_are_told_from_the_others(
    db: dict[str, Any], code_point: bool
) -> None:
    assert orders_by_code_point(db) is code_point


def row(cid: str, pid: str | None, *, blob: bool = False, inline: Any = None) -> dict[str, Any]:
    return {
        "checkpoint_id": cid,
        "parent_checkpoint_id": pid,
        "ver_0": "1",
        "hb_0": blob,
        "inline_0": inline,
    }


def test_walk_stops_at_the_first_stored_value_and_skips_inline_null() -> None:
    rows = [row("4", "3"), row("3", "2"), row("2", "1", inline=None), row("1", None, inline=5)]
    found = history.walk(rows, ["ch"])
    assert found.chains == {"ch": ["3", "2", "1"]}
    assert found.seed_versions == {"ch": "1"}
    assert found.seed_inline == {"ch": 5}


def test_walk_ends_on_a_cycle_of_parents() -> None:
    rows = [row("3", "2"), row("2", "1"), row("1", "2"), row("2", "1")]
    found = history.walk(rows, ["ch"])
    assert found.chains == {"ch": ["2", "1"]}
    assert found.seed_versions == {"ch": None}


def test_walk_sql_names_every_channel_as_a_parameter() -> None:
    sql = history.walk_sql(2, named=False)
    assert "%(ch_0)s" in sql
    assert "%(ch_1)s" in sql
    assert "ORDER BY id DESC LIMIT 1" in sql
    params = history.walk_params("t", "", None, ["a", "b"], tail_of("x"))
    assert params["tids"] == ["x"]
    assert params["stored"] is True
