"""`SyncBufferedCheckpointSaver`: a real graph run with ``graph.invoke`` from plain
synchronous code (no event loop of the test's own), interrupted here and resumed from a
second process; after `force_flush_all`, LangGraph's sync `PostgresSaver` reads the
same states. These tests are synchronous functions on purpose."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.conformance.test_utils import generate_checkpoint
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

from buffered_store.errors import StoreClosedError, WalUnavailableError
from buffered_store.langgraph import LangGraphConfig, SyncBufferedCheckpointSaver
from tests.langgraph.graph import build_graph
from tests.langgraph.test_graph_processes import ROOT, child_env


def cfg(thread_id: str) -> RunnableConfig:
    return {"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}}


def test_a_sync_graph_interrupted_here_is_resumed_with_invoke_in_another_process(
    lg_config: LangGraphConfig, pg_dsn: str
) -> None:
    config = lg_config.replace(drain_on_close=False)
    thread_id = f"sync-{uuid.uuid4().hex[:8]}"
    run: RunnableConfig = {"configurable": {"thread_id": thread_id}}
    with SyncBufferedCheckpointSaver.connect(config) as saver:
        graph = build_graph(saver)
        out = graph.invoke({"items": ["s"], "answer": ""}, run)
        assert out["__interrupt__"][0].value == {"question": "approve?", "items": ["s"]}
        assert graph.get_state(run).next == ("ask",)

        child = subprocess.run(
            [sys.executable, "-m", "tests.langgraph.graph", "--sync", thread_id, "yes"],
            cwd=ROOT,
            env=child_env(config),
            capture_output=True,
            timeout=60,
            check=False,
        )
        assert child.returncode == 0, child.stderr.decode()[-3000:]
        result = json.loads(child.stdout)

        assert result == {"items": ["s", "done:yes"], "answer": "yes"}
        state = graph.get_state(run)
        assert state.values == result
        assert state.next == ()
        history = list(graph.get_state_history(run))
        assert len(history) >= 4
        assert saver.stats()["overlay_reads"] > 0  # nothing was flushed: read from the WAL
        assert saver.force_flush_all() == 1
    with PostgresSaver.from_conn_string(pg_dsn) as reference:
        theirs = build_graph(reference)
        assert theirs.get_state(run).values == result
        their_history = list(theirs.get_state_history(run))
    assert [s.config for s in their_history] == [s.config for s in history]
    assert [s.values for s in their_history] == [s.values for s in history]


def test_sync_methods_from_many_threads_then_close_ends_the_loop_thread(
    lg_config: LangGraphConfig,
) -> None:
    before = {t.name for t in threading.enumerate()}
    tids = [f"sync-many-{i}-{uuid.uuid4().hex[:6]}" for i in range(8)]
    with SyncBufferedCheckpointSaver.connect(lg_config) as saver:

        def write(tid: str) -> str:
            cp = generate_checkpoint(channel_values={"x": [tid]}, channel_versions={"x": 1})
            written = saver.put(cfg(tid), cp, {"source": "input", "step": 0}, {"x": 1})
            saver.put_writes(written, [("x", "w")], "task-1")
            return str(written["configurable"]["checkpoint_id"])

        with ThreadPoolExecutor(4) as pool:
            ids = list(pool.map(write, tids))
        for tid, cid in zip(tids, ids, strict=True):
            found = saver.get_tuple(cfg(tid))
            assert found is not None
            assert found.config["configurable"]["checkpoint_id"] == cid
            assert found.checkpoint["channel_values"] == {"x": [tid]}
            assert found.pending_writes == [("task-1", "x", "w")]
            assert [t.config for t in saver.list(cfg(tid))] == [found.config]
        # LangGraph clones a checkpointer with a msgpack allowlist when it compiles a
        # graph (with strict msgpack on): the clone shares the loop and reads through
        # the async saver's clone, with its serde.
        assert saver.with_allowlist(set()) is saver  # the serde does not change
        inner = copy.copy(saver.saver)
        inner.serde = JsonPlusSerializer()
        saver.saver.with_allowlist = lambda extra: inner  # type: ignore[method-assign,assignment]
        clone = saver.with_allowlist({("tests", "Thing")})
        del saver.saver.with_allowlist
        assert isinstance(clone, SyncBufferedCheckpointSaver)
        assert clone.saver is inner
        assert clone.serde is inner.serde
        assert clone.get_tuple(cfg(tids[1])) == saver.get_tuple(cfg(tids[1]))
        saver.delete_thread(tids[0])
        assert saver.get_tuple(cfg(tids[0])) is None
        assert "bufstore-langgraph-sync" in {t.name for t in threading.enumerate()} - before
    assert "bufstore-langgraph-sync" not in {t.name for t in threading.enumerate()} - before
    with pytest.raises(StoreClosedError):
        saver.get_tuple(cfg(tids[1]))


async def test_its_async_methods_answer_on_another_loop(lg_config: LangGraphConfig) -> None:
    """An async caller (this test's loop) may use it too: the calls run on its own loop."""
    saver = SyncBufferedCheckpointSaver.connect(lg_config)
    try:
        tid = f"sync-async-{uuid.uuid4().hex[:8]}"
        cp = generate_checkpoint(channel_values={"x": [1]}, channel_versions={"x": 1})
        written = await saver.aput(cfg(tid), cp, {"source": "input", "step": 0}, {"x": 1})
        found = await saver.aget_tuple(cfg(tid))
        assert found is not None
        assert found.config == written
        assert [t.config async for t in saver.alist(cfg(tid))] == [written]
    finally:
        saver.close()


def test_a_failed_open_leaves_no_loop_thread_behind() -> None:
    """NATS unreachable: `connect` raises what `BufferedCheckpointSaver.connect` raises,
    and the private loop's thread is gone (nothing to close)."""
    before = {t.ident for t in threading.enumerate()}
    config = LangGraphConfig(
        nats_url="nats://127.0.0.1:1",
        database_url="postgresql://nobody@127.0.0.1:1/none",
        connect_timeout_s=0.5,
    )
    with pytest.raises(WalUnavailableError):
        SyncBufferedCheckpointSaver.connect(config)
    left = [t for t in threading.enumerate() if t.ident not in before]
    assert [t.name for t in left if t.name == "bufstore-langgraph-sync"] == []


def test_from_conn_string_opens_and_closes_like_postgres_savers(
    lg_config: LangGraphConfig, pg_dsn: str, nats_url: str
) -> None:
    wal = {
        name: getattr(lg_config, name)
        for name in ("stream_name", "hot_bucket", "quarantine_bucket", "consumer_name")
    }
    tid = f"sync-fcs-{uuid.uuid4().hex[:8]}"
    cp = generate_checkpoint(channel_values={"x": [1]}, channel_versions={"x": 1})
    with SyncBufferedCheckpointSaver.from_conn_string(pg_dsn, nats_url=nats_url, **wal) as saver:
        assert (saver.settings.conninfo, saver.settings.nats_url) == (pg_dsn, nats_url)
        saver.setup()
        written = saver.put(cfg(tid), cp, {"source": "input", "step": 0}, {"x": 1})
    with pytest.raises(StoreClosedError):
        saver.get_tuple(cfg(tid))
    with PostgresSaver.from_conn_string(pg_dsn) as reference:  # drained on close
        theirs = reference.get_tuple(cfg(tid))
        assert theirs is not None
        assert theirs.config == written
