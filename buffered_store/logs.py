"""Structured logs: one line per event, with a stable event name and fields.

Every log call of this project names its event with ``extra={"action": ...}`` and passes
its facts as further ``extra`` fields. `JsonFormatter` writes one JSON object per line
(``ts``, ``level``, ``logger``, ``event``, ``msg``, the fields, and ``error`` for an
exception); `TextFormatter` writes the same as a readable line. `configure_logging`
installs either on the root logger, with a `RepeatFilter` that lets one line per window
through for events that repeat while one condition lasts (the NATS client reports every
failed reconnect attempt).

Payloads never reach the log: our log calls do not pass message content. Error texts are
the one way foreign data could slip in (a SQLAlchemy error lists its statement and
parameters; a Postgres error's DETAIL and CONTEXT lines quote values), so `scrub` cuts
those parts from every text, tracebacks keep only their frames, and texts are bounded.

Thread ids are user data too: ``BUFSTORE_LOG_THREAD_IDS`` = ``plain`` (default),
``hash`` (a short BLAKE2 digest: equal ids give equal digests, for grepping)
or ``truncate`` (the first 8 characters) applies to fields named like ``thread_id`` and
to ``thread '...'`` mentions inside texts.
"""

from __future__ import annotations

import ast
import hashlib
import logging
import os
import re
import sys
import time
import traceback
from collections.abc import Callable, Collection, Mapping
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Literal, TextIO

import orjson

from buffered_store.errors import ConfigError
from buffered_store.masking import mask_credentials

__all__ = [
    "ENV_LOG_FORMAT",
    "ENV_THREAD_IDS",
    "NOISY_EVENTS",
    "JsonFormatter",
    "RepeatFilter",
    "TextFormatter",
    "ThreadIdMode",
    "configure_logging",
    "redact_thread_id",
    "scrub",
    "thread_id_mode",
]

ENV_THREAD_IDS = "BUFSTORE_LOG_THREAD_IDS"
ENV_LOG_FORMAT = "BUFSTORE_LOG_FORMAT"

MAX_TEXT = 1000
"""Longest text (message, error, field) written; longer ones are cut."""

NOISY_EVENTS = frozenset({"nats_error", "settle_failed", "unsubscribe_failed"})
"""Events logged once per attempt by code we do not control (the NATS client's error
callback) or per message; `RepeatFilter` keeps one line per window of each."""

THREAD_FIELDS = frozenset({"thread_id", "thread", "parent_thread_id"})
THREAD_LIST_FIELDS = frozenset({"thread_ids", "threads"})

_STANDARD_ATTRS = frozenset(
    {
        *logging.LogRecord("", 0, "", 0, "", (), None).__dict__,
        "message",
        "asctime",
        "taskName",
        "action",
    }
)
_SQLALCHEMY_SUFFIX = re.compile(r"\s*\[(?:SQL|parameters): ")
_QUOTED_LINES = re.compile(
    r"^\s*(?:DETAIL|CONTEXT|HINT|QUERY|STATEMENT|WHERE|LINE \d+):.*$\n?"  # Postgres
    r"|^\s*\^\s*$\n?",  # the caret under a LINE
    re.M,
)
_THREAD_MENTION = re.compile(r"""(\bthread(?:_id)?[ =:]+)('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")""")


class ThreadIdMode(StrEnum):
    """How thread ids appear in logs."""

    PLAIN = "plain"
    HASH = "hash"
    TRUNCATE = "truncate"


def thread_id_mode(env: Mapping[str, str] | None = None) -> ThreadIdMode:
    """The mode ``BUFSTORE_LOG_THREAD_IDS`` asks for (plain when unset)."""
    raw = (os.environ if env is None else env).get(ENV_THREAD_IDS, "").strip().lower()
    try:
        return ThreadIdMode(raw or ThreadIdMode.PLAIN)
    except ValueError:
        choices = ", ".join(m.value for m in ThreadIdMode)
        raise ConfigError(f"{ENV_THREAD_IDS} must be one of {choices}; got {raw!r}") from None


