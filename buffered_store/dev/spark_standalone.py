"""A throwaway standalone Spark cluster (one master, one worker) from the installed pyspark.

The pyspark wheel has no ``sbin/start-master.sh``; it has ``bin/spark-class``, which runs
any Spark class with the JVM options Spark needs and then *execs* the JVM, so the PID of
the process started here is the master's (or worker's) own and stopping it by PID stops
exactly it. Both listen on loopback on free ports; the master's REST submission server
(a fixed port, 6066) is off; the worker's application files go to a temporary directory,
not into the installed package.

Readiness is read from the master's web UI (``/json/``): the master is up when it says
``ALIVE``, the cluster when it counts a live worker. Nothing here imports pyspark.

``python -m buffered_store.dev.spark_standalone`` starts one and prints its master URL
until Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from buffered_store.backoff import Backoff
from buffered_store.dev.services import (
    LOCALHOST,
    DevServiceError,
    ServerContext,
    ServiceStartError,
    ms_since,
    pick_free_ports,
    register,
    say,
    tail_text,
    unregister,
)

__all__ = ["SparkDaemon", "SparkStandalone", "find_spark_home"]

MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"

DAEMON_PROPERTIES = (
    "spark.master.rest.enabled false\n"  # its port (6066) is fixed: two clusters would clash
)


def find_spark_home() -> Path:
    """The installed pyspark package, which is a Spark home (``bin/spark-class``, ``jars/``).

    Found without importing pyspark; ``$SPARK_HOME`` is ignored on purpose, so the cluster
    runs the Spark version the driver will.
    """
    spec = importlib.util.find_spec("pyspark")
    if spec is None or not spec.submodule_search_locations:
        raise DevServiceError(
            "pyspark is not installed: pip install 'buffered-thread-store[spark]'"
        )
    home = Path(next(iter(spec.submodule_search_locations)))
    if not (home / "bin" / "spark-class").is_file():
        raise DevServiceError(f"{home} has no bin/spark-class: not a full pyspark install")
    return home


def _web_json(url: str, timeout: float = 1.0) -> dict[str, Any] | None:
    """The JSON document of a Spark web UI page, or None when it cannot be read."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            doc = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


@dataclass
class SparkDaemon:
    """One JVM of the cluster (master or worker): its command line, log and process."""

    name: str
    command: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The JVM's PID while it runs."""
        return self.proc.pid if self.proc is not None else None

    @property
    def running(self) -> bool:
        """True while the process is alive."""
        return self.proc is not None and self.proc.poll() is None


