"""BufferedStoreConfig / EngineConfig: validation, environment parsing, docs coverage."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from buffered_store.config import (
    BufferedStoreConfig,
    ConnectionSettings,
    EngineConfig,
    ReadConsistency,
)
from buffered_store.errors import ConfigError

DOCS = Path(__file__).resolve().parents[2] / "docs" / "reference" / "configuration.md"


def test_defaults_match_design_names() -> None:
    config = BufferedStoreConfig()
    assert config.stream_name == "THREADLOG"
    assert config.hot_bucket == "thread-hot"
    assert config.consumer_name == "thread-flusher"
    assert config.read_consistency is ReadConsistency.READ_YOUR_WRITES
    assert config.flush_interval_s == 0.5


def test_from_env_parses_every_type_and_overrides_win() -> None:
    env = {
        "BUFSTORE_NATS_URL": "nats://a:1, nats://b:2",
        "BUFSTORE_FLUSH_INTERVAL_S": "0.25",
        "BUFSTORE_FLUSH_BATCH_SIZE": "77",
        "BUFSTORE_DRAIN_ON_CLOSE": "off",
        "BUFSTORE_READ_CONSISTENCY": "STRONG",
        "BUFSTORE_STREAM_NAME": "FROMENV",
    }
    config = BufferedStoreConfig.from_env(env, stream_name="EXPLICIT")
    assert config.servers == ["nats://a:1", "nats://b:2"]
    assert config.flush_interval_s == 0.25
    assert config.flush_batch_size == 77
    assert config.drain_on_close is False
    assert config.read_consistency is ReadConsistency.STRONG
    assert config.stream_name == "EXPLICIT"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"BUFSTORE_FLUSH_INTERVAL_S": "soon"}, "BUFSTORE_FLUSH_INTERVAL_S"),
        ({"BUFSTORE_DRAIN_ON_CLOSE": "maybe"}, "BUFSTORE_DRAIN_ON_CLOSE"),
        ({"BUFSTORE_READ_CONSISTENCY": "linearizable"}, "READ_CONSISTENCY"),
    ],
)
def test_from_env_rejects_bad_values_with_the_variable_name(
    env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        BufferedStoreConfig.from_env(env)


@pytest.mark.parametrize(
    "changes",
    [
        {"stream_name": "THREAD.LOG"},
        {"stream_name": "THREAD-LOG"},
        {"hot_bucket": "hot bucket"},
        {"consumer_name": ""},
        {"nats_url": ""},
        {"flush_interval_s": 0},
        {"ack_wait_s": -1.0},
        {"flush_batch_size": 0},
        {"replicas": 0},
        {"poison_attempts": 0},
        {"duplicate_window_s": 10.0, "max_age_s": 5.0},
        {"recent_window": 0},
        {"read_consistency": "sometimes"},
        {"read_from": "follower"},
    ],
)
def test_invalid_values_are_rejected_at_construction(changes: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        BufferedStoreConfig(**changes)


@pytest.mark.parametrize(
    ("read_from", "replicas", "leader_reads"),
    [
        ("auto", 1, False),  # one server: it is the leader, direct gets are as fresh
        ("auto", 3, True),  # replicas may lag the leader: read-your-writes needs it
        ("leader", 1, True),
        ("any", 3, False),  # an explicit opt-out, accepting stale reads on a cluster
    ],
)
def test_reads_go_to_the_leader_when_replicas_may_lag(
    read_from: str, replicas: int, leader_reads: bool
) -> None:
    config = BufferedStoreConfig(read_from=read_from, replicas=replicas)
    assert config.leader_reads is leader_reads


def test_read_from_comes_from_the_environment() -> None:
    env = {"BUFSTORE_READ_FROM": "any", "BUFSTORE_REPLICAS": "3"}
    assert BufferedStoreConfig.from_env(env).leader_reads is False


def test_config_is_frozen_and_replace_validates() -> None:
    config = BufferedStoreConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.stream_name = "OTHER"
    assert config.replace(stream_name="OTHER").stream_name == "OTHER"
    with pytest.raises(ConfigError):
        config.replace(flush_interval_s=-1)


def test_credentials_path_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        EngineConfig(credentials=str(tmp_path / "missing.creds")).credentials_file()
    creds = tmp_path / "user.creds"
    creds.write_text("x")
    assert EngineConfig(credentials=str(creds)).credentials_file() == str(creds)
    raw = "-----BEGIN NATS USER JWT-----\nabc\n------END NATS USER JWT------\n"
    assert EngineConfig(credentials=raw).credentials_file() is None
    assert EngineConfig().credentials_file() is None


def test_every_setting_is_documented_with_its_variable() -> None:
    from flusher import FlusherConfig

    text = DOCS.read_text()
    names = {*BufferedStoreConfig.knob_names(), *FlusherConfig.knob_names()}
    for name in names:
        assert f"`{name}`" in text, f"{name} missing from {DOCS.name}"
        assert f"BUFSTORE_{name.upper()}" in text


def test_raw_credentials_reach_nats_as_the_file_contents(tmp_path: Path) -> None:
    from buffered_store.nats.connection import credentials_option

    raw = "-----BEGIN NATS USER JWT-----\nabc\n------END NATS USER JWT------\n"
    assert str(credentials_option(ConnectionSettings(credentials=raw))) == raw
    creds = tmp_path / "user.creds"
    creds.write_text("x")
    assert credentials_option(ConnectionSettings(credentials=str(creds))) == str(creds)
    assert credentials_option(ConnectionSettings()) is None
