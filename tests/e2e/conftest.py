"""The end-to-end tests' own hook: every test here starts processes. Their fixtures (unique
WAL names, fresh Postgres schemas, stores) are the suite's plugins (tests/conftest.py);
`tests.e2e.children.child_env` hands them to child processes."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test here starts processes: mark it ``e2e``."""
    for item in items:
        if "tests/e2e/" in str(item.path).replace(os.sep, "/"):
            item.add_marker(pytest.mark.e2e)
