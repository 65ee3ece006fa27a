"""Which threads have unflushed entries, found in O(pending threads), not O(stream).

The hot bucket keeps only the latest value of each key, so its own stream holds one
message per thread, in the order the threads were last written. A thread can only be
pending (hot seq above its flushed watermark) if its hot record was written after the
last moment every thread was known to be flushed. The *floor* (KV key `FLOOR_KEY`)
remembers that moment as a position in the bucket's stream, plus the few threads still
pending below it (`held`), so a scan reads only the hot records written since:

1. read the floor, the held threads' hot records, and every hot record from the floor on;
2. ask the flush target for the watermarks of those threads (one query);
3. pending = hot seq above the watermark; raise the floor past everything else.

Entries whose hot record update failed after the publish ("commit unknown") are not
pending here until the next write of their thread; the flusher still applies them.
`plan_floor` is pure; `PendingIndex` awaits.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic

import orjson

from buffered_store.engine.entries import Format, H
from buffered_store.engine.keys import decode_token, hot_key
from buffered_store.engine.ports import Wal
from buffered_store.errors import ConflictError, CorruptEntryError, WalUnavailableError

log = logging.getLogger("buffered_store.engine.pending")

FLOOR_KEY = "floor.pending"
"""KV key (hot bucket) of the pending-thread floor."""
MAX_HELD_BYTES = 256 * 1024
"""Budget of the thread ids the floor lists below itself (UTF-8 bytes, plus 4 per id for
the JSON around it); beyond that the floor stays put. Each id is at most 512 bytes, so at
least 500 threads fit, and about 6,000 of 40-byte ids (quarantined threads stay pending
until an operator resolves them, and are held all that time)."""


@dataclass(frozen=True, slots=True)
class Floor:
    """Every thread whose hot record sits below `kv_seq` in the bucket's stream is flushed,
    except those in `held`."""

    kv_seq: int = 1
    held: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class HotAt(Generic[H]):
    """A thread's hot record and where it sits in the bucket's stream (its KV revision)."""

    thread_id: str
    kv_seq: int
    record: H


@dataclass(frozen=True, slots=True)
class PendingThread(Generic[H]):
    """A thread with entries above its flushed watermark."""

    thread_id: str
    record: H
    flushed_seq: int


def encode_floor(floor: Floor) -> bytes:
    """KV bytes of a floor."""
    return orjson.dumps({"s": floor.kv_seq, "held": list(floor.held)})


def decode_floor(data: bytes) -> Floor:
    """Floor from KV bytes."""
    try:
        raw = orjson.loads(data)
        return Floor(int(raw["s"]), tuple(str(t) for t in raw.get("held", ())))
    except Exception as exc:
        raise CorruptEntryError(f"malformed pending floor: {exc!r}") from exc


def plan_floor(
    floor: Floor,
    pending: Sequence[HotAt[Any]],
    scanned_upto: int,
    *,
    max_held_bytes: int = MAX_HELD_BYTES,
) -> Floor:
    """The floor after a scan that read every hot record up to `scanned_upto`.

    Pending threads sitting below the new floor are held; when their ids do not fit in
    `max_held_bytes`, the floor stops at the first one that does not fit.
    """
    ordered = sorted(pending, key=lambda item: item.kv_seq)
    kv_seq = max(floor.kv_seq, scanned_upto + 1)
    used = 0
    for item in ordered:
        if item.kv_seq >= kv_seq:
            break
        used += len(item.thread_id.encode("utf-8")) + 4
        if used > max_held_bytes:
            kv_seq = item.kv_seq
            break
    held = tuple(item.thread_id for item in ordered if item.kv_seq < kv_seq)
    return Floor(kv_seq, held)


class PendingIndex(Generic[H]):
    """Finds the threads with unflushed entries (see the module docstring), among the
    hot records of one front-end (`fmt`)."""

    def __init__(
        self,
        wal: Wal,
        flushed_seqs: Callable[[Sequence[str]], Awaitable[dict[str, int]]],
        fmt: Format[Any, H],
    ) -> None:
        self.wal = wal
        self._flushed_seqs = flushed_seqs
        self._fmt = fmt

    async def scan(self) -> list[PendingThread[H]]:
        """Pending threads, sorted by id; raises the floor when it can (best effort)."""
        current = await self.wal.kv_get(FLOOR_KEY)
        floor = decode_floor(current.value) if current else Floor()
        held, scanned = await asyncio.gather(
            self.wal.kv_get_many([hot_key(t) for t in floor.held]),
            self.wal.hot_updates("h.", floor.kv_seq),
        )
        found: dict[str, HotAt[H]] = {}
        for thread_id, value in zip(floor.held, held, strict=True):
            if value is not None:
                found[thread_id] = HotAt(
                    thread_id, value.revision, self._fmt.decode_hot(value.value)
                )
        upto = max((msg.seq for msg in scanned), default=floor.kv_seq - 1)
        for msg in scanned:
            item = self._hot_at(msg.subject, msg.seq, msg.data)
            if item is not None:
                found[item.thread_id] = item  # newer than a held copy
            else:
                # Its thread may be pending, which nobody can tell: the floor stays below
                # it (and the warning repeats) until a new write of the thread replaces it.
                upto = min(upto, msg.seq - 1)
        ids = sorted(found)
        flushed = await self._flushed_seqs(ids) if ids else {}
        pending = [found[t] for t in ids if found[t].record.seq > flushed[t]]
        new = plan_floor(floor, pending, upto)
        if new != floor:
            await self._store(new, current.revision if current else None)
        return [PendingThread(p.thread_id, p.record, flushed[p.thread_id]) for p in pending]

    async def _store(self, floor: Floor, revision: int | None) -> None:
        try:
            await self.wal.kv_swap(FLOOR_KEY, encode_floor(floor), revision=revision)
        except ConflictError:
            # Another reader raised it meanwhile from its own scan: either floor is safe.
            log.debug("pending floor moved meanwhile", extra={"action": "floor_contended"})
        except WalUnavailableError:
            # The scan's answer stands; the next scan reads from the old floor again.
            log.debug("pending floor not stored", extra={"action": "floor_contended"})

    def _hot_at(self, key: str, kv_seq: int, data: bytes) -> HotAt[H] | None:
        token = key[2:]
        try:
            return HotAt(decode_token(token), kv_seq, self._fmt.decode_hot(data))
        except Exception:  # not a hot record of ours: skip it rather than fail every list call
            log.warning("unreadable hot record %s", key, extra={"action": "hot_record_unreadable"})
            return None
