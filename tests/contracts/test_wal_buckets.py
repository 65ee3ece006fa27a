"""The `Wal` port's buckets, over `MemoryWal` and `NatsWal` alike: the hot bucket's
compare-and-set, deletes and revision-ordered scans, and the quarantine `Bucket`."""

from __future__ import annotations

import pytest

from buffered_store.engine.ports import KvValue, Wal
from buffered_store.errors import ConflictError, StoreError
from tests.contracts.harness import WalHarness


async def test_create_swap_and_conflicts(wal: Wal) -> None:
    first = await wal.kv_swap("h.a", b"1", revision=None)
    with pytest.raises(ConflictError):
        await wal.kv_swap("h.a", b"again", revision=None)  # must be absent
    second = await wal.kv_swap("h.a", b"2", revision=first)
    assert second > first
    with pytest.raises(ConflictError):
        await wal.kv_swap("h.a", b"stale", revision=first)
    with pytest.raises(ConflictError):
        await wal.kv_swap("h.never", b"x", revision=second)
    assert await wal.kv_get("h.a") == KvValue(b"2", second)


async def test_delete_hides_a_key_and_it_can_be_created_again(wal: Wal) -> None:
    revision = await wal.kv_put("h.a", b"1")
    await wal.kv_delete("h.a")
    assert await wal.kv_get("h.a") is None
    again = await wal.kv_swap("h.a", b"2", revision=None)
    assert again > revision
    assert await wal.kv_get("h.a") == KvValue(b"2", again)
    await wal.kv_delete("h.never-written")  # absent keys are fine
    assert await wal.kv_swap("h.never-written", b"3", revision=None) > again


async def test_revisions_increase_across_keys(wal: Wal) -> None:
    revisions = [
        await wal.kv_put("h.a", b"1"),
        await wal.kv_put("h.b", b"1"),
        await wal.kv_swap("f.a", b"1", revision=None),
        await wal.kv_put("h.a", b"2"),
    ]
    assert revisions == sorted(revisions)
    assert len(set(revisions)) == 4
    assert await wal.kv_get_many(["h.b", "h.none", "h.a"]) == [
        KvValue(b"1", revisions[1]),
        None,
        KvValue(b"2", revisions[3]),
    ]


async def test_hot_updates_in_revision_order_by_prefix(wal: Wal) -> None:
    a1 = await wal.kv_put("h.a", b"a1")
    b1 = await wal.kv_put("h.b", b"b1")
    await wal.kv_put("f.a", b"flushed")
    c1 = await wal.kv_put("h.c", b"c1")
    a2 = await wal.kv_put("h.a", b"a2")  # supersedes a1: a appears once, at a2
    await wal.kv_put("h.d", b"d1")
    await wal.kv_delete("h.d")  # deleted keys are left out
    updates = await wal.hot_updates("h.", 1)
    assert [(m.subject, m.data, m.seq) for m in updates] == [
        ("h.b", b"b1", b1),
        ("h.c", b"c1", c1),
        ("h.a", b"a2", a2),
    ]
    assert [m.subject for m in await wal.hot_updates("h.", c1)] == ["h.c", "h.a"]
    assert [m.subject for m in await wal.hot_updates("h.", a2 + 1)] == []
    assert [m.subject for m in await wal.hot_updates("f.", 0)] == ["f.a"]
    assert a1 < b1


async def test_hot_updates_past_the_direct_gets(wal: Wal) -> None:
    """More keys than a scan reads one by one (`NatsWal` switches to a consumer)."""
    keys = [f"h.k{n:02d}" for n in range(20)]
    for key in keys:
        await wal.kv_put(key, key.encode())
    await wal.kv_delete("h.k03")
    first = await wal.hot_updates("h.", 1)
    assert [m.subject for m in first] == [k for k in keys if k != "h.k03"]
    assert [m.data for m in first][:2] == [b"h.k00", b"h.k01"]


async def test_hot_and_quarantine_buckets_are_apart(wal: Wal) -> None:
    quarantine = wal.quarantine
    assert await quarantine.keys() == []
    created = await quarantine.create("q.1", b"bad entry")
    with pytest.raises(ConflictError):
        await quarantine.create("q.1", b"twice")
    assert await wal.kv_get("q.1") is None  # not in the hot bucket
    got = await quarantine.get("q.1")
    assert got is not None
    assert (got.value, got.revision) == (b"bad entry", created)
    swapped = await quarantine.swap("q.1", b"retried", revision=created)
    with pytest.raises(ConflictError):
        await quarantine.swap("q.1", b"stale", revision=created)
    put = await quarantine.put("q.2", b"other")
    assert put > swapped > created
    assert sorted(await quarantine.keys()) == ["q.1", "q.2"]
    await quarantine.delete("q.1")
    await quarantine.delete("q.absent")
    assert await quarantine.get("q.1") is None
    assert await quarantine.keys() == ["q.2"]
    assert await quarantine.swap("q.1", b"back", revision=None) > put


async def test_invalid_keys_are_refused(wal: Wal) -> None:
    for key in ("", ".h", "h.", "a*b", "a b"):
        with pytest.raises(StoreError):
            await wal.kv_put(key, b"x")
        with pytest.raises(StoreError):
            await wal.kv_get(key)


async def test_hot_updates_prefix_is_whole_tokens(wal: Wal) -> None:
    """The prefix is a subject filter ``<prefix>>``: "h" is no prefix of "h.a"."""
    await wal.kv_put("h.a", b"1")
    assert await wal.hot_updates("h", 1) == []


async def test_oldest_hot_keys_and_forgetting_one(wal: Wal, harness: WalHarness) -> None:
    """`hot_oldest` lists the least recently written live keys first, with when they
    were written; `kv_forget` removes a key at its revision only, and it can be created
    again as if it never existed."""
    a = await wal.kv_put("h.a", b"1")
    b = await wal.kv_put("h.b", b"1")
    await wal.kv_put("r.x", b"1")
    await harness.elapse(1.2)
    c = await wal.kv_put("h.c", b"1")
    oldest = await wal.hot_oldest("h.", 16)
    assert [(v.key, v.revision) for v in oldest] == [("h.a", a), ("h.b", b), ("h.c", c)]
    assert oldest[2].written_at - oldest[0].written_at >= 1.0
    assert await wal.kv_forget("h.a", a)
    assert await wal.kv_get("h.a") is None
    assert not await wal.kv_forget("h.b", a)  # written at another revision: kept
    assert await wal.kv_get("h.b") == KvValue(b"1", b)
    assert [v.key for v in await wal.hot_oldest("h.", 16)] == ["h.b", "h.c"]
    again = await wal.kv_swap("h.a", b"2", revision=None)
    assert again > c
    assert await wal.kv_get("h.a") == KvValue(b"2", again)
    moved = await wal.kv_swap("h.b", b"2", revision=b)
    assert not await wal.kv_forget("h.b", b)
    assert await wal.kv_get("h.b") == KvValue(b"2", moved)
