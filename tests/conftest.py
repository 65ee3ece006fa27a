"""The suite's fixtures live in plugin modules (tests/plugins/), loaded here for every
test; a folder's own conftest.py only adds what that folder alone uses.

- `tests.plugins.services`: the session's nats-server and Postgres, the markers added
  from the fixtures a test uses.
- `tests.plugins.stores`: per-test WAL names, Postgres schemas and buffered stores.
- `tests.plugins.network`: a TCP proxy a test can cut to fake an outage of a shared server.
"""

from __future__ import annotations

pytest_plugins = [
    "tests.plugins.services",
    "tests.plugins.stores",
    "tests.plugins.network",
]
