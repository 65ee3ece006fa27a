"""WAL entries and the KV records around them, and their wire codec. Pure: no I/O.

A WAL entry is one checkpoint (or delete) of one thread at one `seq`. Its messages are a
delta against the thread's previous entry: keep the first `keep` messages, then append
`messages`. An append-only step therefore carries only the new messages. The entry also
carries the full thread summary at its seq, so readers and flushers never derive it.

Entries of a thread normally follow each other: seq, seq + 1, ... A *jump* entry starts a
chain whose predecessor is unknown (its writer could not read the inner store to learn
where the thread's seqs stand, see `engine.appender.jump_seq`): it carries a full snapshot
and applies on top of any stored state with a lower seq.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import orjson

from buffered_store.engine.entries import (
    NO_RECENT,
    Header,
    RecentSeqs,
    advance_head,
    header_json,
    parse_entry,
)
from buffered_store.engine.frontend import THREADRUN
from buffered_store.engine.ids import parse_time, wire_time, writes_as_iso
from buffered_store.errors import CorruptEntryError
from buffered_store.model.changes import EntryKind as EntryKind
from buffered_store.model.changes import WalEntry as WalEntry
from buffered_store.model.messages import (
    DIGEST_SIZE,
    MessageSnapshot,
    apply_delta,
    canonical_objects,
    decode_message,
)
from buffered_store.model.records import Message, RunRecord, Thread

_RUN_JSON_CACHE = 1024
_run_json: dict[int, tuple[RunRecord, bytes, orjson.Fragment]] = {}


def run_json(run: RunRecord) -> tuple[bytes, orjson.Fragment]:
    """The run's JSON (bytes, and a fragment to splice into a document), encoded once per
    `RunRecord` object.

    A checkpoint's run goes into its entry and its hot record, and a hot record carries
    the last few runs from one checkpoint to the next as the same objects: without this,
    every checkpoint would encode up to five runs. Keyed by identity (records are frozen),
    the entry holding the object so its id cannot be reused while cached.
    """
    hit = _run_json.get(id(run))
    if hit is not None and hit[0] is run:
        return hit[1], hit[2]
    if (
        type(run) is RunRecord  # a subclass may have fields or a `to_json` of its own
        and writes_as_iso(run.created_at)
        and writes_as_iso(run.updated_at)
        and writes_as_iso(run.finished_at)
        and type(run.metadata) is dict
    ):
        data = orjson.dumps(run)  # the dataclass: `to_json()`'s keys and values, in C
    else:
        data = orjson.dumps(run.to_json())
    fragment = orjson.Fragment(data)
    if len(_run_json) >= _RUN_JSON_CACHE:
        _run_json.clear()
    _run_json[id(run)] = (run, data, fragment)
    return data, fragment


def thread_json(thread: Thread) -> Any:
    """What to put in a document for `orjson.dumps` to write `thread.to_json()`: the
    dataclass itself when orjson writes it the same (`writes_as_iso`), else the dict."""
    if (
        type(thread) is Thread
        and writes_as_iso(thread.created_at)
        and writes_as_iso(thread.updated_at)
        and type(thread.metadata) is dict
    ):
        return thread
    return thread.to_json()


def encode_entry(entry: WalEntry) -> bytes:
    """Wire bytes of an entry; message bytes are spliced in without re-encoding."""
    head = header_json(
        Header(entry.thread_id, entry.seq, entry.kind.value, entry.at, entry.writer, entry.jump)
    )
    if entry.kind is EntryKind.CHECKPOINT:
        head.update(
            keep=entry.keep,
            n=entry.message_count,
            run=run_json(entry.run)[1] if entry.run else None,
            c=wire_time(entry.thread_created_at),
            p=entry.parent_thread_id,
            md=entry.metadata if type(entry.metadata) is dict else dict(entry.metadata),
        )
        if entry.digest:
            head["dg"] = entry.digest.hex()
    prefix = orjson.dumps(head)
    return prefix[:-1] + b',"m":[' + b",".join(entry.messages) + b"]}"


def decode_digest(value: Any) -> bytes:
    """A snapshot digest from its hex form in an entry or hot record (None: unknown)."""
    if value is None:
        return b""
    try:
        digest = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        digest = b""
    if len(digest) != DIGEST_SIZE:
        raise CorruptEntryError(f"malformed snapshot digest {value!r}")
    return digest


def decode_entry(payload: bytes, *, stream_seq: int = 0) -> WalEntry:
    """Entry from wire bytes; anything malformed raises `CorruptEntryError`."""
    return _decode(payload, stream_seq)[0]


def decode_entry_roles(payload: bytes, *, stream_seq: int = 0) -> tuple[WalEntry, tuple[str, ...]]:
    """`decode_entry`, plus the role of each appended message.

    Columnar readers need the roles; taking them from the parse done here spares parsing
    every message a second time.
    """
    entry, raw_messages = _decode(payload, stream_seq)
    return entry, tuple(m["role"] for m in raw_messages)


def _decode(payload: bytes, stream_seq: int) -> tuple[WalEntry, list[dict[str, Any]]]:
    """`decode_entry`, plus the appended messages as parsed (checked objects with a role)."""
    header, data = parse_entry(payload)
    thread_id, seq, at, jump = header.thread_id, header.seq, header.at, header.jump
    try:
        kind = EntryKind(header.kind)
        if kind is EntryKind.DELETE:
            entry = WalEntry(
                thread_id=thread_id,
                seq=seq,
                kind=kind,
                at=at,
                writer=header.writer,
                jump=jump,
                stream_seq=stream_seq,
            )
            return entry, []
        raw_messages = data["m"]
        if not isinstance(raw_messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in raw_messages
        ):
            raise CorruptEntryError("entry messages are not JSON objects with a role")
        messages = canonical_objects(raw_messages)
        keep, count = data["keep"], data["n"]
        if not isinstance(keep, int) or keep < 0 or count != keep + len(messages):
            raise CorruptEntryError("entry message counts are inconsistent")
        if jump and keep:
            raise CorruptEntryError("a jump entry must carry its full snapshot")
        run = RunRecord.from_json(data["run"]) if data.get("run") else None
        if run is not None and run.thread_id != thread_id:
            raise CorruptEntryError("entry run belongs to another thread")
        entry = WalEntry(
            thread_id=thread_id,
            seq=seq,
            kind=kind,
            at=at,
            keep=keep,
            messages=messages,
            message_count=count,
            run=run,
            created_at=parse_time(data["c"]),
            parent_thread_id=data.get("p"),
            metadata=data.get("md") or {},
            writer=header.writer,
            jump=jump,
            digest=decode_digest(data.get("dg")),
            stream_seq=stream_seq,
        )
        return entry, raw_messages
    except CorruptEntryError:
        raise
    except Exception as exc:
        raise CorruptEntryError(f"malformed entry: {exc!r}") from exc


RUNS_WINDOW = 4
"""Distinct runs whose latest version a hot record carries."""
HOT_RUN_MAX_BYTES = 4096
"""Largest run (as JSON) a hot record carries; a larger one is read from its entry, so
the hot record stays small whatever a run's `output` holds."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HotRecord:
    """The thread's hot metadata in KV (`h.<thread>`), advanced by writers with CAS.

    `recent` maps the latest few seqs to their stream seqs, so a reader fetches the
    unflushed tail with direct gets instead of walking the subject. `runs` holds the
    latest version of the last few runs written, so run reads overlay pending versions
    without fetching entries whenever `runs_from` covers what is unflushed.
    """

    seq: int
    stream_seq: int
    thread: Thread | None
    """Summary at `seq`; None when the entry at `seq` deleted the thread."""
    recent: RecentSeqs = NO_RECENT
    runs: tuple[tuple[RunRecord, int], ...] = ()
    """(run, seq of the entry that last wrote it), most recently written first."""
    runs_from: int = 0
    """Every run written by an entry with seq >= `runs_from` is in `runs` (0: unknown)."""
    deleted_seq: int = 0
    """Seq of the thread's latest delete entry known to this record (0: none)."""
    chain_from: int = 0
    """First seq of the chain `seq` belongs to: no entry sits between a lower stored seq
    and it (a jump, see `WalEntry.jump`). 0: unknown (records older than the field)."""
    digest: bytes = b""
    """Digest of the thread's snapshot at `seq` (`WalEntry.digest`; empty: unknown)."""

    def stream_seq_of(self, seq: int) -> int | None:
        """Stream sequence of the entry with this thread seq, if still in `recent`."""
        for thread_seq, stream_seq in self.recent:
            if thread_seq == seq:
                return stream_seq
        return None

    def covers_runs_after(self, flushed_seq: int) -> bool:
        """Whether `runs` holds every run version written after `flushed_seq`."""
        return 0 < self.runs_from <= flushed_seq + 1


