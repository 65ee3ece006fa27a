"""A cuttable link to the session's servers (a pytest plugin, see tests/conftest.py).

Outage tests point their clients at a `CuttableProxy` in front of the shared nats-server
or Postgres and cut that link, instead of stopping the server every other test uses: the
outage is the test's alone, it works against external servers (NATS_URL, DATABASE_URL)
too, and nothing has to be restarted afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from buffered_store.dev.proxy import CuttableProxy

LinkFactory = Callable[[str], CuttableProxy]


@pytest.fixture
def cuttable_link() -> Iterator[LinkFactory]:
    """``cuttable_link(url)``: a started proxy in front of the server `url` names (its
    `via(url)` reaches that server through it); every one is closed after the test."""
    made: list[CuttableProxy] = []

    def open_link(url: str) -> CuttableProxy:
        proxy = CuttableProxy.in_front_of(url).start()
        made.append(proxy)
        return proxy

    yield open_link
    for proxy in made:
        proxy.close()


@pytest.fixture
def postgres_link(database_url: str, cuttable_link: LinkFactory) -> CuttableProxy:
    """A cuttable link to the session's Postgres: ``postgres_link.via(database_url)``."""
    return cuttable_link(database_url)


@pytest.fixture
def nats_link(nats_url: str, cuttable_link: LinkFactory) -> CuttableProxy:
    """A cuttable link to the session's nats-server: ``nats_link.via(nats_url)``."""
    return cuttable_link(nats_url)
