"""Crash points for failure tests: `BUFSTORE_CRASH_POINT` makes the flusher SIGKILL itself.

Only the e2e tests set it. A real SIGKILL (not an exception) is what makes these tests
honest: no `finally` block, no nak, no drain runs.

- ``mid_batch``: after a batch was fetched, before anything is applied.
- ``after_commit``: right after the apply transaction committed, before the KV flushed
  mark is raised and before any ack.
"""

from __future__ import annotations

import os
import signal

CRASH_POINTS = frozenset({"mid_batch", "after_commit"})


def crash_point() -> str | None:
    """The configured crash point, if any (unknown values are rejected loudly)."""
    point = os.environ.get("BUFSTORE_CRASH_POINT") or None
    if point is not None and point not in CRASH_POINTS:
        raise ValueError(f"BUFSTORE_CRASH_POINT={point!r}: expected one of {sorted(CRASH_POINTS)}")
    return point


_POINT = crash_point()


def maybe_crash(point: str) -> None:
    """SIGKILL this process if `point` is the configured crash point."""
    if point == _POINT:
        os.kill(os.getpid(), signal.SIGKILL)
