"""Identifiers and timestamps as every part of the store checks them. Pure: no I/O."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from buffered_store.errors import ValidationError

MAX_ID_BYTES = 512
"""Longest id, in UTF-8 bytes. Ids are btree keys in Postgres, where one index tuple may
hold at most about 2,700 bytes; ``runs_thread_created_idx`` holds a thread id, a timestamp
and a run id, so two ids of 512 bytes always fit, compressed or not (a limit counted in
characters does not: 512 varied CJK characters are 1,536 bytes that do not compress)."""


def utcnow() -> datetime:
    """Now, timezone-aware (UTC)."""
    return datetime.now(UTC)


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


def parse_time(value: Any) -> datetime:
    """A timezone-aware datetime from itself or its ISO 8601 text."""
    if isinstance(value, datetime):
        return value
    parsed = datetime.fromisoformat(value)
    if parsed.tzinfo is None:
        raise ValidationError(f"timestamp {value!r} has no timezone")
    return parsed


def wire_time(value: datetime) -> datetime | str:
    """A datetime as a value for `orjson.dumps` to write as ``value.isoformat()``: the
    datetime itself in UTC (orjson writes the same text, in C), else that text (with
    another offset orjson may not: it drops an offset's seconds; nor a subclass)."""
    return value if writes_as_iso(value) else value.isoformat()


def writes_as_iso(value: datetime | None) -> bool:
    """Whether orjson writes `value` (None too) as `isoformat()` does (`wire_time`)."""
    return value is None or (value.tzinfo is UTC and type(value) is datetime)
