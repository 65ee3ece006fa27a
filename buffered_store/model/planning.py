"""Flush planning: which entries of a thread apply on top of a stored watermark, and
their coalesced net effect. Shared by the flusher, `force_flush` and the read overlay.
Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from buffered_store.engine.entries import chain_after, follows
from buffered_store.errors import CorruptEntryError
from buffered_store.model.changes import (
    EntryKind,
    WalEntry,
)
from buffered_store.model.messages import apply_delta
from buffered_store.model.records import RunRecord, Thread


class PlanStatus(StrEnum):
    """What a thread's batch of entries means against the stored watermark."""

    APPLY = "apply"
    """Entries continue the watermark without a gap: apply them."""
    STALE = "stale"
    """Every entry is at or below the watermark: nothing to do but ack."""
    GAP = "gap"
    """Entries start after watermark + 1: earlier entries must be fetched first."""


@dataclass(frozen=True, slots=True)
class Plan:
    """Result of `plan_entries`."""

    status: PlanStatus
    entries: tuple[WalEntry, ...]
    """For APPLY: the entries above the watermark, in seq order, deduplicated."""
    missing_from: int = 0
    """For GAP: the first missing seq (watermark + 1)."""


def plan_entries(entries: Iterable[WalEntry], flushed_seq: int) -> Plan:
    """Sort, deduplicate and check a thread's entries against its flushed watermark.

    Entries at or below the watermark are dropped (stale, duplicated or redelivered);
    the rest apply while they follow each other (`follows`), else only the contiguous
    prefix applies and a GAP is reported when even the first one is missing.
    """
    items = list(entries)
    if not any(entry.seq > flushed_seq for entry in items):
        return Plan(PlanStatus.STALE, ())
    chain = chain_after(items, flushed_seq)
    if not chain:
        return Plan(PlanStatus.GAP, (), missing_from=flushed_seq + 1)
    return Plan(PlanStatus.APPLY, tuple(chain))


def deletes_first(batches: Sequence[Sequence[WalEntry]]) -> list[list[int]]:
    """The indexes of one apply call's batches in the groups to write one after the other,
    each thread's batches in their order: the threads deleted (their last entry of the
    call a delete), then those deleted and re-created, then the rest.

    A run a deleted thread owned may be taken over by another thread of the same call
    (the writer allowed it because the delete came first in the WAL): the delete must
    free it before the other thread writes it. A thread re-created after its delete may
    itself take over a run (of a thread deleted for good), so it follows those.
    """
    deleting: set[str] = set()
    last: dict[str, WalEntry] = {}
    for batch in batches:
        if batch:
            last[batch[0].thread_id] = batch[-1]
            if any(entry.kind is EntryKind.DELETE for entry in batch):
                deleting.add(batch[0].thread_id)
    groups: list[list[int]] = [[], [], []]
    for index, batch in enumerate(batches):
        if not batch or batch[0].thread_id not in deleting:
            groups[2].append(index)
        elif last[batch[0].thread_id].kind is EntryKind.DELETE:
            groups[0].append(index)
        else:
            groups[1].append(index)
    return groups


@dataclass(frozen=True, kw_only=True, slots=True)
class ThreadChange:
    """The net effect of consecutive entries of one thread on its stored state."""

    thread_id: str
    first_seq: int
    last_seq: int
    reset: bool
    """A delete is in the chain: drop the stored messages and runs before writing."""
    keep: int
    """Stored messages at positions below `keep` stay untouched."""
    messages: list[bytes]
    """Written at positions keep, keep + 1, ...; rows from `message_count` on are deleted."""
    message_count: int
    runs: dict[str, tuple[RunRecord, int]] = field(default_factory=dict)
    """Latest version of each run written since the last reset, with its seq."""
    thread: Thread | None
    """Summary at `last_seq`; None when the thread is deleted at `last_seq`."""


def coalesce(entries: Sequence[WalEntry], *, stored_count: int) -> ThreadChange:
    """Fold contiguous entries into one change against a stored snapshot of `stored_count`."""
    if not entries:
        raise ValueError("coalesce needs at least one entry")
    reset = False
    keep = stored_count
    tail: list[bytes] = []
    runs: dict[str, tuple[RunRecord, int]] = {}
    for entry in entries:
        if entry.kind is EntryKind.DELETE:
            reset, keep, tail, runs = True, 0, [], {}
            continue
        current = keep + len(tail)
        if entry.keep > current:
            raise CorruptEntryError(
                f"entry {entry.seq} keeps {entry.keep} messages but only {current} exist"
            )
        if entry.keep <= keep:
            keep, tail = entry.keep, list(entry.messages)
        else:
            tail = tail[: entry.keep - keep] + list(entry.messages)
        if entry.run is not None:
            runs[entry.run.run_id] = (entry.run, entry.seq)
    last = entries[-1]
    return ThreadChange(
        thread_id=last.thread_id,
        first_seq=entries[0].seq,
        last_seq=last.seq,
        reset=reset,
        keep=keep,
        messages=tail,
        message_count=keep + len(tail),
        runs=runs,
        thread=last.thread,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class ThreadView:
    """A thread as a reader sees it at `seq`: stored state with entries folded on top."""

    seq: int
    thread: Thread | None
    messages: list[bytes]
    runs: dict[str, tuple[RunRecord, int]]
    """Run versions known to this view (stored ones passed in, plus those of entries)."""


def fold(view: ThreadView, entries: Iterable[WalEntry]) -> ThreadView:
    """Apply entries above `view.seq` in order; entries at or below it are ignored."""
    seq, thread, messages, runs = view.seq, view.thread, list(view.messages), dict(view.runs)
    for entry in sorted(entries, key=lambda e: e.seq):
        if entry.seq <= seq:
            continue
        if not follows(entry, seq):
            raise CorruptEntryError(f"entry {entry.seq} does not follow seq {seq}")
        if entry.kind is EntryKind.DELETE:
            thread, messages, runs = None, [], {}
        else:
            messages = apply_delta(messages, entry.keep, entry.messages)
            thread = entry.thread
            if entry.run is not None:
                previous = runs.get(entry.run.run_id)
                if previous is None or previous[1] < entry.seq:
                    runs[entry.run.run_id] = (entry.run, entry.seq)
        seq = entry.seq
    return ThreadView(seq=seq, thread=thread, messages=messages, runs=runs)
