"""The change one thread-run checkpoint (or delete) makes to its thread: `WalEntry`,
as the thread-run front-end appends it to the WAL and the inner stores apply it (its
wire codec is the front-end's, `threadrun.entry`). Pure: no I/O.

Its messages are a delta against the thread's previous entry: keep the first `keep`
messages, then append `messages`; the entry also carries the full thread summary at its
seq. A *jump* entry starts a chain whose predecessor is unknown and applies on top of any
stored state with a lower seq.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from buffered_store.model.records import RunRecord, Thread


class EntryKind(StrEnum):
    """What an entry does to its thread."""

    CHECKPOINT = "cp"
    DELETE = "del"


@dataclass(frozen=True, kw_only=True, slots=True)
class WalEntry:
    """One checkpoint or delete of one thread, as stored on the WAL."""

    thread_id: str
    seq: int
    kind: EntryKind
    at: datetime
    """Time of the checkpoint: the thread's `updated_at`."""
    keep: int = 0
    messages: Sequence[bytes] = ()
    """Canonical JSON bytes of the messages appended after `keep`."""
    message_count: int = 0
    run: RunRecord | None = None
    created_at: datetime | None = None
    parent_thread_id: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    writer: str = ""
    """Nonce of the writing call, to tell our own deduplicated publish from another's."""
    jump: bool = False
    """The entry starts a chain: it follows any lower seq, not only `seq - 1`."""
    digest: bytes = b""
    """Digest of the thread's whole snapshot after this entry
    (`buffered_store.model.messages.extend_chain`); empty when its writer did not know
    the digest of what the entry keeps."""
    stream_seq: int = 0
    """Where the entry sits in the stream, when read back from it (not encoded)."""
    chain: bytes = field(default=b"", compare=False, repr=False)
    """The snapshot's digests after each of `messages` (not encoded; empty, or aligned
    with them): the writer's snapshot of the thread takes them over."""
    sources: Sequence[Any] = field(default=(), compare=False, repr=False)
    """The message objects `messages` were encoded from, when this process built the
    entry (not encoded; aligned with `messages`, or empty): the writer's snapshot of the
    thread remembers them to recognise them in the next `checkpoint()`."""

    @property
    def deletes(self) -> bool:
        """The entry deletes its thread."""
        return self.kind is EntryKind.DELETE

    @property
    def thread_created_at(self) -> datetime:
        """The thread's creation time as this entry states it (its own time if unset)."""
        return self.created_at or self.at

    @property
    def latest_run_id(self) -> str | None:
        """The run this entry checkpoints, the thread's latest one."""
        return self.run.run_id if self.run else None

    @property
    def thread(self) -> Thread | None:
        """The thread summary at this seq (None for a delete)."""
        if self.kind is EntryKind.DELETE:
            return None
        return Thread(
            thread_id=self.thread_id,
            parent_thread_id=self.parent_thread_id,
            metadata=self.metadata,
            created_at=self.thread_created_at,
            updated_at=self.at,
            latest_run_id=self.latest_run_id,
            message_count=self.message_count,
        )
