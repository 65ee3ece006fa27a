"""Fixtures of the end-to-end tests: the integration fixtures (unique WAL names, fresh
Postgres schema) plus the environment that hands them to child processes."""

from __future__ import annotations

import os

import pytest

from buffered_store.config import BufferedStoreConfig
from tests.integration.conftest import (
    make_config,
    open_postgres,
    open_store,
    schema_name,
)

__all__ = ["child_env", "make_config", "open_postgres", "open_store", "schema_name"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test here starts processes: mark it ``e2e``."""
    for item in items:
        if "tests/e2e/" in str(item.path).replace(os.sep, "/"):
            item.add_marker(pytest.mark.e2e)


def child_env(
    config: BufferedStoreConfig, database_url: str, schema: str, **extra: str
) -> dict[str, str]:
    """Environment of a child process using the same WAL objects and Postgres schema."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUFSTORE_")}
    env.update(
        BUFSTORE_NATS_URL=config.nats_url,
        BUFSTORE_STREAM_NAME=config.stream_name,
        BUFSTORE_HOT_BUCKET=config.hot_bucket,
        BUFSTORE_QUARANTINE_BUCKET=config.quarantine_bucket,
        BUFSTORE_CONSUMER_NAME=config.consumer_name,
        BUFSTORE_TEST_SCHEMA=schema,
        DATABASE_URL=database_url,
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env
