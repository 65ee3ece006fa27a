"""`InMemoryThreadRunStore`: a complete `ThreadRunStore` and `FlushTarget` in a dict.

Made for tests (ours and users'): it has exactly the semantics of the Postgres store,
checked by the same conformance suite, without a database. `checkpoint()` and
`delete_thread()` build the same `WalEntry` the buffered store puts on the WAL and write
it through the same code as `apply()`, so the direct and the flushed paths cannot
drift apart.

State is stored as canonical JSON bytes and decoded on every read: callers that mutate
what they passed in or what they got back can never change the store.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from types import TracebackType
from typing import Any

import orjson

from buffered_store.engine.flushing import (
    ApplyOutcome,
    ApplyStatus,
    failed_outcome,
    let_go_outcome,
)
from buffered_store.engine.ids import check_id, utcnow
from buffered_store.errors import CorruptEntryError, StoreClosedError, ValidationError
from buffered_store.model.changes import (
    EntryKind,
    WalEntry,
)
from buffered_store.model.checkpointing import (
    CheckpointInput,
    build_checkpoint_entry,
    build_delete_entry,
    check_page,
    run_owned_elsewhere,
    validate_checkpoint,
)
from buffered_store.model.messages import decode_message
from buffered_store.model.planning import (
    PlanStatus,
    ThreadChange,
    coalesce,
    deletes_first,
    plan_entries,
)
from buffered_store.model.records import (
    CheckpointReceipt,
    Message,
    RunRecord,
    RunStatus,
    Thread,
)
from buffered_store.model.target import (
    StoredThread,
    VersionedRun,
    run_sort_key,
    thread_sort_key,
)

__all__ = ["InMemoryThreadRunStore"]


@dataclass(slots=True)
class _ThreadSlot:
    """A thread as stored: summary and messages as canonical bytes, plus its watermark.

    A deleted thread keeps its slot as a tombstone (`summary` None) so that its
    `flushed_seq` survives: later checkpoints continue the seqs and late entries stay stale.
    """

    flushed_seq: int = 0
    summary: bytes | None = None
    sort_key: tuple[float, str] = (0.0, "")
    messages: list[bytes] = field(default_factory=list)
    run_ids: set[str] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class _RunSlot:
    """A run as stored: its record as canonical bytes and the seq that wrote it."""

    record: bytes
    thread_id: str
    thread_seq: int
    status: RunStatus
    sort_key: tuple[float, str]


@dataclass(frozen=True, slots=True)
class _Write:
    """A thread change made ready to commit: everything that can fail is done."""

    thread_id: str
    slot: _ThreadSlot
    runs: dict[str, _RunSlot]
    dropped_runs: frozenset[str]


_Saved = tuple[dict[str, _ThreadSlot], dict[str, _RunSlot], int, int]
"""The threads, the runs and the two apply counters, as `apply` may put them back."""


def _dumps(value: Any, what: str) -> bytes:
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except TypeError as exc:
        raise ValidationError(f"{what} cannot be encoded as JSON: {exc}") from exc


class InMemoryThreadRunStore:
    """A `ThreadRunStore` and `FlushTarget` kept in process memory.

    Use it as the inner store of a `BufferedThreadRunStore` in tests, or on its own
    wherever a `ThreadRunStore` is needed without a database. Nothing is persisted.

    Args:
        clock: returns the current time (timezone-aware); inject a fake one to control
            the threads' `created_at`/`updated_at` in tests.

    Counters (also returned by `stats()`):
        apply_calls: calls of `apply()`.
        thread_applications: per-thread applications by `apply()` that wrote something
            (several entries of one thread coalesced in one call count once).
        applied_entries: entries written by `apply()` (stale and duplicate ones excluded).
        checkpoints: successful `checkpoint()` calls.
        deletes: `delete_thread()` calls that deleted a live thread.
    """

    def __init__(self, *, clock: Callable[[], datetime] = utcnow) -> None:
        self._clock = clock
        self._threads: dict[str, _ThreadSlot] = {}
        self._runs: dict[str, _RunSlot] = {}
        self._closed = False
        self.apply_calls = 0
        self.thread_applications = 0
        self.applied_entries = 0
        self.checkpoints = 0
        self.deletes = 0

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether `close()` was called."""
        return self._closed

    async def close(self) -> None:
        """Close the store; later calls raise `StoreClosedError`. Closing twice is harmless."""
        self._closed = True

    async def __aenter__(self) -> InMemoryThreadRunStore:
        self._check_open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def stats(self) -> dict[str, int]:
        """Counters and sizes, for tests and metrics exporters."""
        return {
            "apply_calls": self.apply_calls,
            "thread_applications": self.thread_applications,
            "applied_entries": self.applied_entries,
            "checkpoints": self.checkpoints,
            "deletes": self.deletes,
            "threads": sum(1 for slot in self._threads.values() if slot.summary is not None),
            "runs": len(self._runs),
        }

    # -- ThreadRunStore: writes --------------------------------------------------------

    async def checkpoint(
        self,
        thread_id: str,
        messages: Sequence[Message],
        run: RunRecord,
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> CheckpointReceipt:
        """Store the snapshot of a thread after one step and upsert its run."""
        self._check_open()
        return self._checkpoint(validate_checkpoint(thread_id, messages, run, metadata))

    async def append(
        self,
        thread_id: str,
        messages: Sequence[Message],
        run: RunRecord,
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> CheckpointReceipt:
        """Append `messages` to the thread's snapshot and upsert its run."""
        self._check_open()
        return self._checkpoint(
            validate_checkpoint(thread_id, messages, run, metadata, append=True)
        )

    def _checkpoint(self, call: CheckpointInput) -> CheckpointReceipt:
        slot = self._threads.get(call.thread_id)
        previous = _decode_thread(slot.summary) if slot and slot.summary else None
        entry = build_checkpoint_entry(
            call,
            previous=previous,
            previous_messages=slot.messages if slot else None,
            seq=(slot.flushed_seq if slot else 0) + 1,
            now=self._clock(),
        )
        self._write_direct(entry)
        self.checkpoints += 1
        return CheckpointReceipt(thread_id=call.thread_id, thread_seq=entry.seq)

    async def delete_thread(self, thread_id: str) -> None:
        """Remove a thread, its messages and its runs; unknown threads are ignored."""
        self._check_open()
        check_id(thread_id, "thread_id")
        slot = self._threads.get(thread_id)
        if slot is None or slot.summary is None:
            return
        self._write_direct(
            build_delete_entry(thread_id, seq=slot.flushed_seq + 1, now=self._clock())
        )
        self.deletes += 1

    # -- ThreadRunStore: reads ---------------------------------------------------------

    async def load_thread(self, thread_id: str) -> Thread | None:
        """The thread summary, or None if unknown or deleted."""
        self._check_open()
        slot = self._live(check_id(thread_id, "thread_id"))
        return _decode_thread(slot.summary) if slot and slot.summary else None

    async def load_messages(self, thread_id: str) -> list[Message] | None:
        """The latest message snapshot, or None if the thread is unknown or deleted."""
        self._check_open()
        slot = self._live(check_id(thread_id, "thread_id"))
        return [decode_message(item) for item in slot.messages] if slot else None

    async def load_run(self, run_id: str) -> RunRecord | None:
        """A run by id, or None."""
        self._check_open()
        stored = self._runs.get(check_id(run_id, "run_id"))
        return _decode_run(stored.record) if stored else None

    async def latest_run(self, thread_id: str) -> RunRecord | None:
        """The run of the thread's latest checkpoint, or None."""
        thread = await self.load_thread(thread_id)
        if thread is None or thread.latest_run_id is None:
            return None
        stored = self._runs.get(thread.latest_run_id)
        if stored is None or stored.thread_id != thread.thread_id:
            return None
        return _decode_run(stored.record)

    async def list_runs(
        self,
        thread_id: str | None = None,
        *,
        status: RunStatus | None = None,
        limit: int = 50,
        offset: int = 0,
    ) -> list[RunRecord]:
        """Runs, newest `created_at` first, optionally of one thread and/or one status."""
        versioned = await self.read_runs(thread_id, status=status, limit=limit, offset=offset)
        return [item.run for item in versioned]

    async def list_threads(self, *, limit: int = 50, offset: int = 0) -> list[Thread]:
        """Live threads, newest `updated_at` first (then `thread_id` descending)."""
        return [
            stored.thread
            for stored in await self.read_threads(limit=limit, offset=offset)
            if stored.thread is not None
        ]

    # -- FlushTarget -------------------------------------------------------------------

    async def apply(self, batches: Sequence[Sequence[WalEntry]]) -> list[ApplyOutcome]:
        """Apply each thread's entries against its watermark (see `FlushTarget.apply`).

        Each batch is planned, coalesced and validated before anything of it is written,
        so a FAILED thread leaves no trace; the other batches are unaffected. The batches
        holding a delete go first: another thread of the call may take one of the deleted
        thread's runs over (as `PostgresThreadRunStore` orders them). As if every reset
        came before every write (two re-created threads may swap their runs), the runs a
        thread held when the call began are free for the others when its first batch of
        the call resets it; a thread so reset that then does not apply is left out and
        the call runs again from its start, so nothing of it is written and its runs are
        its own, with the first refused batch of every other thread (as Postgres runs its
        transaction again). A refusal left out so is judged again on the final state, as
        Postgres looks the owner up after its commit.
        """
        self._check_open()
        self.apply_calls += 1
        # In thread id order within each group, as Postgres writes them (which of two
        # claims of one run comes first decides which is refused).
        groups = deletes_first(batches)
        order = [
            index
            for group in groups
            for index in sorted(group, key=lambda i: batches[i][0].thread_id if batches[i] else "")
        ]
        holding_a_delete = set(groups[0]) | set(groups[1])
        resetting = self._resetting(batches, [i for i in order if i in holding_a_delete])
        if not resetting:
            outcomes = {index: self._apply_batch(batches[index]) for index in order}
            return [outcomes[index] for index in range(len(batches))]
        saved = self._save()
        left_out: dict[int, ApplyOutcome] = {}
        while True:
            free = {run_id: run for run_id, run in saved[1].items() if run.thread_id in resetting}
            outcomes = {
                index: left_out.get(index) or self._apply_batch(batches[index], free)
                for index in order
            }
            failed = next(
                (i for i in resetting.values() if outcomes[i].status is not ApplyStatus.APPLIED),
                None,
            )
            if failed is None:
                break
            self._restore(saved)
            if outcomes[failed].waits_for is None:
                # Its data is refused: Postgres decides that in planning and never writes
                # its reset; the others are judged again without it.
                refused = {failed}
            else:
                # As Postgres runs its transaction again: without that batch, nor the
                # first refused batch of any other thread (refused a run, maybe one a
                # left-out reset had freed: judged again at the end).
                refused = {failed} | {
                    i for i in order if i not in left_out and outcomes[i].waits_for is not None
                }
            first_of: dict[str, int] = {}
            for index in sorted(refused, key=order.index):
                first_of.setdefault(batches[index][0].thread_id, index)
            for thread_id, index in first_of.items():
                left_out[index] = outcomes[index]
                if resetting.get(thread_id) == index:
                    del resetting[thread_id]
        for index, outcome in left_out.items():
            outcomes[index] = self._refusal_now(batches[index], outcome)
        return [outcomes[index] for index in range(len(batches))]

    def _resetting(
        self, batches: Sequence[Sequence[WalEntry]], order: Sequence[int]
    ) -> dict[str, int]:
        """Of the threads of `order` (those holding a delete), the ones whose first batch
        of the call with something to apply holds a delete (resets them), with the index
        of that batch (as Postgres hoists the reset of a thread's first planned batch)."""
        seen: set[str] = set()
        resetting: dict[str, int] = {}
        for index in order:
            batch = batches[index]
            if not batch or batch[0].thread_id in seen:
                continue
            thread_id = batch[0].thread_id
            slot = self._threads.get(thread_id)
            plan = plan_entries(batch, slot.flushed_seq if slot else 0)
            if plan.status is not PlanStatus.APPLY:
                continue  # stale or a gap: writes nothing, the next batch may
            seen.add(thread_id)
            if any(entry.kind is EntryKind.DELETE for entry in plan.entries):
                resetting[thread_id] = index
        return resetting

    def _save(self) -> _Saved:
        """What `_restore` puts back (slots are replaced, never changed in place)."""
        return dict(self._threads), dict(self._runs), self.thread_applications, self.applied_entries

    def _restore(self, saved: _Saved) -> None:
        """Back to `saved`, which stays as it is (the dicts put back are copies)."""
        threads, runs, self.thread_applications, self.applied_entries = saved
        self._threads, self._runs = dict(threads), dict(runs)

    def _refusal_now(self, entries: Sequence[WalEntry], recorded: ApplyOutcome) -> ApplyOutcome:
        """A left-out batch refused a run, judged on the state the call leaves: the run's
        owner now, or, when its runs are nobody else's any more, `let_go_outcome` (the
        same entries may apply at once)."""
        if recorded.waits_for is None:
            return recorded
        thread_id = entries[0].thread_id
        watermark = recorded.flushed_seq
        named: list[str] = []  # the runs the batch writes: those after its last delete
        for entry in plan_entries(entries, watermark).entries:
            if entry.kind is EntryKind.DELETE:
                named = []
            elif entry.run is not None and entry.run.run_id not in named:
                named.append(entry.run.run_id)
        for run_id in named:
            owner = self._runs.get(run_id)
            if owner is not None and owner.thread_id != thread_id:
                error = run_owned_elsewhere(run_id, owner.thread_id, thread_id)
                return failed_outcome(thread_id, watermark, error, retriable=False)
        return let_go_outcome(thread_id, watermark)

    async def read_thread(self, thread_id: str, *, with_messages: bool) -> StoredThread:
        """The stored thread and its watermark (messages: [] when the thread is absent)."""
        self._check_open()
        slot = self._threads.get(check_id(thread_id, "thread_id"))
        if slot is None:
            return StoredThread(
                thread_id=thread_id,
                flushed_seq=0,
                thread=None,
                messages=[] if with_messages else None,
            )
        return _stored_thread(thread_id, slot, with_messages=with_messages)

    async def read_run(self, run_id: str) -> VersionedRun | None:
        """A stored run with the seq of the checkpoint that wrote it."""
        self._check_open()
        stored = self._runs.get(check_id(run_id, "run_id"))
        return VersionedRun(_decode_run(stored.record), stored.thread_seq) if stored else None

    async def read_runs(
        self, thread_id: str | None, *, status: RunStatus | None, limit: int, offset: int
    ) -> list[VersionedRun]:
        """Stored runs in `list_runs` order, with their versions."""
        self._check_open()
        if thread_id is not None:
            check_id(thread_id, "thread_id")
        wanted_status = _check_status(status)
        check_page(limit, offset)
        if thread_id is not None:
            slot = self._threads.get(thread_id)
            candidates = [self._runs[run_id] for run_id in slot.run_ids] if slot else []
        else:
            candidates = list(self._runs.values())
        if wanted_status is not None:
            candidates = [run for run in candidates if run.status is wanted_status]
        candidates.sort(key=lambda run: run.sort_key, reverse=True)
        return [
            VersionedRun(_decode_run(run.record), run.thread_seq)
            for run in candidates[offset : offset + limit]
        ]

    async def read_threads(self, *, limit: int, offset: int) -> list[StoredThread]:
        """Live threads in `list_threads` order, with their watermarks (no messages)."""
        self._check_open()
        check_page(limit, offset)
        live = [(tid, slot) for tid, slot in self._threads.items() if slot.summary is not None]
        live.sort(key=lambda item: item[1].sort_key, reverse=True)
        return [
            _stored_thread(tid, slot, with_messages=False)
            for tid, slot in live[offset : offset + limit]
        ]

    async def flushed_seqs(self, thread_ids: Sequence[str]) -> dict[str, int]:
        """Watermarks of several threads (0 for unknown ones; tombstones keep theirs)."""
        self._check_open()
        result: dict[str, int] = {}
        for thread_id in thread_ids:
            slot = self._threads.get(check_id(thread_id, "thread_id"))
            result[thread_id] = slot.flushed_seq if slot else 0
        return result

    # -- internals ---------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the in-memory store is closed")

    def _live(self, thread_id: str) -> _ThreadSlot | None:
        slot = self._threads.get(thread_id)
        return slot if slot is not None and slot.summary is not None else None

    def _write_direct(self, entry: WalEntry) -> None:
        """Write one entry built by this store at watermark + 1, as `apply()` would."""
        change = coalesce([entry], stored_count=self._stored_count(entry.thread_id))
        self._commit(self._prepare(change))

    def _apply_batch(
        self, entries: Sequence[WalEntry], free: Mapping[str, _RunSlot] | None = None
    ) -> ApplyOutcome:
        if not entries:
            return ApplyOutcome(
                "", ApplyStatus.FAILED, 0, error="empty batch: no entries", retriable=False
            )
        thread_id = entries[0].thread_id
        slot = self._threads.get(thread_id)
        watermark = slot.flushed_seq if slot else 0
        try:
            if any(entry.thread_id != thread_id for entry in entries):
                raise CorruptEntryError(f"a batch of thread {thread_id!r} holds other threads")
            plan = plan_entries(entries, watermark)
            if plan.status is PlanStatus.STALE:
                return ApplyOutcome(thread_id, ApplyStatus.STALE, watermark)
            if plan.status is PlanStatus.GAP:
                return ApplyOutcome(
                    thread_id, ApplyStatus.GAP, watermark, missing_from=plan.missing_from
                )
            write = self._prepare(
                coalesce(plan.entries, stored_count=self._stored_count(thread_id)), free
            )
        except (ValidationError, CorruptEntryError) as exc:
            # The thread's data is refused: its outcome says so; other threads go on.
            return failed_outcome(thread_id, watermark, exc, retriable=exc.retriable)
        except (TypeError, ValueError) as exc:
            return failed_outcome(thread_id, watermark, exc, retriable=False)
        self._commit(write)
        self.thread_applications += 1
        self.applied_entries += len(plan.entries)
        return ApplyOutcome(thread_id, ApplyStatus.APPLIED, write.slot.flushed_seq)

    def _stored_count(self, thread_id: str) -> int:
        slot = self._threads.get(thread_id)
        return len(slot.messages) if slot else 0

    def _prepare(self, change: ThreadChange, free: Mapping[str, _RunSlot] | None = None) -> _Write:
        """Everything a change writes, encoded and checked; raises instead of writing.

        A run whose stored slot is still the one in `free` (held by a thread the same
        call resets) may be taken over."""
        thread_id = change.thread_id
        old = self._threads.get(thread_id) or _ThreadSlot()
        base = [] if change.reset else old.messages
        messages = [*base[: change.keep], *change.messages] if change.thread else []
        run_ids = set() if change.reset or change.thread is None else set(old.run_ids)
        dropped = frozenset(old.run_ids - run_ids)
        runs: dict[str, _RunSlot] = {}
        if change.thread is not None:
            if change.thread.message_count != len(messages):
                raise CorruptEntryError(
                    f"thread {thread_id!r} at seq {change.last_seq} claims "
                    f"{change.thread.message_count} messages but the change yields {len(messages)}"
                )
            for run_id, (run, seq) in change.runs.items():
                if run.thread_id != thread_id:
                    raise CorruptEntryError(f"run {run_id!r} belongs to another thread")
                owner = self._runs.get(run_id)
                if (
                    owner is not None
                    and owner.thread_id != thread_id
                    and (free is None or free.get(run_id) is not owner)
                ):
                    raise run_owned_elsewhere(run_id, owner.thread_id, thread_id)
                runs[run_id] = _RunSlot(
                    record=_dumps(run.to_json(), "run"),
                    thread_id=thread_id,
                    thread_seq=seq,
                    status=run.status,
                    sort_key=run_sort_key(run),
                )
                run_ids.add(run_id)
            summary: bytes | None = _dumps(change.thread.to_json(), "thread")
            sort_key = thread_sort_key(change.thread)
        else:
            summary, sort_key = None, old.sort_key
        slot = _ThreadSlot(
            flushed_seq=change.last_seq,
            summary=summary,
            sort_key=sort_key,
            messages=messages,
            run_ids=run_ids,
        )
        return _Write(thread_id, slot, runs, dropped)

    def _commit(self, write: _Write) -> None:
        """Install a prepared change; cannot fail, so a thread is never half written."""
        for run_id in write.dropped_runs:
            stored = self._runs.get(run_id)
            if stored is not None and stored.thread_id == write.thread_id:
                del self._runs[run_id]
        # `_prepare` refused runs owned by other threads, unless reset by the same call.
        self._runs.update(write.runs)
        self._threads[write.thread_id] = write.slot


def _check_status(status: object) -> RunStatus | None:
    if status is None or isinstance(status, RunStatus):
        return status
    if isinstance(status, str):
        try:
            return RunStatus(status)
        except ValueError:
            pass
    raise ValidationError(f"unknown run status {status!r}")


def _decode_thread(data: bytes) -> Thread:
    return Thread.from_json(orjson.loads(data))


def _decode_run(data: bytes) -> RunRecord:
    return RunRecord.from_json(orjson.loads(data))


def _stored_thread(thread_id: str, slot: _ThreadSlot, *, with_messages: bool) -> StoredThread:
    return StoredThread(
        thread_id=thread_id,
        flushed_seq=slot.flushed_seq,
        thread=_decode_thread(slot.summary) if slot.summary is not None else None,
        messages=list(slot.messages) if with_messages else None,
    )
