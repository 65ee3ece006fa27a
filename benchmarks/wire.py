"""Round trips to Postgres counted on the wire, independently of the code being measured.

`RoundTrips` traces the frontend/backend protocol of every connection a SQLAlchemy pool
hands out while it is installed (libpq's ``PQtrace`` through psycopg) and counts the
messages after which the client waits for the server: ``Sync`` (the end of an
extended-protocol statement, or of a pipeline) and ``Query`` (a simple-protocol
statement such as psycopg's own ``BEGIN``/``COMMIT``). Each is one round trip.

Tracing costs client CPU: count in cycles that are not timed.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Any

from psycopg import pq
from sqlalchemy import event
from sqlalchemy.pool import Pool

_WAITING = frozenset({"Sync", "Query"})


def count_waits(trace: str) -> int:
    """Frontend messages in a libpq trace after which the client waits for an answer."""
    count = 0
    for line in trace.splitlines():
        fields = line.split("\t")
        if len(fields) >= 3 and fields[0] == "F" and fields[2].split(" ", 1)[0] in _WAITING:
            count += 1
    return count


class RoundTrips:
    """While entered, counts the round trips of every pooled psycopg connection checked
    out (all pools of the process); `total` reads them once the connections are back."""

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="pgtrace-")
        self._open: dict[int, tuple[Any, int]] = {}
        self._files: list[Path] = []

    def __enter__(self) -> RoundTrips:
        event.listen(Pool, "checkout", self._checkout)
        event.listen(Pool, "checkin", self._checkin)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        event.remove(Pool, "checkout", self._checkout)
        event.remove(Pool, "checkin", self._checkin)
        for pgconn, fd in self._open.values():
            self._stop(pgconn, fd)
        self._open.clear()

    @property
    def total(self) -> int:
        """Round trips of the connections traced so far and checked in again."""
        return sum(count_waits(path.read_text()) for path in self._files)

    def close(self) -> None:
        """Remove the trace files."""
        self._dir.cleanup()

    def _checkout(self, dbapi_connection: Any, record: Any, proxy: Any) -> None:
        pgconn = record.driver_connection.pgconn
        path = Path(self._dir.name) / f"{len(self._files)}.trace"
        self._files.append(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        pgconn.trace(fd)
        pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)
        self._open[id(record)] = (pgconn, fd)

    def _checkin(self, dbapi_connection: Any, record: Any) -> None:
        opened = self._open.pop(id(record), None)
        if opened is not None:
            self._stop(*opened)

    @staticmethod
    def _stop(pgconn: Any, fd: int) -> None:
        # PQuntrace flushes the trace stream; libpq never closes it, so the fd is ours.
        with contextlib.suppress(Exception):
            pgconn.untrace()
        os.close(fd)
