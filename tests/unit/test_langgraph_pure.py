"""The LangGraph front-end's pure parts: input checks and configuration."""

from __future__ import annotations

import datetime
import enum
import math
import uuid
from dataclasses import dataclass

import orjson
import pytest

from buffered_store.config import BufferedStoreConfig
from buffered_store.errors import ConfigError, ValidationError
from buffered_store.langgraph.config import LangGraphConfig
from buffered_store.langgraph.validation import check_json, check_text, json_bytes


@pytest.mark.parametrize(
    ("value", "path"),
    [
        ({"a": {"b": "x\x00"}}, "metadata.a.b"),
        ({"a": [1, math.nan]}, "metadata.a[1]"),
        ({"a": [{"inf": -math.inf}]}, "metadata.a[0].inf"),
        ({"n": 2**64}, "metadata.n"),
        ({"n": [-(2**63) - 1]}, "metadata.n[0]"),
        ({"k\x00": 1}, "metadata key"),
        ({"s": "\ud800"}, "metadata.s"),
        ({"d": {1: "x"}}, "metadata.d"),
        ({"o": object()}, "metadata.o"),
    ],
)
def test_what_postgres_or_the_wal_refuses_is_refused_with_its_path(
    value: object, path: str
) -> None:
    with pytest.raises(ValidationError, match=path.replace("[", r"\[").replace("]", r"\]")):
        check_json(value, "metadata")


class Plain(enum.Enum):
    A = "a"


class Text(enum.StrEnum):
    A = "a"


@dataclass
class Point:
    x: int


@pytest.mark.parametrize(
    ("value", "path"),
    [
        ({"a": {"b": "x\x00"}}, "metadata.a.b"),
        ({"a": [1, math.nan]}, "metadata.a[1]"),
        ({"a": [{"inf": -math.inf}]}, "metadata.a[0].inf"),
        ({"n": 2**64}, "metadata.n"),
        ({"k\x00": 1}, "metadata key"),
        ({"s": "\ud800"}, "metadata.s"),
        ({"d": {1: "x"}}, "metadata.d"),
        # orjson writes these without complaint; Postgres-bound JSON must not hold them.
        ({"t": datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)}, "metadata.t"),
        ({"u": uuid.UUID(int=1)}, "metadata.u"),
        ({"p": [Point(1)]}, "metadata.p[0]"),
        ({"e": Plain.A}, "metadata.e"),
    ],
)
def test_json_bytes_refuses_what_check_json_refuses(value: object, path: str) -> None:
    with pytest.raises(ValidationError, match=path.replace("[", r"\[").replace("]", r"\]")):
        json_bytes(value, "metadata")


@pytest.mark.parametrize(
    "value",
    [
        {"a": [1, 2.5, -0.0, None, True, "é", {"b": 2**64 - 1, "c": -(2**63)}]},
        {"escaped": "a \\u0000 that is text, not a NUL"},
        {"t": (1, "two"), "s": Text.A},
        [],
    ],
)
def test_json_bytes_writes_what_check_json_accepts(value: object) -> None:
    check_json(value, "checkpoint")
    data = json_bytes(value, "checkpoint")
    assert data == orjson.dumps(value)


def test_json_postgres_takes_is_accepted() -> None:
    check_json({"a": [1, 2.5, None, True, "é", {"b": 2**64 - 1, "c": -(2**63)}]}, "metadata")
    deep: object = "leaf"
    for _ in range(5000):  # no recursion limit
        deep = [deep]
    check_json(deep, "checkpoint")


def test_text_must_be_a_string_without_nul() -> None:
    assert check_text("ok", "thread_id") == "ok"
    with pytest.raises(ValidationError, match="thread_id contains a NUL"):
        check_text("a\x00b", "thread_id")
    with pytest.raises(ValidationError, match="must be a string"):
        check_text(3, "task_id")


def test_langgraph_config_has_its_own_wal_objects() -> None:
    mine, theirs = LangGraphConfig(), BufferedStoreConfig()
    for name in ("stream_name", "hot_bucket", "quarantine_bucket", "consumer_name"):
        assert getattr(mine, name) != getattr(theirs, name)


def test_langgraph_config_from_env_reads_its_prefix_and_shares_the_nats_url() -> None:
    env = {
        "BUFSTORE_NATS_URL": "nats://shared:4222",
        "BUFSTORE_STREAM_NAME": "THREADLOG2",  # the thread-run store's: not ours
        "BUFSTORE_LG_STREAM_NAME": "LGX",
        "BUFSTORE_LG_DATABASE_URL": "postgresql+psycopg://u@h/db",
        "BUFSTORE_LG_OWNER": "worker-1",
        "BUFSTORE_LG_FLUSH_EACH_WRITE": "true",
    }
    config = LangGraphConfig.from_env(env)
    assert config.nats_url == "nats://shared:4222"
    assert config.stream_name == "LGX"
    assert config.conninfo == "postgresql://u@h/db"
    assert config.owner == "worker-1"
    assert config.flush_each_write is True
    assert LangGraphConfig.from_env({**env, "BUFSTORE_LG_NATS_URL": "nats://lg:1"}).nats_url == (
        "nats://lg:1"
    )


def test_langgraph_config_from_env_honours_database_url_and_nats_url() -> None:
    """As the CLI and the quickstart do: the conventional variables, not localhost, when
    no ``BUFSTORE_*`` variable says otherwise; the prefixed ones win."""
    env = {"DATABASE_URL": "postgresql://app@db:5432/app", "NATS_URL": "nats://nats:4222"}
    config = LangGraphConfig.from_env(env)
    assert config.conninfo == "postgresql://app@db:5432/app"
    assert config.nats_url == "nats://nats:4222"
    shared = LangGraphConfig.from_env({**env, "BUFSTORE_NATS_URL": "nats://shared:4222"})
    assert shared.nats_url == "nats://shared:4222"
    mine = LangGraphConfig.from_env(
        {
            **env,
            "BUFSTORE_LG_DATABASE_URL": "postgresql://lg@db/lg",
            "BUFSTORE_LG_NATS_URL": "nats://lg:1",
        }
    )
    assert (mine.conninfo, mine.nats_url) == ("postgresql://lg@db/lg", "nats://lg:1")
    assert LangGraphConfig.from_env(env, database_url="postgresql://kw@db/kw").conninfo == (
        "postgresql://kw@db/kw"
    )


@pytest.mark.parametrize(
    "bad",
    [
        {"database_url": ""},
        {"pool_max_size": 0},
        {"pool_min_size": 3, "pool_max_size": 2},
        {"owner": ""},
    ],
)
def test_langgraph_config_is_validated(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        LangGraphConfig(**bad)