class SparkStandalone(ServerContext):
    """A standalone master and one worker on ``host`` (loopback by default).

    ``master_url`` is what ``--master`` takes. The worker offers ``worker_cores`` cores
    and ``worker_memory_mb`` of memory to executors (an application asks for 1 GiB per
    executor unless ``spark.executor.memory`` says otherwise).
    """

    name = "spark"
    managed = True

    def __init__(
        self,
        *,
        host: str = LOCALHOST,
        worker_cores: int = 2,
        worker_memory_mb: int = 1024,
        spark_home: str | os.PathLike[str] | None = None,
        startup_timeout: float = 120.0,
    ) -> None:
        if worker_cores < 1 or worker_memory_mb < 1:
            raise ValueError("worker_cores and worker_memory_mb must be >= 1")
        self.spark_home = Path(spark_home) if spark_home is not None else find_spark_home()
        self.host = host
        self.startup_timeout = startup_timeout
        self._tmp_root = Path(tempfile.mkdtemp(prefix="bufstore-spark-"))
        port, web_port, worker_port, worker_web_port = pick_free_ports(4, host)
        self.port = port
        self.web_port = web_port
        properties = self._tmp_root / "spark-daemons.conf"
        properties.write_text(DAEMON_PROPERTIES)
        work_dir = self._tmp_root / "work"
        spark_class = os.fspath(self.spark_home / "bin" / "spark-class")
        common = ["--host", host, "--properties-file", os.fspath(properties)]
        master_args = ["--port", str(port), "--webui-port", str(web_port)]
        self.master = SparkDaemon(
            "master",
            [spark_class, MASTER_CLASS, *common, *master_args],
            self._tmp_root / "master.log",
        )
        worker_args = [
            *("--port", str(worker_port), "--webui-port", str(worker_web_port)),
            *("--work-dir", os.fspath(work_dir)),
            *("--cores", str(worker_cores), "--memory", f"{worker_memory_mb}m"),
        ]
        self.worker = SparkDaemon(
            "worker",
            [spark_class, WORKER_CLASS, *common, *worker_args, self.master_url],
            self._tmp_root / "worker.log",
        )
        self._closed = False
        self._lock = threading.RLock()
        register(self)

    def __repr__(self) -> str:
        return f"SparkStandalone(url={self.master_url!r}, pids={self.pids})"

    @property
    def master_url(self) -> str:
        """``spark://host:port`` of the master."""
        return f"spark://{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """Same as `master_url` (the name every dev service has)."""
        return self.master_url

    @property
    def web_url(self) -> str:
        """The master's web UI (its ``/json/`` page is the cluster's state)."""
        return f"http://{self.host}:{self.web_port}"

    @property
    def pids(self) -> dict[str, int | None]:
        """PID of the master and of the worker (None when not running)."""
        return {"master": self.master.pid, "worker": self.worker.pid}

    def state(self) -> dict[str, Any] | None:
        """The master's view of the cluster (workers, applications), None if unreadable."""
        return _web_json(f"{self.web_url}/json/")

    def applications(self) -> list[dict[str, Any]]:
        """Every application the master knows, running or finished."""
        state = self.state() or {}
        apps = [*(state.get("activeapps") or []), *(state.get("completedapps") or [])]
        return [app for app in apps if isinstance(app, dict)]

    # -- life cycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Start the master, then the worker, and wait until the worker has registered."""
        with self._lock:
            if self._closed:
                raise DevServiceError("SparkStandalone is closed")
            t0 = time.perf_counter()
            if not self.master.running:
                self._launch(self.master)
            # The worker may start as soon as the master's RPC port is open (the master's
            # web UI and leader election come later); a worker that finds no master waits
            # several seconds before it tries again.
            self._wait(self.master, lambda: _port_open(self.host, self.port), "its port open")
            if not self.worker.running:
                self._launch(self.worker)
            self._wait(self.worker, self._worker_alive, "a live worker")
            say(f"spark standalone master {self.master_url} with a worker in {ms_since(t0)}")

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["SPARK_HOME"] = os.fspath(self.spark_home)
        # The web UIs bind SPARK_LOCAL_IP (else every interface); the RPC ports take --host.
        env["SPARK_LOCAL_IP"] = self.host
        # No spark-defaults.conf or spark-env.sh of the user's: they could change ports.
        env["SPARK_CONF_DIR"] = os.fspath(self._tmp_root)
        return env

    def _launch(self, daemon: SparkDaemon) -> None:
        with open(daemon.log_path, "ab") as log:
            daemon.proc = subprocess.Popen(
                daemon.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self._tmp_root,
                env=self._env(),
                start_new_session=True,
            )

    def _worker_alive(self) -> bool:
        state = self.state() or {}
        return state.get("status") == "ALIVE" and int(state.get("aliveworkers") or 0) >= 1

    def _wait(self, daemon: SparkDaemon, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.startup_timeout
        retry = Backoff(0.05, 0.5)
        while True:
            if ready():
                return
            if daemon.proc is None or daemon.proc.poll() is not None:
                code = daemon.proc.returncode if daemon.proc is not None else None
                daemon.proc = None
                raise ServiceStartError(
                    f"spark {daemon.name} exited with code {code} during startup; cmd: "
                    f"{shlex.join(daemon.command)}\n--- log tail ---\n" + tail_text(daemon.log_path)
                )
            if time.monotonic() > deadline:
                raise ServiceStartError(
                    f"spark {daemon.name}: no {what} after {self.startup_timeout:.0f}s "
                    f"(master {self.master_url}, web UI {self.web_url})\n--- log tail ---\n"
                    + tail_text(daemon.log_path)
                )
            time.sleep(retry.next_delay())

    def _stop(self, daemon: SparkDaemon, timeout: float) -> None:
        """SIGTERM the daemon's JVM by its PID (its shutdown hooks run), SIGKILL after
        `timeout`; then the same for any child it left (a worker's executors)."""
        proc = daemon.proc
        if proc is None:
            return
        children = _child_pids(proc.pid)
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pid in children:
            _end_pid(pid, timeout)
        daemon.proc = None

    def stop(self, timeout: float = 15.0) -> None:
        """Stop the worker (and its executors), then the master."""
        with self._lock:
            self._stop(self.worker, timeout)
            self._stop(self.master, timeout)

    def close(self) -> None:
        """Stop both and delete the temporary directory (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self.stop()
            self._closed = True
            shutil.rmtree(self._tmp_root, ignore_errors=True)
            unregister(self)


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _child_pids(pid: int) -> list[int]:
    """PIDs whose parent is `pid` (Linux /proc; empty elsewhere)."""
    children: list[int] = []
    proc = Path("/proc")
    if not proc.is_dir():
        return children
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 1 and fields[1] == str(pid):
            children.append(int(entry.name))
    return children


def _end_pid(pid: int, timeout: float) -> None:
    """SIGTERM `pid` if it still runs, SIGKILL it after `timeout`."""
    deadline = time.monotonic() + timeout
    sig = signal.SIGTERM
    while True:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        if sig == signal.SIGKILL:
            return
        while time.monotonic() < deadline:
            time.sleep(0.05)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
        sig = signal.SIGKILL


def main(argv: Sequence[str] | None = None) -> int:
    """Start a master and a worker, print the master URL, stop both on Ctrl-C/SIGTERM."""
    parser = argparse.ArgumentParser(
        prog="python -m buffered_store.dev.spark_standalone",
        description="A throwaway standalone Spark master and worker from the installed pyspark.",
    )
    parser.add_argument("--host", default=LOCALHOST)
    parser.add_argument("--cores", type=int, default=2, help="cores the worker offers")
    parser.add_argument("--memory-mb", type=int, default=2048, help="memory the worker offers")
    args = parser.parse_args(argv)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    with SparkStandalone(
        host=args.host, worker_cores=args.cores, worker_memory_mb=args.memory_mb
    ) as cluster:
        print(f"master {cluster.master_url}  web UI {cluster.web_url}  pids {cluster.pids}")
        print("Ctrl-C stops both", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            stopping.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
