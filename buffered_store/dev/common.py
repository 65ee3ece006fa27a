"""What every throwaway service shares: its errors, free ports, log tails, the
`ServiceHandle` protocols tests rely on and `ServerContext` (start on entry, close on
exit)."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Protocol, Self, runtime_checkable

LOCALHOST = "127.0.0.1"


class DevServiceError(RuntimeError):
    """A throwaway service could not be found, started or controlled."""


class ServiceStartError(DevServiceError):
    """A service process was launched but never became ready."""


class ServiceNotManagedError(DevServiceError):
    """kill()/restart() on a service this process did not start (NATS_URL/DATABASE_URL)."""


def say(message: str) -> None:
    """One progress line on stderr (``BUFSTORE_SERVICES_QUIET=1`` silences them)."""
    if os.environ.get("BUFSTORE_SERVICES_QUIET", "") not in ("", "0"):
        return
    print(f"[devservices] {message}", file=sys.stderr, flush=True)


def ms_since(start: float) -> str:
    """Milliseconds since `start` (a `time.perf_counter` reading), for progress lines."""
    return f"{(time.perf_counter() - start) * 1000:.0f} ms"


def pick_free_ports(count: int, host: str = LOCALHOST) -> list[int]:
    """Return ``count`` distinct TCP ports that were free on ``host`` a moment ago."""
    if count < 1:
        raise ValueError("count must be >= 1")
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


def pick_free_port(host: str = LOCALHOST) -> int:
    """Bind ``host:0``, read the port the kernel chose, close the socket and return it."""
    return pick_free_ports(1, host)[0]


def is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def tail_text(path: str | os.PathLike[str], *, offset: int = 0, max_lines: int = 40) -> str:
    """Last ``max_lines`` lines of a log file from byte ``offset`` ('' if unreadable)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except OSError:
        return ""
    lines = data.decode("utf-8", "replace").splitlines()
    return "\n".join(lines[-max_lines:])


def http_ok(url: str, timeout: float = 0.5) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


@runtime_checkable
class ServiceHandle(Protocol):
    """What tests may rely on for every kind of service."""

    name: str
    managed: bool

    @property
    def url(self) -> str: ...
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def kill(self) -> None: ...
    def restart(self) -> None: ...
    def close(self) -> None: ...


@runtime_checkable
class NatsService(ServiceHandle, Protocol):
    pass


@runtime_checkable
class PostgresService(ServiceHandle, Protocol):
    @property
    def jdbc_url(self) -> str: ...
    @property
    def libpq_url(self) -> str: ...


class ServerContext:
    """A local server usable as a context manager: started on entry, closed on exit."""

    def start(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
