"""Session-wide services for the whole suite (a pytest plugin, see tests/conftest.py).

The first test needing ``services``/``nats_url``/``database_url`` starts a throwaway
nats-server and PostgreSQL cluster (or uses NATS_URL / DATABASE_URL, or containers with
BUFSTORE_SERVICES=containers; see buffered_store.dev.services). If they cannot start, the
tests error out loudly: they are never skipped, in CI or locally.

``BUFSTORE_TEST_NO_SERVICES=1`` (set by ``make test-fast``) forbids starting them: a test
of the fast run that needs a server then errors, naming itself, instead of slowing the
fast run down.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from buffered_store.dev.cluster import NatsCluster
from buffered_store.dev.services import (
    DevServiceError,
    Services,
    start_services,
    stop_on_sigterm,
)

_SERVICE_FIXTURES = frozenset({"services", "nats_url", "database_url", "nats_cluster"})


def pytest_configure(config: pytest.Config) -> None:
    """A test run ended with SIGTERM (a CI time limit, ``timeout``) stops its servers."""
    stop_on_sigterm()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that (even indirectly) use the service fixtures get the ``integration`` marker."""
    for item in items:
        if _SERVICE_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)


NO_SERVICES_ENV = "BUFSTORE_TEST_NO_SERVICES"


@pytest.fixture(scope="session")
def services() -> Iterator[Services]:
    if os.environ.get(NO_SERVICES_ENV, "") not in ("", "0"):
        raise RuntimeError(
            f"{NO_SERVICES_ENV} is set (make test-fast): this test needs NATS or Postgres; "
            "mark it `integration` or move it out of the fast run"
        )
    try:
        svc = start_services()
    except DevServiceError as exc:
        # Fail, never skip: a missing service must not turn the suite green.
        raise RuntimeError(f"test services could not start: {exc}") from exc
    try:
        yield svc
    finally:
        svc.close()


@pytest.fixture(scope="session")
def nats_url(services: Services) -> str:
    return services.nats_url


@pytest.fixture(scope="session")
def database_url(services: Services) -> str:
    """SQLAlchemy URL (``postgresql+psycopg://...``)."""
    return services.database_url


@pytest.fixture
def nats_cluster() -> Iterator[NatsCluster]:
    """A fresh three-node JetStream cluster of this test alone (it may kill nodes)."""
    try:
        cluster = NatsCluster(size=3)
        cluster.start()
    except DevServiceError as exc:
        raise RuntimeError(f"the NATS cluster could not start: {exc}") from exc
    try:
        yield cluster
    finally:
        cluster.close()