def seeded_hot(seq: int, thread: Thread | None) -> HotRecord:
    """The hot record of a thread the WAL has not seen yet, continuing at `seq`."""
    return HotRecord(seq=seq, stream_seq=0, thread=thread, runs_from=seq + 1, chain_from=1)


def advance_hot(
    previous: HotRecord | None, entry: WalEntry, stream_seq: int, *, window: int
) -> HotRecord:
    """The hot record after `entry` was stored at `stream_seq`."""
    head = advance_head(previous, entry, stream_seq, window=window)
    runs = previous.runs if previous is not None and head.follows else ()
    runs_from = previous.runs_from if previous is not None and head.follows else entry.seq
    if entry.kind is EntryKind.DELETE:
        runs, runs_from = (), entry.seq
    elif entry.run is not None:
        run_id = entry.run.run_id
        others = tuple(item for item in runs if item[0].run_id != run_id)
        if len(run_json(entry.run)[0]) > HOT_RUN_MAX_BYTES:
            runs, runs_from = others, entry.seq + 1
        else:
            runs = ((entry.run, entry.seq), *others)
        if len(runs) > RUNS_WINDOW:
            dropped = max(seq for _, seq in runs[RUNS_WINDOW:])
            runs, runs_from = runs[:RUNS_WINDOW], max(runs_from, dropped + 1)
    return HotRecord(
        seq=head.seq,
        stream_seq=head.stream_seq,
        thread=entry.thread,
        recent=head.recent,
        runs=runs,
        runs_from=runs_from,
        deleted_seq=head.deleted_seq,
        chain_from=head.chain_from,
        digest=entry.digest,
    )


