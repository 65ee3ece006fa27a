"""Validation and canonical encoding of message snapshots, and snapshot diffing.

Every store encodes messages the same way (orjson, sorted keys) so that two snapshots can
be compared byte for byte: the diff decides how many stored messages a checkpoint keeps
and which ones it writes. Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any
from uuid import UUID

import orjson

from buffered_store.errors import ValidationError
from buffered_store.threadrun.records import Message

_OPTS = orjson.OPT_SORT_KEYS | orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS
"""Canonical encoding: sorted keys; datetimes and dataclasses are refused, not converted."""

_SUSPECT = (b"null", b"\\u0000")
"""Bytes that need the precise check: NaN/inf encode as null, NUL as an escape."""


def _check_json(value: Any, path: str) -> None:
    """Reject what JSON (and Postgres jsonb) cannot hold: NaN/inf, NUL, non-str keys."""
    if isinstance(value, str):
        if "\x00" in value:
            raise ValidationError(f"{path}: strings must not contain NUL characters")
    elif isinstance(value, bool | int | UUID | Enum) or value is None:
        return  # orjson encodes UUIDs and enums natively, as their JSON value
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValidationError(f"{path}: {value!r} cannot be encoded as JSON")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValidationError(f"{path}: object keys must be strings, got {key!r}")
            if "\x00" in key:
                raise ValidationError(f"{path}: object keys must not contain NUL characters")
            _check_json(item, f"{path}.{key}")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _check_json(item, f"{path}[{index}]")
    else:
        raise ValidationError(f"{path}: {type(value).__name__} cannot be encoded as JSON")


def _check_encodable(value: Any, what: str) -> bytes:
    # orjson refuses what _check_json cannot see cheaply: integers beyond 64 bits, lone
    # surrogates, nesting deeper than 255 levels.
    try:
        return orjson.dumps(value, option=_OPTS)
    except TypeError as exc:
        raise ValidationError(f"{what} cannot be encoded as JSON: {exc}") from exc


def check_json_object(value: Any, what: str) -> dict[str, Any]:
    """Validate a JSON object (metadata, run output...)."""
    if not isinstance(value, Mapping):
        raise ValidationError(f"{what} must be a JSON object, got {type(value).__name__}")
    _check_json(value, what)
    _check_encodable(value, what)
    return dict(value)


def check_json_value(value: Any, what: str) -> Any:
    """Validate any JSON value."""
    _check_json(value, what)
    _check_encodable(value, what)
    return value


def encode_message(message: Any, index: int) -> bytes:
    """Validate one message and return its canonical JSON bytes."""
    if not isinstance(message, Mapping):
        raise ValidationError(
            f"messages[{index}] must be a JSON object, got {type(message).__name__}"
        )
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ValidationError(f"messages[{index}] needs a non-empty string 'role'")
    try:
        encoded = orjson.dumps(message, option=_OPTS)
    except TypeError:
        encoded = b""  # the precise walk below names the offending value
    # orjson rejects non-string keys and foreign types itself; only NaN/inf (encoded as
    # null) and NUL characters (escaped) slip through, so walk the message only then.
    if not encoded or any(token in encoded for token in _SUSPECT):
        _check_json(message, f"messages[{index}]")
        encoded = _check_encodable(message, f"messages[{index}]")
    return encoded


def encode_messages(messages: Any, previous: Sequence[bytes] | None = None) -> list[bytes]:
    """Validate a snapshot and return the canonical bytes of each message.

    ``previous`` is the cached snapshot of the thread's last checkpoint. When the new
    snapshot starts with the same messages (the usual append), that prefix is encoded in
    one call and compared byte for byte: equal bytes are messages already validated, and
    only the new ones are checked one by one. The cost stays one C-level pass over the
    history instead of a Python walk of every message.
    """
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise ValidationError(
            f"messages must be a list of JSON objects, got {type(messages).__name__}"
        )
    out = _reuse_prefix(messages, previous) if previous else []
    for index in range(len(out), len(messages)):
        out.append(encode_message(messages[index], index))
    return out


def _reuse_prefix(messages: Sequence[Any], previous: Sequence[bytes]) -> list[bytes]:
    """The cached bytes of the common prefix, when it provably did not change."""
    prefix = min(len(previous), len(messages))
    if prefix == 0:
        return []
    try:
        blob = orjson.dumps(list(messages[:prefix]), option=_OPTS)
    except TypeError:
        return []
    if blob != b"[" + b",".join(previous[:prefix]) + b"]":
        return []
    if b"null" in blob:
        for index in range(prefix):
            # A cached null may now be a NaN (which also encodes as null): check those.
            if b"null" in previous[index]:
                encode_message(messages[index], index)
    return list(previous[:prefix])


def decode_message(data: bytes | str) -> Message:
    """Canonical bytes back to a message dict."""
    value = orjson.loads(data)
    if not isinstance(value, dict):
        raise ValidationError("stored message is not a JSON object")
    return value


@dataclass(frozen=True, slots=True)
class SnapshotDelta:
    """How a new snapshot differs from the previous one.

    The first `keep` messages are unchanged; `appended` replaces everything after them.
    An append-only checkpoint has ``keep == len(previous)``; a rewrite has a smaller keep.
    """

    keep: int
    appended: list[bytes]

    @property
    def length(self) -> int:
        """Number of messages in the new snapshot."""
        return self.keep + len(self.appended)


def diff_snapshot(previous: Sequence[bytes] | None, new: Sequence[bytes]) -> SnapshotDelta:
    """Longest common prefix of the two snapshots; the rest of `new` is appended.

    `previous` is None when the previous snapshot is unknown: the delta is then the full
    snapshot (keep 0).
    """
    if not previous:
        return SnapshotDelta(0, list(new))
    limit = min(len(previous), len(new))
    keep = 0
    # Fast path for the common case: the whole previous snapshot is a prefix of the new one.
    if limit == len(previous) and list(new[:limit]) == list(previous):
        keep = limit
    else:
        while keep < limit and previous[keep] == new[keep]:
            keep += 1
    return SnapshotDelta(keep, list(new[keep:]))


def apply_delta(base: Sequence[bytes], keep: int, appended: Sequence[bytes]) -> list[bytes]:
    """The snapshot after a delta: the first `keep` of `base`, then `appended`."""
    if keep > len(base):
        raise ValidationError(f"delta keeps {keep} messages but the base has only {len(base)}")
    return [*base[:keep], *appended]


def canonical_objects(objects: Sequence[Mapping[str, Any]]) -> tuple[bytes, ...]:
    """The canonical bytes of each JSON object of `objects` (as parsed from JSON).

    One C-level encoding of the whole list, cut at the ``},{`` between items, instead of
    one call per item. The cut is exact only when no string holds ``},{``: the count of
    cuts tells, and the rare list where a string does is encoded item by item.
    """
    if not objects:
        return ()
    whole = orjson.dumps(objects, option=orjson.OPT_SORT_KEYS)
    inner = whole[2:-2]  # without the list's ``[{`` and ``}]``
    if inner.count(b"},{") != len(objects) - 1:
        return tuple(orjson.dumps(item, option=orjson.OPT_SORT_KEYS) for item in objects)
    return tuple(b"{" + part + b"}" for part in inner.split(b"},{"))
