"""Small helpers shared by the conformance test mixins."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from buffered_store import RunRecord, ThreadRunStore
from buffered_store.testing import make_messages, make_run

__all__ = [
    "T0",
    "as_any",
    "assert_same_json",
    "at",
    "checkpoint_run",
    "fresh_id",
    "make_messages",
    "make_run",
]

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
"""A fixed origin for the `created_at` of runs, so run ordering is deterministic."""


def fresh_id(prefix: str = "t") -> str:
    """A unique id: stores may be shared across tests, so never reuse a fixed id."""
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def at(seconds: float) -> datetime:
    """`T0` plus some seconds."""
    return T0 + timedelta(seconds=seconds)


def as_any(value: object) -> Any:
    """Let a deliberately ill-typed argument through the type checker."""
    return value


def assert_same_json(actual: Any, expected: Any, path: str = "$") -> None:
    """Equal JSON values of equal types (`1 == 1.0 == True` is not good enough here)."""
    assert type(actual) is type(expected), f"{path}: {actual!r} is not {expected!r}"
    if isinstance(expected, dict):
        assert list(sorted(actual)) == list(sorted(expected)), f"{path}: keys differ"
        for key, value in expected.items():
            assert_same_json(actual[key], value, f"{path}.{key}")
    elif isinstance(expected, list):
        assert len(actual) == len(expected), f"{path}: lengths differ"
        for index, (left, right) in enumerate(zip(actual, expected, strict=True)):
            assert_same_json(left, right, f"{path}[{index}]")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


async def checkpoint_run(
    store: ThreadRunStore, thread_id: str, n_messages: int = 1, **run_fields: Any
) -> RunRecord:
    """Checkpoint `n_messages` messages with a fresh run of the thread; return the run."""
    run = make_run(thread_id, **run_fields)
    await store.checkpoint(thread_id, make_messages(n_messages), run)
    return run
