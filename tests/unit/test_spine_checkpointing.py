"""`buffered_store.model.checkpointing`: validation and the entry (summary + delta)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from buffered_store.errors import ValidationError
from buffered_store.model.changes import (
    EntryKind,
)
from buffered_store.model.checkpointing import (
    build_checkpoint_entry,
    build_delete_entry,
    check_page,
    validate_checkpoint,
)
from buffered_store.model.records import RunRecord, Thread
from buffered_store.testing import make_messages, make_run

T0 = datetime(2026, 1, 1, tzinfo=UTC)
LATER = T0 + timedelta(minutes=5)


def _previous(**overrides: Any) -> Thread:
    fields: dict[str, Any] = {
        "thread_id": "t",
        "parent_thread_id": None,
        "metadata": {"k": 1},
        "created_at": T0,
        "updated_at": T0,
        "latest_run_id": "old",
        "message_count": 2,
    }
    return Thread(**(fields | overrides))


def _entry(
    run: RunRecord | None = None,
    metadata: dict[str, Any] | None = None,
    previous: Thread | None = None,
    messages: int = 3,
) -> Any:
    call = validate_checkpoint("t", make_messages(messages), run or make_run("t"), metadata)
    prior = validate_checkpoint("t", make_messages(2), make_run("t"), None).encoded
    return build_checkpoint_entry(
        call, previous=previous, previous_messages=prior, seq=4, now=LATER, writer="w"
    )


def test_new_thread_summary() -> None:
    run = make_run("t", parent_thread_id="p")
    entry = _entry(run, previous=None)
    assert entry.kind is EntryKind.CHECKPOINT
    assert (entry.seq, entry.at, entry.writer) == (4, LATER, "w")
    assert entry.thread == Thread(
        thread_id="t",
        parent_thread_id="p",
        metadata={},
        created_at=LATER,
        updated_at=LATER,
        latest_run_id=run.run_id,
        message_count=3,
    )
    assert (entry.keep, len(entry.messages)) == (0, 3), "no previous: the full snapshot"


def test_existing_thread_keeps_created_at_and_metadata() -> None:
    entry = _entry(previous=_previous())
    assert entry.thread.created_at == T0
    assert entry.thread.updated_at == LATER
    assert dict(entry.thread.metadata) == {"k": 1}


def test_metadata_replaces_when_given() -> None:
    assert dict(_entry(metadata={"n": 2}, previous=_previous()).thread.metadata) == {"n": 2}
    assert dict(_entry(metadata={}, previous=_previous()).thread.metadata) == {}


@pytest.mark.parametrize(
    ("stored", "from_run", "expected"),
    [(None, None, None), (None, "p", "p"), ("p", "q", "p"), ("p", None, "p")],
)
def test_parent_thread_is_sticky(
    stored: str | None, from_run: str | None, expected: str | None
) -> None:
    entry = _entry(
        make_run("t", parent_thread_id=from_run), previous=_previous(parent_thread_id=stored)
    )
    assert entry.thread.parent_thread_id == expected


def test_append_only_checkpoint_carries_only_new_messages() -> None:
    entry = _entry(previous=_previous(), messages=5)
    assert (entry.keep, len(entry.messages), entry.message_count) == (2, 3, 5)


def test_rewrite_carries_the_tail_from_the_first_change() -> None:
    call = validate_checkpoint("t", [{"role": "x"}, *make_messages(2)], make_run("t"), None)
    prior = validate_checkpoint("t", make_messages(2), make_run("t"), None).encoded
    entry = build_checkpoint_entry(
        call, previous=_previous(), previous_messages=prior, seq=2, now=LATER
    )
    assert (entry.keep, entry.message_count) == (0, 3)


def test_naive_now_is_rejected() -> None:
    call = validate_checkpoint("t", [], make_run("t"), None)
    with pytest.raises(ValidationError):
        build_checkpoint_entry(
            call, previous=None, previous_messages=None, seq=1, now=datetime(2026, 1, 1)
        )


def test_validate_checkpoint_checks_everything() -> None:
    run = make_run("t")
    call = validate_checkpoint("t", make_messages(2), run, {"k": [1]})
    assert (call.thread_id, call.run, call.metadata, len(call.encoded)) == ("t", run, {"k": [1]}, 2)
    assert validate_checkpoint("t", [], run, None).metadata is None
    bad_calls: list[tuple[Any, Any, Any, Any]] = [
        ("", [], run, None),
        ("t", [], {"run_id": "r"}, None),
        ("t", [], make_run("u"), None),
        ("t", [], make_run("t", output={1, 2}), None),
        ("t", [], make_run("t", metadata={"x": float("nan")}), None),
        ("t", [], run, ["not", "a", "dict"]),
        ("t", [{"no": "role"}], run, None),
    ]
    for thread_id, messages, bad_run, metadata in bad_calls:
        with pytest.raises(ValidationError):
            validate_checkpoint(thread_id, messages, bad_run, metadata)


def test_delete_entry() -> None:
    entry = build_delete_entry("t", seq=7, now=T0, writer="w")
    assert (entry.kind, entry.seq, entry.thread, entry.writer) == (EntryKind.DELETE, 7, None, "w")
    with pytest.raises(ValidationError):
        build_delete_entry("", seq=1, now=T0)


@pytest.mark.parametrize(("limit", "offset"), [(0, 0), (50, 0), (1, 10**9)])
def test_check_page_accepts(limit: int, offset: int) -> None:
    check_page(limit, offset)


@pytest.mark.parametrize(
    ("limit", "offset"), [(-1, 0), (0, -1), (True, 0), (1.0, 0), ("1", 0), (None, 0)]
)
def test_check_page_rejects(limit: Any, offset: Any) -> None:
    with pytest.raises(ValidationError):
        check_page(limit, offset)
