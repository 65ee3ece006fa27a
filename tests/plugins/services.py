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


TEST_SPARK_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
"""Java options of the Spark drivers the tests start (through ``SPARK_SUBMIT_OPTS``, which
every ``spark-submit`` honours, child processes included): the tests' queries are small
and short, and compiled by the JIT's first tier only they cost about a third less CPU
(tests/spark/test_overlay.py: 79 to 84 CPU-s without, 54 to 56 with)."""


def pytest_configure(config: pytest.Config) -> None:
    """A test run ended with SIGTERM (a CI time limit, ``timeout``) stops its servers;
    the tests' Spark drivers get `TEST_SPARK_JVM_OPTIONS` unless the caller set its own."""
    stop_on_sigterm()
    os.environ.setdefault("SPARK_SUBMIT_OPTS", TEST_SPARK_JVM_OPTIONS)


SPARK_GROUP = "spark"
"""The ``xdist_group`` of the tests using the session's Spark session (the ``spark``
fixture): in a parallel run (``make test`` runs pytest-xdist workers) one worker runs
them all, so one Spark driver JVM starts for them, not one per worker."""


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the ``xdist_group`` markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that (even indirectly) use the service fixtures get the ``integration``
    marker; tests of the Spark session get their ``xdist_group``.

    The longest work goes first: the Spark session's tests (one group), then tests marked
    ``long``, then the rest in their order. A parallel run hands out work in this order,
    so the long pieces start while the short ones fill the other workers, instead of one
    of them starting last and running alone at the end."""
    for item in items:
        if _SERVICE_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)
        if "spark" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group(SPARK_GROUP))

    def rank(item: pytest.Item) -> int:
        if item.get_closest_marker("xdist_group") is not None:
            return 0
        return 1 if item.get_closest_marker("long") is not None else 2

    items.sort(key=rank)  # stable: the order within each rank is kept


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Fail, in a parallel run, every test whose ``xdist_group`` was not applied
    (pytest-xdist marks a grouped test by suffixing its id with ``@group``, which pytest
    9.2 ignores: pytest-xdist issue 1386), rather than start a Spark session per worker
    and run slowly without a word."""
    if (
        getattr(item.config.option, "loadgroup", False)
        and item.get_closest_marker("xdist_group") is not None
        and "@" not in item.nodeid
    ):
        raise RuntimeError(
            "--dist loadgroup did not group this test: this pytest-xdist does not work "
            "with this pytest; see the pytest pin in pyproject.toml"
        )


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
