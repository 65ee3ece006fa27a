"""The environment handed to the child processes of end-to-end and chaos tests."""

from __future__ import annotations

import os

from buffered_store.config import BufferedStoreConfig


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
