"""What the engine knows of a WAL entry and of a thread's hot record, whatever the
front-end that wrote them. Pure: no I/O.

On the wire an entry is one JSON object: the header's keys (``v`` the wire version,
``t`` thread, ``s`` seq, ``k`` kind, ``at`` time, ``w`` writer, ``j`` jump when set),
written and checked here, and the body's keys, the front-end's (`Header`,
`header_json`, `parse_entry`). A front-end may append raw bytes after the object,
separated by one NUL byte (`frame`, `parse_framed`): JSON text never holds a raw NUL
(encoders escape it), so the first NUL ends the object. Binary values then travel as
they are instead of base64 inside the JSON.

Every entry has a header the engine reads: the thread, its per-thread `seq`, the nonce of
the writing call (`writer`), whether it starts a chain (`jump`), whether it deletes the
thread, and where it sits in the stream. Its body is the front-end's business: each
front-end brings a `Format` that decodes its entries and keeps its hot records, and the
engine treats bodies and summaries as opaque.

The flushed watermark record (`FlushedMark`, KV key ``f.<thread>``) belongs to the
engine itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, TypeVar, overload

import orjson

from buffered_store.engine.ids import parse_time, wire_time
from buffered_store.errors import CorruptEntryError

WIRE_VERSION = 1
"""Version of the entry format (the ``v`` key); a reader refuses any other."""


class Entry(Protocol):
    """The header of a WAL entry, as every front-end's entries expose it."""

    @property
    def thread_id(self) -> str: ...
    @property
    def seq(self) -> int: ...
    @property
    def at(self) -> datetime:
        """When the entry was written (the writer's clock)."""
        ...

    @property
    def writer(self) -> str:
        """Nonce of the writing call: tells our own deduplicated publish from another's."""
        ...

    @property
    def jump(self) -> bool:
        """The entry starts a chain: it follows any lower seq, not only ``seq - 1``."""
        ...

    @property
    def deletes(self) -> bool:
        """The entry deletes its thread."""
        ...

    @property
    def stream_seq(self) -> int:
        """Where the entry sits in the stream, once read back (0 before)."""
        ...


class HotView(Protocol):
    """What the engine reads of a thread's hot record (KV key ``h.<thread>``)."""

    @property
    def seq(self) -> int:
        """The thread's latest seq."""
        ...

    @property
    def stream_seq(self) -> int:
        """Stream seq of the entry at `seq` (0: not in the stream, a seeded record)."""
        ...

    @property
    def recent(self) -> Sequence[tuple[int, int]]:
        """(seq, stream seq) of the latest entries, oldest first (a `RecentSeqs` in the
        records the engine's `advance_head` builds)."""
        ...

    @property
    def deleted_seq(self) -> int:
        """Seq of the thread's latest delete known to the record (0: none)."""
        ...

    @property
    def chain_from(self) -> int:
        """First seq of the chain `seq` belongs to (0: unknown)."""
        ...


E = TypeVar("E", bound=Entry)
H = TypeVar("H", bound=HotView)
E_co = TypeVar("E_co", bound=Entry, covariant=True)
H_co = TypeVar("H_co", bound=HotView, covariant=True)


class Format(Protocol[E_co, H_co]):
    """How a front-end's entries and hot records read from their bytes."""

    def decode_entry(self, payload: bytes, *, stream_seq: int = 0) -> E_co:
        """The entry; anything malformed raises `CorruptEntryError`."""
        ...

    def decode_hot(self, data: bytes) -> H_co:
        """The hot record; anything malformed raises `CorruptEntryError`."""
        ...


@dataclass(frozen=True, slots=True)
class Header:
    """An entry's header as it travels, the kind still the front-end's text."""

    thread_id: str
    seq: int
    kind: str
    at: datetime
    writer: str = ""
    jump: bool = False


def header_json(header: Header) -> dict[str, Any]:
    """The header's keys of an entry's JSON object (the front-end adds its body's), as
    values for `orjson.dumps` with its default options: the time may be a `datetime`
    (`ids.wire_time`), which orjson writes as its `isoformat()`."""
    head: dict[str, Any] = {
        "v": WIRE_VERSION,
        "t": header.thread_id,
        "s": header.seq,
        "k": header.kind,
        "at": wire_time(header.at),
        "w": header.writer,
    }
    if header.jump:
        head["j"] = True
    return head


