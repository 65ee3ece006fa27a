"""Puts before their entry: a put's blobs serialised as AsyncPostgresSaver serialises
them, except a list value that extends the one this writer put last in its channel,
written as a delta (its new items only: O(new items), however long the list).

A draft assumes the thread's state it saw when it was made; the entry is built on the
cursor the write finds (`Drafter.resolve`), where a delta on another state is written
whole.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, TypeAlias

from langgraph.checkpoint.serde.base import SerializerProtocol
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

from buffered_store.langgraph.entry import (
    BlobRow,
    Claim,
    Delete,
    Op,
    Put,
    Writes,
    delta_blob,
    msgpack_list_start,
)
from buffered_store.langgraph.format import (
    NO_BASES,
    LgState,
    ListBase,
)
from buffered_store.langgraph.validation import check_key

log = logging.getLogger("buffered_store.langgraph")


def _full(base: ListBase, items: bytes, value: list[Any]) -> bytes | None:
    """The whole blob of a delta, kept only while deltas are checked."""
    return None if base.full is None else delta_blob(base.full, len(value), items)


@dataclass(frozen=True, slots=True)
class PutDraft:
    """A put made before its entry: its blobs, deltas among them, assume the thread's
    cursor was at `based_on` (the entry is built on the cursor it finds)."""

    blobs: tuple[BlobRow, ...]
    based_on: LgState | None
    bases: dict[str, ListBase]
    """channel -> the list value put, for the cursor state after the entry."""
    op: Put | None = None

    def with_op(self, op: Put) -> PutDraft:
        return replace(self, op=op)


Item: TypeAlias = PutDraft | Op
"""What a write call hands to the group commit: a put still to be built, or an
operation."""


def _extends(value: Any, items: tuple[Any, ...]) -> bool:
    """Whether the list `value` starts with exactly these objects (identity, a C-level
    pass: in-place changes of an item are not seen, see docs/how-to/langgraph.md)."""
    return (
        isinstance(value, list)
        and len(value) >= len(items)
        and all(map(operator.is_, value, items))
    )


class Drafter:
    """Makes put drafts and resolves them on the cursor an entry is built on.

    `stats` is the saver's counter dict (``delta_blobs``, ``deltas_refused``,
    ``deltas_dropped`` are counted in it).
    """

    def __init__(
        self, serde: SerializerProtocol, *, check_deltas: bool, stats: dict[str, int]
    ) -> None:
        self.serde = serde
        self.check_deltas = check_deltas
        self.deltas = type(serde) is JsonPlusSerializer
        """Whether list values may be written as deltas: only with LangGraph's own
        serializer, whose msgpack list is its items' encodings one after the other."""
        self._stats = stats

    def resolve(
        self, items: Sequence[Item], state: LgState | None
    ) -> tuple[tuple[Op, ...], LgState | None]:
        """The operations of an entry built on a cursor at `state`, and the state after
        it. A put's deltas assumed the state it saw when it was called; on another one
        (another writer wrote the thread meanwhile) its blobs are written whole."""
        ops: list[Op] = []
        for item in items:
            if isinstance(item, PutDraft):
                put = item.op
                assert put is not None
                bases = item.bases
                if state is not item.based_on and any(b.base is not None for b in put.blobs):
                    put, bases = self.whole(put, item)
                    self._stats["deltas_dropped"] += 1
                ops.append(put)
                after = dict(state or {})
                for blob in put.blobs:
                    after.pop((put.ns, blob.channel), None)
                after.update(((put.ns, channel), base) for channel, base in bases.items())
                state = MappingProxyType(after)
            else:
                ops.append(item)
                if isinstance(item, Delete):
                    state = NO_BASES
                elif not isinstance(item, Writes | Claim):
                    state = None  # runs, prune, copy: which versions remain is not known here
        return tuple(ops), state

    def whole(self, put: Put, draft: PutDraft) -> tuple[Put, dict[str, ListBase]]:
        """`put` with every delta blob serialised whole."""
        blobs: list[BlobRow] = []
        bases = dict(draft.bases)
        for blob in put.blobs:
            if blob.base is None:
                blobs.append(blob)
                continue
            value = list(bases[blob.channel].items)
            typ, data = self.serde.dumps_typed(value)
            blobs.append(BlobRow(blob.channel, blob.version, typ, data))
            bases[blob.channel] = ListBase(blob.version, tuple(value), len(data))
        return replace(put, blobs=tuple(blobs)), bases

    def _delta_holds(self, channel: str, value: list[Any], base: ListBase, items: bytes) -> bool:
        """False when ``check_deltas`` finds that the delta would not rebuild the list
        serialised whole (an item of the base was changed in place after it was saved)."""
        if not self.check_deltas or base.full is None:
            return True
        if delta_blob(base.full, len(value), items) == self.serde.dumps_typed(value)[1]:
            return True
        self._stats["deltas_refused"] += 1
        log.warning(
            "an item of list channel %r was changed in place after it was saved; "
            "its value is written whole (see docs/how-to/langgraph.md)",
            channel,
            extra={"action": "delta_refused"},
        )
        return False

    def draft(
        self,
        based_on: LgState | None,
        ns: str,
        versions: Mapping[str, Any],
        values: Mapping[str, Any],
    ) -> PutDraft:
        """The blobs of a put, each list value that extends what this writer put last in
        its channel as a delta (only the new items serialised: O(new items), however long
        the list), the others whole, as AsyncPostgresSaver serialises them."""
        blobs: list[BlobRow] = []
        bases: dict[str, ListBase] = {}
        for channel, version in versions.items():
            check_key(channel, "channel")
            ver = check_key(str(version), "version")
            if channel not in values:
                blobs.append(BlobRow(channel, ver, "empty", None))
                continue
            value = values[channel]
            base = based_on.get((ns, channel)) if based_on is not None else None
            if self.deltas and base is not None and _extends(value, base.items):
                typ, data = self.serde.dumps_typed(value[len(base.items) :])
                if typ == "msgpack":
                    items = data[msgpack_list_start(data) :]
                    if self._delta_holds(channel, value, base, items):
                        blob = BlobRow(
                            channel, ver, typ, items, base=base.version, count=len(value)
                        )
                        blobs.append(blob)
                        self._stats["delta_blobs"] += 1
                        bases[channel] = ListBase(
                            ver, tuple(value), base.size + len(items), _full(base, items, value)
                        )
                        continue
            typ, data = self.serde.dumps_typed(value)
            blobs.append(BlobRow(channel, ver, typ, data))
            if self.deltas and typ == "msgpack" and isinstance(value, list):
                full = data if self.check_deltas else None
                bases[channel] = ListBase(ver, tuple(value), len(data), full)
        return PutDraft(tuple(blobs), based_on, bases)
