"""A flusher drains only its own front-end's stream (see `buffered_store.engine.frontend`).

A tagged stream of another front-end is refused when the flusher opens it (`NatsWal`
compares the tag). An untagged one, made by an older release or kept by a server that
drops stream metadata (before 2.10), is judged here by its newest entries before the
flusher binds to its consumer.
"""

from __future__ import annotations

import logging
from typing import Any

from buffered_store.engine.frontend import Verdict, front_end_of, judge_entry, wrong_front_end
from buffered_store.errors import ConfigError
from buffered_store.nats import NatsWal

log = logging.getLogger("flusher")

JUDGED_ENTRIES = 8
"""Newest messages of an untagged stream read to tell whose it is (deletes say nothing)."""


async def confirm_front_end(wal: NatsWal, fmt: Any) -> None:
    """Refuse (`ConfigError`) an untagged stream whose newest entries are another
    front-end's; tag it when they are this front-end's; start with a warning when
    nothing tells (an empty stream, deletes only, payloads that are no entry)."""
    ours = front_end_of(fmt)
    if ours is None or wal.stream_front_end is not None:
        return
    last = await wal.last_seq()
    for seq in range(last, max(0, last - JUDGED_ENTRIES), -1):
        msg = await wal.get(seq)
        if msg is None:
            continue
        verdict, kind = judge_entry(fmt, msg.data)
        if verdict is Verdict.FOREIGN:
            evidence = f"untagged, but its entry {seq} is of kind {kind!r}, not {ours}"
            raise ConfigError(wrong_front_end(wal.stream, None, ours, evidence))
        if verdict is Verdict.OURS:
            if await wal.tag_stream():
                log.info(
                    "untagged stream %r holds %s entries: tagged",
                    wal.stream,
                    ours,
                    extra={"action": "stream_tagged"},
                )
            else:
                log.warning(
                    "untagged stream %r holds %s entries, but the server keeps no stream "
                    "metadata (nats-server before 2.10): judged again at each start",
                    wal.stream,
                    ours,
                    extra={"action": "stream_untagged"},
                )
            return
    log.warning(
        "stream %r names no front-end and its newest entries do not tell whose it is; "
        "draining it as %s",
        wal.stream,
        ours,
        extra={"action": "stream_untagged"},
    )
