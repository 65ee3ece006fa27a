"""Building the WAL entry of a checkpoint or delete: validation and the thread summary.

Every store turns a `checkpoint()` call into the same `WalEntry`, so the direct stores,
the buffered writer and the flusher agree on seqs, summaries and message deltas.
Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from buffered_store.engine.ids import check_aware, check_id
from buffered_store.errors import RunOwnershipError, ValidationError
from buffered_store.model.changes import (
    EntryKind,
    WalEntry,
)
from buffered_store.model.messages import (
    DIGEST_SIZE,
    EMPTY_DIGEST,
    EncodedSnapshot,
    MessageSnapshot,
    SnapshotDelta,
    check_json_object,
    check_json_value,
    encode_snapshot,
    extend_chain,
)
from buffered_store.model.records import RunRecord, Thread


def run_owned_elsewhere(run_id: str, owner_thread_id: str, thread_id: str) -> RunOwnershipError:
    """The error for a checkpoint of `thread_id` naming a run that `owner_thread_id` owns."""
    return RunOwnershipError(
        f"run {run_id!r} belongs to thread {owner_thread_id!r}, not {thread_id!r}; "
        "use a new run id for a run of another thread",
        run_id=run_id,
        owner_thread_id=owner_thread_id,
    )


@dataclass(frozen=True, slots=True)
class CheckpointInput:
    """A validated `checkpoint()` or `append()` call."""

    thread_id: str
    snapshot: EncodedSnapshot
    """The messages of the new snapshot (the appended ones only when `append`)."""
    run: RunRecord
    metadata: dict[str, Any] | None
    append: bool = False
    """`snapshot` extends the thread's current snapshot instead of replacing it."""

    @property
    def encoded(self) -> list[bytes]:
        """Canonical bytes of every message of `snapshot` (O(history) for a checkpoint
        whose prefix was reused: the buffered writer uses `snapshot.delta` instead)."""
        return self.snapshot.new if self.append else self.snapshot.full()


def validate_checkpoint(
    thread_id: Any,
    messages: Any,
    run: Any,
    metadata: Mapping[str, Any] | None,
    *,
    previous: Sequence[bytes] | None = None,
    append: bool = False,
    check: bool = False,
) -> CheckpointInput:
    """Check every argument of `checkpoint()` (of `append()` when `append`: `messages`
    are then only the new messages); raise `ValidationError` on the first problem.

    `previous` is the cached snapshot of the thread, whose unchanged prefix need not be
    validated again (ignored for an append, which never looks at the history); `check`
    verifies that the message objects it was encoded from were not changed in place
    (`encode_messages`).
    """
    check_id(thread_id, "thread_id")
    if not isinstance(run, RunRecord):
        raise ValidationError(f"run must be a RunRecord, got {type(run).__name__}")
    if run.thread_id != thread_id:
        raise ValidationError(
            f"run {run.run_id!r} belongs to thread {run.thread_id!r}, not {thread_id!r}"
        )
    if run.output is not None:  # None and {} (the usual values) need no check
        check_json_value(run.output, "run.output")
    if run.metadata:
        check_json_object(run.metadata, "run.metadata")
    checked_metadata = None if metadata is None else check_json_object(metadata, "metadata")
    snapshot = encode_snapshot(messages, None if append else previous, check=check)
    return CheckpointInput(thread_id, snapshot, run, checked_metadata, append)


def build_checkpoint_entry(
    call: CheckpointInput,
    *,
    previous: Thread | None,
    previous_messages: Sequence[bytes] | None,
    seq: int,
    now: datetime,
    writer: str = "",
    jump: bool = False,
    previous_digest: bytes = b"",
    digest: bool = False,
) -> WalEntry:
    """The entry for a checkpoint at `seq` on top of the thread's previous state.

    `previous` is the live thread summary before this checkpoint (None for a new or
    deleted thread); `previous_messages` its snapshot, or None when unknown (the entry
    then carries the full snapshot); `previous_digest` the digest of that snapshot, if
    known. A `jump` entry starts a chain on an unknown base: it always carries the full
    snapshot.

    An append keeps the `previous.message_count` messages of the thread without looking
    at them, so its cost does not depend on the history. With `digest` (the buffered
    writer: stores that apply the entry at once need none), the entry's digest extends
    the digest of what it keeps (`previous_digest`, or the snapshot's chain) over its new
    messages; it is left unknown when neither tells it.
    """
    check_aware(now, "now")
    origin = call.snapshot.origin
    if call.append:
        delta = _append_delta(call.snapshot.new, previous, previous_messages, jump=jump)
        if delta.keep == 0 and len(delta.appended) != len(origin):
            origin = ()  # a jump carrying the history too
    else:
        known = previous_messages if previous is not None and not jump else None
        delta, origin = call.snapshot.delta(known)
    if previous is not None:
        created_at = previous.created_at
        parent = previous.parent_thread_id or call.run.parent_thread_id
        metadata: Mapping[str, Any] = (
            call.metadata if call.metadata is not None else previous.metadata
        )
    else:
        created_at = now
        parent = call.run.parent_thread_id
        metadata = call.metadata if call.metadata is not None else {}
    kept = _digest_at(delta.keep, previous, previous_messages, previous_digest) if digest else b""
    chain = extend_chain(kept, delta.appended) if kept else b""
    return WalEntry(
        thread_id=call.thread_id,
        seq=seq,
        kind=EntryKind.CHECKPOINT,
        at=now,
        keep=delta.keep,
        messages=delta.appended,
        message_count=delta.length,
        run=call.run,
        created_at=created_at,
        parent_thread_id=parent,
        metadata=metadata,
        writer=writer,
        jump=jump,
        sources=origin,
        digest=bytes(chain[-DIGEST_SIZE:]) if chain else kept,
        chain=bytes(chain),
    )


def _digest_at(
    keep: int,
    previous: Thread | None,
    previous_messages: Sequence[bytes] | None,
    previous_digest: bytes,
) -> bytes:
    """The digest of the first `keep` messages of the previous snapshot (b"": unknown)."""
    if keep == 0:
        return EMPTY_DIGEST
    if previous_digest and previous is not None and keep == previous.message_count:
        return previous_digest
    if isinstance(previous_messages, MessageSnapshot) and keep <= len(previous_messages):
        return previous_messages.digest_at(keep)
    return b""


def _append_delta(
    new: list[bytes],
    previous: Thread | None,
    previous_messages: Sequence[bytes] | None,
    *,
    jump: bool,
) -> SnapshotDelta:
    if previous is None:
        return SnapshotDelta(0, new)  # a new or deleted thread: the append starts it
    if not jump:
        return SnapshotDelta(previous.message_count, new)
    # A jump entry must carry the full snapshot, so the history is needed after all.
    if previous_messages is None or len(previous_messages) != previous.message_count:
        raise ValueError("an append on a jump entry needs the previous snapshot")
    return SnapshotDelta(0, [*previous_messages, *new])


def build_delete_entry(
    thread_id: str, *, seq: int, now: datetime, writer: str = "", jump: bool = False
) -> WalEntry:
    """The entry that deletes a thread at `seq`."""
    check_id(thread_id, "thread_id")
    return WalEntry(
        thread_id=thread_id, seq=seq, kind=EntryKind.DELETE, at=now, writer=writer, jump=jump
    )


def check_page(limit: Any, offset: Any) -> None:
    """Validate `limit`/`offset` of list calls."""
    for name, value in (("limit", limit), ("offset", offset)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValidationError(f"{name} must be a non-negative integer, got {value!r}")