def encode_hot(record: HotRecord) -> bytes:
    """KV bytes of a hot record."""
    fields: dict[str, Any] = {
        "s": record.seq,
        "ss": record.stream_seq,
        "th": thread_json(record.thread) if record.thread else None,
        "r": orjson.Fragment(record.recent.json),
        "ru": [[run_json(run)[1], seq] for run, seq in record.runs],
        "rf": record.runs_from,
        "ds": record.deleted_seq,
        "cf": record.chain_from,
    }
    if record.digest:
        fields["dg"] = record.digest.hex()
    return orjson.dumps(fields)


def encode_hot_within(record: HotRecord, limit: int) -> bytes:
    """`encode_hot`, without the run versions when they would take the record over
    `limit` bytes (a KV value is a NATS message): readers then find the runs in the
    entries, as `runs_from` past `seq` tells them."""
    data = encode_hot(record)
    if len(data) <= limit or not record.runs:
        return data
    return encode_hot(replace(record, runs=(), runs_from=record.seq + 1))


def decode_hot(data: bytes) -> HotRecord:
    """Hot record from KV bytes (records written before `runs` existed cover no runs)."""
    try:
        raw = orjson.loads(data)
        thread = Thread.from_json(raw["th"]) if raw.get("th") else None
        return HotRecord(
            seq=int(raw["s"]),
            stream_seq=int(raw["ss"]),
            thread=thread,
            recent=RecentSeqs(raw.get("r", ())),
            runs=tuple((RunRecord.from_json(run), int(seq)) for run, seq in raw.get("ru", ())),
            runs_from=int(raw.get("rf", 0)),
            deleted_seq=int(raw.get("ds", 0)),
            chain_from=int(raw.get("cf", 0)),
            digest=decode_digest(raw.get("dg")),
        )
    except Exception as exc:
        raise CorruptEntryError(f"malformed hot record: {exc!r}") from exc


def messages_of(data: Sequence[bytes]) -> list[Message]:
    """Decode canonical message bytes to dicts."""
    return [decode_message(item) for item in data]


