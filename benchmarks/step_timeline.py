"""Where a LangGraph step's time goes on `BufferedCheckpointSaver`'s write path.

`profile_langgraph --timeline` marks the clock at each stage of a step (the task's writes,
`aput`, the thread's group commit, the entry's encoding, the publish and its socket
write, the reply's arrival and parsing, the acknowledged write's bookkeeping, `aput`'s
return) by wrapping those calls for the run, and reports the median of each stage over
the steps that ran alone (no other step started before it ended): at a paced load, what
one round trip from idle costs beside what the saver's own code adds before the socket
write and after the reply. The wrappers cost a few microseconds a mark; the stages are
meant for comparing with each other, not for adding up to the step's latency.

`stage_times` (pure) does the attribution and is tested on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

STAGES: tuple[tuple[str, str], ...] = (
    ("writes", "the task's writes (aput_writes, until aput is called)"),
    ("aput", "aput until its write is queued (checks, blobs of the new items)"),
    ("queued", "to the thread's publishing task (group commit)"),
    ("publishing", "the entry built (drafts resolved)"),
    ("encoding", "the entry encoded"),
    ("encoded", "to the client's publish"),
    (
        "published",
        "the publish (`Publisher`: the command into nats-py's buffer) to its socket write",
    ),
    ("sending", "the socket write (system call)"),
    ("sent", "the reply arrives (loopback and nats-server)"),
    ("received", "the reply parsed and handed over (nats-py)"),
    ("delivered", "the acknowledged write recorded (cursor, caches, hot record queued)"),
    ("recorded", "back in the caller: aput returns"),
)
"""Each mark, in the order a step makes them, and what the stage from it to the next one
covers (the last mark's stage ends at `end`)."""
MARKS = (*(name for name, _ in STAGES), "end")


def stage_times(marks: Sequence[tuple[float, str]]) -> dict[str, dict[str, float]]:
    """Median and mean microseconds of each stage (`STAGES`), and how many steps they
    come from, over the steps whose marks (time, name) all came in order before the
    next step's first mark: a step is attributed the first mark of each name after its
    previous one. Steps that overlapped another step are left out."""
    ordered = sorted(marks)
    durations: list[list[float]] = [[] for _ in STAGES]
    starts = [i for i, (_, name) in enumerate(ordered) if name == MARKS[0]]
    for k, first in enumerate(starts):
        stop = starts[k + 1] if k + 1 < len(starts) else len(ordered)
        times = _walk(ordered, first, stop)
        if times is None:
            continue
        for stage, (a, b) in enumerate(itertools.pairwise(times)):
            durations[stage].append((b - a) * 1e6)
    steps = len(durations[0])
    out: dict[str, dict[str, float]] = {}
    for (name, _), values in zip(STAGES, durations, strict=True):
        if values:
            out[name] = {
                "p50_us": round(statistics.median(values), 1),
                "mean_us": round(statistics.fmean(values), 1),
                "steps": steps,
            }
    return out


ONCE = frozenset(
    ("writes", "aput", "queued", "publishing", "encoding", "encoded", "recorded", "end")
)
"""Marks a step alone makes once: a second one between its first mark and its end is
another step's (the socket, the reply and the client's publish also serve the hot
records' updates, which go out in the background)."""


def _walk(ordered: Sequence[tuple[float, str]], first: int, stop: int) -> list[float] | None:
    """The times of every mark of `MARKS`, in order, found between `first` and `stop`
    (the next step's first mark); None when one is missing or another step's marks are
    among them."""
    times = [ordered[first][0]]
    at = first
    for name in MARKS[1:]:
        at += 1
        while at < stop and ordered[at][1] != name:
            at += 1
        if at >= stop:
            return None
        times.append(ordered[at][0])
    names = [name for _, name in ordered[first : at + 1] if name in ONCE]
    return times if len(names) == len(set(names)) else None


@contextlib.contextmanager
def marking(marks: list[tuple[float, str]]) -> Iterator[None]:
    """Append (time, mark) to `marks` at each stage of the saver's write path while
    inside; every wrapped call is put back on the way out."""
    import nats.aio.transport

    import buffered_store.langgraph.saver as saver_module
    from buffered_store.engine.groupcommit import GroupCommit
    from buffered_store.langgraph import BufferedCheckpointSaver
    from buffered_store.nats.publishing import Publisher
    from buffered_store.nats.requests import Dispatch

    clock = time.perf_counter

    def note(name: str) -> None:
        marks.append((clock(), name))

    patches: list[tuple[Any, str, Any]] = []

    def around(
        owner: Any,
        attr: str,
        before: str | None,
        after: str | None = None,
        when: Callable[[dict[str, Any]], bool] | None = None,
    ) -> None:
        original = getattr(owner, attr)
        patches.append((owner, attr, original))
        if asyncio.iscoroutinefunction(original):

            async def wrapped_async(*args: Any, **kwargs: Any) -> Any:
                marked = when is None or when(kwargs)
                if before and marked:
                    note(before)
                result = await original(*args, **kwargs)
                if after and marked:
                    note(after)
                return result

            setattr(owner, attr, wrapped_async)
            return

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            marked = when is None or when(kwargs)
            if before and marked:
                note(before)
            result = original(*args, **kwargs)
            if after and marked:
                note(after)
            return result

        setattr(owner, attr, wrapped)

    around(BufferedCheckpointSaver, "aput_writes", "writes")
    around(BufferedCheckpointSaver, "aput", "aput", "end")
    around(GroupCommit, "submit", "queued", when=lambda kwargs: bool(kwargs.get("urgent")))
    around(GroupCommit, "_send", "publishing", "recorded")
    around(saver_module, "encode_entry", "encoding", "encoded")
    around(Publisher, "publish", "published")
    around(nats.aio.transport.TcpTransport, "writelines", "sending", "sent")
    around(asyncio.StreamReaderProtocol, "data_received", "received")
    around(Dispatch, "set_result", "delivered")
    try:
        yield
    finally:
        for owner, attr, original in reversed(patches):
            setattr(owner, attr, original)
