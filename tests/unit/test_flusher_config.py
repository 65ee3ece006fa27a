"""`FlusherConfig`: validation, environment variables, copying a store's settings."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from buffered_store.config import BufferedStoreConfig, EngineConfig
from buffered_store.errors import ConfigError
from flusher import FlusherConfig


def test_defaults_are_valid_and_extend_the_engine_settings() -> None:
    config = FlusherConfig()
    assert isinstance(config, EngineConfig)
    assert config.consumer_name == "thread-flusher"
    assert config.db_retry_initial_s <= config.db_retry_max_s
    assert config.fetch_timeout_s <= config.ack_wait_s


@pytest.mark.parametrize(
    "changes",
    [
        {"db_retry_max_s": 0},
        {"db_retry_initial_s": -1.0},
        {"fetch_timeout_s": 0.001},
        {"max_rounds": 0},
        {"nak_delay_initial_s": 10.0, "nak_delay_max_s": 1.0},
        {"db_retry_initial_s": 6.0, "db_retry_max_s": 5.0},
        {"nats_retry_initial_s": 2.0, "nats_retry_max_s": 1.0},
        {"drain_timeout_s": 0},
        {"requeue_delay_s": True},
        {"flush_interval_s": 30.0, "ack_wait_s": 30.0},
        {"poison_attempts": 0},
        {"stream_name": "bad.name"},
    ],
)
def test_invalid_values_are_rejected(changes: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        FlusherConfig(**changes)


def test_from_env_reads_flusher_knobs_and_overrides_win() -> None:
    env = {
        "BUFSTORE_DB_RETRY_MAX_S": "2.5",
        "BUFSTORE_MAX_ROUNDS": "7",
        "BUFSTORE_CONSUMER_NAME": "from-env",
        "BUFSTORE_FLUSH_INTERVAL_S": "0.2",
    }
    config = FlusherConfig.from_env(env, consumer_name="explicit")
    assert config.db_retry_max_s == 2.5
    assert config.max_rounds == 7
    assert config.flush_interval_s == 0.2
    assert config.consumer_name == "explicit"


def test_from_store_config_copies_every_shared_field() -> None:
    store = BufferedStoreConfig(
        nats_url="nats://example:4222",
        stream_name="WAL",
        hot_bucket="hot",
        quarantine_bucket="quar",
        consumer_name="drain",
        flush_interval_s=0.1,
        poison_attempts=9,
        drain_timeout_s=1.0,  # a store field of the same name is not shared
    )
    config = FlusherConfig.from_store_config(store, db_retry_max_s=1.0)
    for item in dataclasses.fields(EngineConfig):
        assert getattr(config, item.name) == getattr(store, item.name)
    assert config.db_retry_max_s == 1.0
    assert config.drain_timeout_s == FlusherConfig().drain_timeout_s
