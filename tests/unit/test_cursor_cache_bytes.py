"""The writer's cursor cache is bounded in bytes: large snapshots push the least recently
written threads out (their next write takes the slow path), and everything written
still reads back and flushes exactly."""

from __future__ import annotations

from buffered_store.config import BufferedStoreConfig
from buffered_store.engine.cursors import CURSOR_OVERHEAD_BYTES, Cursor, CursorCache
from buffered_store.stores.memory import InMemoryThreadRunStore
from buffered_store.testing import make_run, open_memory_store
from buffered_store.threadrun.entry import FORMAT, HotRecord

KB = 1024


def big_messages(count: int, size: int, tag: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{tag}-{i}-" + "x" * size} for i in range(count)]


def cursor(state: list[bytes] | None) -> Cursor[HotRecord, list[bytes]]:
    return Cursor(1, 1, None, None, state)


def test_cache_evicts_by_bytes_and_keeps_an_oversized_cursor_without_its_state() -> None:
    cache: CursorCache[HotRecord, list[bytes]] = CursorCache(
        100, max_bytes=10 * KB, weigh=FORMAT.state_bytes
    )
    for name in ("a", "b", "c"):
        cache.put(name, cursor([b"x" * (3 * KB)]))
    assert cache.threads() == ["b", "c"]  # a: three 4-KB cursors exceed 10 KB
    assert cache.held_bytes <= 10 * KB
    huge = cursor([b"y" * (20 * KB)])
    cache.put("d", huge)
    assert cache.get("d") is huge
    assert huge.state is None  # kept where the thread stands, not what it holds
    assert cache.held_bytes == sum(
        CURSOR_OVERHEAD_BYTES + (FORMAT.state_bytes(c.state) if c.state else 0)
        for c in (cache.get(t) for t in cache.threads())
        if c is not None
    )
    cache.drop("d")
    cache.drop("missing")
    assert "d" not in cache.threads()


async def test_writer_memory_stays_within_cursor_cache_bytes() -> None:
    budget = 256 * KB
    config = BufferedStoreConfig(cursor_cache_bytes=budget, drain_on_close=False)
    inner = InMemoryThreadRunStore()
    store = open_memory_store(inner, config)
    snapshots: dict[str, list[dict[str, str]]] = {}
    for round_ in range(3):
        for t in range(20):  # 20 threads of about 40 KB: three times the budget
            thread_id = f"t{t}"
            snapshots[thread_id] = snapshots.get(thread_id, []) + big_messages(
                4, 10 * KB, f"{thread_id}-{round_}"
            )
            run = make_run(thread_id, f"r-{thread_id}")
            if round_ == 1:  # deltas on evicted threads
                await store.append(thread_id, snapshots[thread_id][-4:], run)
            else:
                await store.checkpoint(thread_id, snapshots[thread_id], run)
            assert store.stats()["cursor_cache_bytes"] <= budget
    assert 0 < store.stats()["cursor_cache_threads"] < 20
    for thread_id, messages in snapshots.items():
        assert await store.load_messages(thread_id) == messages
    assert await store.force_flush_all() == 20
    for thread_id, messages in snapshots.items():
        assert await inner.load_messages(thread_id) == messages
    await store.close()


async def test_a_thread_larger_than_the_budget_is_written_without_a_cached_snapshot() -> None:
    config = BufferedStoreConfig(cursor_cache_bytes=64 * KB, drain_on_close=False)
    inner = InMemoryThreadRunStore()
    store = open_memory_store(inner, config)
    messages = big_messages(10, 10 * KB, "big")
    run = make_run("big", "r1")
    await store.checkpoint("big", messages, run)
    await store.append("big", big_messages(1, 10, "tail"), run)
    messages += big_messages(1, 10, "tail")
    await store.checkpoint("big", messages, run)
    assert store.stats()["cursor_cache_bytes"] <= 64 * KB
    assert await store.load_messages("big") == messages
    await store.force_flush("big")
    assert await inner.load_messages("big") == messages
    await store.close()


def test_a_cursor_being_written_is_not_evicted_until_its_write_is_done() -> None:
    """What a write learns on the way (its run's claim, a snapshot read back) lives in
    the cursor: evicted between two awaits, the write started over cold, and with many
    threads larger than the budget it did so until it gave up (ConflictError "keeps
    being deleted", or a full snapshot too large for the WAL)."""
    cache: CursorCache[HotRecord, list[bytes]] = CursorCache(
        100, max_bytes=10 * KB, weigh=FORMAT.state_bytes
    )
    written = cursor([b"x" * (3 * KB)])
    cache.put("a", written)
    with cache.pinned("a"):
        for name in ("b", "c", "d"):
            cache.put(name, cursor([b"x" * (3 * KB)]))
        assert cache.get("a") is written  # kept although the least recently used
        assert "b" not in cache.threads()  # the others make room instead
        with cache.pinned("a"):  # pins nest
            pass
        cache.put("e", cursor([b"x" * (3 * KB)]))
        assert cache.get("a") is written
    cache.put("f", cursor([b"x" * (3 * KB)]))
    cache.put("g", cursor([b"x" * (3 * KB)]))
    assert "a" not in cache.threads()  # unpinned: evicted as usual
    assert cache.held_bytes <= 10 * KB


def test_pinned_cursors_may_hold_the_cache_over_its_budget_until_released() -> None:
    cache: CursorCache[HotRecord, list[bytes]] = CursorCache(
        100, max_bytes=10 * KB, weigh=FORMAT.state_bytes
    )
    with cache.pinned("a"), cache.pinned("b"):
        cache.put("a", cursor([b"x" * (4 * KB)]))
        cache.put("b", cursor([b"x" * (4 * KB)]))
        cache.put("c", cursor([b"x" * (4 * KB)]))
        assert set(cache.threads()) == {"a", "b", "c"}
        assert cache.held_bytes > 10 * KB
    cache.put("d", cursor([b"x" * (1 * KB)]))
    assert cache.held_bytes <= 10 * KB