def redact_thread_id(thread_id: str, mode: ThreadIdMode) -> str:
    """A thread id as the mode shows it: itself, ``h:`` + 12 hex digits, or its first
    8 characters followed by ``…``."""
    if mode is ThreadIdMode.HASH:
        data = thread_id.encode("utf-8", "surrogatepass")
        return "h:" + hashlib.blake2b(data, digest_size=6).hexdigest()
    if mode is ThreadIdMode.TRUNCATE and len(thread_id) > 8:
        return thread_id[:8] + "…"
    return thread_id


def scrub(text: str, *, mode: ThreadIdMode = ThreadIdMode.PLAIN, limit: int = MAX_TEXT) -> str:
    """`text` without the parts that can quote data: SQLAlchemy's ``[SQL: ...]`` and
    ``[parameters: ...]`` suffix, Postgres' DETAIL/CONTEXT/LINE lines; thread mentions
    redacted per `mode`; credentials in URLs and connection strings masked
    (`buffered_store.masking`); at most `limit` characters."""
    text = mask_credentials(_SQLALCHEMY_SUFFIX.split(text, maxsplit=1)[0])
    text = _QUOTED_LINES.sub("", text).rstrip()
    if mode is not ThreadIdMode.PLAIN:
        text = _THREAD_MENTION.sub(lambda m: m.group(1) + _redact_quoted(m.group(2), mode), text)
    if len(text) > limit:
        text = f"{text[:limit]}…({len(text) - limit} more chars)"
    return text


def _redact_quoted(quoted: str, mode: ThreadIdMode) -> str:
    try:
        value = ast.literal_eval(quoted)
    except (ValueError, SyntaxError):
        value = quoted[1:-1]
    return repr(redact_thread_id(str(value), mode))


