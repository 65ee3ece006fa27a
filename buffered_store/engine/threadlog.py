"""Reading a thread's entries back from the WAL and flushing them to a `FlushSink`.

Shared by `force_flush` (inline, no flusher process needed), the read overlay and the
flusher service, so every path applies entries the same way: in seq order, with no gap,
checked against the watermark inside the target, then the KV `flushed` mark is raised.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic

from buffered_store.config import EngineConfig
from buffered_store.engine.entries import (
    E,
    FlushedMark,
    Format,
    H,
    chain_after,
    decode_flushed,
    encode_flushed,
)
from buffered_store.engine.flushing import ApplyStatus, FlushSink
from buffered_store.engine.keys import flushed_key, hot_key, thread_from_subject, wal_subject
from buffered_store.engine.pending import PendingThread
from buffered_store.engine.ports import StoredMsg, Wal
from buffered_store.errors import (
    ConflictError,
    CorruptEntryError,
    FlushFailedError,
    FlushTimeoutError,
    WalEntriesMissingError,
    WalObjectMissingError,
    WalRefusedError,
)

log = logging.getLogger("buffered_store.engine.threadlog")


@dataclass(frozen=True, slots=True)
class HotState(Generic[H]):
    """A thread's hot record with its KV revision."""

    record: H
    revision: int


MARK_CACHE_SIZE = 65_536
"""Threads whose flushed-mark revision a `ThreadLog` remembers (least recently raised
ones are forgotten first)."""


WALK_DIRECT_GETS = 4
"""Messages a walk of a subject reads one direct get at a time before it reads the rest
with one consumer scan (whose consumer costs two more round trips: made and deleted)."""


class EntryCache(Generic[E]):
    """Entries this process appended, kept for its own reads of their threads.

    An entry never changes once it is in the stream, so a read of a thread this process
    writes finds its unflushed tail here instead of fetching it again. Bounded in bytes
    (the entries' wire sizes, least recently written threads dropped first) and to the
    newest `per_thread` entries of each thread.
    """

    def __init__(self, max_bytes: int, per_thread: int = 64) -> None:
        self.max_bytes = max_bytes
        self.per_thread = per_thread
        self.bytes = 0
        self._threads: OrderedDict[str, OrderedDict[int, tuple[E, int]]] = OrderedDict()

    def put(self, thread_id: str, entry: E, size: int) -> None:
        """Keep `entry` (read back from the stream: its stream seq is set), `size` bytes."""
        if self.max_bytes <= 0 or size > self.max_bytes:
            return
        entries = self._threads.get(thread_id)
        if entries is None:
            entries = self._threads[thread_id] = OrderedDict()
        self._threads.move_to_end(thread_id)
        old = entries.pop(entry.seq, None)
        if old is not None:
            self.bytes -= old[1]
        entries[entry.seq] = (entry, size)
        self.bytes += size
        while len(entries) > self.per_thread:
            self.bytes -= entries.popitem(last=False)[1][1]
        while self.bytes > self.max_bytes and self._threads:
            _, dropped = self._threads.popitem(last=False)
            self.bytes -= sum(size for _, size in dropped.values())

    def found(self, thread_id: str, after: int, upto: int) -> dict[int, E]:
        """The cached entries of the thread with seq in (after, upto]."""
        entries = self._threads.get(thread_id)
        if not entries:
            return {}
        return {seq: e for seq, (e, _) in entries.items() if after < seq <= upto}

    def drop(self, thread_id: str) -> None:
        """Forget a thread's entries."""
        entries = self._threads.pop(thread_id, None)
        if entries:
            self.bytes -= sum(size for _, size in entries.values())


