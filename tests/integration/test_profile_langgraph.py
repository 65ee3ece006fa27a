"""The `profile_langgraph` probe's floor: bare JetStream publishes, timed, cleaned up."""

from __future__ import annotations

import asyncio
import os

import nats
from nats.js.errors import NotFoundError

from benchmarks.measure import runqueue_wait_s
from benchmarks.profile_langgraph import main, parse, publish_floor
from benchmarks.step_timeline import STAGES
from buffered_store.langgraph import BufferedCheckpointSaver


async def test_publish_floor_times_publishes_and_deletes_its_stream(nats_url: str) -> None:
    figures = await publish_floor(nats_url, count=40, size=300)
    assert figures["floor_publishes"] == 40
    assert figures["floor_bytes"] == 300
    assert figures["floor_wall_us"] > 0
    assert figures["floor_user_us"] + figures["floor_sys_us"] > 0
    if runqueue_wait_s(os.getpid()) is None:  # no schedstat on this kernel
        assert "floor_wait_us" not in figures
    else:
        assert figures["floor_wait_us"] >= 0
    paced = await publish_floor(nats_url, count=10, size=300, gap_ms=20)
    assert paced["floor_gap_ms"] == 20
    # Each publish is timed alone: the gaps between them are not in its wall time.
    assert 0 < paced["floor_wall_p50_us"] < 20_000
    nc = await nats.connect(nats_url)
    try:
        names = [info.config.name for info in await nc.jetstream().streams_info()]
    except NotFoundError:
        names = []
    finally:
        await nc.close()
    assert not [name for name in names if name and name.startswith("FLOOR_")]


def test_floor_is_off_unless_asked() -> None:
    assert parse([]).floor == 0
    assert parse(["--floor", "500", "--floor-bytes", "100"]).floor_bytes == 100
    assert parse([]).floor_gap_ms == 0
    assert parse([]).timeline is False
    assert parse(["--timeline"]).timeline is True
    assert parse(["--floor", "5", "--floor-gap-ms", "13.3"]).floor_gap_ms == 13.3


async def test_timeline_marks_every_stage_of_a_paced_step_and_puts_the_calls_back(
    nats_url: str,
) -> None:
    aput, received = BufferedCheckpointSaver.aput, asyncio.StreamReaderProtocol.data_received
    # One thread: no step overlaps another (with two, their random slots may make every
    # step overlap on a busy machine, and none would be attributed).
    paced = ["--threads", "1", "--steps", "6", "--warm", "2", "--rate", "50", "--timeline"]
    figures = await main(parse(["--nats-url", nats_url, *paced]))
    assert figures["steps"] == 6
    timeline = figures["timeline"]
    assert list(timeline) == [name for name, _ in STAGES]
    assert all(stage["steps"] == 6 for stage in timeline.values())
    assert all(stage["p50_us"] > 0 for stage in timeline.values())
    assert BufferedCheckpointSaver.aput is aput
    assert asyncio.StreamReaderProtocol.data_received is received
    if runqueue_wait_s(os.getpid()) is None:  # no schedstat on this kernel
        assert "wait_ms_per_step" not in figures
    else:
        # The process's wait for a core per step, beside its CPU: at most its wall time.
        assert 0 <= figures["wait_ms_per_step"] <= figures["wall_ms_per_step"]
        assert figures["process_threads"] >= 1
    assert "timeline" not in await main(parse(["--nats-url", nats_url, "--steps", "2"]))