class _Fields:
    """Turns a record into the event name and the extra fields, made safe to write."""

    def __init__(self, mode: ThreadIdMode | None) -> None:
        self.mode = thread_id_mode() if mode is None else mode

    def event(self, record: logging.LogRecord) -> str:
        action = getattr(record, "action", None)
        return str(action) if action else "unnamed"

    def message(self, record: logging.LogRecord) -> str:
        try:
            text = record.getMessage()
        except Exception:  # bad %-args: keep the template rather than lose the line
            text = str(record.msg)
        return scrub(text, mode=self.mode)

    def extra(self, record: logging.LogRecord) -> dict[str, Any]:
        return {
            key: self.value(key, value)
            for key, value in record.__dict__.items()
            if key not in _STANDARD_ATTRS and not key.startswith("_")
        }

    def value(self, key: str, value: Any) -> Any:
        if key in THREAD_FIELDS and isinstance(value, str):
            return redact_thread_id(value, self.mode)
        if key in THREAD_LIST_FIELDS and isinstance(value, list | tuple | set | frozenset):
            return [redact_thread_id(str(v), self.mode) for v in value]
        return self.plain(value)

    def plain(self, value: Any) -> Any:
        if value is None or isinstance(value, bool | int | float):
            return value
        if isinstance(value, str):
            return scrub(value, mode=self.mode)
        if isinstance(value, Mapping):
            return {str(k): self.value(str(k), v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.plain(v) for v in value]
        return scrub(str(value), mode=self.mode)

    def error(self, record: logging.LogRecord) -> dict[str, Any] | None:
        if not record.exc_info or record.exc_info[1] is None:
            return None
        exc = record.exc_info[1]
        chain: list[dict[str, str]] = []
        seen: set[int] = set()
        current: BaseException | None = exc
        while current is not None and id(current) not in seen and len(chain) < 5:
            seen.add(id(current))
            chain.append(
                {"type": _type_name(current), "message": scrub(str(current), mode=self.mode)}
            )
            current = current.__cause__ or current.__context__
        frames = traceback.extract_tb(exc.__traceback__)
        return {
            **chain[0],
            "causes": chain[1:],
            # Frames only (file, line, function): never the texts of the exceptions.
            "stack": [f"{f.filename}:{f.lineno} in {f.name}" for f in frames[-10:]],
        }


def _type_name(exc: BaseException) -> str:
    cls = type(exc)
    return f"{cls.__module__}.{cls.__qualname__}"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``ts`` (UTC, ISO 8601), ``level``, ``logger``,
    ``event`` (the record's ``action``, or ``unnamed``), ``msg``, the extra fields, and
    ``error`` (type, message, causes, stack frames) for an exception.

    Args:
        thread_ids: how thread ids appear; None reads ``BUFSTORE_LOG_THREAD_IDS``.
    """

    def __init__(self, thread_ids: ThreadIdMode | None = None) -> None:
        super().__init__()
        self._fields = _Fields(thread_ids)

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": self._fields.event(record),
            "msg": self._fields.message(record),
        }
        for key, value in self._fields.extra(record).items():
            out.setdefault(key, value)
        error = self._fields.error(record)
        if error is not None:
            out["error"] = error
        return orjson.dumps(out, default=str).decode()


class TextFormatter(logging.Formatter):
    """``time level logger [event] message key=value ...``, scrubbed like the JSON."""

    def __init__(self, thread_ids: ThreadIdMode | None = None) -> None:
        super().__init__()
        self._fields = _Fields(thread_ids)

    def format(self, record: logging.LogRecord) -> str:
        parts = [
            self.formatTime(record),
            record.levelname,
            record.name,
            f"[{self._fields.event(record)}]",
            self._fields.message(record),
        ]
        for key, value in self._fields.extra(record).items():
            parts.append(f"{key}={orjson.dumps(value, default=str).decode()}")
        error = self._fields.error(record)
        if error is not None:
            parts.append(f"error={error['type']}: {error['message']}")
        return " ".join(parts)


class RepeatFilter(logging.Filter):
    """Lets one record per `window_s` through for each (logger, event) in `events`; the
    next one let through carries ``suppressed``: how many were dropped meanwhile.

    One line per episode instead of one per attempt, for events whose callers log every
    attempt. `clock` is injectable (monotonic seconds) so tests need no sleeps.
    """

    def __init__(
        self,
        events: Collection[str] = NOISY_EVENTS,
        *,
        window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.events = frozenset(events)
        self.window_s = window_s
        self._clock = clock
        self._last: dict[tuple[str, str], float] = {}
        self._suppressed: dict[tuple[str, str], int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        event = getattr(record, "action", None)
        if event not in self.events:
            return True
        key = (record.name, str(event))
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self.window_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        self._last[key] = now
        suppressed = self._suppressed.pop(key, 0)
        if suppressed:
            record.suppressed = suppressed
        return True


def configure_logging(
    level: str | int = "INFO",
    *,
    fmt: Literal["json", "text"] | None = None,
    stream: TextIO | None = None,
    thread_ids: ThreadIdMode | None = None,
    repeat_window_s: float = 60.0,
) -> logging.Handler:
    """Send every log record to `stream` (stderr) as JSON or text lines; returns the
    handler installed on the root logger (replacing its handlers).

    `fmt` None reads ``BUFSTORE_LOG_FORMAT`` (``json`` or ``text``, default text);
    `thread_ids` None reads ``BUFSTORE_LOG_THREAD_IDS``.
    """
    chosen = fmt or os.environ.get(ENV_LOG_FORMAT, "text").strip().lower() or "text"
    if chosen not in ("json", "text"):
        raise ConfigError(f"log format must be json or text, got {chosen!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(RepeatFilter(window_s=repeat_window_s))
    mode = thread_id_mode() if thread_ids is None else thread_ids
    handler.setFormatter(JsonFormatter(mode) if chosen == "json" else TextFormatter(mode))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper() if isinstance(level, str) else level)
    return handler
