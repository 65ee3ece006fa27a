"""Records stored per thread: `Thread`, `RunRecord`, `RunStatus`, `Message`, receipts.

Pure data: no I/O, no client libraries. Records validate themselves at construction so bad
input fails before anything is written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any, TypeAlias

from buffered_store.engine.ids import check_aware, check_id, parse_time, utcnow
from buffered_store.errors import ValidationError

JSONValue: TypeAlias = Any
Message: TypeAlias = dict[str, Any]
"""A message is a JSON object with at least a string ``role``."""


class RunStatus(StrEnum):
    """Lifecycle state of a run."""

    RUNNING = "running"
    WAITING = "waiting"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


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
                created_at=parse_time(data["created_at"]),
                updated_at=parse_time(data["updated_at"]),
                finished_at=parse_time(finished) if finished else None,
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
            created_at=parse_time(data["created_at"]),
            updated_at=parse_time(data["updated_at"]),
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
