"""A Postgres that accepts only TLS connections: `sslmode` and `sslrootcert` in the
database URL reach libpq from the store, the buffered store's flush and `bufstore health`.

The cluster is a throwaway one of this module (initdb from the machine's PostgreSQL
binaries), with a server certificate signed by a CA made with openssl in the test and a
pg_hba.conf that rejects every connection without TLS.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from buffered_store.config import BufferedStoreConfig
from buffered_store.dev.services import PostgresServer
from buffered_store.errors import StoreError
from buffered_store.stores.postgres import PostgresThreadRunStore
from buffered_store.testing import make_run
from buffered_store.threadrun.store import BufferedThreadRunStore
from tests.integration.access_servers import Certs, make_certs

BUFSTORE = str(Path(sys.executable).with_name("bufstore"))
HBA = (
    "local all all trust\nhostssl all all 127.0.0.1/32 trust\nhostnossl all all 0.0.0.0/0 reject\n"
)


@pytest.fixture(scope="module")
def tls_postgres(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[PostgresServer, Certs]]:
    certs = make_certs(tmp_path_factory.mktemp("pg-certs"))
    server = PostgresServer()
    # In the cluster's own folder: the postgres user can reach it (pytest's is root's).
    server_files = server.base_dir / "tls"
    server_files.mkdir()
    cert, key, hba = server_files / "server.pem", server_files / "server.key", server_files / "hba"
    shutil.copy(certs.server_cert, cert)
    shutil.copy(certs.server_key, key)
    hba.write_text(HBA)
    key.chmod(0o600)
    if os.geteuid() == 0:  # the server runs as postgres, which must own its key
        owner = pwd.getpwnam("postgres")
        for path in (server_files, cert, key, hba):
            os.chown(path, owner.pw_uid, owner.pw_gid)
    server.settings.update(
        {"ssl": "on", "ssl_cert_file": str(cert), "ssl_key_file": str(key), "hba_file": str(hba)}
    )
    try:
        server.start()
        yield server, certs
    finally:
        server.close()


def tls_url(server: PostgresServer, query: str) -> str:
    return f"{server.url}?{query}"


async def test_the_store_connects_with_verified_tls_and_plain_connections_are_refused(
    tls_postgres: tuple[PostgresServer, Certs], config: BufferedStoreConfig
) -> None:
    server, certs = tls_postgres
    url = tls_url(server, f"sslmode=verify-full&sslrootcert={certs.ca}")
    inner = await PostgresThreadRunStore.connect(url, migrate=True)
    try:
        async with BufferedThreadRunStore.connect(inner, config) as store:
            await store.checkpoint("t1", [{"role": "user", "content": "hi"}], make_run("t1"))
            assert await store.force_flush("t1") == 1
        assert await inner.load_messages("t1") == [{"role": "user", "content": "hi"}]
    finally:
        await inner.close()
    with pytest.raises(StoreError, match="no encryption"):  # pg_hba rejects plain text
        await PostgresThreadRunStore.connect(tls_url(server, "sslmode=disable"))
    with pytest.raises(StoreError, match="certificate verify failed"):  # another CA
        await PostgresThreadRunStore.connect(
            tls_url(server, f"sslmode=verify-full&sslrootcert={certs.other_ca}")
        )


async def test_health_checks_postgres_over_tls(
    tls_postgres: tuple[PostgresServer, Certs], nats_url: str
) -> None:
    server, certs = tls_postgres
    env = {
        **{k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ},
        "BUFSTORE_NATS_URL": nats_url,
    }

    def health(query: str) -> str:
        done = subprocess.run(
            [BUFSTORE, "health", "--database-url", tls_url(server, query)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        return next(line for line in done.stdout.splitlines() if "postgres" in line)

    verified = await asyncio.to_thread(health, f"sslmode=verify-full&sslrootcert={certs.ca}")
    assert verified.startswith("OK"), verified
    plain = await asyncio.to_thread(health, "sslmode=disable")
    assert plain.startswith("FAIL"), plain
