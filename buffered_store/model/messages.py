"""Validation and canonical encoding of message snapshots, and snapshot diffing.

Every store encodes messages the same way (orjson, sorted keys) so that two snapshots can
be compared byte for byte: the diff decides how many stored messages a checkpoint keeps
and which ones it writes. Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any
from uuid import UUID

import orjson

from buffered_store.errors import ValidationError
from buffered_store.model.records import Message

_OPTS = orjson.OPT_SORT_KEYS | orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS
"""Canonical encoding: sorted keys; datetimes and dataclasses are refused, not converted."""


def _suspect(encoded: bytes) -> bool:
    """Whether canonical bytes need the precise check: NaN and infinities encode as
    null, NUL characters as an escape."""
    return b"null" in encoded or b"\\u0000" in encoded


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
    if type(message) is not dict and not isinstance(message, Mapping):
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
    if not encoded or _suspect(encoded):
        _check_json(message, f"messages[{index}]")
        encoded = _check_encodable(message, f"messages[{index}]")
    return encoded


DIGEST_SIZE = 16
"""Bytes of a snapshot digest (BLAKE2b-128)."""
EMPTY_DIGEST = bytes(DIGEST_SIZE)
"""The digest of the empty snapshot."""


def extend_chain(start: bytes, encoded: Iterable[bytes]) -> bytearray:
    """The digests of a snapshot after each of `encoded` (canonical message bytes),
    continuing from `start`, the digest of the messages before them: concatenated,
    `DIGEST_SIZE` bytes each.

    A snapshot's digest is a chain over its messages, ``d(0) = EMPTY_DIGEST`` and
    ``d(i + 1) = BLAKE2b-128(message i, key=d(i))``: it extends in O(new messages),
    whatever the entries were that built the snapshot, so a writer that never saw a
    thread can prove that its snapshot starts with the stored one (`prove_prefix`).
    """
    chain = bytearray()
    digest = start
    for message in encoded:
        digest = hashlib.blake2b(message, key=digest, digest_size=DIGEST_SIZE).digest()
        chain += digest
    return chain


class MessageSnapshot(list[bytes]):
    """The canonical bytes of a snapshot's messages, remembering the message objects the
    first of them were encoded from, and the digests of its first ones.

    `sources` is an aligned prefix: ``sources[i]`` is the object ``self[i]`` was encoded
    from, for every ``i < len(sources) <= len(self)``. A writer keeps the snapshot of a
    thread's last checkpoint; the next `checkpoint()` usually passes the same list grown
    by a few messages, whose leading items are then those very objects: `encode_messages`
    recognises them with one pointer comparison each instead of an encoding.

    `chain` holds the digests (`extend_chain`) of the first ``len(chain) // DIGEST_SIZE``
    messages, computed when first asked for (`digest_at`) and carried along as the
    snapshot grows.
    """

    __slots__ = ("chain", "sources")

    def __init__(
        self,
        encoded: Iterable[bytes] = (),
        sources: Iterable[Any] = (),
        chain: bytes | bytearray = b"",
    ) -> None:
        super().__init__(encoded)
        self.sources: list[Any] = list(sources)
        del self.sources[len(self) :]
        self.chain = bytearray(chain[: DIGEST_SIZE * len(self)])

    def digest_at(self, count: int) -> bytes:
        """The digest of the first `count` messages (at most ``len(self)``)."""
        if count > len(self):
            raise ValueError(f"digest of {count} messages asked of a snapshot of {len(self)}")
        if count == 0:
            return EMPTY_DIGEST
        known = len(self.chain) // DIGEST_SIZE
        if known < count:
            start = self.chain[-DIGEST_SIZE:] if known else EMPTY_DIGEST
            self.chain += extend_chain(bytes(start), self[known:count])
        return bytes(self.chain[DIGEST_SIZE * (count - 1) : DIGEST_SIZE * count])


@dataclass(frozen=True, slots=True)
class EncodedSnapshot:
    """A validated snapshot: the first `kept` messages are those of `base` (known equal
    without encoding them), `new` the canonical bytes of the rest."""

    base: Sequence[bytes]
    kept: int
    new: list[bytes]
    lead: Sequence[Any]
    """The message objects the first `kept` were encoded from (at least `kept` items)."""
    origin: tuple[Any, ...]
    """The message objects `new` was encoded from."""

    def __len__(self) -> int:
        return self.kept + len(self.new)

    def full(self) -> MessageSnapshot:
        """Every message's bytes (O(history): only off the usual path)."""
        return MessageSnapshot(
            [*self.base[: self.kept], *self.new], [*self.lead[: self.kept], *self.origin]
        )

    def delta(self, previous: Sequence[bytes] | None) -> tuple[SnapshotDelta, tuple[Any, ...]]:
        """How this snapshot differs from `previous`, and the objects of the appended
        messages (aligned with them). O(new) when `previous` is the `base` it was
        validated against, as it is unless another write of the thread came between."""
        if previous is self.base and previous is not None and len(previous) >= self.kept:
            same = self.kept
            limit = min(len(previous), len(self))
            while same < limit and previous[same] == self.new[same - self.kept]:
                same += 1
            skip = same - self.kept
            return SnapshotDelta(same, self.new[skip:]), self.origin[skip:]
        full = self.full()
        delta = diff_snapshot(previous, full)
        return delta, tuple(full.sources[delta.keep :])


