"""Operating the LangGraph front-end from the command line (issue 24 items 6 and 7): its
flusher process takes the stream settings of ``BUFSTORE_LG_*``, a flusher of another
front-end refuses its stream, and `bufstore status`, `health` and `quarantine` work with
``--front-end langgraph``."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import pytest
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.conformance.test_utils import generate_checkpoint

from buffered_store.langgraph import BufferedCheckpointSaver, LangGraphConfig

ROOT = Path(__file__).resolve().parents[2]


def lg_env(config: LangGraphConfig, **extra: str) -> dict[str, str]:
    """The environment of a process configured for `config` through ``BUFSTORE_LG_*``
    (no ``BUFSTORE_*`` variable of the test runner leaks in)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUFSTORE_")}
    env.update(
        BUFSTORE_LG_NATS_URL=config.nats_url,
        BUFSTORE_LG_DATABASE_URL=config.database_url,
        BUFSTORE_LG_STREAM_NAME=config.stream_name,
        BUFSTORE_LG_HOT_BUCKET=config.hot_bucket,
        BUFSTORE_LG_QUARANTINE_BUCKET=config.quarantine_bucket,
        BUFSTORE_LG_CONSUMER_NAME=config.consumer_name,
        BUFSTORE_LG_MAX_AGE_S=repr(config.max_age_s),
        BUFSTORE_LG_DUPLICATE_WINDOW_S=repr(config.duplicate_window_s),
        BUFSTORE_LG_ACK_WAIT_S=repr(config.ack_wait_s),
        DATABASE_URL="postgresql://127.0.0.1:1/not-this-one",
    )
    env.update(extra)
    return env


async def bufstore(env: Mapping[str, str], *args: str, timeout_s: float = 60) -> tuple[int, str]:
    """Run ``bufstore ARGS`` to its end: (exit status, stdout + stderr)."""
    proc = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "bufstore"),
        *args,
        cwd=ROOT,
        env=dict(env),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


async def start_flusher(env: Mapping[str, str], *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        *("-m", "flusher", *args),
        *("--flush-interval", "0.05", "--stats-interval", "0"),
        cwd=ROOT,
        env=dict(env),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )


async def stop(proc: asyncio.subprocess.Process) -> tuple[int, str]:
    """SIGTERM (unless it ended already), then its exit status and stderr."""
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
    _, err = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert proc.returncode is not None
    return proc.returncode, err.decode()


