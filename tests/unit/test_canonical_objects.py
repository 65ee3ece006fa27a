"""`canonical_objects`: one encoding of a list cut into items equals encoding each item."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from buffered_store.model.messages import canonical_objects

# Strings rich in the characters around the cut (``},{``), nested objects and lists.
text = st.text(alphabet=st.sampled_from(list('},{[]":\\ab\x00é')), max_size=8)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False) | text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=10,
)
objects = st.dictionaries(text, json_values, max_size=4)


@settings(max_examples=500, deadline=None)
@given(st.lists(objects, max_size=6))
def test_cut_items_equal_items_encoded_one_by_one(items: list[dict[str, Any]]) -> None:
    expected = tuple(orjson.dumps(item, option=orjson.OPT_SORT_KEYS) for item in items)
    assert canonical_objects(items) == expected


def test_a_string_holding_the_cut_falls_back_to_item_by_item() -> None:
    items: list[dict[str, Any]] = [
        {"content": "a},{b", "role": "user"},
        {},
        {"role": "x", "n": [{}, {}]},
    ]
    assert canonical_objects(items) == (
        b'{"content":"a},{b","role":"user"}',
        b"{}",
        b'{"n":[{},{}],"role":"x"}',
    )
