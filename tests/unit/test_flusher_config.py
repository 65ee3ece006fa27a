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


def test_langgraph_flusher_takes_every_stream_setting_from_bufstore_lg(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 24 item 6: ``bufstore flusher --front-end langgraph`` expects the stream and
    consumer its savers create from ``BUFSTORE_LG_*`` (replicas 3, as the durability
    docs recommend, included), never the thread-run store's ``BUFSTORE_*`` settings; its
    own knobs read ``BUFSTORE_LG_*`` first, then ``BUFSTORE_*``."""
    from buffered_store.langgraph import LangGraphConfig
    from flusher.cli import langgraph_flusher_config

    env = {
        "BUFSTORE_LG_MAX_AGE_S": "3600",
        "BUFSTORE_LG_REPLICAS": "3",
        "BUFSTORE_LG_DUPLICATE_WINDOW_S": "60",
        "BUFSTORE_LG_ACK_WAIT_S": "20",
        "BUFSTORE_MAX_AGE_S": "86400",  # the thread-run store's: not the saver's stream
        "BUFSTORE_REPLICAS": "1",
        "BUFSTORE_FETCH_TIMEOUT_S": "0.25",
        "BUFSTORE_LG_DB_RETRY_MAX_S": "2",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    saver = LangGraphConfig.from_env()
    config = langgraph_flusher_config(saver, flush_batch_size=64, consumer_name=None)
    for name in ("stream_name", "consumer_name", "quarantine_bucket", "hot_bucket"):
        assert getattr(config, name) == getattr(saver, name)
    assert (config.max_age_s, config.replicas) == (3600.0, 3)
    assert (config.duplicate_window_s, config.ack_wait_s) == (60.0, 20.0)
    assert (config.fetch_timeout_s, config.db_retry_max_s) == (0.25, 2.0)
    assert config.flush_batch_size == 64
