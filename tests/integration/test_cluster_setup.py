"""Connecting to a three-node JetStream cluster that cannot answer yet.

A cluster that has lost its quorum (or is electing a meta or stream leader) leaves
JetStream API requests unanswered or answers "temporarily unavailable". `NatsWal.connect`
tries the set-up again within its connect budget instead of failing at the first
request (CI, 2026-11-27: a store's first stream-info request to a cluster just started
timed out after 2 s, and the store never opened), and names the budget when it runs out.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import pytest

from buffered_store.config import BufferedStoreConfig
from buffered_store.dev.cluster import NatsCluster
from buffered_store.errors import WalUnavailableError
from buffered_store.nats import NatsWal
from tests.plugins.stores import unique_names


class RetryWatch(logging.Handler):
    """Sets `retried` when `NatsWal.connect` logs a set-up it will try again."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.retried = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "action", None) == "jetstream_setup_retry":
            self.retried.set()


@pytest.fixture
def retry_watch() -> Iterator[RetryWatch]:
    watch = RetryWatch()
    logger = logging.getLogger("buffered_store.nats.wal")
    level = logger.level
    logger.addHandler(watch)
    logger.setLevel(logging.INFO)
    try:
        yield watch
    finally:
        logger.removeHandler(watch)
        logger.setLevel(level)


def config_on(cluster: NatsCluster, **overrides: object) -> BufferedStoreConfig:
    return BufferedStoreConfig(
        nats_url=cluster.url, replicas=3, request_timeout_s=1.0, **unique_names(), **overrides
    )


async def test_connect_waits_for_a_cluster_to_regain_its_quorum(
    nats_cluster: NatsCluster, retry_watch: RetryWatch
) -> None:
    nats_cluster.kill_node(1)
    nats_cluster.kill_node(2)  # one node of three: no meta leader, JetStream cannot answer
    connecting = asyncio.create_task(
        NatsWal.connect(config_on(nats_cluster), connect_timeout_s=120)
    )
    retried = asyncio.create_task(retry_watch.retried.wait())
    try:
        await asyncio.wait({connecting, retried}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
        # A set-up attempt failed, and the connect goes on (before: it failed at once).
        assert not connecting.done(), connecting
        assert retried.done()
        # With one node back the meta leader may place the stream at once, or find too
        # few servers up for three replicas (tried again too) until the second is back.
        await asyncio.to_thread(nats_cluster.start_node, 1)
        await asyncio.to_thread(nats_cluster.start_node, 2)
        wal = await asyncio.wait_for(connecting, timeout=90)
    finally:
        connecting.cancel()
        retried.cancel()
    try:
        seq, _ = await wal.publish(
            f"{wal.stream}.t.x", b"e", msg_id="m", expected_last_subject_seq=0
        )
        assert seq == 1  # the stream answered the set-up through its leader: it has one
    finally:
        await wal.close()


async def test_connect_names_its_budget_when_jetstream_never_answers(
    nats_cluster: NatsCluster, retry_watch: RetryWatch
) -> None:
    nats_cluster.kill_node(1)
    nats_cluster.kill_node(2)
    with pytest.raises(WalUnavailableError, match=r"within 4 s, \d+ attempt"):
        await NatsWal.connect(config_on(nats_cluster), connect_timeout_s=4)
    assert retry_watch.retried.is_set()