async def put_steps(saver: BufferedCheckpointSaver, thread_id: str, steps: int) -> int:
    """`steps` puts (each with a write) on a thread; the thread's seq after them."""
    head: RunnableConfig = {"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}}
    for step in range(steps):
        cp = generate_checkpoint(
            channel_values={"msgs": [f"m{i}" for i in range(step + 1)]},
            channel_versions={"msgs": step + 1},
        )
        head = await saver.aput(head, cp, {"source": "loop", "step": step}, {"msgs": step + 1})
        await saver.aput_writes(head, [("msgs", ["w"])], f"task-{step}")
    return 2 * steps


async def wait_flushed(
    saver: BufferedCheckpointSaver, thread_id: str, seq: int, flusher: asyncio.subprocess.Process
) -> None:
    """Until the flusher process has flushed the thread up to `seq`; fails at once with
    its stderr when it exits."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if (await saver.sink.flushed_seqs([thread_id]))[thread_id] >= seq:
            return
        if flusher.returncode is not None:
            _, err = await stop(flusher)
            raise AssertionError(f"the flusher exited {flusher.returncode}: {err[-1500:]}")
        await asyncio.sleep(0.02)
    raise AssertionError(f"thread {thread_id!r} not flushed up to {seq} in time")


async def test_langgraph_flusher_takes_the_stream_settings_of_bufstore_lg(
    lg_config: LangGraphConfig,
) -> None:
    """Issue 24 item 6: with ``BUFSTORE_LG_MAX_AGE_S=3600`` (and a duplicate window and
    ack wait of its own) the saver creates its stream and consumer so; the flusher
    process, configured by the same variables, opens them and drains (it used to compare
    them with the ``BUFSTORE_*`` defaults and exit 1: "stream exists with a different
    configuration")."""
    config = lg_config.replace(
        max_age_s=3600.0, duplicate_window_s=60.0, ack_wait_s=20.0, drain_on_close=False
    )
    async with BufferedCheckpointSaver.connect(config) as saver:
        seq = await put_steps(saver, "settings-1", 3)
        flusher = await start_flusher(lg_env(config), "--front-end", "langgraph")
        try:
            await wait_flushed(saver, "settings-1", seq, flusher)
        finally:
            code, err = await stop(flusher)
        assert code == 0, err[-2000:]
        assert "different configuration" not in err


async def stream_tag(config: LangGraphConfig) -> str | None:
    """The front-end the stream's metadata names (None: untagged)."""
    import nats

    from buffered_store.engine.frontend import tag_of

    nc = await nats.connect(config.nats_url)
    try:
        info = await nc.jetstream().stream_info(config.stream_name)
        return tag_of(info.config.metadata)
    finally:
        await nc.close()


async def test_an_untagged_stream_is_judged_by_its_entries(lg_config: LangGraphConfig) -> None:
    """Issue 24 item 7, streams made before the tag (or on a server that keeps no stream
    metadata): a thread-run flusher finds LangGraph entries and refuses; the LangGraph
    flusher finds its own, tags the stream and drains it."""
    from buffered_store.errors import ConfigError
    from buffered_store.langgraph import LG_FORMAT
    from buffered_store.nats import NatsWal
    from buffered_store.stores.memory import InMemoryThreadRunStore
    from flusher import Flusher, FlusherConfig

    config = lg_config.replace(drain_on_close=False)
    old = await NatsWal.connect(config)  # what an older release created: no tag
    await old.close()
    assert await stream_tag(config) is None
    async with BufferedCheckpointSaver.connect(config) as saver:
        seq = await put_steps(saver, "old-1", 2)
        wrong = Flusher(
            InMemoryThreadRunStore(),
            FlusherConfig(nats_url=config.nats_url, stream_name=config.stream_name),
            backlog_poll_s=0,
        )
        with pytest.raises(ConfigError, match=r"untagged, but its entry \d+ is of kind 'o'"):
            await wrong.start()
        assert await stream_tag(config) is None

        async with Flusher(saver.sink, config, fmt=LG_FORMAT, backlog_poll_s=0):
            assert await stream_tag(config) == "langgraph"
            deadline = time.monotonic() + 30
            while (await saver.sink.flushed_seqs(["old-1"]))["old-1"] < seq:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
        with pytest.raises(ConfigError, match=r"its metadata bufstore_front_end='langgraph'"):
            await wrong.start()


async def test_the_langgraph_flusher_process_refuses_a_thread_run_stream(
    lg_config: LangGraphConfig,
) -> None:
    """Issue 24 item 7 the other way round, from the command line: ``bufstore flusher
    --front-end langgraph`` on the thread-run store's stream exits 1 at once, saying
    whose stream it is; the thread-run entries stay where they were."""
    from buffered_store import BufferedThreadRunStore, InMemoryThreadRunStore, RunRecord
    from buffered_store.config import BufferedStoreConfig

    store_config = BufferedStoreConfig(
        nats_url=lg_config.nats_url,
        stream_name=lg_config.stream_name,
        hot_bucket=lg_config.hot_bucket,
        consumer_name="thread-flusher",
    )
    async with BufferedThreadRunStore.connect(InMemoryThreadRunStore(), store_config) as store:
        run = RunRecord(run_id="tr-run", thread_id="tr-1", agent_id="a")
        await store.checkpoint("tr-1", [{"role": "user", "content": "hi"}], run)
        before = await store.wal.consumer_state()
    flusher = await start_flusher(lg_env(lg_config), "--front-end", "langgraph")
    try:
        _, err_bytes = await asyncio.wait_for(flusher.communicate(), timeout=30)
    finally:
        if flusher.returncode is None:  # it started after all: the test fails below
            flusher.kill()
            await flusher.wait()
    code, err = flusher.returncode, err_bytes.decode()
    assert code == 1
    assert f"stream {lg_config.stream_name!r} holds the threadrun front-end's entries" in err
    assert "bufstore flusher --front-end threadrun" in err
    assert before.num_pending == 1


async def test_quarantine_replay_by_thread_and_in_bulk_for_langgraph(
    lg_config: LangGraphConfig,
) -> None:
    """Issue 24 item 7, the recovery: every LangGraph entry quarantined as a payload that
    is no entry (what a thread-run flusher on the saver's stream did: "'put' is not a
    valid EntryKind"), plus one payload no front-end wrote. ``bufstore quarantine replay
    --front-end langgraph`` flushes one thread with all its records (``--thread-id``),
    then every other one (``--all``), one flush per thread instead of one call per
    message, and leaves only the record that holds nothing."""
    from buffered_store.engine.ids import utcnow
    from buffered_store.engine.keys import thread_from_subject, wal_subject
    from flusher.policy import Undecodable
    from flusher.quarantine import Quarantine, undecodable_record

    config = lg_config.replace(drain_on_close=False)
    threads = ["rq-0", "rq-1", "rq-2"]
    async with BufferedCheckpointSaver.connect(config) as saver:
        seqs = {t: await put_steps(saver, t, 3) for t in threads}
        junk = await saver.wal.append(wal_subject(config.stream_name, "rq-1"), b"junk")
        quarantine = Quarantine(saver.wal)
        for msg in await saver.wal.read_range(1, junk):
            reason = "'o' is not a valid EntryKind" if msg.seq != junk else "not JSON"
            bad = Undecodable(reason, thread_from_subject(config.stream_name, msg.subject))
            record = undecodable_record(
                bad,
                subject=msg.subject,
                stream_seq=msg.seq,
                data=msg.data,
                deliveries=1,
                now=utcnow(),
            )
            assert await quarantine.add_message(record)
        records = len(await saver.wal.quarantine.keys())
        assert records > 2 * len(threads)

        env = lg_env(config)
        code, out = await bufstore(
            env, "quarantine", "replay", "--front-end", "langgraph", "--thread-id", "rq-0"
        )
        assert code == 0, out
        assert f"thread 'rq-0' flushed up to seq {seqs['rq-0']}" in out
        flushed = await saver.sink.flushed_seqs(threads)
        assert flushed == {"rq-0": seqs["rq-0"], "rq-1": 0, "rq-2": 0}

        code, out = await bufstore(env, "quarantine", "replay", "--front-end", "langgraph", "--all")
        assert code == 0, out
        assert "2 thread(s) replayed, 0 failed, 1 record(s) left" in out
        assert f"left m.{junk}: not an entry of this front-end" in out
        assert await saver.sink.flushed_seqs(threads) == seqs
        assert await saver.wal.quarantine.keys() == [f"m.{junk}"]

        code, out = await bufstore(env, "quarantine", "list", "--front-end", "langgraph")
        assert code == 0, out
        assert f"message {junk} on" in out


async def test_status_and_health_know_the_langgraph_front_end(
    lg_config: LangGraphConfig, pg_dsn: str
) -> None:
    """``bufstore status`` and ``health`` with ``--front-end langgraph`` read the saver's
    stream and consumer (``BUFSTORE_LG_*``) and its watermarks in Postgres; health fails
    while entries are pending and no flusher consumes them (nobody ever pulled, or nobody
    pulled nor acked for ``--max-idle-s``), and passes while its flusher drains."""
    import json

    config = lg_config.replace(drain_on_close=False)
    env = lg_env(config)
    async with BufferedCheckpointSaver.connect(config) as saver:
        seqs = {t: await put_steps(saver, t, 2) for t in ("st-1", "st-2")}

        code, out = await bufstore(env, "status", "--front-end", "langgraph", "--json")
        assert code == 0, out
        report = json.loads(out)
        assert (report["front_end"], report["stream"]) == ("langgraph", config.stream_name)
        assert report["pending_threads"] == 2
        assert {r["thread_id"]: r["latest_seq"] for r in report["threads"]} == seqs

        code, out = await bufstore(env, "health", "--front-end", "langgraph", "--json")
        assert code == 1, out
        checks = {c["name"]: c for c in json.loads(out)["checks"]}
        assert checks["nats"]["status"] == "ok"
        assert checks["flusher"]["status"] == "fail"
        assert "no flusher consumes them" in checks["flusher"]["detail"]
        assert "never active" in checks["flusher"]["detail"]

        flusher = await start_flusher(env, "--front-end", "langgraph")
        try:
            for thread_id, seq in seqs.items():
                await wait_flushed(saver, thread_id, seq, flusher)
            code, out = await bufstore(
                env, "health", "--front-end", "langgraph", "--database-url", pg_dsn
            )
            assert code == 0, out
            assert "OK    postgres" in out
            code, out = await bufstore(
                env, "status", "--front-end", "langgraph", "--database-url", pg_dsn, "--json"
            )
            assert json.loads(out)["pending_threads"] == 0, out
            # The flusher keeps a pull request waiting: pending entries are consumed.
            await put_steps(saver, "st-3", 1)
            code, out = await bufstore(env, "health", "--front-end", "langgraph")
            assert code == 0, out
        finally:
            code, err = await stop(flusher)
        assert code == 0, err[-2000:]

        await put_steps(saver, "st-4", 1)  # no flusher any more
        await asyncio.sleep(0.5)
        code, out = await bufstore(env, "health", "--front-end", "langgraph", "--max-idle-s", "0.2")
        assert code == 1, out
        assert "FAIL  flusher" in out
        assert "no pull request waiting, last delivery or ack" in out


async def test_langgraph_flusher_exports_the_inner_store_metrics_with_its_front_end(
    lg_config: LangGraphConfig,
) -> None:
    """``bufstore flusher --front-end langgraph --metrics-port``: the flusher's metrics and
    the inner-store ones (``bufstore_inner_*``) as the thread-run flusher exports them,
    every sample labelled ``front_end="langgraph"``."""
    import socket
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = lg_config.replace(drain_on_close=False)
    async with BufferedCheckpointSaver.connect(config) as saver:
        seq = await put_steps(saver, "metrics-1", 3)
        flusher = await start_flusher(
            lg_env(config), "--front-end", "langgraph", "--metrics-port", str(port)
        )
        try:
            await wait_flushed(saver, "metrics-1", seq, flusher)

            def scrape() -> dict[tuple[str, str | None, str | None], float]:
                with urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                    text = response.read().decode()
                return {
                    (s.name, s.labels.get("front_end"), s.labels.get("outcome")): s.value
                    for f in text_string_to_metric_families(text)
                    for s in f.samples
                    if s.name.startswith("bufstore_")
                }

            # The watermark shows at the commit; the sink counts the batch once its
            # apply returns, the flusher once its cycle takes the outcome, each a few
            # turns of the flusher's loop later, while its metrics thread answers a
            # scrape at any moment. A flusher descheduled right after the commit (a busy
            # machine) is scraped with the counts apart: scrape until they agree.
            deadline = time.monotonic() + 30
            while True:
                samples = await asyncio.to_thread(scrape)
                applied = samples.get(("bufstore_flusher_entries_applied_total", "langgraph", None))
                inner = samples.get(("bufstore_inner_applied_entries_total", "langgraph", None))
                if (applied and applied == inner) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
        finally:
            code, err = await stop(flusher)
        assert code == 0, err[-2000:]
    assert {front_end for _, front_end, _ in samples} == {"langgraph"}
    applied = samples[("bufstore_flusher_entries_applied_total", "langgraph", None)]
    assert applied >= 1
    assert samples[("bufstore_inner_applied_entries_total", "langgraph", None)] == applied
    assert samples[("bufstore_inner_transactions_total", "langgraph", None)] >= 1
    assert samples[("bufstore_inner_round_trips_total", "langgraph", None)] >= 2
    assert samples[("bufstore_inner_apply_outcomes_total", "langgraph", "applied")] >= 1
