"""`buffered_store.model.records`: self-validating records and their JSON forms."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from buffered_store.engine.flushing import FlushStatus
from buffered_store.engine.ids import check_aware, check_id
from buffered_store.errors import ValidationError
from buffered_store.model.records import RunRecord, RunStatus, Thread

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_run_record_json_round_trip() -> None:
    run = RunRecord(
        run_id="r",
        thread_id="t",
        agent_id="a",
        status=RunStatus.WAITING,
        parent_run_id="pr",
        parent_thread_id="pt",
        created_at=T0.astimezone(timezone(timedelta(hours=-3))),
        updated_at=T0,
        finished_at=T0 + timedelta(microseconds=1),
        steps=2,
        input_tokens=3,
        output_tokens=4,
        error="e",
        output=[1, {"x": None}],
        metadata={"m": "é"},
    )
    assert RunRecord.from_json(run.to_json()) == run


def test_run_status_from_string() -> None:
    run = RunRecord(run_id="r", thread_id="t", agent_id="a", status="done")  # type: ignore[arg-type]
    assert run.status is RunStatus.DONE


@pytest.mark.parametrize(
    "overrides",
    [
        {"run_id": ""},
        {"thread_id": 5},
        {"agent_id": "x" * 513},
        {"status": "finished"},
        {"parent_thread_id": ""},
        {"created_at": datetime(2026, 1, 1)},
        {"finished_at": "2026-01-01T00:00:00+00:00"},
        {"steps": -1},
        {"input_tokens": True},
        {"error": 5},
        {"metadata": ["x"]},
    ],
)
def test_run_record_validates(overrides: dict[str, Any]) -> None:
    fields: dict[str, Any] = {"run_id": "r", "thread_id": "t", "agent_id": "a"}
    with pytest.raises(ValidationError):
        RunRecord(**(fields | overrides))


@pytest.mark.parametrize("data", [{}, {"run_id": "r"}, {"run_id": "r", "thread_id": "t"}])
def test_run_record_from_malformed_json(data: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        RunRecord.from_json(data)


def test_thread_json_round_trip() -> None:
    thread = Thread(
        thread_id="t",
        parent_thread_id=None,
        metadata={"k": [1]},
        created_at=T0,
        updated_at=T0 + timedelta(seconds=1),
        latest_run_id="r",
        message_count=3,
    )
    assert Thread.from_json(thread.to_json()) == thread


def test_flush_status_pending() -> None:
    assert FlushStatus(thread_id="t", latest_seq=5, flushed_seq=3).pending == 2
    assert FlushStatus(thread_id="t", latest_seq=3, flushed_seq=5).pending == 0


def test_check_id_and_check_aware() -> None:
    assert check_id("x" * 512, "id") == "x" * 512
    assert check_id("é" * 256, "id") == "é" * 256
    assert check_id("日" * 170 + "xy", "id") == "日" * 170 + "xy"
    # The limit is in UTF-8 bytes (what Postgres indexes), not characters.
    for bad in ("", "x" * 513, "é" * 256 + "x", "日" * 171, "🧵" * 129, "a\x00", None, 1):
        with pytest.raises(ValidationError):
            check_id(bad, "id")
    with pytest.raises(ValidationError):
        check_aware(datetime(2026, 1, 1), "at")
    with pytest.raises(ValidationError):
        check_aware("2026-01-01", "at")


def test_check_id_rejects_lone_surrogates() -> None:
    # SPINE BUG: ids with lone surrogates pass check_id, then fail as UnicodeEncodeError
    # in keys.encode_token / psycopg instead of a ValidationError before anything is
    # written. Fix: in check_id, `value.encode("utf-8")` inside try/except
    # UnicodeEncodeError -> ValidationError("... must be valid Unicode (no lone surrogates)").
    with pytest.raises(ValidationError):
        check_id("bad\ud800id", "thread_id")
