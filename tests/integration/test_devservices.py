"""buffered_store.dev.services against real nats-server and PostgreSQL processes."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import psycopg
import pytest
from nats.js.errors import NoStreamResponseError

from buffered_store.dev import processes
from buffered_store.dev import services as ds

pytestmark = pytest.mark.integration


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


@pytest.fixture
def nats_server() -> Iterator[ds.NatsServer]:
    server = ds.NatsServer()
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def pg_server() -> Iterator[ds.PostgresServer]:
    server = ds.PostgresServer()
    server.start()
    try:
        yield server
    finally:
        server.close()


# ---- NATS ----------------------------------------------------------------------------------


async def test_nats_connect_and_stop_leaves_no_process(nats_server: ds.NatsServer) -> None:
    assert nats_server.port not in (4222,)
    nc = await nats.connect(nats_server.url)
    try:
        info = await nc.jetstream().account_info()
        assert info.streams == 0
    finally:
        await nc.close()
    pid = nats_server.pid
    assert pid is not None
    assert ds.pid_alive(pid)
    nats_server.stop()
    assert not ds.pid_alive(pid)
    assert nats_server.pid is None
    assert not nats_server.running
    assert not _port_open(nats_server.host, nats_server.port)
    nats_server.stop()  # idempotent
    tmp_root = nats_server.store_dir.parent
    nats_server.close()
    assert not tmp_root.exists()


async def _publish_with_retry(js: nats.js.JetStreamContext, subject: str, data: bytes) -> int:
    deadline = time.monotonic() + 10
    while True:
        try:
            ack = await js.publish(subject, data, timeout=1)
            return int(ack.seq)
        except (nats.errors.Error, NoStreamResponseError, TimeoutError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def test_nats_restart_keeps_port_and_jetstream_data(nats_server: ds.NatsServer) -> None:
    nc = await nats.connect(nats_server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.05)
    try:
        js = nc.jetstream()
        await js.add_stream(name="DEVSVC", subjects=["devsvc.>"])
        for i in range(10):
            await js.publish(f"devsvc.{i}", f"m{i}".encode())
        port, old_pid = nats_server.port, nats_server.pid

        await asyncio.to_thread(nats_server.restart)  # restart() blocks: keep the loop free

        assert nats_server.port == port
        assert not ds.pid_alive(old_pid)
        assert nats_server.pid != old_pid
        assert ds.pid_alive(nats_server.pid)
        # the connected client reconnects to the same URL and can write again
        assert await _publish_with_retry(js, "devsvc.after", b"after") == 11
    finally:
        await nc.close()

    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        info = await js.stream_info("DEVSVC")
        assert info.state.messages == 11
        msg = await js.get_msg("DEVSVC", 3)
        assert msg.data == b"m2"
    finally:
        await nc.close()


async def test_nats_kill_keeps_acked_data(nats_server: ds.NatsServer) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        await js.add_stream(name="KILLED", subjects=["killed.>"])
        for i in range(5):
            await js.publish("killed.x", f"k{i}".encode())
    finally:
        await nc.close()
    pid = nats_server.pid
    nats_server.kill()
    assert not ds.pid_alive(pid)
    nats_server.restart()
    nc = await nats.connect(nats_server.url)
    try:
        info = await nc.jetstream().stream_info("KILLED")
        assert info.state.messages == 5
    finally:
        await nc.close()


async def test_nats_sync_always() -> None:
    with ds.NatsServer(sync_always=True) as server:
        assert server.config_path is not None
        assert "sync_interval: always" in server.config_path.read_text()
        nc = await nats.connect(server.url)
        try:
            js = nc.jetstream()
            await js.add_stream(name="SYNC", subjects=["sync.>"])
            ack = await js.publish("sync.a", b"x")
            assert ack.seq == 1
        finally:
            await nc.close()


# ---- PostgreSQL ----------------------------------------------------------------------------


def test_postgres_urls(pg_server: ds.PostgresServer) -> None:
    port = pg_server.port
    assert port != 5432
    assert pg_server.url == f"postgresql+psycopg://postgres@127.0.0.1:{port}/bufstore"
    assert pg_server.libpq_url == f"postgresql://postgres@127.0.0.1:{port}/bufstore"
    assert pg_server.jdbc_url == f"jdbc:postgresql://127.0.0.1:{port}/bufstore?user=postgres"


def test_postgres_restart_kill_and_stop(pg_server: ds.PostgresServer) -> None:
    with psycopg.connect(pg_server.libpq_url, autocommit=True) as conn:
        assert conn.execute("select 1").fetchone() == (1,)
        assert conn.execute("show fsync").fetchone() == ("off",)
        assert conn.execute("show max_connections").fetchone() == ("200",)
        conn.execute("create table t (id int primary key)")
        conn.execute("insert into t values (1)")

    port, old_pid = pg_server.port, pg_server.pid
    assert old_pid is not None
    pg_server.restart()
    assert pg_server.port == port
    assert not ds.pid_alive(old_pid)
    assert pg_server.pid not in (None, old_pid)
    with psycopg.connect(pg_server.libpq_url, autocommit=True) as conn:
        conn.execute("insert into t values (2)")

    # crash: SIGKILL postmaster + children; the next start does crash recovery
    crashed = pg_server.pid
    assert crashed is not None
    children = processes.child_pids(crashed)
    assert children  # checkpointer, walwriter, ...
    pg_server.kill()
    assert not ds.pid_alive(crashed)
    assert not any(ds.pid_alive(c) for c in children)
    assert not _port_open(pg_server.host, port)
    pg_server.start()
    with psycopg.connect(pg_server.libpq_url) as conn:
        assert conn.execute("select count(*) from t").fetchone() == (2,)

    last = pg_server.pid
    pg_server.stop()
    assert not ds.pid_alive(last)
    assert pg_server.pid is None
    assert not _port_open(pg_server.host, port)
    base = pg_server.base_dir
    pg_server.close()
    assert not base.exists()


# ---- Services / session fixtures -----------------------------------------------------------


async def test_session_services_fixtures(
    request: pytest.FixtureRequest, services: ds.Services, nats_url: str, database_url: str
) -> None:
    assert request.node.get_closest_marker("integration") is not None
    assert nats_url == services.nats_url
    assert database_url.startswith("postgresql+psycopg://")
    if not os.environ.get("NATS_URL"):
        assert services.nats_managed
        assert not nats_url.endswith(":4222")
    if not os.environ.get("DATABASE_URL"):
        assert services.postgres_managed
        assert ":5432/" not in database_url
    nc = await nats.connect(nats_url)
    try:
        await nc.jetstream().account_info()
    finally:
        await nc.close()
    with psycopg.connect(services.libpq_url) as conn:
        assert conn.execute("select 1").fetchone() == (1,)


def test_containers_mode_without_docker_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    with pytest.raises(ds.DevServiceError, match="Docker engine"):
        ds.start_services(postgres=False, env={"BUFSTORE_SERVICES": "containers"})


def test_module_entry_point_prints_urls_and_cleans_up(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "buffered_store.dev.services"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=_own_env(),
    )
    urls: dict[str, str] = {}
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("#"):
                break
            key, _, value = line.strip().partition("=")
            urls[key] = value
        assert set(urls) == {"NATS_URL", "DATABASE_URL", "JDBC_URL"}
        nats_port = int(urls["NATS_URL"].rsplit(":", 1)[1])
        with psycopg.connect(ds.to_libpq_url(urls["DATABASE_URL"])) as conn:
            assert conn.execute("select 1").fetchone() == (1,)
        pg_port = int(urls["DATABASE_URL"].split(":")[-1].split("/")[0])
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    assert rc == 0
    assert not _port_open("127.0.0.1", nats_port)
    assert not _port_open("127.0.0.1", pg_port)


def _own_env() -> dict[str, str]:
    """This environment without the variables that point at existing servers."""
    drop = ("NATS_URL", "DATABASE_URL", "BUFSTORE_SERVICES")
    return {k: v for k, v in os.environ.items() if k not in drop}


def _terminate_and_check_servers_stop(command: list[str], cwd: Path | None = None) -> None:
    """Run `command`, which prints ``PIDS <pid>...`` (its servers', its children's) once
    they are up and then waits; SIGTERM it; it must end by that signal with all of them
    gone."""
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=_own_env(),
        cwd=cwd,
    )
    pids: list[int] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "PIDS " in line:
                pids = [int(p) for p in line.split("PIDS ", 1)[1].split()]
                break
        assert len(pids) >= 2, "the child never reported its servers"
        assert all(ds.pid_alive(pid) for pid in pids)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # hung in the handler: fail, leave nothing behind
            proc.kill()
            rc = proc.wait()
    left = [pid for pid in pids if ds.pid_alive(pid)]
    for pid in left:  # an orphan of a failing run: stop it by its own PID
        os.kill(pid, signal.SIGKILL)
    assert rc == -signal.SIGTERM
    assert left == [], "servers or children outlived the process that started them"


def test_sigterm_stops_the_servers_a_process_started() -> None:
    script = (
        "import time\n"
        "from buffered_store.dev.services import start_services, stop_on_sigterm\n"
        "stop_on_sigterm()\n"
        "svc = start_services()\n"
        "print('PIDS', svc.nats.pid, svc.postgres.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    _terminate_and_check_servers_stop([sys.executable, "-c", script])


def test_sigterm_while_the_registry_is_busy_still_stops_the_servers() -> None:
    """The handler runs in the main thread, possibly while that thread is inside
    `register`/`unregister` holding the registry's lock (white box: the script holds it)."""
    script = (
        "import time\n"
        "from buffered_store.dev import processes, services as ds\n"
        "ds.stop_on_sigterm()\n"
        "svc = ds.start_services()\n"
        "with processes.LIVE_LOCK:\n"
        "    print('PIDS', svc.nats.pid, svc.postgres.pid, flush=True)\n"
        "    time.sleep(600)\n"
    )
    _terminate_and_check_servers_stop([sys.executable, "-c", script])


