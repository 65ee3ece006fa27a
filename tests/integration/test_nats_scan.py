"""Consumer scans (`buffered_store.nats.scan`) where a cluster makes them hard, driven
deterministically on one server.

- A pull request sent before the server it reaches knows where the scan's consumer
  lives is answered ``503`` (no responders). On a three-node cluster that happened to
  2 to 4% of scans through a follower (`test_cluster_reads` reads through one); here the
  consumer is made only after the first pull request went out.
- The server places a scan's consumer on any peer of a replicated stream, and a follower
  may not have applied the newest writes yet. Reads that must come from the leader
  complete a scan that ended short from the leader; here the scan is cut short the way
  a lagging replica would cut it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from buffered_store.engine.keys import hot_key, wal_subject
from buffered_store.errors import WalUnavailableError
from buffered_store.nats import NatsWal, scan
from tests.plugins.stores import ConfigFactory


@pytest.fixture
async def wal_for(make_config: ConfigFactory) -> AsyncIterator[Callable[..., Any]]:
    opened: list[NatsWal] = []

    async def factory(**overrides: Any) -> NatsWal:
        wal = await NatsWal.connect(make_config(**overrides))
        opened.append(wal)
        return wal

    yield factory
    for wal in opened:
        await wal.close()


async def fill(wal: NatsWal, thread: str, count: int) -> list[int]:
    """`count` entries on the thread's subject; their stream seqs."""
    subject = wal_subject(wal.config.stream_name, thread)
    seqs: list[int] = []
    for i in range(count):
        seq, _ = await wal.publish(
            subject,
            f"e{i}".encode(),
            msg_id=f"{thread}-{i}",
            expected_last_subject_seq=seqs[-1] if seqs else 0,
        )
        seqs.append(seq)
    return seqs


async def test_a_pull_nobody_heard_is_sent_again(wal_for: Callable[..., Any]) -> None:
    """The consumer appears 50 ms after the first pull request: the scan still returns
    every message (it raised ``503`` before), and gives up with an error, not a short
    answer, when the consumer never appears."""
    wal: NatsWal = await wal_for()
    seqs = await fill(wal, "t", 5)
    stream = wal.config.stream_name
    wanted = ConsumerConfig(
        name="late",
        deliver_policy=DeliverPolicy.ALL,
        ack_policy=AckPolicy.NONE,
        mem_storage=True,
        inactive_threshold=10,
    )

    async def make_it_late() -> None:
        await asyncio.sleep(0.05)
        await wal._js.add_consumer(stream, wanted)

    maker = asyncio.create_task(make_it_late())
    found, seen = await scan._pull_all(
        wal._nc, stream, "late", 1, "", 0, None, 5.0, until_empty=False
    )
    await maker
    assert [m.seq for m in found] == seqs
    assert seen == seqs[-1]

    with pytest.raises(WalUnavailableError, match="503"):
        await scan._pull_all(wal._nc, stream, "never", 1, "", 0, None, 0.3, until_empty=False)


def lagging_replica(monkeypatch: pytest.MonkeyPatch, keep: int, *, scans: int = 0) -> list[int]:
    """From now on scans deliver only their first `keep` messages, as a consumer on a
    replica that has applied no more would (only the first `scans` scans, 0: all).
    Returns the first seq of every scan made."""
    real = scan._pull_all
    starts: list[int] = []

    async def short(*args: Any, **kwargs: Any) -> tuple[list[Any], int]:
        found, seen = await real(*args, **kwargs)
        starts.append(args[3])
        if len(found) <= keep or (scans and len(starts) > scans):
            return found, seen
        kept = found[:keep]
        return kept, (kept[-1].seq if kept else args[3] - 1)

    monkeypatch.setattr(scan, "_pull_all", short)
    return starts