class ThreadLog(Generic[E, H]):
    """Per-thread views of the WAL: hot records, watermarks and entry ranges, of the
    entries and hot records of one front-end (`fmt`).

    It remembers the KV revision of each flushed mark it wrote or read last, so raising a
    mark is usually one compare-and-set, without reading the key first.
    """

    def __init__(
        self,
        wal: Wal,
        config: EngineConfig,
        fmt: Format[E, H],
        *,
        cache: EntryCache[E] | None = None,
    ) -> None:
        self.wal = wal
        self.config = config
        self.fmt = fmt
        self.cache = cache
        """Entries this process appended (`EntryCache`), read before the stream."""
        self._marks: OrderedDict[str, tuple[int, int]] = OrderedDict()
        """thread id -> (seq, KV revision) of its flushed mark, as last written or read."""
        self.mark_stats = {"cached_swaps": 0, "stale_revisions": 0, "reads": 0}
        """How marks were raised: ``cached_swaps`` (one CAS on a remembered revision),
        ``stale_revisions`` (that CAS found the key moved and fell back to a read),
        ``reads`` (reads of the key before a CAS)."""

    def subject(self, thread_id: str) -> str:
        """WAL subject of a thread."""
        return wal_subject(self.config.stream_name, thread_id)

    async def hot(self, thread_id: str) -> HotState[H] | None:
        """The thread's hot record, or None when the WAL never saw it."""
        value = await self.wal.kv_get(hot_key(thread_id))
        if value is None:
            return None
        return HotState(self.fmt.decode_hot(value.value), value.revision)

    async def latest(self, thread_id: str) -> tuple[HotState[H] | None, int]:
        """The hot record and the highest seq in the stream for the thread.

        The stream can be ahead of the hot record when a writer's KV update failed after
        its publish ("commit unknown"); flushing must include that entry too.
        """
        hot, last = await asyncio.gather(
            self.hot(thread_id), self.wal.last_on(self.subject(thread_id))
        )
        upto = hot.record.seq if hot else 0
        if last is not None and (hot is None or last.seq > hot.record.stream_seq):
            entry = self.decode(thread_id, last)
            if entry is not None:
                upto = max(upto, entry.seq)
        return hot, upto

    async def last_entry(self, thread_id: str) -> tuple[bool, E | None]:
        """Whether the thread's subject holds any message, and the entry its last one
        holds (None when it is no readable entry of the thread). One direct get: the
        stream's view of the thread's latest seq, whatever its hot record says."""
        last = await self.wal.last_on(self.subject(thread_id))
        if last is None:
            return False, None
        return True, self.decode(thread_id, last)

    async def mark(self, thread_id: str) -> FlushedMark | None:
        """The thread's KV flushed watermark, or None."""
        value = await self.wal.kv_get(flushed_key(thread_id))
        if value is None:
            return None
        mark = decode_flushed(value.value)
        self._remember(thread_id, mark.seq, value.revision)
        return mark

    async def entries_between(
        self, thread_id: str, after: int, upto: int, hot: H | None
    ) -> list[E]:
        """The chain of entries applying on top of seq `after`, up to seq `upto`, in order.

        Uses the entries this process appended when they make the whole chain (no
        request), else the stream seqs cached in the hot record when they cover the range
        (one round of concurrent direct gets), else walks the subject. Raises
        `WalEntriesMissingError` when an entry of the chain is no longer in the stream.
        """
        if upto <= after:
            return []
        if self.cache is not None:
            local = self.cache.found(thread_id, after, upto)
            chain = chain_after(local.values(), after)
            if chain and chain[-1].seq == upto:
                return chain
        known = dict(hot.recent) if hot else {}
        found = await self._cached(thread_id, after, upto, known)
        chain = chain_after(found.values(), after)
        if not chain or chain[-1].seq != upto:
            found.update(await self._walk(thread_id, after, upto, known))
            chain = chain_after(found.values(), after)
        if not chain or chain[-1].seq != upto:
            reached = chain[-1].seq if chain else after
            raise WalEntriesMissingError(
                f"thread {thread_id!r}: the entries after seq {reached} up to {upto} are not "
                "in the WAL (expired before they were flushed?)",
                thread_id=thread_id,
                reached=reached,
                upto=upto,
            )
        return chain

    async def _cached(
        self, thread_id: str, after: int, upto: int, known: dict[int, int]
    ) -> dict[int, E]:
        """Entries of (after, upto] read by the stream seqs cached in the hot record, when
        they can make the whole chain: they reach `upto` without a hole and start right
        after `after`, or with a jump entry (only known once that first one is read)."""
        cached = sorted(seq for seq in known if after < seq <= upto)
        if not cached or cached[-1] != upto or cached[-1] - cached[0] + 1 != len(cached):
            return {}
        found: dict[int, E] = {}
        if cached[0] != after + 1:
            first = await self.wal.get(known[cached[0]])
            entry = self.decode(thread_id, first) if first is not None else None
            if entry is None or entry.seq != cached[0] or not entry.jump:
                return {}
            found[entry.seq] = entry
            cached = cached[1:]
        for msg in await self.wal.get_many([known[seq] for seq in cached]):
            entry = self.decode(thread_id, msg)
            if entry is not None and after < entry.seq <= upto:
                found[entry.seq] = entry
        return found

    async def _walk(
        self, thread_id: str, after: int, upto: int, known: dict[int, int]
    ) -> dict[int, E]:
        # Entries of one subject sit in seq order (each publish is a per-subject CAS), so
        # the walk can start at the newest stream position known to be at or below `after`.
        below = [stream_seq for seq, stream_seq in known.items() if seq <= after]
        if below:
            return await self._walk_from(thread_id, after, upto, max(below) + 1)
        floor = await self._ack_floor() if after > 0 else 0
        if floor > 0:
            # An entry above the watermark was never acknowledged (acks follow the
            # flush), so it lies above the flusher consumer's ack floor: walking from
            # there costs the thread's unflushed entries, not its whole history.
            found = await self._walk_from(thread_id, after, upto, floor + 1)
            if after + 1 in found:
                return found
            # Nothing continues the watermark above the floor (its entries were
            # terminated, as a quarantine does): the whole subject decides.
        return await self._walk_from(thread_id, after, upto, 1)

    async def _ack_floor(self) -> int:
        """The flusher consumer's ack floor (stream seq), 0 when there is no consumer to
        read it from (NATS unavailable raises, as the walk itself would)."""
        try:
            return (await self.wal.consumer_state()).ack_floor
        except (WalObjectMissingError, WalRefusedError):
            return 0

    async def _walk_from(self, thread_id: str, after: int, upto: int, start: int) -> dict[int, E]:
        """Entries of (after, upto] on the thread's subject from stream seq `start` on."""
        found: dict[int, E] = {}
        async for _, entry in self.walk(thread_id, start):
            if entry is not None:
                if after < entry.seq <= upto:
                    found[entry.seq] = entry
                if entry.seq >= upto:
                    break
        return found

    async def walk(self, thread_id: str, start: int) -> AsyncIterator[tuple[StoredMsg, E | None]]:
        """The messages on the thread's subject from stream seq `start` on, in order, each
        with its entry (None when it is no readable entry of the thread).

        The first `WALK_DIRECT_GETS` one direct get each, so callers that need only the
        next few stop early; then the rest of the subject in one consumer scan
        (`Wal.read_subject`): a tail of hundreds of entries (a flusher behind, a reader
        in another process) costs a few round trips, not one per entry."""
        subject = self.subject(thread_id)
        msg = await self.wal.next_on(subject, start)
        gets = 1
        while msg is not None:
            yield msg, self.decode(thread_id, msg)
            if gets >= WALK_DIRECT_GETS:
                for rest in await self.wal.read_subject(subject, msg.seq + 1):
                    yield rest, self.decode(thread_id, rest)
                return
            msg = await self.wal.next_on(subject, msg.seq + 1)
            gets += 1

    def decode(self, thread_id: str, msg: StoredMsg) -> E | None:
        """The entry `msg` holds, or None when it holds none of the thread's."""
        try:
            entry = self.fmt.decode_entry(msg.data, stream_seq=msg.seq)
        except CorruptEntryError:
            return None  # garbage on the subject holds no seq; the flusher quarantines it
        return entry if entry.thread_id == thread_id else None

    async def tail_entries(self) -> list[E]:
        """Entries of the WAL tail: between the flusher consumer's ack floor and the end.

        Everything unflushed is there (and maybe some flushed entries acked out of order).
        Costs O(tail entries), read with concurrent direct gets.
        """
        first, last = await self.wal.tail_bounds()
        return await self.read_tail(first, last)

    async def pending_threads(self) -> list[str]:
        """Threads with entries in the WAL tail, sorted."""
        return sorted({entry.thread_id for entry in await self.tail_entries()})

    async def read_tail(self, first: int, last: int) -> list[E]:
        """Decodable thread entries with stream seq in [first, last], in stream order."""
        out: list[E] = []
        if last < first:
            return out
        for msg in await self.wal.get_many(list(range(first, last + 1)), parallel=256):
            thread_id = thread_from_subject(self.config.stream_name, msg.subject)
            if thread_id is None:
                continue
            try:
                entry = self.fmt.decode_entry(msg.data, stream_seq=msg.seq)
            except CorruptEntryError:
                continue
            if entry.thread_id == thread_id:
                out.append(entry)
        return out

    async def raise_mark(self, thread_id: str, seq: int, stream_seq: int) -> None:
        """Raise the KV flushed watermark to `seq` (never lowers it).

        With the key's revision remembered from an earlier raise, this is one
        compare-and-set; when the key moved meanwhile (another flusher raised it, or it
        was deleted) the CAS fails and the key is read again, as without a cache.
        """
        key = flushed_key(thread_id)
        value = encode_flushed(FlushedMark(seq, stream_seq))
        known = self._marks.get(thread_id)
        if known is not None and known[0] < seq:
            try:
                revision = await self.wal.kv_swap(key, value, revision=known[1])
            except ConflictError:
                self.mark_stats["stale_revisions"] += 1
                self._marks.pop(thread_id, None)
            else:
                self.mark_stats["cached_swaps"] += 1
                self._remember(thread_id, seq, revision)
                return
        for _ in range(10):
            self.mark_stats["reads"] += 1
            current = await self.wal.kv_get(key)
            if current is not None:
                current_seq = decode_flushed(current.value).seq
                if current_seq >= seq:
                    self._remember(thread_id, current_seq, current.revision)
                    return
            try:
                revision = await self.wal.kv_swap(
                    key, value, revision=current.revision if current else None
                )
            except ConflictError:
                continue
            self._remember(thread_id, seq, revision)
            return
        log.warning("flushed mark of a thread kept moving", extra={"action": "mark_contended"})

    def _remember(self, thread_id: str, seq: int, revision: int) -> None:
        self._marks[thread_id] = (seq, revision)
        self._marks.move_to_end(thread_id)
        while len(self._marks) > MARK_CACHE_SIZE:
            self._marks.popitem(last=False)


