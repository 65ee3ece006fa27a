"""Fixtures of the chaos tests: a fresh NATS cluster per test (tests/conftest.py), the
Postgres schema fixtures of the integration tests, and the ``chaos`` marker."""

from __future__ import annotations

import os

import pytest

from tests.integration.conftest import open_postgres, schema_name

__all__ = ["open_postgres", "schema_name"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test here kills servers: mark it ``chaos``."""
    for item in items:
        if "tests/chaos/" in str(item.path).replace(os.sep, "/"):
            item.add_marker(pytest.mark.chaos)
