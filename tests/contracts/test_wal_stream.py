"""The `Wal` port's stream half, over `MemoryWal` and `NatsWal` alike: the per-subject
compare-and-set, deduplication by message id, reads, sizes and request counts."""

from __future__ import annotations

import pytest

from buffered_store.engine.ports import Wal
from buffered_store.errors import ConflictError, StoreError, WalUnavailableError
from tests.contracts.harness import WalHarness


def subject(wal: Wal, token: str) -> str:
    return f"{wal.config.stream_name}.t.{token}"


async def test_publish_appends_on_the_expected_last_subject_seq(wal: Wal) -> None:
    a, b = subject(wal, "a"), subject(wal, "b")
    assert await wal.publish(a, b"a1", msg_id="a:1", expected_last_subject_seq=0) == (1, False)
    assert await wal.publish(b, b"b1", msg_id="b:1", expected_last_subject_seq=0) == (2, False)
    # The expectation is per subject: a's last is 1 although the stream is at 2.
    assert await wal.publish(a, b"a2", msg_id="a:2", expected_last_subject_seq=1) == (3, False)
    last = await wal.last_on(a)
    assert last is not None
    assert (last.seq, last.subject, last.data) == (3, a, b"a2")
    assert await wal.last_seq() == 3


async def test_publish_on_a_stale_expectation_is_a_conflict_and_stores_nothing(wal: Wal) -> None:
    a = subject(wal, "a")
    await wal.publish(a, b"a1", msg_id="a:1", expected_last_subject_seq=0)
    with pytest.raises(ConflictError):
        await wal.publish(a, b"x", msg_id="a:x", expected_last_subject_seq=0)
    with pytest.raises(ConflictError):
        await wal.publish(a, b"x", msg_id="a:y", expected_last_subject_seq=7)
    with pytest.raises(ConflictError):  # 0 would be right; 1 is another subject's seq
        await wal.publish(subject(wal, "b"), b"x", msg_id="b:1", expected_last_subject_seq=1)
    assert await wal.last_seq() == 1


async def test_same_msg_id_is_stored_once(wal: Wal) -> None:
    a = subject(wal, "a")
    assert await wal.publish(a, b"first", msg_id="a:1", expected_last_subject_seq=0) == (1, False)
    # The expectation holds (a's last is 1), the id was seen: the first copy's seq.
    assert await wal.publish(a, b"again", msg_id="a:1", expected_last_subject_seq=1) == (1, True)
    # Ids are deduplicated across subjects too.
    b = subject(wal, "b")
    assert await wal.publish(b, b"other", msg_id="a:1", expected_last_subject_seq=0) == (1, True)
    assert await wal.last_seq() == 1
    stored = await wal.get(1)
    assert stored is not None
    assert stored.data == b"first"


async def test_expectation_is_checked_before_deduplication(wal: Wal) -> None:
    """A retried publish whose first copy landed comes back as a conflict, not as a
    duplicate: the writer must tell its own entry from another writer's by reading."""
    a = subject(wal, "a")
    await wal.publish(a, b"first", msg_id="a:1", expected_last_subject_seq=0)
    with pytest.raises(ConflictError):
        await wal.publish(a, b"first", msg_id="a:1", expected_last_subject_seq=0)
    assert await wal.last_seq() == 1


async def test_msg_ids_are_forgotten_after_the_duplicate_window(harness: WalHarness) -> None:
    wal = await harness.open(duplicate_window_s=1.0)
    a = subject(wal, "a")
    await wal.publish(a, b"first", msg_id="a:1", expected_last_subject_seq=0)
    await harness.elapse(2.5)  # the server purges expired ids on a timer of the window
    assert await wal.publish(a, b"later", msg_id="a:1", expected_last_subject_seq=1) == (2, False)


