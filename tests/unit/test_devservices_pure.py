"""Pure helpers of buffered_store.dev.services (no servers started)."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from buffered_store.dev import processes
from buffered_store.dev import services as ds


def _fake_exe(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


def _fake_pg_bindir(path: Path) -> Path:
    for name in ("initdb", "pg_ctl", "postgres"):
        _fake_exe(path / name)
    return path


# ---- ports ---------------------------------------------------------------------------------


def test_pick_free_port_is_bindable() -> None:
    port = ds.pick_free_port()
    assert 1024 <= port <= 65535
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((ds.LOCALHOST, port))


def test_pick_free_ports_are_distinct() -> None:
    ports = ds.pick_free_ports(5)
    assert len(set(ports)) == 5
    with pytest.raises(ValueError, match="count"):
        ds.pick_free_ports(0)


# ---- URLs ----------------------------------------------------------------------------------


def test_nats_url() -> None:
    assert ds.nats_url("127.0.0.1", 4333) == "nats://127.0.0.1:4333"


def test_postgres_url_variants() -> None:
    assert (
        ds.postgres_url("127.0.0.1", 5999)
        == "postgresql+psycopg://postgres@127.0.0.1:5999/bufstore"
    )
    assert (
        ds.postgres_url("h", 1, user="u", password="p@ss/word", database="db", driver=None)
        == "postgresql://u:p%40ss%2Fword@h:1/db"
    )


def test_jdbc_url() -> None:
    assert (
        ds.jdbc_url("127.0.0.1", 5999) == "jdbc:postgresql://127.0.0.1:5999/bufstore?user=postgres"
    )
    assert ds.jdbc_url("h", 1, database="d", user="u", password="p w") == (
        "jdbc:postgresql://h:1/d?user=u&password=p+w"
    )


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("postgresql://u@h:1/d", "postgresql+psycopg://u@h:1/d"),
        ("postgres://u@h:1/d", "postgresql+psycopg://u@h:1/d"),
        ("postgresql+psycopg://u@h:1/d", "postgresql+psycopg://u@h:1/d"),
        ("postgresql+asyncpg://u@h/d", "postgresql+asyncpg://u@h/d"),
    ],
)
def test_to_sqlalchemy_url(given: str, expected: str) -> None:
    assert ds.to_sqlalchemy_url(given) == expected


def test_to_libpq_url_and_errors() -> None:
    assert ds.to_libpq_url("postgresql+psycopg://u:p@h:1/d?x=1") == "postgresql://u:p@h:1/d?x=1"
    with pytest.raises(ValueError, match="PostgreSQL"):
        ds.to_libpq_url("mysql://h/d")
    with pytest.raises(ValueError, match="PostgreSQL"):
        ds.to_sqlalchemy_url("nats://h:1")


def test_jdbc_url_from_url() -> None:
    assert ds.jdbc_url_from_url("postgresql+psycopg://postgres@127.0.0.1:5432/test") == (
        "jdbc:postgresql://127.0.0.1:5432/test?user=postgres"
    )
    assert ds.jdbc_url_from_url("postgres://a%40b:s%3Ac@db.example/x?sslmode=require") == (
        "jdbc:postgresql://db.example:5432/x?user=a%40b&password=s%3Ac&sslmode=require"
    )


# ---- command lines -------------------------------------------------------------------------


def test_nats_config_text() -> None:
    assert ds.nats_config_text(sync_always=False) == ""
    text = ds.nats_config_text(sync_always=True)
    assert "sync_interval: always" in text
    assert "store_dir" not in text  # -sd on the command line; both at once is rejected


def test_build_nats_command() -> None:
    cmd = ds.build_nats_command("/bin/nats-server", host="127.0.0.1", port=1, store_dir="/s")
    assert cmd == ["/bin/nats-server", "-js", "-sd", "/s", "-a", "127.0.0.1", "-p", "1"]
    cmd = ds.build_nats_command(
        "n", host="h", port=2, store_dir="/s", monitor_port=3, config_file="/c.conf"
    )
    assert cmd[:3] == ["n", "-c", "/c.conf"]
    assert cmd[-2:] == ["-m", "3"]


def test_build_postgres_options() -> None:
    opts = ds.build_postgres_options(host="127.0.0.1", port=5, socket_dir="/tmp/x y")
    joined = shlex.join(opts)
    assert shlex.split(joined) == opts
    assert opts[:4] == ["-p", "5", "-k", "/tmp/x y"]
    for setting in (
        "listen_addresses=127.0.0.1",
        "fsync=off",
        "synchronous_commit=on",
        "max_connections=200",
    ):
        assert setting in opts
    opts = ds.build_postgres_options(
        host="h", port=5, socket_dir="/s", settings={"max_connections": "50", "work_mem": "8MB"}
    )
    assert "max_connections=50" in opts
    assert "max_connections=200" not in opts
    assert "work_mem=8MB" in opts


# ---- binary discovery ----------------------------------------------------------------------


def test_find_nats_server_order(tmp_path: Path) -> None:
    explicit = _fake_exe(tmp_path / "explicit" / "nats-server")
    venv_python = tmp_path / "venv" / "bin" / "python"
    beside = _fake_exe(venv_python.parent / "nats-server")
    on_path = str(_fake_exe(tmp_path / "path" / "nats-server"))

    def which(name: str) -> str | None:
        return on_path

    def no_which(name: str) -> str | None:
        return None

    env = {"NATS_SERVER": str(explicit)}
    py = str(venv_python)
    assert ds.find_nats_server(env, python_executable=py, which=which) == explicit
    assert ds.find_nats_server({}, python_executable=py, which=which) == beside
    other_py = str(tmp_path / "other" / "python")
    assert ds.find_nats_server({}, python_executable=other_py, which=which) == Path(on_path)
    with pytest.raises(ds.DevServiceError, match="nats-server not found"):
        ds.find_nats_server({}, python_executable=other_py, which=no_which)
    with pytest.raises(ds.DevServiceError, match="NATS_SERVER"):
        ds.find_nats_server({"NATS_SERVER": str(tmp_path / "missing")}, which=which)


def test_pg_version_key() -> None:
    assert ds.pg_version_key("/usr/lib/postgresql/15/bin") == (15,)
    assert ds.pg_version_key("/usr/lib/postgresql/9.6/bin") == (9, 6)
    assert ds.pg_version_key("/opt/pg/bin") == (0,)
    assert sorted(["/x/9.6/bin", "/x/15/bin", "/x/10/bin"], key=ds.pg_version_key) == [
        "/x/9.6/bin",
        "/x/10/bin",
        "/x/15/bin",
    ]


def test_find_pg_bindir_order(tmp_path: Path) -> None:
    def no_which(name: str) -> str | None:
        return None

    explicit = _fake_pg_bindir(tmp_path / "explicit")
    _fake_pg_bindir(tmp_path / "lib" / "postgresql" / "9.6" / "bin")
    newest = _fake_pg_bindir(tmp_path / "lib" / "postgresql" / "16" / "bin")
    (tmp_path / "lib" / "postgresql" / "17" / "bin").mkdir(parents=True)  # no programs
    globs = [str(tmp_path / "lib" / "postgresql" / "*" / "bin")]

    def find(env: dict[str, str]) -> Path:
        return ds.find_pg_bindir(env, system_globs=globs, packages=(), which=no_which)

    assert find({"PG_BIN": str(explicit)}) == explicit
    assert find({}) == newest
    with pytest.raises(ds.DevServiceError, match="PG_BIN"):
        find({"PG_BIN": str(tmp_path / "lib")})
    with pytest.raises(ds.DevServiceError, match="binaries not found"):
        ds.find_pg_bindir({}, system_globs=[], packages=(), which=no_which)


def test_find_pg_bindir_initdb_on_path(tmp_path: Path) -> None:
    bindir = _fake_pg_bindir(tmp_path / "pg" / "bin")
    link = tmp_path / "usr-local-bin" / "initdb"
    link.parent.mkdir()
    link.symlink_to(bindir / "initdb")

    def which(name: str) -> str | None:
        return str(link) if name == "initdb" else None

    assert ds.find_pg_bindir({}, system_globs=[], packages=(), which=which) == bindir


def test_services_mode() -> None:
    assert ds.services_mode({}) == "local"
    assert ds.services_mode({"BUFSTORE_SERVICES": "local"}) == "local"
    assert ds.services_mode({"BUFSTORE_SERVICES": " Containers "}) == "containers"
    with pytest.raises(ds.DevServiceError, match="BUFSTORE_SERVICES"):
        ds.services_mode({"BUFSTORE_SERVICES": "docker-compose"})


# ---- process / file helpers ----------------------------------------------------------------


def test_tail_text(tmp_path: Path) -> None:
    log = tmp_path / "log"
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    assert ds.tail_text(log, max_lines=2) == "line 98\nline 99"
    offset = len("".join(f"line {i}\n" for i in range(99)))
    assert ds.tail_text(log, offset=offset) == "line 99"
    assert ds.tail_text(tmp_path / "missing") == ""


def test_pid_alive() -> None:
    assert ds.pid_alive(os.getpid())
    assert not ds.pid_alive(None)
    assert not ds.pid_alive(0)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert not ds.pid_alive(proc.pid)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc (Linux)")
def test_pid_alive_treats_zombie_as_gone() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        for _ in range(500):  # exited but not reaped yet: a zombie
            if processes.proc_state(proc.pid) == "Z":
                break
            time.sleep(0.01)
        assert not ds.pid_alive(proc.pid)
    finally:
        proc.wait()


# ---- external services (no processes) ------------------------------------------------------


def test_start_services_uses_env_urls() -> None:
    env = {
        "NATS_URL": "nats://10.0.0.1:4222",
        "DATABASE_URL": "postgresql://u@10.0.0.2:5432/test",
    }
    with ds.start_services(env=env) as svc:
        assert svc.nats_url == "nats://10.0.0.1:4222"
        assert svc.database_url == "postgresql+psycopg://u@10.0.0.2:5432/test"
        assert svc.libpq_url == "postgresql://u@10.0.0.2:5432/test"
        assert svc.jdbc_url == "jdbc:postgresql://10.0.0.2:5432/test?user=u"
        assert not svc.nats_managed
        assert not svc.postgres_managed
        assert svc.env() == {
            "NATS_URL": "nats://10.0.0.1:4222",
            "DATABASE_URL": "postgresql+psycopg://u@10.0.0.2:5432/test",
        }
        assert svc.nats is not None
        assert svc.postgres is not None
        with pytest.raises(ds.ServiceNotManagedError):
            svc.nats.restart()
        with pytest.raises(ds.ServiceNotManagedError):
            svc.postgres.kill()


def test_services_without_postgres() -> None:
    with ds.start_services(postgres=False, env={"NATS_URL": "nats://h:1"}) as svc:
        assert svc.postgres is None
        assert not svc.postgres_managed
        with pytest.raises(ds.DevServiceError, match="Postgres was not requested"):
            _ = svc.database_url


BEFORE_THE_SPLIT = [
    "ContainerNats",
    "ContainerPostgres",
    "DEFAULT_DATABASE",
    "DEFAULT_PG_USER",
    "DevServiceError",
    "ExternalNats",
    "ExternalPostgres",
    "LOCALHOST",
    "NATS_CONTAINER_IMAGE",
    "NatsServer",
    "NatsService",
    "POSTGRES_CONTAINER_IMAGE",
    "PostgresServer",
    "PostgresService",
    "ServerContext",
    "ServiceHandle",
    "ServiceNotManagedError",
    "ServiceStartError",
    "Services",
    "build_nats_command",
    "build_postgres_options",
    "find_nats_server",
    "find_pg_bindir",
    "http_ok",
    "jdbc_url",
    "jdbc_url_from_url",
    "main",
    "ms_since",
    "nats_config_text",
    "nats_info_probe",
    "nats_url",
    "pg_version_key",
    "pick_free_port",
    "pick_free_ports",
    "pid_alive",
    "postgres_url",
    "register",
    "running_services",
    "say",
    "services_mode",
    "start_services",
    "stop_on_sigterm",
    "tail_text",
    "to_libpq_url",
    "to_sqlalchemy_url",
    "unregister",
]


def test_every_public_name_of_services_before_the_split_is_still_exported() -> None:
    """`buffered_store.dev.services` was one module; code importing from it keeps working."""
    assert sorted(set(BEFORE_THE_SPLIT) - set(ds.__all__)) == []
    for name in BEFORE_THE_SPLIT:
        assert getattr(ds, name) is not None
