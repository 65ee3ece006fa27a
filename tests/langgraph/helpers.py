"""Helpers of the LangGraph front-end's tests."""

from __future__ import annotations

import uuid

from buffered_store.langgraph import LangGraphConfig


def fresh_config(nats_url: str, dsn: str, **overrides: object) -> LangGraphConfig:
    """A config whose WAL objects no other test uses."""
    run = uuid.uuid4().hex[:10]
    values: dict[str, object] = {
        "nats_url": nats_url,
        "database_url": dsn,
        "stream_name": f"LG{run}",
        "hot_bucket": f"lg-hot-{run}",
        "quarantine_bucket": f"lg-q-{run}",
        "consumer_name": f"lg-fl-{run}",
        "flush_interval_s": 0.05,
    }
    values.update(overrides)
    return LangGraphConfig(**values)