def prove_prefix(snapshot: EncodedSnapshot, count: int, digest: bytes) -> MessageSnapshot | None:
    """The first `count` messages of `snapshot` as a `MessageSnapshot`, when their digest
    is `digest` (the stored snapshot's, from the thread's hot record): proof, short of a
    BLAKE2b collision, that the snapshot starts with the stored one, which a writer that
    has not seen the thread can then extend with a delta instead of the whole history.
    None when it does not (or `digest` is unknown). O(count) hashing, once per thread."""
    if not digest or count > len(snapshot):
        return None
    full = snapshot.full()
    chain = extend_chain(EMPTY_DIGEST, full[:count])
    if (chain[-DIGEST_SIZE:] if count else EMPTY_DIGEST) != digest:
        return None
    return MessageSnapshot(full[:count], full.sources[:count], chain)


RECHECKED_TAIL = 2
"""Messages at the end of an unchanged prefix that are encoded again anyway: the place an
application changes a message in place (a streamed answer growing), caught cheaply."""


def encode_snapshot(
    messages: Any, previous: Sequence[bytes] | None = None, *, check: bool = False
) -> EncodedSnapshot:
    """Validate a snapshot; encode what `previous` (the cached snapshot of the thread's
    last checkpoint) does not provably hold already.

    Its prefix is reused without validating or encoding it again:

    * by identity, when ``previous`` is a `MessageSnapshot` and the new snapshot starts
      with the objects it was encoded from (the usual step: the same list, grown). One
      pointer comparison per message (an object that is not the same one must compare
      equal, ``==``), then O(new messages). The contract, documented for `checkpoint()`:
      a message object once checkpointed is not changed in place (an edit puts a new
      object in its place), except the last `RECHECKED_TAIL` of the snapshot, which are
      encoded again. ``check`` (config ``check_snapshots``) verifies the contract on every
      call instead, at the cost of an encoding of the whole snapshot, and raises
      `ValidationError` naming the message changed in place;
    * else by value: the prefix encoded in one call and compared byte for byte (one
      C-level pass over the history instead of a Python walk of every message).
    """
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise ValidationError(
            f"messages must be a list of JSON objects, got {type(messages).__name__}"
        )
    kept = _same_objects(messages, previous) if previous else 0
    if kept:
        if check:
            _check_unchanged(messages, previous, kept)  # type: ignore[arg-type]
        lead: Sequence[Any] = previous.sources  # type: ignore[union-attr]
    else:
        kept = _same_values(messages, previous) if previous else 0
        lead = messages[:kept]
        if kept and isinstance(previous, MessageSnapshot):
            # Now known: these objects encode to the snapshot's first `kept` messages.
            previous.sources = list(lead)
    new = [encode_message(messages[index], index) for index in range(kept, len(messages))]
    return EncodedSnapshot(previous or (), kept, new, lead, tuple(messages[kept:]))


def encode_messages(
    messages: Any, previous: Sequence[bytes] | None = None, *, check: bool = False
) -> list[bytes]:
    """Validate a snapshot and return the canonical bytes of each message
    (`encode_snapshot`, whole)."""
    return encode_snapshot(messages, previous, check=check).full()


def _same_objects(messages: Sequence[Any], previous: Sequence[bytes]) -> int:
    """How many leading messages are the objects `previous` was encoded from and still
    encode the same (the last `RECHECKED_TAIL` of them are encoded again); 0 when the
    snapshot does not start with them."""
    sources = getattr(previous, "sources", None)
    if not sources or not isinstance(messages, list):
        return 0
    kept = min(len(sources), len(messages))
    if kept < len(sources):
        same = sources[:kept] == messages
    else:
        # One pass of ``list ==``, which skips identical items without touching them
        # (a scan that touched every message would cost a cache miss each): lend
        # `sources` the caller's new messages for the comparison, then take them back.
        sources.extend(messages[kept:])
        try:
            same = sources == messages
        finally:
            del sources[kept:]
    if not same:
        return 0
    if not _encode_as(messages, previous, max(0, kept - RECHECKED_TAIL), kept):
        return 0  # changed in place: compare by value (which names the problem)
    return kept


def _check_unchanged(messages: Sequence[Any], previous: Sequence[bytes], kept: int) -> None:
    for index in range(kept):
        if encode_message(messages[index], index) != previous[index]:
            raise ValidationError(
                f"messages[{index}] was changed in place after an earlier checkpoint() of "
                "this thread; checkpoint() reuses the encoding of message objects it has "
                "seen: pass a new object for a changed message (check_snapshots found this)"
            )


def _same_values(messages: Sequence[Any], previous: Sequence[bytes]) -> int:
    """How many leading messages encode to `previous`'s (all of the common length, or
    none: one encoding of the prefix compared byte for byte)."""
    prefix = min(len(previous), len(messages))
    return prefix if prefix and _encode_as(messages, previous, 0, prefix) else 0


def _encode_as(messages: Sequence[Any], previous: Sequence[bytes], start: int, stop: int) -> bool:
    """Whether ``messages[start:stop]`` encode to ``previous[start:stop]``: one encoding
    of them all, compared byte for byte. Equal bytes are valid messages (`previous` was
    validated), but for a NaN or infinity where a null was (both encode as null): those
    messages are validated again, and raise `ValidationError`."""
    try:
        blob = orjson.dumps(list(messages[start:stop]), option=_OPTS)
    except TypeError:
        return False
    if blob != b"[" + b",".join(previous[start:stop]) + b"]":
        return False
    if b"null" in blob:
        for index in range(start, stop):
            if b"null" in previous[index]:
                encode_message(messages[index], index)
    return True


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
