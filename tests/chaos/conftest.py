"""The chaos tests' own hook, the ``chaos`` marker. Their fixtures (a fresh NATS cluster
per test, Postgres schemas) are the suite's plugins (tests/conftest.py)."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test here kills servers: mark it ``chaos``."""
    for item in items:
        if "tests/chaos/" in str(item.path).replace(os.sep, "/"):
            item.add_marker(pytest.mark.chaos)
