"""`buffered_store.stores.pipelining`: the bound on pipelined statements and how rows
are split to stay below it (the hang it avoids is driven in
tests/integration/test_postgres_apply_pipeline.py and tests/langgraph/test_sink.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from buffered_store.stores.pipelining import (
    CHUNK_BYTES,
    MESSAGE_LIMIT,
    chunks,
    fits_pipeline,
    payload_bytes,
)


def test_payload_bytes_counts_bytes_text_and_nesting() -> None:
    assert payload_bytes(b"abc") == 3
    assert payload_bytes(memoryview(b"abcd")) == 4
    assert payload_bytes("abc") == 3
    assert payload_bytes("é") == 4  # not ASCII: four bytes a character, an upper bound
    assert payload_bytes(["ab", [b"cde", None]]) == 2 + 3 + 8
    assert payload_bytes({"a": b"xy", "b": 7}) == 2 + 8


def test_a_statement_over_the_limit_does_not_fit_a_pipeline() -> None:
    small = [b"x" * 1000]
    assert fits_pipeline([small, small])
    assert not fits_pipeline([small, [b"x" * (MESSAGE_LIMIT + 1)]])
    assert fits_pipeline([])


def test_chunks_keep_each_range_under_the_limit_unless_one_row_exceeds_it() -> None:
    assert chunks([]) == []
    assert chunks([5, 5, 5], limit=10) == [range(0, 2), range(2, 3)]
    assert chunks([30, 5, 5], limit=10) == [range(0, 1), range(1, 3)]
    assert chunks([5, 30, 5], limit=10) == [range(0, 1), range(1, 2), range(2, 3)]
    assert chunks([CHUNK_BYTES // 2] * 4) == [range(0, 2), range(2, 4)]


@given(st.lists(st.integers(min_value=0, max_value=50)), st.integers(min_value=1, max_value=60))
def test_chunks_cover_every_row_once_in_order(sizes: list[int], limit: int) -> None:
    parts = chunks(sizes, limit)
    assert [i for part in parts for i in part] == list(range(len(sizes)))
    for part in parts:
        assert len(part) == 1 or sum(sizes[i] for i in part) <= limit
