"""langgraph-checkpoint-conformance against `BufferedCheckpointSaver` over real NATS and
Postgres, in three modes: reads overlaying an unflushed WAL (no flusher), a flusher
draining it meanwhile (embedded), and every write flushed before it returns."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.capabilities import ALL_CAPABILITIES

from buffered_store.langgraph import (
    LG_FORMAT,
    BufferedCheckpointSaver,
    LangGraphConfig,
    SyncBufferedCheckpointSaver,
)
from flusher import Flusher

CASES = 81
"""Tests the suite (0.0.2) runs when every capability is detected; fewer would mean a
capability went undetected or some tests were skipped."""


@pytest.mark.parametrize("mode", ["no_flusher", "embedded_flusher", "flush_each_write"])
async def test_conformance(mode: str, lg_config: LangGraphConfig) -> None:
    config = lg_config.replace(flush_each_write=mode == "flush_each_write")
    instances: list[BufferedCheckpointSaver] = []

    @checkpointer_test(name=f"buffered-{mode}")
    async def factory() -> AsyncIterator[BufferedCheckpointSaver]:
        async with BufferedCheckpointSaver.connect(config) as saver:
            instances.append(saver)
            if mode != "embedded_flusher":
                yield saver
                return
            async with Flusher(saver.sink, config, fmt=LG_FORMAT, backlog_poll_s=0):
                yield saver

    report = await validate(factory)

    failures = {name: r.failures for name, r in report.results.items() if r.failures}
    assert report.passed_all_base(), failures
    # passed_all_base() and conformance_level() pass with an optional capability that
    # went undetected: each one must be detected and passed.
    for capability in ALL_CAPABILITIES:
        result = report.results[capability.value]
        assert result.detected, capability.value
        assert result.passed, (capability.value, result.failures)
    counts = [(r.tests_passed, r.tests_failed, r.tests_skipped) for r in report.results.values()]
    assert sum(c[0] for c in counts) == CASES, counts
    assert sum(c[1] + c[2] for c in counts) == 0, counts
    stats = [s.stats() for s in instances]
    if mode == "no_flusher":
        # The reads really went through the overlay.
        assert sum(s["overlay_reads"] for s in stats) > 0


async def test_conformance_of_the_sync_saver_called_from_another_loop(
    lg_config: LangGraphConfig,
) -> None:
    """The suite (async) against `SyncBufferedCheckpointSaver`: each call crosses from
    this test's loop to the saver's private loop and back."""

    @checkpointer_test(name="buffered-sync")
    async def factory() -> AsyncIterator[SyncBufferedCheckpointSaver]:
        saver = await asyncio.to_thread(SyncBufferedCheckpointSaver.connect, lg_config)
        try:
            yield saver
        finally:
            await asyncio.to_thread(saver.close)

    report = await validate(factory)

    failures = {name: r.failures for name, r in report.results.items() if r.failures}
    assert report.passed_all_base(), failures
    for capability in ALL_CAPABILITIES:
        result = report.results[capability.value]
        assert result.detected, capability.value
        assert result.passed, (capability.value, result.failures)
    counts = [(r.tests_passed, r.tests_failed, r.tests_skipped) for r in report.results.values()]
    assert sum(c[0] for c in counts) == CASES, counts
