"""`engine.entries.RecentSeqs`: the hot record's (seq, stream seq) window kept as its
JSON text, advanced by byte copies; it must say exactly what the tuple of pairs said."""

from __future__ import annotations

from types import SimpleNamespace

import orjson
from hypothesis import given
from hypothesis import strategies as st

from buffered_store.engine.entries import NO_RECENT, RecentSeqs, advance_head
from buffered_store.langgraph.format import LgHot
from buffered_store.langgraph.format import decode_hot as decode_lg_hot
from buffered_store.langgraph.format import encode_hot as encode_lg_hot
from buffered_store.threadrun.entry import HotRecord, decode_hot, encode_hot

pairs = st.lists(st.tuples(st.integers(1, 2**62), st.integers(1, 2**62)), min_size=0, max_size=40)


@given(pairs, st.integers(1, 12), st.integers(0, 20))
def test_added_keeps_the_newest_pairs_as_a_tuple_slice_would(
    steps: list[tuple[int, int]], window: int, start: int
) -> None:
    # From a list made of pairs (as decoded from KV) or built by `added` alone.
    reference: tuple[tuple[int, int], ...] = tuple((n, 1000 + n) for n in range(start))
    recent = RecentSeqs(reference)
    for seq, stream_seq in steps:
        reference = (*reference, (seq, stream_seq))[-window:]
        recent = recent.added(seq, stream_seq, window)
        assert len(recent) == len(reference)
        # The text is what orjson writes for the pairs, so old readers parse it.
        assert recent.json == orjson.dumps(reference)
    assert recent.pairs() == reference
    assert tuple(recent) == reference
    assert dict(recent) == dict(reference)


def test_a_window_smaller_than_the_list_drops_every_pair_beyond_it() -> None:
    recent = RecentSeqs([(n, 10 * n) for n in range(1, 9)])
    assert recent.added(9, 90, 3).pairs() == ((7, 70), (8, 80), (9, 90))
    assert recent.added(9, 90, 1).pairs() == ((9, 90),)
    assert NO_RECENT.added(1, 5, 4).pairs() == ((1, 5),)


def test_equality_indexing_and_hash() -> None:
    made = RecentSeqs([(1, 10), (2, 20)])
    grown = RecentSeqs([(1, 10)]).added(2, 20, 64)
    assert made == grown
    assert hash(made) == hash(grown)
    assert made == ((1, 10), (2, 20))
    assert hash(made) == hash(((1, 10), (2, 20)))
    assert made != RecentSeqs([(1, 10), (2, 21)])
    assert (made[0], made[-1], made[:1]) == ((1, 10), (2, 20), ((1, 10),))
    assert repr(made) == "RecentSeqs(((1, 10), (2, 20)))"


def test_hot_records_write_the_pairs_as_before_and_read_older_records() -> None:
    recent = NO_RECENT.added(3, 103, 2).added(4, 104, 2).added(5, 105, 2)
    record = HotRecord(seq=5, stream_seq=105, thread=None, recent=recent)
    data = encode_hot(record)
    assert orjson.loads(data)["r"] == [[4, 104], [5, 105]]
    assert decode_hot(data) == record
    # A record written by a version that kept a tuple of pairs.
    older = orjson.dumps({"s": 5, "ss": 105, "th": None, "r": ((4, 104), (5, 105))})
    assert decode_hot(older).recent == ((4, 104), (5, 105))
    assert decode_hot(older).stream_seq_of(4) == 104
    lg = LgHot(seq=5, stream_seq=105, recent=recent, owner="o")
    assert orjson.loads(encode_lg_hot(lg))["r"] == [[4, 104], [5, 105]]
    assert decode_lg_hot(encode_lg_hot(lg)) == lg


def test_advance_head_takes_a_front_ends_own_tuple_of_pairs() -> None:
    """A front-end's hot record may keep `recent` as a tuple (`HotView` asks a sequence
    of pairs); the engine's next head holds a `RecentSeqs` of the newest pairs."""
    previous = SimpleNamespace(seq=2, recent=((1, 10), (2, 20)), deleted_seq=0, chain_from=1)
    entry = SimpleNamespace(seq=3, jump=False, deletes=False)
    head = advance_head(previous, entry, 30, window=2)
    assert isinstance(head.recent, RecentSeqs)
    assert head.recent.pairs() == ((2, 20), (3, 30))
    assert (head.follows, head.chain_from) == (True, 1)