def test_sigterm_to_the_demo_stops_its_flusher_before_its_servers(tmp_path: Path) -> None:
    """The demo's flusher process is registered with the servers: SIGTERM stops it too,
    first, while the NATS server it drains to still answers (the child writes down
    whether it did when its own SIGTERM came)."""
    seen = tmp_path / "nats-at-child-sigterm"
    child = (
        "import signal, socket, sys, time\n"
        "def stop(*_):\n"
        "    up = socket.socket().connect_ex(('127.0.0.1', int(sys.argv[1]))) == 0\n"
        "    open(sys.argv[2], 'w').write('up' if up else 'down')\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    script = (
        "import subprocess, sys, time\n"
        "from buffered_store.dev.demo import ChildProcess\n"
        "from buffered_store.dev.services import start_services, stop_on_sigterm\n"
        "stop_on_sigterm()\n"
        "svc = start_services()\n"
        "port = svc.nats_url.rsplit(':', 1)[1]\n"
        f"proc = subprocess.Popen([sys.executable, '-c', {child!r}, port, {str(seen)!r}],"
        " stdout=subprocess.PIPE)\n"
        "proc.stdout.readline()\n"
        "child = ChildProcess(proc)\n"
        "print('PIDS', svc.nats.pid, svc.postgres.pid, child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    _terminate_and_check_servers_stop([sys.executable, "-c", script])
    assert seen.read_text() == "up"


def test_sigterm_to_a_test_run_stops_its_servers(tmp_path: Path) -> None:
    """The suite's own wiring (tests/conftest.py): pytest killed by a CI time limit."""
    (tmp_path / "test_waits.py").write_text(
        "import time\n"
        "def test_waits(services):\n"
        "    print('PIDS', services.nats.pid, services.postgres.pid, flush=True)\n"
        "    time.sleep(600)\n"
    )
    root = Path(__file__).resolve().parents[2]
    _terminate_and_check_servers_stop(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-s",
            "-p",
            "tests.conftest",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            str(tmp_path / "test_waits.py"),
        ],
        cwd=root,
    )