async def test_reads_of_the_stream(wal: Wal) -> None:
    a, b = subject(wal, "a"), subject(wal, "b")
    for n, subj in enumerate((a, b, a, b, a), start=1):
        assert await wal.append(subj, f"m{n}".encode()) == n
    assert await wal.get(6) is None
    got = await wal.get(2)
    assert got is not None
    assert (got.seq, got.subject, got.data) == (2, b, b"m2")
    nxt = await wal.next_on(a, 2)
    assert nxt is not None
    assert nxt.seq == 3
    found = await wal.next_on(a, 3)
    assert found is not None
    assert found.seq == 3  # "at or after"
    first = await wal.next_on(a, 0)
    assert first is not None
    assert first.seq == 1
    assert await wal.next_on(b, 5) is None
    assert await wal.last_on(subject(wal, "none")) is None
    assert [m.seq for m in await wal.get_many([4, 9, 1, 2])] == [4, 1, 2]
    assert [m.data for m in await wal.read_range(2, 4)] == [b"m2", b"m3", b"m4"]
    assert [m.seq for m in await wal.read_range(4, 99)] == [4, 5]
    assert [m.seq for m in await wal.read_range(0, 1)] == [1]
    assert await wal.read_range(3, 2) == []
    # A subject's messages from a stream seq on, the other subjects' left out.
    assert [(m.seq, m.data) for m in await wal.read_subject(a, 0)] == [
        (1, b"m1"),
        (3, b"m3"),
        (5, b"m5"),
    ]
    assert [m.seq for m in await wal.read_subject(a, 2)] == [3, 5]
    assert [m.subject for m in await wal.read_subject(b, 1)] == [b, b]
    assert await wal.read_subject(b, 5) == []
    assert await wal.read_subject(subject(wal, "none"), 1) == []
    assert await wal.last_seq() == 5


async def test_empty_stream(wal: Wal) -> None:
    assert await wal.last_seq() == 0
    assert await wal.get(1) is None
    assert await wal.read_range(1, 10) == []
    assert await wal.next_on(subject(wal, "a"), 1) is None
    assert await wal.read_subject(subject(wal, "a"), 1) == []


async def test_a_subject_outside_the_stream_reaches_nobody(wal: Wal) -> None:
    with pytest.raises(WalUnavailableError):
        await wal.publish("elsewhere.a", b"x", msg_id="x", expected_last_subject_seq=0)


async def test_a_payload_over_max_payload_is_refused(wal: Wal) -> None:
    assert wal.max_payload >= 1024 * 1024
    with pytest.raises(StoreError):
        await wal.publish(
            subject(wal, "a"),
            b"x" * (wal.max_payload + 1),
            msg_id="big",
            expected_last_subject_seq=0,
        )
    assert await wal.last_seq() == 0


async def test_request_counts(wal: Wal) -> None:
    """The round trips the write and read paths are measured by (invariants 5 and 13)."""
    a = subject(wal, "a")

    async def cost(call: object) -> int:
        before = wal.requests
        await call  # type: ignore[misc]
        return wal.requests - before

    assert await cost(wal.publish(a, b"x", msg_id="1", expected_last_subject_seq=0)) == 1
    assert await cost(wal.kv_swap("h.a", b"v", revision=None)) == 1
    hot = await wal.kv_get("h.a")
    assert hot is not None
    assert await cost(wal.kv_swap("h.a", b"w", revision=hot.revision)) == 1
    assert await cost(wal.kv_get("h.a")) == 1
    assert await cost(wal.get(1)) == 1
    assert await cost(wal.last_on(a)) == 1
    assert await cost(wal.next_on(a, 1)) == 1
    assert await cost(wal.get_many([1, 1, 1])) == 3
    assert await cost(wal.read_subject(a, 1)) == 2  # a consumer made and deleted
    assert await cost(wal.consumer_state()) == 2
    assert await cost(wal.ensure_consumer()) == 1
    assert await cost(wal.hot_updates("h.", 1)) == 2  # one key read, one finding none
