"""The LangGraph front-end's format for the engine (`LG_FORMAT`): its hot records
(`LgHot`, KV ``h.<thread>``) and the writer's cursor state (`LgState`: the list values
it put last, the bases of its delta blobs). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, TypeAlias

import orjson

from buffered_store.engine.entries import NO_RECENT, RecentSeqs, advance_head
from buffered_store.engine.frontend import LANGGRAPH
from buffered_store.errors import CorruptEntryError
from buffered_store.langgraph.decoding import decode_entry
from buffered_store.langgraph.entry import Claim, LgEntry


@dataclass(frozen=True, kw_only=True, slots=True)
class LgHot:
    """Hot record (KV ``h.<thread>``): the engine's view plus the write owner."""

    seq: int
    stream_seq: int
    recent: RecentSeqs = NO_RECENT
    deleted_seq: int = 0
    chain_from: int = 0
    owner: str | None = None
    """Who may put (set by the latest claim entry; None: anyone)."""
    logical_seq: int = 0
    """Seq of the latest entry a read cannot overlay row by row (runs/prune/copy): a reader
    whose watermark is below it flushes the thread before reading."""


def advance_hot(previous: LgHot | None, entry: LgEntry, stream_seq: int, *, window: int) -> LgHot:
    head = advance_head(previous, entry, stream_seq, window=window)
    owner = previous.owner if previous else None
    logical = previous.logical_seq if previous else 0
    for op in entry.ops:
        if isinstance(op, Claim):
            owner = op.owner
    if not entry.simple:
        logical = entry.seq
    return LgHot(
        seq=head.seq,
        stream_seq=head.stream_seq,
        recent=head.recent,
        deleted_seq=head.deleted_seq,
        chain_from=head.chain_from,
        owner=owner,
        logical_seq=logical,
    )


def encode_hot(record: LgHot) -> bytes:
    return orjson.dumps(
        {
            "s": record.seq,
            "ss": record.stream_seq,
            "r": orjson.Fragment(record.recent.json),
            "ds": record.deleted_seq,
            "cf": record.chain_from,
            "o": record.owner,
            "ls": record.logical_seq,
        }
    )


def decode_hot(data: bytes) -> LgHot:
    try:
        raw = orjson.loads(data)
        return LgHot(
            seq=int(raw["s"]),
            stream_seq=int(raw["ss"]),
            recent=RecentSeqs(raw.get("r", ())),
            deleted_seq=int(raw.get("ds", 0)),
            chain_from=int(raw.get("cf", 0)),
            owner=raw.get("o"),
            logical_seq=int(raw.get("ls", 0)),
        )
    except Exception as exc:
        raise CorruptEntryError(f"malformed LangGraph hot record: {exc!r}") from exc


@dataclass(frozen=True, slots=True)
class ListBase:
    """What a writer put last in a list channel of a namespace: a delta's base."""

    version: str
    items: tuple[Any, ...]
    """The items of the value put (a copy of the list: appending to it later changes
    nothing here). A new value extends it when its first items are these very objects."""
    size: int
    """Bytes of the stored blob."""
    full: bytes | None = None
    """The stored blob itself, kept only to check deltas (``check_deltas``)."""


LgState: TypeAlias = Mapping[tuple[str, str], ListBase]
"""The writer's cursor state of a thread: (namespace, channel) -> the list value it put
last, for the channels whose latest version it knows it wrote."""
NO_BASES: LgState = MappingProxyType({})


class LangGraphFormat:
    """`engine.appender.WriteFormat` of the LangGraph front-end. The cursor state is the
    list values this writer put last (`LgState`), the bases of its delta blobs; it is
    only known for what the writer itself wrote, so an entry read back leaves it unknown
    (None: the next put writes whole blobs)."""

    front_end = LANGGRAPH
    """The name its streams are tagged with (`buffered_store.engine.frontend`)."""

    def decode_entry(self, payload: bytes, *, stream_seq: int = 0) -> LgEntry:
        return decode_entry(payload, stream_seq=stream_seq)

    def decode_hot(self, data: bytes) -> LgHot:
        return decode_hot(data)

    def advance_hot(
        self, previous: LgHot | None, entry: LgEntry, stream_seq: int, *, window: int
    ) -> LgHot:
        return advance_hot(previous, entry, stream_seq, window=window)

    def encode_hot(self, record: LgHot, *, limit: int) -> bytes:
        return encode_hot(record)

    def with_recent(self, record: LgHot, recent: Sequence[tuple[int, int]]) -> LgHot:
        return replace(record, recent=RecentSeqs(recent))

    def placed(self, entry: LgEntry, stream_seq: int) -> LgEntry:
        # Operations hold bytes and texts only: the built entry is what a read gets back.
        return replace(entry, stream_seq=stream_seq)

    def known_state(self, hot: LgHot | None, same_seq: LgState | None) -> LgState | None:
        if same_seq is not None:
            return same_seq
        if hot is None or hot.deleted_seq == hot.seq:
            return NO_BASES  # nothing stored: nothing to be the base of a delta
        return None

    def state_after(self, state: LgState | None, entry: LgEntry, *, owned: bool) -> LgState | None:
        return NO_BASES if entry.deletes else None

    def state_bytes(self, state: LgState) -> int:
        # The items a base holds weigh about what their encoding does (they are the
        # graph's own objects, often still alive in its state), plus the blob kept to
        # check deltas and a little per channel.
        return sum(
            base.size + len(base.full or b"") + 8 * len(base.items) + 200 for base in state.values()
        )

    def added_bytes(self, entry: LgEntry) -> int:
        return 0  # the state is never extended in place (`state_after` gives None)


LG_FORMAT = LangGraphFormat()
