"""Records stored per thread: `Thread`, `RunRecord`, `RunStatus`, `Message`, receipts.

Pure data: no I/O, no client libraries. Records validate themselves at construction so bad
input fails before anything is written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, TypeAlias

from buffered_store.errors import ValidationError

JSONValue: TypeAlias = Any
Message: TypeAlias = dict[str, Any]
"""A message is a JSON object with at least a string ``role``."""

MAX_ID_BYTES = 512
"""Longest id, in UTF-8 bytes. Ids are btree keys in Postgres, where one index tuple may
hold at most about 2,700 bytes; ``runs_thread_created_idx`` holds a thread id, a timestamp
and a run id, so two ids of 512 bytes always fit, compressed or not (a limit counted in
characters does not: 512 varied CJK characters are 1,536 bytes that do not compress)."""


def utcnow() -> datetime:
    """Now, timezone-aware (UTC)."""
    return datetime.now(UTC)


class RunStatus(StrEnum):
    """Lifecycle state of a run."""

    RUNNING = "running"
    WAITING = "waiting"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class ReadConsistency(StrEnum):
    """How a read of the buffered store relates to acknowledged checkpoints."""

    READ_YOUR_WRITES = "read_your_writes"
    """Overlay the unflushed WAL tail on the inner store (default)."""
    STRONG = "strong"
    """Flush the pending entries first, then read the inner store."""
    EVENTUAL = "eventual"
    """Read the inner store only; may miss unflushed checkpoints."""


def check_id(value: object, what: str) -> str:
    """Validate an identifier: a non-empty string of at most `MAX_ID_BYTES` UTF-8 bytes."""
    if not isinstance(value, str):
        raise ValidationError(f"{what} must be a string, got {type(value).__name__}")
    if not value:
        raise ValidationError(f"{what} must not be empty")
    if "\x00" in value:
        raise ValidationError(f"{what} must not contain NUL characters")
    # Cheap reject first: a string longer than the limit in characters is too long in bytes.
    if len(value) > MAX_ID_BYTES:
        raise ValidationError(f"{what} is longer than {MAX_ID_BYTES} bytes (UTF-8)")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValidationError(f"{what} is not valid Unicode (lone surrogate)") from None
    if size > MAX_ID_BYTES:
        raise ValidationError(f"{what} is {size} bytes in UTF-8, longer than {MAX_ID_BYTES}")
    return value


def check_aware(value: object, what: str) -> datetime:
    """Validate a timezone-aware datetime."""
    if not isinstance(value, datetime):
        raise ValidationError(f"{what} must be a datetime, got {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValidationError(f"{what} must be timezone-aware (got a naive datetime)")
    return value


def _check_count(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValidationError(f"{what} must be a non-negative integer, got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class RunRecord:
    """The record of one agent run, upserted by `run_id` on every checkpoint."""

    run_id: str
    thread_id: str
    agent_id: str
    status: RunStatus = RunStatus.RUNNING
    parent_run_id: str | None = None
    parent_thread_id: str | None = None
    created_at: datetime = field(default_factory=utcnow)
    updated_at: datetime = field(default_factory=utcnow)
    finished_at: datetime | None = None
    steps: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None
    output: JSONValue = None
    metadata: Mapping[str, JSONValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_id(self.run_id, "run_id")
        check_id(self.thread_id, "run.thread_id")
        check_id(self.agent_id, "run.agent_id")
        if not isinstance(self.status, RunStatus):
            try:
                object.__setattr__(self, "status", RunStatus(self.status))
            except ValueError:
                raise ValidationError(f"unknown run status {self.status!r}") from None
        for name in ("parent_run_id", "parent_thread_id"):
            value = getattr(self, name)
            if value is not None:
                check_id(value, name)
        check_aware(self.created_at, "run.created_at")
        check_aware(self.updated_at, "run.updated_at")
        if self.finished_at is not None:
            check_aware(self.finished_at, "run.finished_at")
        _check_count(self.steps, "run.steps")
        _check_count(self.input_tokens, "run.input_tokens")
        _check_count(self.output_tokens, "run.output_tokens")
        if self.error is not None and not isinstance(self.error, str):
            raise ValidationError("run.error must be a string or None")
        if not isinstance(self.metadata, Mapping):
            raise ValidationError("run.metadata must be a JSON object")

    def replace(self, **changes: Any) -> RunRecord:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (datetimes as ISO 8601 strings)."""
        return {
            "run_id": self.run_id,
            "thread_id": self.thread_id,
            "agent_id": self.agent_id,
            "status": self.status.value,
            "parent_run_id": self.parent_run_id,
            "parent_thread_id": self.parent_thread_id,
            "created_at": self.created_at.isoformat(),
            "updated_at": self.updated_at.isoformat(),
            "finished_at": self.finished_at.isoformat() if self.finished_at else None,
            "steps": self.steps,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "error": self.error,
            "output": self.output,
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunRecord:
        """Inverse of `to_json`."""
        try:
            finished = data.get("finished_at")
            return cls(
                run_id=data["run_id"],
                thread_id=data["thread_id"],
                agent_id=data["agent_id"],
                status=RunStatus(data["status"]),
                parent_run_id=data.get("parent_run_id"),
                parent_thread_id=data.get("parent_thread_id"),
                created_at=_parse_dt(data["created_at"]),
                updated_at=_parse_dt(data["updated_at"]),
                finished_at=_parse_dt(finished) if finished else None,
                steps=data.get("steps", 0),
                input_tokens=data.get("input_tokens", 0),
                output_tokens=data.get("output_tokens", 0),
                error=data.get("error"),
                output=data.get("output"),
                metadata=data.get("metadata") or {},
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, ValidationError):
                raise
            raise ValidationError(f"malformed run record: {exc!r}") from exc


@dataclass(frozen=True, kw_only=True, slots=True)
class Thread:
    """Summary of a conversation thread as of its latest checkpoint."""

    thread_id: str
    parent_thread_id: str | None
    metadata: Mapping[str, JSONValue]
    created_at: datetime
    updated_at: datetime
    latest_run_id: str | None
    message_count: int

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (datetimes as ISO 8601 strings)."""
        return {
            "thread_id": self.thread_id,
            "parent_thread_id": self.parent_thread_id,
            "metadata": dict(self.metadata),
            "created_at": self.created_at.isoformat(),
            "updated_at": self.updated_at.isoformat(),
            "latest_run_id": self.latest_run_id,
            "message_count": self.message_count,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Thread:
        """Inverse of `to_json`."""
        return cls(
            thread_id=data["thread_id"],
            parent_thread_id=data.get("parent_thread_id"),
            metadata=data.get("metadata") or {},
            created_at=_parse_dt(data["created_at"]),
            updated_at=_parse_dt(data["updated_at"]),
            latest_run_id=data.get("latest_run_id"),
            message_count=int(data["message_count"]),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointReceipt:
    """What a successful `checkpoint()` returns."""

    thread_id: str
    thread_seq: int
    """Per-thread sequence number of this checkpoint: unique and increasing, from 1, and
    gap-free except at a *jump*: the first buffered write of a thread the WAL has never
    seen, made while the inner store could not say where the thread's seqs stand, starts
    at a large seq (see docs/concepts/failure-modes.md); the seqs after it are gap-free
    again."""
    stream_seq: int | None = None
    """Sequence of the WAL entry in the JetStream stream (buffered store only)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FlushStatus:
    """How far a thread's checkpoints have been flushed to the inner store."""

    thread_id: str
    latest_seq: int
    flushed_seq: int
    pending_from: int = 0
    """Lowest seq that can be pending when the thread's entries jumped past its stored
    seq (see docs/concepts/failure-modes.md): no entry sits between `flushed_seq` and
    it. 0 when they did not (or nobody knows)."""

    @property
    def pending(self) -> int:
        """Checkpoints acknowledged but not yet in the inner store."""
        return max(0, self.latest_seq - max(self.flushed_seq, self.pending_from - 1))


def _parse_dt(value: Any) -> datetime:
    if isinstance(value, datetime):
        return value
    parsed = datetime.fromisoformat(value)
    if parsed.tzinfo is None:
        raise ValidationError(f"timestamp {value!r} has no timezone")
    return parsed
