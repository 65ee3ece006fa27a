"""NATS and PostgreSQL in containers (``BUFSTORE_SERVICES=containers``), started with
testcontainers on a fixed host port so that ``restart()`` keeps the URL; needs a reachable
Docker engine."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import time
from typing import Any

from buffered_store.dev.common import (
    LOCALHOST,
    DevServiceError,
    ServerContext,
    ServiceStartError,
    ms_since,
    pick_free_port,
    say,
)
from buffered_store.dev.nats_server import nats_info_probe, nats_url
from buffered_store.dev.postgres_server import DEFAULT_PG_USER, jdbc_url, pg_ready, postgres_url
from buffered_store.dev.processes import register, unregister
from buffered_store.stores.urls import (
    DEFAULT_DATABASE,
)

NATS_CONTAINER_IMAGE = "nats:2.10"
POSTGRES_CONTAINER_IMAGE = "postgres:16-alpine"


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
        return pg_ready(self.libpq_url) is None

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
