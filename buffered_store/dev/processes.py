"""Processes of the throwaway servers: whether a PID lives, its children, signals, and
the registry of live servers that are stopped at interpreter exit or on SIGTERM.

Processes are only ever signalled by their own PID."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from buffered_store.dev.common import say


def proc_state(pid: int) -> str | None:
    """Linux process state letter from /proc, None when the process does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return "?"
    return stat.rsplit(")", 1)[1].split()[0]


def pid_alive(pid: int | None) -> bool:
    """True if ``pid`` is a live process. Zombies (exited, not yet reaped) count as gone."""
    if pid is None or pid <= 0:
        return False
    if Path("/proc/self/stat").exists():
        state = proc_state(pid)
        return state is not None and state not in ("Z", "X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def child_pids(pid: int) -> list[int]:
    """The PIDs whose parent is `pid` (from /proc, else `pgrep -P`)."""
    if Path("/proc/self/stat").exists():
        children: list[int] = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if len(fields) > 1 and fields[1] == str(pid):
                children.append(int(entry.name))
        return children
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
        return [int(x) for x in out.split()]
    return []


def wait_pids_gone(pids: Sequence[int], timeout: float) -> bool:
    """Wait until none of `pids` lives; False if one still does after `timeout`."""
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def signal_pid(pid: int, sig: signal.Signals) -> None:
    """Send `sig` to `pid` (gone already is fine)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


class _Closable(Protocol):
    def close(self) -> None: ...


_LIVE: list[_Closable] = []
LIVE_LOCK = threading.RLock()
"""Reentrant: `stop_on_sigterm`'s handler runs `close_all` in the main thread, possibly
while that thread is inside `register` or `unregister`."""


def register(obj: _Closable) -> None:
    """Close `obj` at interpreter exit or on SIGTERM (see `stop_on_sigterm`)."""
    with LIVE_LOCK:
        if not any(o is obj for o in _LIVE):
            _LIVE.append(obj)


def unregister(obj: _Closable) -> None:
    """Forget `obj` (it was closed)."""
    with LIVE_LOCK:
        _LIVE[:] = [o for o in _LIVE if o is not obj]


@atexit.register
def close_all() -> None:
    """Close every registered server, newest first (atexit, SIGTERM)."""
    with LIVE_LOCK:
        live = list(reversed(_LIVE))
    for obj in live:
        try:
            obj.close()
        except Exception as exc:  # keep closing the others
            say(f"cleanup of {obj!r} failed: {exc}")


def stop_on_sigterm() -> None:
    """Make SIGTERM stop every server this process started, then end the process as the
    signal would have.

    The servers run in sessions of their own (a terminal's Ctrl-C does not reach them)
    and are stopped at interpreter exit; but SIGTERM, what CI runners and ``timeout``
    send, ends a Python process without running ``atexit``, which left them running.
    Call from the main thread (the test session and the demo do).
    """

    def on_sigterm(signum: int, frame: object) -> None:
        say("SIGTERM: stopping the servers this process started")
        close_all()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)