MESSAGE_OVERHEAD_BYTES = 57
"""Memory of one message in a snapshot beyond its bytes: a bytes object's header (33),
its list slot (8) and its digest in the snapshot's chain (16), on CPython 64-bit."""


class ThreadRunFormat:
    """The thread-run front-end as the engine sees it: its entries, its hot records and,
    as the writer's cursor state, the thread's canonical message snapshot
    (`buffered_store.engine.appender.WriteFormat`)."""

    front_end = THREADRUN
    """The name its streams are tagged with (`buffered_store.engine.frontend`)."""

    def decode_entry(self, payload: bytes, *, stream_seq: int = 0) -> WalEntry:
        """`decode_entry`."""
        return decode_entry(payload, stream_seq=stream_seq)

    def decode_hot(self, data: bytes) -> HotRecord:
        """`decode_hot`."""
        return decode_hot(data)

    def advance_hot(
        self, previous: HotRecord | None, entry: WalEntry, stream_seq: int, *, window: int
    ) -> HotRecord:
        """`advance_hot`."""
        return advance_hot(previous, entry, stream_seq, window=window)

    def encode_hot(self, record: HotRecord, *, limit: int) -> bytes:
        """`encode_hot_within`."""
        return encode_hot_within(record, limit)

    def with_recent(self, record: HotRecord, recent: Sequence[tuple[int, int]]) -> HotRecord:
        """The record with another `recent` list."""
        return replace(record, recent=RecentSeqs(recent))

    def placed(self, entry: WalEntry, stream_seq: int) -> WalEntry | None:
        """None: a built entry holds the caller's run and metadata objects, which it may
        change after the call (reads of a writer's own threads use its snapshot)."""
        return None

    def known_state(
        self, hot: HotRecord | None, same_seq: list[bytes] | None
    ) -> list[bytes] | None:
        """A new or deleted thread's snapshot is empty; otherwise only a cursor at the
        same seq knows it."""
        if hot is None or hot.thread is None:
            return MessageSnapshot()
        return same_seq

    def state_after(
        self, state: list[bytes] | None, entry: WalEntry, *, owned: bool
    ) -> list[bytes] | None:
        """The snapshot after `entry` (a `MessageSnapshot`, remembering the message
        objects of entries this process built). An owned snapshot that the entry extends
        is extended in place instead of copying the history: safe because its cursor is
        replaced by the new one and cursors hand their snapshot out only to readers that
        decode it before yielding."""
        if entry.kind is EntryKind.DELETE:
            return MessageSnapshot()
        sources = entry.sources if len(entry.sources) == len(entry.messages) else ()
        chain = entry.chain if len(entry.chain) == DIGEST_SIZE * len(entry.messages) else b""
        if entry.keep == 0:
            return MessageSnapshot(entry.messages, sources, chain)
        if state is None or entry.keep > len(state):
            return None
        lead: list[Any] = getattr(state, "sources", [])
        aligned = len(lead) >= entry.keep
        # The digests of what the entry keeps continue with the entry's own, when known.
        known: bytearray = getattr(state, "chain", bytearray())
        chained = len(known) >= DIGEST_SIZE * entry.keep
        if owned and entry.keep == len(state):
            state.extend(entry.messages)
            if aligned and sources:
                lead.extend(sources)  # a plain list has no sources: `lead` is a spare
            if chained and chain:
                known += chain  # likewise `chain`
            return state
        return MessageSnapshot(
            apply_delta(state, entry.keep, entry.messages),
            [*lead[: entry.keep], *sources] if aligned else lead[: entry.keep],
            known[: DIGEST_SIZE * entry.keep] + chain if chained else b"",
        )

    def state_bytes(self, state: list[bytes]) -> int:
        """The snapshot's message bytes plus a bytes object and a list slot each."""
        return sum(map(len, state)) + MESSAGE_OVERHEAD_BYTES * len(state)

    def added_bytes(self, entry: WalEntry) -> int:
        """What extending a snapshot with the entry's messages adds."""
        return sum(map(len, entry.messages)) + MESSAGE_OVERHEAD_BYTES * len(entry.messages)


FORMAT = ThreadRunFormat()
"""The one instance the store, the flusher and the tools hand to the engine."""
