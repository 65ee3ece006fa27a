"""Names on the NATS side: WAL subjects, KV keys and message ids for a thread.

Thread ids are arbitrary Unicode; they are encoded as unpadded URL-safe base64 of their
UTF-8 bytes, whose alphabet (A-Z a-z 0-9 - _) can never form a subject token separator
or wildcard (".", "*", ">") nor whitespace. Pure: no I/O.
"""

from __future__ import annotations

import base64
import binascii
import functools

from buffered_store.engine.ids import check_id
from buffered_store.errors import ValidationError

THREAD_SUBJECT_KIND = "t"
"""Subject token of thread entries (``<stream>.t.<thread>``). Every front-end's entries
use it; front-ends keep apart by their own stream, bucket and consumer names."""


def encode_token(value: str) -> str:
    """A subject/KV-safe token for an identifier."""
    return base64.urlsafe_b64encode(value.encode("utf-8")).rstrip(b"=").decode("ascii")


def decode_token(token: str) -> str:
    """Inverse of `encode_token`."""
    try:
        padded = token + "=" * (-len(token) % 4)
        value = base64.urlsafe_b64decode(padded.encode("ascii")).decode("utf-8")
    except (binascii.Error, UnicodeError, ValueError) as exc:
        raise ValidationError(f"not an encoded identifier: {token!r}") from exc
    if not value or encode_token(value) != token:
        raise ValidationError(f"not a canonical encoded identifier: {token!r}")
    return value


_CACHED_THREADS = 4096
"""Threads whose subject/token translations each cache remembers (least recently used
dropped first): a flusher or writer sees the same active threads over and over."""


def thread_token(thread_id: str) -> str:
    """Validated, encoded thread id."""
    if type(thread_id) is str:
        return _thread_token(thread_id)
    return encode_token(check_id(thread_id, "thread_id"))  # raises: not a str


@functools.lru_cache(maxsize=_CACHED_THREADS)
def _thread_token(thread_id: str) -> str:
    # An invalid id raises, and exceptions are not cached: it is checked on every call.
    return encode_token(check_id(thread_id, "thread_id"))


def stream_subjects(stream: str) -> str:
    """The subject filter the WAL stream captures."""
    return f"{stream}.>"


def wal_subject(stream: str, thread_id: str) -> str:
    """The WAL subject of a thread's entries."""
    return f"{stream}.{THREAD_SUBJECT_KIND}.{thread_token(thread_id)}"


def thread_from_subject(stream: str, subject: str) -> str | None:
    """The thread id a WAL subject belongs to, or None when it is not a thread subject.

    Decoding (base64, UTF-8, canonical check) costs about ten times a cache hit, and the
    flusher decodes the subject of every message it fetches: results are cached."""
    return _thread_from_subject(stream, subject)


@functools.lru_cache(maxsize=_CACHED_THREADS)
def _thread_from_subject(stream: str, subject: str) -> str | None:
    prefix = f"{stream}.{THREAD_SUBJECT_KIND}."
    if not subject.startswith(prefix):
        return None
    token = subject[len(prefix) :]
    if not token or "." in token:
        return None
    try:
        return decode_token(token)
    except ValidationError:
        return None


def hot_key(thread_id: str) -> str:
    """KV key of the thread's hot record (latest seq and summary), written by writers."""
    return f"h.{thread_token(thread_id)}"


def flushed_key(thread_id: str) -> str:
    """KV key of the thread's flushed watermark, written by flushers after commit."""
    return f"f.{thread_token(thread_id)}"


def msg_id(thread_id: str, seq: int) -> str:
    """`Nats-Msg-Id` of an entry: a retried publish of the same seq is deduplicated."""
    return f"{thread_token(thread_id)}:{seq}"
