"""Structured logs: event names, fields, thread-id redaction, payload scrubbing, and one
line per episode for events that repeat."""

from __future__ import annotations

import ast
import io
import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import exc as sa_exc

from buffered_store.errors import ConfigError
from buffered_store.logs import (
    JsonFormatter,
    RepeatFilter,
    TextFormatter,
    ThreadIdMode,
    configure_logging,
    redact_thread_id,
    scrub,
    thread_id_mode,
)

MARKER = "PAYLOAD-MARKER-7f3a"
ROOT = Path(__file__).resolve().parents[2]


def record(
    msg: str = "something happened",
    *args: object,
    level: int = logging.WARNING,
    exc_info: Any = None,
    **extra: Any,
) -> logging.LogRecord:
    rec = logging.LogRecord("flusher", level, __file__, 1, msg, args, exc_info)
    for key, value in extra.items():
        setattr(rec, key, value)
    return rec


def sqlalchemy_error() -> sa_exc.OperationalError:
    return sa_exc.OperationalError(
        "UPDATE messages SET message = %(m)s WHERE thread_id = %(t)s",
        {"m": f'{{"role": "user", "content": "{MARKER}"}}', "t": "thread-1"},
        Exception("server closed the connection unexpectedly"),
    )


# -- configuration and redaction -------------------------------------------------------------


def test_thread_id_mode_comes_from_the_environment() -> None:
    assert thread_id_mode({}) is ThreadIdMode.PLAIN
    assert thread_id_mode({"BUFSTORE_LOG_THREAD_IDS": " Hash "}) is ThreadIdMode.HASH
    assert thread_id_mode({"BUFSTORE_LOG_THREAD_IDS": "truncate"}) is ThreadIdMode.TRUNCATE
    with pytest.raises(ConfigError, match="BUFSTORE_LOG_THREAD_IDS"):
        thread_id_mode({"BUFSTORE_LOG_THREAD_IDS": "rot13"})


def test_redaction_modes() -> None:
    assert redact_thread_id("customer-42/session", ThreadIdMode.PLAIN) == "customer-42/session"
    hashed = redact_thread_id("customer-42/session", ThreadIdMode.HASH)
    assert hashed.startswith("h:")
    assert len(hashed) == 14
    assert "customer" not in hashed
    assert hashed == redact_thread_id("customer-42/session", ThreadIdMode.HASH)  # stable
    assert hashed != redact_thread_id("customer-43/session", ThreadIdMode.HASH)
    assert redact_thread_id("customer-42/session", ThreadIdMode.TRUNCATE) == "customer…"
    assert redact_thread_id("short", ThreadIdMode.TRUNCATE) == "short"
    assert redact_thread_id("\ud800 lone surrogate", ThreadIdMode.HASH).startswith("h:")


# -- scrubbing -----------------------------------------------------------------------------------


def test_scrub_cuts_sqlalchemy_statement_and_parameters() -> None:
    text = f"database unavailable: {sqlalchemy_error()}"
    assert MARKER in text  # what SQLAlchemy would let through
    assert "[parameters:" in text
    cleaned = scrub(text)
    assert MARKER not in cleaned
    assert "UPDATE" not in cleaned
    assert cleaned.startswith("database unavailable: (builtins.Exception) server closed")


def test_scrub_drops_postgres_lines_that_quote_values() -> None:
    text = (
        "invalid input syntax for type json\n"
        f'DETAIL:  Token "{MARKER}" is invalid.\n'
        f"CONTEXT:  JSON data, line 1: {MARKER}\n"
        f"LINE 1: SELECT '{MARKER}'::jsonb\n"
        "               ^\n"
        "the end"
    )
    assert scrub(text) == "invalid input syntax for type json\nthe end"


def test_scrub_redacts_thread_mentions() -> None:
    text = "thread 'secret-id': entries 3..5 missing; of thread \"it's\" too; thread_id='x\\'y'"
    hashed = scrub(text, mode=ThreadIdMode.HASH)
    for leaked in ("secret-id", "it's", "x\\'y"):
        assert leaked not in hashed
    for original, prefix in (("secret-id", "thread "), ("it's", "thread "), ("x'y", "thread_id=")):
        assert prefix + repr(redact_thread_id(original, ThreadIdMode.HASH)) in hashed
    assert scrub(text) == text  # plain mode leaves them


def test_scrub_bounds_the_length() -> None:
    cleaned = scrub("x" * 5000, limit=100)
    assert cleaned.startswith("x" * 100)
    assert cleaned.endswith("(4900 more chars)")


# -- formatters ----------------------------------------------------------------------------------


