"""Which front-end a WAL stream belongs to. Pure: no I/O.

Every front-end keeps its entries in a stream of its own (``THREADLOG``, ``LGWAL``), and
the two formats share the engine's header but not their bodies: a flusher of one
front-end pointed at the other's stream would find every entry undecodable and
quarantine (and acknowledge) all of them, leaving nothing for the right flusher.

So a stream says whose it is: the process that creates it writes its front-end's name
into the stream's metadata (``bufstore_front_end``, JetStream >= 2.10), and every
process that opens it with a front-end in mind (stores, savers, flushers) refuses a
stream of another front-end (`wrong_front_end`). A stream without the tag (created by
an older release, or by a server before 2.10, which drops metadata) is judged by its
last entry when a flusher starts (`judge_entry`): another front-end's entry refuses the
start, one of its own lets the flusher tag the stream, anything else (an empty stream, a
payload no front-end wrote) lets it start with a warning.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from buffered_store.engine.entries import parse_entry
from buffered_store.errors import CorruptEntryError

FRONT_END_KEY = "bufstore_front_end"
"""Key of the stream metadata entry naming its front-end."""
THREADRUN = "threadrun"
LANGGRAPH = "langgraph"


class Verdict(StrEnum):
    """What an entry of an untagged stream says about whose stream it is."""

    OURS = "ours"
    """It decodes as an entry of the front-end asking."""
    FOREIGN = "foreign"
    """It is an engine entry (header intact) that the asking front-end cannot decode."""
    UNKNOWN = "unknown"
    """Not an entry at all, or one every front-end writes alike (a delete): it says
    nothing about whose stream it is."""


def front_end_of(fmt: Any) -> str | None:
    """The name a front-end's `Format` declares (its ``front_end`` attribute), or None."""
    name = getattr(fmt, "front_end", None)
    return name if isinstance(name, str) and name else None


def stream_metadata(front_end: str | None) -> dict[str, str] | None:
    """The metadata of a stream created for `front_end` (None: no tag)."""
    return {FRONT_END_KEY: front_end} if front_end else None


def tag_of(metadata: dict[str, str] | None) -> str | None:
    """The front-end a stream's metadata names, or None when untagged."""
    return (metadata or {}).get(FRONT_END_KEY) or None


def judge_entry(fmt: Any, payload: bytes) -> tuple[Verdict, str]:
    """Whether `payload` is an entry of `fmt`'s front-end, of another one, or says
    nothing (no entry, or a delete: both front-ends write ``del`` entries); with the
    entry's kind (empty when it is none)."""
    try:
        header, _ = parse_entry(payload)
    except CorruptEntryError:
        return Verdict.UNKNOWN, ""
    try:
        entry = fmt.decode_entry(payload)
    except Exception:  # whatever a decoder raises, the entry is not its front-end's
        return Verdict.FOREIGN, header.kind
    return (Verdict.UNKNOWN if entry.deletes else Verdict.OURS), header.kind


def wrong_front_end(stream: str, found: str | None, ours: str, evidence: str) -> str:
    """The message of a process of front-end `ours` refusing the stream of `found` (None:
    another front-end, unnamed)."""
    whose = f"the {found} front-end's" if found else "another front-end's"
    flusher = f"--front-end {found}" if found else "--front-end of that front-end"
    return (
        f"stream {stream!r} holds {whose} entries ({evidence}), and this process is of "
        f"the {ours} front-end: it refuses to use it (a {ours} flusher would quarantine "
        f"every entry). Drain it with `bufstore flusher {flusher}`, and give the {ours} "
        f"front-end its own stream (its stream_name setting)."
    )
