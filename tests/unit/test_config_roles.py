"""The configurations are made of role settings, and every keyword and attribute of the
flat configurations of earlier versions still works and means the same; the
configuration reference (docs/reference/configuration.md) lists each role's fields with
their variables and defaults."""

from __future__ import annotations

import dataclasses
import pickle
import re
from enum import Enum
from pathlib import Path
from typing import Any, get_type_hints

import pytest

from buffered_store.config import (
    BufferedStoreConfig,
    Composed,
    ConnectionSettings,
    EngineConfig,
    FlushPolicy,
    ReadConsistency,
    Role,
    ThreadRunSettings,
    WalLayout,
    WriterConfig,
    WriterSettings,
)
from buffered_store.langgraph.config import LangGraphConfig, LangGraphSettings
from flusher.config import FlusherConfig, FlusherSettings

DOCS = Path(__file__).resolve().parents[2] / "docs" / "reference" / "configuration.md"

ENGINE = {
    "nats_url": "nats://127.0.0.1:4222",
    "credentials": None,
    "tls_ca_file": None,
    "tls_cert_file": None,
    "tls_key_file": None,
    "connect_timeout_s": 10.0,
    "stream_name": "THREADLOG",
    "hot_bucket": "thread-hot",
    "quarantine_bucket": "thread-quarantine",
    "consumer_name": "thread-flusher",
    "max_age_s": None,
    "retain_flushed_s": 300.0,
    "wal_max_bytes": None,
    "duplicate_window_s": 120.0,
    "replicas": 1,
    "read_from": "auto",
    "flush_interval_s": 0.5,
    "flush_batch_size": 1024,
    "flush_batch_bytes": 64 * 1024 * 1024,
    "ack_wait_s": 30.0,
    "max_ack_pending": 20000,
    "request_timeout_s": 2.0,
    "poison_attempts": 5,
}
WRITER = {
    "read_consistency": ReadConsistency.READ_YOUR_WRITES,
    "checkpoint_timeout_s": 10.0,
    "drain_on_close": True,
    "drain_timeout_s": 10.0,
    "recent_window": 64,
    "cursor_cache_threads": 4096,
    "entry_cache_bytes": 33554432,
    "cursor_cache_bytes": 67108864,
}
THREADRUN = {"check_snapshots": False, "run_claim_grace_s": 300.0, "hot_linger_s": None}
FLUSHER = {
    "fetch_timeout_s": 0.5,
    "max_rounds": 4,
    "db_retry_initial_s": 0.1,
    "db_retry_max_s": 5.0,
    "nak_delay_initial_s": 0.5,
    "nak_delay_max_s": 30.0,
    "requeue_delay_s": 0.05,
    "nats_retry_initial_s": 0.1,
    "nats_retry_max_s": 5.0,
    "drain_timeout_s": 30.0,
    "hot_idle_s": 604800.0,
    "trim_interval_s": 5.0,
}
LANGGRAPH = {
    "database_url": "postgresql://127.0.0.1:5432/postgres",
    "pool_min_size": 1,
    "pool_max_size": 8,
    "db_timeout_s": 2.0,
    "owner": None,
    "flush_each_write": False,
    "write_linger_s": 0.002,
    "hot_linger_s": 0.5,
    "max_inflight_writes": 64,
    "check_deltas": False,
    "wal_format": 2,
}
LG_NAMES = {
    "stream_name": "LGWAL",
    "hot_bucket": "lg-hot",
    "quarantine_bucket": "lg-quarantine",
    "consumer_name": "lg-flusher",
}
BEFORE: dict[type[Composed], dict[str, Any]] = {
    EngineConfig: ENGINE,
    BufferedStoreConfig: {**ENGINE, **WRITER, **THREADRUN},
    FlusherConfig: {**ENGINE, **FLUSHER},
    LangGraphConfig: {**ENGINE, **LG_NAMES, **WRITER, **LANGGRAPH},
}
"""Every keyword the flat configurations took before they were composed by role, with
its default then (LangGraphConfig's thread-run keywords are checked apart)."""

OTHER: dict[str, Any] = {
    "nats_url": "nats://other:4222",
    "credentials": "-----BEGIN NATS USER JWT-----\nx",
    "tls_ca_file": "/etc/ca.pem",
    "tls_cert_file": "/etc/client.pem",
    "read_from": "leader",
    "stream_name": "OTHER",
    "hot_bucket": "other-hot",
    "quarantine_bucket": "other-q",
    "consumer_name": "other-c",
    "max_age_s": 600.0,
    "wal_max_bytes": 4096,
    "read_consistency": ReadConsistency.STRONG,
    "database_url": "postgresql://db.example/app",
    "owner": "me",
    "wal_format": 1,
    "hot_linger_s": 0.25,
}
NEEDS = {"tls_key_file": {"tls_cert_file": "/etc/client.pem"}}


def other(name: str, default: Any) -> Any:
    """A valid value of `name` other than its default."""
    if name in OTHER:
        return OTHER[name]
    if name == "tls_key_file":
        return "/etc/client.key"
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    assert isinstance(default, float), name
    return default * 2


def as_env(value: Any) -> str:
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


CASES = [(cls, name) for cls, names in BEFORE.items() for name in names]