ATTACHMENTS = b"\x00"
"""Separates an entry's JSON object from the raw bytes a front-end appends to it."""


def frame(obj: bytes, attachments: Iterable[bytes]) -> bytes:
    """An entry's wire bytes: its JSON object, then the attachments, if any, after one
    NUL byte (the front-end's body says where each one starts and ends)."""
    parts = list(attachments)
    if not parts:
        return obj
    return b"".join((obj, ATTACHMENTS, *parts))


def parse_entry(payload: bytes) -> tuple[Header, dict[str, Any]]:
    """The header of an entry's wire bytes, checked, and the whole JSON object (for the
    front-end's body keys); anything malformed raises `CorruptEntryError`. Attachments
    (see `frame`) are ignored: `parse_framed` returns them."""
    return parse_framed(payload)[:2]


def parse_framed(payload: bytes) -> tuple[Header, dict[str, Any], memoryview]:
    """`parse_entry`, plus the attachments that follow the JSON object (empty if none)."""
    cut = payload.find(ATTACHMENTS)
    if cut < 0:
        text, attached = payload, memoryview(b"")
    else:
        text, attached = payload[:cut], memoryview(payload)[cut + 1 :]
    try:
        data = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise CorruptEntryError(f"payload is not JSON: {exc}") from exc
    if not isinstance(data, dict) or data.get("v") != WIRE_VERSION:
        raise CorruptEntryError("payload is not a WAL entry of a known version")
    thread_id, seq, kind = data.get("t"), data.get("s"), data.get("k")
    if not isinstance(thread_id, str) or not thread_id:
        raise CorruptEntryError("entry has no thread id")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
        raise CorruptEntryError(f"entry has an invalid seq {seq!r}")
    if not isinstance(kind, str):
        raise CorruptEntryError(f"entry has an invalid kind {kind!r}")
    writer = data.get("w", "")
    try:
        at = parse_time(data["at"])
    except Exception as exc:
        raise CorruptEntryError(f"entry has an invalid time: {exc!r}") from exc
    if not isinstance(writer, str):
        raise CorruptEntryError(f"entry has an invalid writer {writer!r}")
    header = Header(thread_id, seq, kind, at, writer, data.get("j", False) is True)
    return header, data, attached


def follows(entry: Entry, seq: int) -> bool:
    """Whether `entry` applies right on top of a thread state at `seq`.

    The next entry of a chain has seq + 1; a jump entry (a chain whose predecessor its
    writer could not know) applies on top of any lower seq.
    """
    return entry.seq == seq + 1 or (entry.jump and entry.seq > seq)


def chain_after(entries: Iterable[E], seq: int) -> list[E]:
    """The entries that apply one after the other on top of `seq`, in order.

    From `seq`, take the entry at seq + 1, else the lowest jump entry above; stop at the
    first hole. Entries at or below `seq` and duplicates are ignored.
    """
    by_seq: dict[int, E] = {}
    for entry in entries:
        if entry.seq > seq:
            by_seq.setdefault(entry.seq, entry)
    jumps = sorted(s for s, entry in by_seq.items() if entry.jump)
    chain: list[E] = []
    while True:
        nxt = by_seq.get(seq + 1)
        if nxt is None:
            later = [s for s in jumps if s > seq]
            if not later:
                return chain
            nxt = by_seq[later[0]]
        chain.append(nxt)
        seq = nxt.seq