async def flush_thread(log_: ThreadLog[E, H], target: FlushSink[E], thread_id: str) -> int:
    """Apply every entry of the thread acknowledged so far; return the flushed seq.

    Works without any flusher running; safe against concurrent flushers (the target
    checks the watermark inside its transaction). A thread refused because another
    thread still holds what it needs in the target (`ApplyOutcome.waits_for`: a run whose
    owner's delete is still in the WAL) is tried again together with that thread, in one
    apply call: the target writes the owner's delete first, and two re-created threads
    that swapped their runs can only be written together. One refused by an owner that
    let the run go meanwhile (`ApplyOutcome.retry_now`: the owner flushed side by side,
    as `force_flush_all` does) tries again at once.
    """
    hot, upto = await log_.latest(thread_id)
    group: dict[str, tuple[H | None, int]] = {thread_id: (hot.record if hot else None, upto)}
    raced = ""
    for attempt in range(20):
        flushed = await target.flushed_seqs(list(group))
        if flushed[thread_id] >= upto:
            if attempt == 0 and hot is not None:
                await _repair_mark(log_, thread_id, flushed[thread_id], hot.record)
            return flushed[thread_id]
        pending = [t for t, (_, last) in group.items() if flushed[t] < last]
        batches = [
            await log_.entries_between(t, flushed[t], group[t][1], group[t][0]) for t in pending
        ]
        outcomes = await target.apply(batches)
        owners: list[str] = []
        # A helper moved by another flusher meanwhile (its refusal of this thread may
        # be gone): read again. (A helper's `retry_now` may come from this thread's own
        # claim in the same call: no reason to try the same call again.)
        moved = False
        for member, batch, outcome in zip(pending, batches, outcomes, strict=True):
            if member != thread_id and outcome.status in (ApplyStatus.STALE, ApplyStatus.GAP):
                moved = True
            if outcome.status is ApplyStatus.APPLIED:
                # A flush outside the flusher acknowledges no WAL message: the KV mark
                # keeps what it did visible to `flush_status` while the target cannot
                # answer (the flusher's cycles do not raise marks: their acks tell).
                last = batch[-1]
                await log_.raise_mark(member, last.seq, last.stream_seq)
            elif outcome.status is ApplyStatus.FAILED and outcome.waits_for is not None:
                owners.append(outcome.waits_for)
        outcome = outcomes[pending.index(thread_id)]
        if outcome.status is ApplyStatus.APPLIED:
            return outcome.flushed_seq
        if outcome.status is ApplyStatus.FAILED and outcome.retry_now:
            raced = f" (last refused: {outcome.error})"
            await asyncio.sleep(0)  # refused by an owner that has let the run go since
            continue
        joining = [owner for owner in dict.fromkeys(owners) if owner not in group]
        if outcome.status is ApplyStatus.FAILED and not joining and not moved:
            raise FlushFailedError(
                f"flushing thread {thread_id!r} failed: {outcome.error}",
                thread_id=thread_id,
                retriable=outcome.retriable,
            )
        for owner in joining:  # flushed with this thread from now on
            owner_hot, owner_upto = await log_.latest(owner)
            group[owner] = (owner_hot.record if owner_hot else None, owner_upto)
        # STALE or GAP (another flusher moved it), a helper moved, or owners joined.
        await asyncio.sleep(0)
    raise ConflictError(f"thread {thread_id!r} kept moving while being flushed{raced}")