@pytest.mark.parametrize("keep", [0, 3, 8])
async def test_leader_reads_complete_a_scan_from_the_leader(
    wal_for: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, keep: int
) -> None:
    """With ``read_from="leader"``, WAL ranges, subject reads and the hot-record scan
    hold every message even when the scan's replica lags: the rest comes from leader
    gets (one for the leader's last message, then one per missing message)."""
    wal: NatsWal = await wal_for(read_from="leader")
    seqs = await fill(wal, "a", 8)
    await fill(wal, "b", 2)
    for key in range(10):
        await wal.kv_put(hot_key(f"k{key}"), b"h")
    requests = wal.record_requests()
    subject = wal_subject(wal.config.stream_name, "a")
    lagging_replica(monkeypatch, keep)
    requests.clear()
    assert [m.seq for m in await wal.read_subject(subject, 1)] == seqs
    leader_gets = [s for s in requests if ".STREAM.MSG.GET." in s]
    assert len(leader_gets) == len(seqs) - keep + 1, requests
    assert [m.seq for m in await wal.read_range(seqs[0], seqs[-1])] == seqs
    # The hot-record scan (after its first direct gets) finds every key.
    keys = [m.subject for m in await wal.hot_updates("h.", 1)]
    assert keys == [hot_key(f"k{key}") for key in range(10)]


async def test_leader_reads_end_where_the_leader_was_when_the_scan_ended(
    wal_for: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writes landing while the leader completes a scan do not keep it going (a busy
    bucket would never let it end): it stops at the leader's last message as the scan
    ended, which holds every write acknowledged before the read began."""
    wal: NatsWal = await wal_for(read_from="leader")
    seqs = await fill(wal, "a", 6)
    subject = wal_subject(wal.config.stream_name, "a")
    lagging_replica(monkeypatch, 2)
    real_get = wal._js.get_msg
    written: list[int] = []

    async def get_while_writing(*args: Any, **kwargs: Any) -> Any:
        got = await real_get(*args, **kwargs)
        last = seqs[-1] if not written else written[-1]
        seq, _ = await wal.publish(
            subject, b"new", msg_id=f"w{len(written)}", expected_last_subject_seq=last
        )
        written.append(seq)
        return got

    monkeypatch.setattr(wal._js, "get_msg", get_while_writing)
    found = [m.seq for m in await asyncio.wait_for(wal.read_subject(subject, 1), 10)]
    assert found == seqs  # a write per leader get, none of them chased
    assert len(written) == 1 + len(seqs) - 2  # the leader's last message, then the rest


async def test_a_replica_far_behind_is_scanned_again_rather_than_read_one_by_one(
    wal_for: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """More than `LEADER_GETS_MAX` missing (the first scan's replica far behind): a second
    scan reads them, from where the first ended, and the leader is asked once."""
    wal: NatsWal = await wal_for(read_from="leader")
    seqs = await fill(wal, "a", scan.LEADER_GETS_MAX + 30)
    starts = lagging_replica(monkeypatch, 10, scans=1)
    requests = wal.record_requests()
    found = [m.seq for m in await wal.read_subject(wal_subject(wal.config.stream_name, "a"), 1)]
    assert found == seqs
    assert starts == [1, seqs[10]]
    assert len([s for s in requests if ".STREAM.MSG.GET." in s]) == 1, requests


async def test_direct_reads_take_the_scan_as_it_comes(
    wal_for: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without leader reads nothing is asked of the leader (replicas may lag there by
    design: `read_from="any"`), so a single server's scans cost no extra round trip."""
    wal: NatsWal = await wal_for(read_from="any")
    seqs = await fill(wal, "a", 6)
    requests = wal.record_requests()
    assert [
        m.seq for m in await wal.read_subject(wal_subject(wal.config.stream_name, "a"), 1)
    ] == seqs
    assert [m.seq for m in await wal.read_range(seqs[0], seqs[-1])] == seqs
    assert not [s for s in requests if ".GET." in s], requests
    lagging_replica(monkeypatch, 2)
    assert len(await wal.read_range(seqs[0], seqs[-1])) == 2


@pytest.mark.parametrize("keep", [0, 1, 3])
async def test_leader_reads_complete_a_key_listing_from_the_leader(
    wal_for: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, keep: int
) -> None:
    """The quarantine bucket's listing (the trim floor keeps every quarantined message
    it names, so a key missed there is a message trimmed): what the lagging replica did
    not deliver, deletes included, comes from the leader."""
    wal: NatsWal = await wal_for(read_from="leader")
    bucket = wal.quarantine
    for key in ("t.a", "t.b", "m.7", "m.9"):
        await bucket.create(key, b"{}")
    await bucket.delete("t.b")
    await bucket.put("t.a", b"{}")  # now the newest key
    lagging_replica(monkeypatch, keep)
    assert await bucket.keys() == ["m.7", "m.9", "t.a"]