def test_json_line_has_event_fields_and_redacted_thread_ids() -> None:
    line = JsonFormatter(ThreadIdMode.HASH).format(
        record(
            "could not flush thread %r: %s",
            "secret-thread",
            sqlalchemy_error(),
            action="apply_failed",
            thread_id="secret-thread",
            thread_ids=["secret-thread", "other"],
            retriable=True,
            entries=3,
            stats={"acked": 2},
        )
    )
    out = json.loads(line)
    assert out["event"] == "apply_failed"
    assert out["level"] == "warning"
    assert out["logger"] == "flusher"
    assert out["retriable"] is True
    assert out["entries"] == 3
    assert out["stats"] == {"acked": 2}
    assert out["thread_id"] == redact_thread_id("secret-thread", ThreadIdMode.HASH)
    assert out["thread_ids"][1] == redact_thread_id("other", ThreadIdMode.HASH)
    assert out["ts"].endswith("+00:00")
    assert "secret-thread" not in line
    assert MARKER not in line


def test_json_error_keeps_types_and_frames_but_no_quoted_data() -> None:
    try:
        try:
            raise sqlalchemy_error()
        except sa_exc.OperationalError as inner:
            raise RuntimeError("apply failed") from inner
    except RuntimeError:
        exc_info = sys.exc_info()
    line = JsonFormatter(ThreadIdMode.PLAIN).format(
        record("cycle failed", level=logging.ERROR, exc_info=exc_info, action="cycle_failed")
    )
    out = json.loads(line)
    assert out["error"]["type"] == "builtins.RuntimeError"
    assert out["error"]["causes"][0]["type"] == "sqlalchemy.exc.OperationalError"
    assert any("test_logs.py" in frame for frame in out["error"]["stack"])
    assert MARKER not in line


def test_records_without_an_action_are_named_unnamed() -> None:
    out = json.loads(JsonFormatter(ThreadIdMode.PLAIN).format(record("hello %s", "world")))
    assert out["event"] == "unnamed"
    assert out["msg"] == "hello world"


def test_bad_format_arguments_do_not_lose_the_line() -> None:
    out = json.loads(JsonFormatter(ThreadIdMode.PLAIN).format(record("%d items", "x")))
    assert out["msg"] == "%d items"


def test_text_line() -> None:
    line = TextFormatter(ThreadIdMode.TRUNCATE).format(
        record("db down: %s", sqlalchemy_error(), action="db_unavailable", thread_id="0123456789")
    )
    assert " WARNING flusher [db_unavailable] db down: (builtins.Exception) server closed" in line
    assert 'thread_id="01234567…"' in line
    assert MARKER not in line


# -- one line per episode --------------------------------------------------------------------


def test_repeat_filter_lets_one_line_per_window_through() -> None:
    now = [0.0]
    gate = RepeatFilter({"nats_error"}, window_s=60.0, clock=lambda: now[0])
    first = record(action="nats_error")
    assert gate.filter(first)
    assert not hasattr(first, "suppressed")
    for step in range(5):
        now[0] = 1.0 + step
        assert not gate.filter(record(action="nats_error"))
    assert gate.filter(record(action="db_unavailable"))  # other events pass untouched
    assert gate.filter(record())
    now[0] = 61.0
    later = record(action="nats_error")
    assert gate.filter(later)
    assert getattr(later, "suppressed", None) == 5


@pytest.fixture
def root_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.usefixtures("root_logging")
def test_configure_logging_writes_json_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BUFSTORE_LOG_FORMAT", "json")
    stream = io.StringIO()
    configure_logging("info", stream=stream, thread_ids=ThreadIdMode.HASH)
    logging.getLogger("flusher").info("flusher started", extra={"action": "flusher_started"})
    logging.getLogger("flusher").debug("hidden", extra={"action": "x"})
    lines = stream.getvalue().splitlines()
    assert [json.loads(line)["event"] for line in lines] == ["flusher_started"]


@pytest.mark.usefixtures("root_logging")
def test_configure_logging_rejects_unknown_formats(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BUFSTORE_LOG_FORMAT", "xml")
    with pytest.raises(ConfigError, match="json or text"):
        configure_logging()


# -- every log call of the project names its event -------------------------------------------


def _log_calls(path: Path) -> Iterator[ast.Call]:
    levels = {"debug", "info", "warning", "error", "exception", "critical"}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in levels
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "log"
        ):
            yield node


def test_every_log_call_passes_an_action() -> None:
    missing: list[str] = []
    calls = 0
    for package in ("buffered_store", "flusher"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for call in _log_calls(path):
                calls += 1
                extra = next((k.value for k in call.keywords if k.arg == "extra"), None)
                named = isinstance(extra, ast.Dict) and any(
                    isinstance(k, ast.Constant) and k.value == "action" for k in extra.keys
                )
                # `extra=extra` (a variable built with an action nearby) is accepted.
                if not named and not isinstance(extra, ast.Name):
                    missing.append(f"{path.relative_to(ROOT)}:{call.lineno}")
    assert calls > 10
    assert missing == []