class RecentSeqs(Sequence[tuple[int, int]]):
    """(seq, stream seq) of a thread's latest entries, oldest first: the ``r`` list of a
    hot record, which lets a reader fetch the unflushed tail by stream seq.

    A writer advances it on every write and almost never reads it, so it is kept as its
    JSON text (``[[seq,stream_seq],...]``, as orjson writes the pairs) and `added`
    makes the next one with a few byte copies: no new tuple of `window` pairs per write,
    none to encode, none for the collector to walk (a 64-pair list cost a writer about
    10 µs a checkpoint). The pairs are parsed the first time they are read; a list made
    from pairs (a record decoded from KV) writes its text the first time it is needed.
    Equal to another `RecentSeqs` of the same pairs, and to the tuple of its pairs.
    """

    __slots__ = ("_count", "_json", "_pairs")

    def __init__(self, pairs: Iterable[tuple[int, int]] = ()) -> None:
        self._pairs: tuple[tuple[int, int], ...] | None = tuple(
            (int(seq), int(stream_seq)) for seq, stream_seq in pairs
        )
        self._count = len(self._pairs)
        self._json: bytes | None = None

    @classmethod
    def _of_json(cls, json: bytes, count: int) -> RecentSeqs:
        made = cls.__new__(cls)
        made._pairs, made._count, made._json = None, count, json
        return made

    @property
    def json(self) -> bytes:
        """The JSON text of the pairs (splice it into a record with `orjson.Fragment`)."""
        if self._json is None:
            self._json = orjson.dumps(self._pairs)
        return self._json

    def pairs(self) -> tuple[tuple[int, int], ...]:
        """The pairs, oldest first."""
        if self._pairs is None:
            assert self._json is not None
            self._pairs = tuple((seq, stream_seq) for seq, stream_seq in orjson.loads(self._json))
        return self._pairs

    def added(self, seq: int, stream_seq: int, window: int) -> RecentSeqs:
        """The newest `window` pairs after one more entry (`seq` at `stream_seq`)."""
        pair = b"[%d,%d]" % (seq, stream_seq)
        count = self._count
        if count == 0 or window <= 1:
            return RecentSeqs._of_json(b"[" + pair + b"]", 1)
        text = self.json
        start = 1  # after the list's "["; each pair is "[a,b]", between them ","
        while count >= window:
            start = text.index(b"],[", start) + 2
            count -= 1
        return RecentSeqs._of_json(b"[" + text[start:-1] + b"," + pair + b"]", count + 1)

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(self.pairs())

    @overload
    def __getitem__(self, index: int) -> tuple[int, int]: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[tuple[int, int], ...]: ...
    def __getitem__(self, index: int | slice) -> tuple[int, int] | tuple[tuple[int, int], ...]:
        return self.pairs()[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RecentSeqs):
            return self._count == other._count and self.json == other.json
        if isinstance(other, tuple):
            return self.pairs() == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.pairs())  # as the tuple it equals

    def __repr__(self) -> str:
        return f"RecentSeqs({self.pairs()!r})"


NO_RECENT = RecentSeqs()
"""The empty list (a record's default)."""


@dataclass(frozen=True, slots=True)
class HotHead:
    """The engine's fields of a thread's hot record after an entry (see `HotView`)."""

    seq: int
    stream_seq: int
    recent: RecentSeqs
    deleted_seq: int
    chain_from: int
    follows: bool
    """The entry continued the previous record's chain (seq + 1, no jump): what the
    front-end's summary carried over stays valid."""


def advance_head(
    previous: HotView | None, entry: Entry, stream_seq: int, *, window: int
) -> HotHead:
    """The engine's part of the hot record after `entry` was stored at `stream_seq`: the
    last `window` (seq, stream seq) pairs, the latest delete, the chain's first seq."""
    known = previous.recent if previous is not None else NO_RECENT
    if not isinstance(known, RecentSeqs):
        known = RecentSeqs(known)  # a front-end's record of its own making
    recent = known.added(entry.seq, stream_seq, window)
    follows = previous is not None and previous.seq + 1 == entry.seq and not entry.jump
    deleted_seq = entry.seq if entry.deletes else (previous.deleted_seq if previous else 0)
    chain_from = previous.chain_from if previous is not None and follows else entry.seq
    return HotHead(entry.seq, stream_seq, recent, deleted_seq, chain_from, follows)


@dataclass(frozen=True, slots=True)
class FlushedMark:
    """The thread's flushed watermark in KV (`f.<thread>`), raised after each commit."""

    seq: int
    stream_seq: int


def encode_flushed(mark: FlushedMark) -> bytes:
    """KV bytes of a flushed watermark."""
    return orjson.dumps({"s": mark.seq, "ss": mark.stream_seq})


def decode_flushed(data: bytes) -> FlushedMark:
    """Flushed watermark from KV bytes."""
    try:
        raw = orjson.loads(data)
        return FlushedMark(int(raw["s"]), int(raw["ss"]))
    except Exception as exc:
        raise CorruptEntryError(f"malformed flushed watermark: {exc!r}") from exc