async def _repair_mark(log_: ThreadLog[E, H], thread_id: str, flushed: int, hot: H) -> None:
    """Raise the KV flushed mark to the target's watermark when it lags behind it.

    A flush cut short between its commit and its mark (a timeout, a crash), or applied by
    the flusher (whose cycles raise no marks), leaves the mark below the data; `bufstore
    status` without a database URL reads the marks. Done when the stream seq of the
    entry at `flushed` is known (the hot record's latest or recent ones).
    """
    stream_seq = dict(hot.recent).get(flushed) or (hot.stream_seq if hot.seq == flushed else 0)
    if stream_seq:
        await log_.raise_mark(thread_id, flushed, stream_seq)  # never lowers it


async def force_flush(
    log_: ThreadLog[E, H], target: FlushSink[E], thread_id: str, *, timeout_s: float
) -> int:
    """`flush_thread` within `timeout_s` seconds (`FlushTimeoutError` after it)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await flush_thread(log_, target, thread_id)
    except TimeoutError as exc:
        raise FlushTimeoutError(
            f"force_flush of thread {thread_id!r} did not complete within {timeout_s}s",
            thread_id=thread_id,
        ) from exc


FlushProgress = Callable[[int, int], None]
"""Told (threads flushed, threads to flush) as a `force_flush_all` goes on."""
LISTED_NOT_FLUSHED = 10
"""Threads a `force_flush_all` timeout names in its message (all are in the error)."""


async def force_flush_all(
    log_: ThreadLog[E, H],
    target: FlushSink[E],
    scan: Callable[[], Awaitable[list[PendingThread[H]]]],
    *,
    timeout_s: float,
    parallel: int,
    progress: FlushProgress | None = None,
) -> int:
    """Flush every thread with unflushed entries, `parallel` at a time, within `timeout_s`
    seconds; returns how many threads were flushed. `progress` is called with (flushed,
    total) once the threads are known and after each one.

    After `timeout_s`, `FlushTimeoutError` says how many were flushed and which were not.
    """
    threads: list[str] = []
    done: set[str] = set()
    try:
        async with asyncio.timeout(timeout_s):
            threads = [p.thread_id for p in await scan()]
            gate = asyncio.Semaphore(parallel)
            if progress is not None:
                progress(0, len(threads))

            async def one(thread_id: str) -> None:
                async with gate:
                    await flush_thread(log_, target, thread_id)
                done.add(thread_id)
                if progress is not None:
                    progress(len(done), len(threads))

            await asyncio.gather(*(one(t) for t in threads))
            return len(threads)
    except TimeoutError as exc:
        missing = tuple(t for t in threads if t not in done)
        raise FlushTimeoutError(
            _flush_all_timeout_text(timeout_s, threads, len(done), missing),
            flushed=len(done),
            not_flushed=missing,
        ) from exc


def _flush_all_timeout_text(
    timeout_s: float, threads: Sequence[str], done: int, missing: Sequence[str]
) -> str:
    text = f"force_flush_all did not complete within {timeout_s:g}s: "
    if not threads:
        return text + "the pending threads were not found in time (nothing flushed)"
    named = ", ".join(repr(t) for t in missing[:LISTED_NOT_FLUSHED])
    more = len(missing) - LISTED_NOT_FLUSHED
    return (
        text
        + f"{done} of {len(threads)} thread(s) flushed; not flushed: {named}"
        + (f" and {more} more" if more > 0 else "")
    )


def group_by_thread(entries: Sequence[E]) -> dict[str, list[E]]:
    """Entries per thread, each list in seq order."""
    groups: dict[str, list[E]] = {}
    for entry in entries:
        groups.setdefault(entry.thread_id, []).append(entry)
    for items in groups.values():
        items.sort(key=lambda e: e.seq)
    return groups