@pytest.mark.parametrize(("cls", "name"), CASES, ids=[f"{c.__name__}.{n}" for c, n in CASES])
def test_every_keyword_and_attribute_of_before_still_works(cls: type[Composed], name: str) -> None:
    default = BEFORE[cls][name]
    assert getattr(cls(), name) == default
    value = other(name, default)
    config = cls(**{name: value, **NEEDS.get(name, {})})
    assert getattr(config, name) == value
    assert getattr(config.replace(**{name: value}), name) == value
    prefix = "BUFSTORE_LG_" if cls is LangGraphConfig else "BUFSTORE_"
    env = {prefix + name.upper(): as_env(value)}
    env.update({prefix + k.upper(): v for k, v in NEEDS.get(name, {}).items()})
    assert getattr(cls.from_env(env), name) == value
    # The value lives in exactly one role, the attribute is a plain copy of it.
    owners = [attr for attr, role in cls.roles().items() if name in role.knob_names()]
    assert len(owners) == 1
    assert getattr(getattr(config, owners[0]), name) == value
    assert vars(config)[name] == value


def test_langgraph_config_still_takes_the_thread_run_keywords_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning, match="run_claim_grace_s"):
        config = LangGraphConfig(run_claim_grace_s=5.0, check_snapshots=True)
    assert config.run_claim_grace_s == 5.0
    assert config.check_snapshots is True
    assert LangGraphConfig().run_claim_grace_s == 300.0
    assert "threadrun" not in LangGraphConfig.roles()


def test_each_configuration_is_made_of_its_roles() -> None:
    assert EngineConfig.roles() == {
        "connection": ConnectionSettings,
        "wal": WalLayout,
        "flush": FlushPolicy,
    }
    assert WriterConfig.roles() == {**EngineConfig.roles(), "writer": WriterSettings}
    assert BufferedStoreConfig.roles() == {**WriterConfig.roles(), "threadrun": ThreadRunSettings}
    assert FlusherConfig.roles() == {**EngineConfig.roles(), "flusher": FlusherSettings}
    assert LangGraphConfig.roles() == {**WriterConfig.roles(), "langgraph": LangGraphSettings}
    assert isinstance(LangGraphConfig(), WriterConfig)
    assert not isinstance(LangGraphConfig(), BufferedStoreConfig)


def test_a_role_object_can_be_given_whole_and_flat_keywords_change_it() -> None:
    wal = WalLayout(stream_name="ROLES", replicas=3)
    config = BufferedStoreConfig(wal=wal, replicas=1, recent_window=8)
    assert config.wal == WalLayout(stream_name="ROLES", replicas=1)
    assert config.stream_name == "ROLES"
    assert config.writer.recent_window == 8
    with pytest.raises(TypeError, match="WalLayout"):
        BufferedStoreConfig(wal=ConnectionSettings())
    with pytest.raises(TypeError, match="nats_urll"):
        BufferedStoreConfig(nats_urll="nats://x:1")


def test_from_env_leaves_a_role_given_whole_alone() -> None:
    env = {"BUFSTORE_STREAM_NAME": "FROMENV", "BUFSTORE_NATS_URL": "nats://env:1"}
    config = BufferedStoreConfig.from_env(env, wal=WalLayout(stream_name="GIVEN"))
    assert config.stream_name == "GIVEN"
    assert config.nats_url == "nats://env:1"


def test_configurations_compare_hash_and_pickle_by_value() -> None:
    one = BufferedStoreConfig(nats_url="nats://a:1", recent_window=9)
    two = BufferedStoreConfig(nats_url="nats://a:1", recent_window=9)
    assert one == two
    assert hash(one) == hash(two)
    assert one != BufferedStoreConfig(nats_url="nats://a:1")
    copy = pickle.loads(pickle.dumps(one))  # Spark ships configurations to executors
    assert copy == one
    assert copy.recent_window == 9
    with pytest.raises(dataclasses.FrozenInstanceError):
        one.recent_window = 3


ROLE_CLASSES: list[type[Role]] = [
    ConnectionSettings,
    WalLayout,
    FlushPolicy,
    WriterSettings,
    ThreadRunSettings,
    FlusherSettings,
    LangGraphSettings,
]


@pytest.mark.parametrize("cls", [*BEFORE, WriterConfig], ids=lambda c: c.__name__)
def test_the_flat_attributes_are_declared_as_their_roles_type_them(cls: type[Composed]) -> None:
    hints = get_type_hints(cls)
    names = cls.knob_names()
    assert len(names) == len(set(names)), "two roles of one configuration share a field"
    for role in cls.roles().values():
        role_hints = get_type_hints(role)
        for name in role.knob_names():
            assert hints[name] == role_hints[name], name


def rows_of(section: str) -> dict[str, list[str]]:
    """field -> cells of the first table under the heading that names `section`."""
    text = DOCS.read_text()
    start = text.index(section)
    rows: dict[str, list[str]] = {}
    for line in text[start:].splitlines()[1:]:
        if line.startswith("#"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        match = re.fullmatch(r"`(\w+)`", cells[0]) if line.startswith("|") else None
        if match:
            rows[match.group(1)] = cells[1:]
    return rows


def shown(default: Any) -> str:
    if default is None:
        return "none"
    if isinstance(default, Enum):
        return f"`{default.value}`"
    if isinstance(default, bool):
        return "true" if default else "false"
    if isinstance(default, str):
        return f"`{default}`"
    if isinstance(default, float) and default.is_integer():
        return str(int(default))
    return str(default)


@pytest.mark.parametrize("role", ROLE_CLASSES, ids=lambda c: c.__name__)
def test_the_reference_lists_each_role_with_its_variables_and_defaults(
    role: type[Role],
) -> None:
    rows = rows_of(f"(`{role.__name__}`")
    assert list(rows) == list(role.knob_names())
    prefix = "BUFSTORE_LG_" if role is LangGraphSettings else "BUFSTORE_"
    defaults = role()
    for name, (env, default, _meaning) in rows.items():
        assert env.startswith(f"`{prefix}{name.upper()}`"), name
        assert default.split(" (")[0] == shown(getattr(defaults, name)), name
