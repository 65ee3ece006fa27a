"""The WAL tail as received by the driver, decoded twice over: lightly for messages,
fully (runs, summaries) only when a read needs it.

The messages read of a pinned snapshot (`union`) needs of each entry its thread, seq,
kind, `keep`, count and messages: `message_entries` decodes only those, checked as
`threadrun.entry.decode_entry_roles` checks them (header, kind, messages with a role,
counts, a jump's snapshot, the run's thread), without building the run record and the
thread summary, which were most of the decoding time (`RunRecord.from_json` alone about
40%). `entries` is the full decode, made on first use by the threads and runs reads. An
entry whose run is malformed beyond its thread id (never one our writers make) is in the
messages read but not in the others, which skip it as the flusher quarantines it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc

from buffered_store.config import EngineConfig
from buffered_store.engine.entries import parse_entry
from buffered_store.engine.ids import parse_time
from buffered_store.engine.keys import thread_from_subject
from buffered_store.engine.ports import StoredMsg
from buffered_store.errors import CorruptEntryError
from buffered_store.model.changes import EntryKind
from buffered_store.spark import datasource
from buffered_store.spark.datasource import ENTRY_ARROW, entry_batch, gc_paused

_CHECKPOINT = EntryKind.CHECKPOINT.value
_DELETE = EntryKind.DELETE.value
_MESSAGE_TYPE = ENTRY_ARROW.field("messages").type


@dataclass(frozen=True, eq=False)
class ReceivedTail:
    """The tail's stored messages, or (read on the executors) its decoded entries."""

    config: EngineConfig
    messages: Sequence[StoredMsg] = ()
    decoded: pa.Table | None = None
    """Entries already decoded (`ENTRY_ARROW`); `messages` is then unused."""

    @cached_property
    def entries(self) -> pa.Table:
        """Every decodable entry, fully (`ENTRY_ARROW`), in stream order."""
        if self.decoded is not None:
            return self.decoded
        with gc_paused():
            batch = entry_batch(datasource.decode_messages(self.config, self.messages))
            return pa.Table.from_batches([batch], schema=ENTRY_ARROW)

    @cached_property
    def message_entries(self) -> pa.Table:
        """The entries as `message_entries` decodes them."""
        if self.decoded is not None:
            return self.decoded
        with gc_paused():
            return message_entries(self.config.stream_name, self.messages)


def message_entries(stream_name: str, messages: Sequence[StoredMsg]) -> pa.Table:
    """`ENTRY_ARROW` rows of the decodable thread entries of `messages`, in their order,
    with what a messages read needs: the summary and run columns are null."""
    thread_ids: list[str] = []
    seqs: list[int] = []
    kinds: list[str] = []
    stream_seqs: list[int] = []
    keeps: list[int] = []
    jumps: list[bool] = []
    counts: list[int] = []
    roles: list[str] = []
    texts: list[bytes] = []
    offsets = [0]
    for msg in messages:
        thread_id = thread_from_subject(stream_name, msg.subject)
        if thread_id is None:
            continue
        try:
            decoded = _light(msg.data, thread_id)
        except CorruptEntryError:
            continue
        seq, kind, keep, jump, count, entry_roles, entry_inner = decoded
        thread_ids.append(thread_id)
        seqs.append(seq)
        kinds.append(kind)
        stream_seqs.append(msg.seq)
        keeps.append(keep)
        jumps.append(jump)
        counts.append(count)
        roles.extend(entry_roles)
        texts.extend(entry_inner)
        offsets.append(len(texts))
    n = len(thread_ids)
    given: dict[str, pa.Array] = {
        "thread_id": pa.array(thread_ids, pa.string()),
        "seq": pa.array(seqs, pa.int64()),
        "kind": pa.array(kinds, pa.string()),
        "stream_seq": pa.array(stream_seqs, pa.int64()),
        "keep": pa.array(keeps, pa.int32()),
        "jump": pa.array(jumps, pa.bool_()),
        "message_count": pa.array(counts, pa.int32()),
        "messages": pa.ListArray.from_arrays(
            pa.array(offsets, pa.int32()),
            pa.StructArray.from_arrays(
                [pa.array(roles, pa.string()), _objects(texts)],
                fields=list(_MESSAGE_TYPE.value_type),
            ),
            type=_MESSAGE_TYPE,
        ),
    }
    columns = [given.get(f.name, pa.nulls(n, f.type)) for f in ENTRY_ARROW]
    return pa.Table.from_arrays(columns, schema=ENTRY_ARROW)


def _objects(inner: list[bytes]) -> pa.Array:
    """JSON objects as strings, from their text without the outer braces: the braces go
    on in one Arrow call instead of two Python bytes objects per message."""
    texts = pa.array(inner, pa.binary()).cast(pa.string())
    return pc.binary_join_element_wise("{", texts, "}", "")


def _inner_texts(objects: list[Any]) -> list[bytes]:
    """The canonical JSON of each object (`model.messages.canonical_objects`), without
    its outer braces: one encoding of the whole list, cut at the ``},{`` between items
    (exact when no string holds ``},{``, as the count tells; else item by item)."""
    inner = orjson.dumps(objects, option=orjson.OPT_SORT_KEYS)[2:-2]
    if inner.count(b"},{") != len(objects) - 1:
        return [orjson.dumps(item, option=orjson.OPT_SORT_KEYS)[1:-1] for item in objects]
    return inner.split(b"},{")


def _light(
    payload: bytes, thread_id: str
) -> tuple[int, str, int, bool, int, list[str], list[bytes]]:
    """``(seq, kind, keep, jump, count, roles, message texts without their braces)`` of
    one entry, checked as `decode_entry_roles` checks them; anything else raises
    `CorruptEntryError`."""
    header, data = parse_entry(payload)
    if header.thread_id != thread_id:
        raise CorruptEntryError("entry of another thread")
    if header.kind == _DELETE:
        return header.seq, _DELETE, 0, header.jump, 0, [], []
    if header.kind != _CHECKPOINT:
        raise CorruptEntryError(f"unknown entry kind {header.kind!r}")
    try:
        raw: Any = data["m"]
        # Parsed JSON: only a dict takes a str key (a list or a string raises TypeError).
        roles = [m["role"] for m in raw] if isinstance(raw, list) else None
        if roles is None or not set(map(type, roles)) <= {str}:
            raise CorruptEntryError("entry messages are not JSON objects with a role")
        keep, count = data["keep"], data["n"]
        if not isinstance(keep, int) or keep < 0 or count != keep + len(raw):
            raise CorruptEntryError("entry message counts are inconsistent")
        if header.jump and keep:
            raise CorruptEntryError("a jump entry must carry its full snapshot")
        run = data.get("run")
        if run and (not isinstance(run, dict) or run.get("thread_id") != thread_id):
            raise CorruptEntryError("entry run belongs to another thread")
        parse_time(data["c"])
        texts = _inner_texts(raw) if raw else []
        return header.seq, _CHECKPOINT, keep, header.jump, count, roles, texts
    except CorruptEntryError:
        raise
    except Exception as exc:
        raise CorruptEntryError(f"malformed entry: {exc!r}") from exc
