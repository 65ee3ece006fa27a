"""Validation and canonical encoding of message snapshots, and snapshot diffing.

Every store encodes messages the same way (orjson, sorted keys) so that two snapshots can
be compared byte for byte: the diff decides how many stored messages a checkpoint keeps
and which ones it writes. Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from buffered_store.errors import ValidationError
from buffered_store.records import Message

_OPTS = orjson.OPT_SORT_KEYS


def _check_json(value: Any, path: str) -> None:
    """Reject what JSON (and Postgres jsonb) cannot hold: NaN/inf, NUL, non-str keys."""
    if isinstance(value, str):
        if "\x00" in value:
            raise ValidationError(f"{path}: strings must not contain NUL characters")
    elif isinstance(value, bool) or value is None or isinstance(value, int):
        return
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
    _check_json(message, f"messages[{index}]")
    return _check_encodable(message, f"messages[{index}]")


def encode_messages(
    messages: Any, previous: Sequence[bytes] | None = None, previous_objects: Sequence[Any] = ()
) -> list[bytes]:
    """Validate a snapshot and return the canonical bytes of each message.

    ``previous``/``previous_objects`` are an optional cache of the last snapshot: a message
    that is the very same object and encodes to the same bytes is not validated twice.
    """
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise ValidationError(
            f"messages must be a list of JSON objects, got {type(messages).__name__}"
        )
    out: list[bytes] = []
    for index, message in enumerate(messages):
        if (
            previous is not None
            and index < len(previous)
            and index < len(previous_objects)
            and previous_objects[index] is message
        ):
            try:
                encoded = orjson.dumps(message, option=_OPTS)
            except TypeError:
                encoded = b""
            # NaN encodes as null, so bytes equal to a cached "null" prove nothing.
            if encoded == previous[index] and b"null" not in encoded:
                out.append(encoded)
                continue
        out.append(encode_message(message, index))
    return out


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
