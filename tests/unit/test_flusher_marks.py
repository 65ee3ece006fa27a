"""`ThreadLog.raise_mark` with remembered KV revisions: one compare-and-set per raise while
the cache is current, and a read-and-retry when it is stale. No services: the KV bucket is
an in-process twin with revisions and compare-and-set."""

from __future__ import annotations

from typing import Any, cast

from buffered_store.config import EngineConfig
from buffered_store.engine.entries import decode_flushed
from buffered_store.engine.keys import flushed_key
from buffered_store.engine.ports import KvValue, Wal
from buffered_store.engine.threadlog import ThreadLog
from buffered_store.errors import ConflictError
from buffered_store.model.changes import (
    WalEntry,
)
from buffered_store.threadrun.entry import (
    FORMAT,
    HotRecord,
)


class FakeKv:
    """Keys with revisions from one counter, like a JetStream KV bucket."""

    def __init__(self) -> None:
        self.items: dict[str, KvValue] = {}
        self.revision = 0
        self.gets = 0
        self.swaps = 0

    async def kv_get(self, key: str) -> KvValue | None:
        self.gets += 1
        return self.items.get(key)

    async def kv_swap(self, key: str, value: bytes, *, revision: int | None) -> int:
        self.swaps += 1
        current = self.items.get(key)
        if (current.revision if current else None) != revision:
            raise ConflictError(f"update {key}: the key changed meanwhile")
        self.revision += 1
        self.items[key] = KvValue(value, self.revision)
        return self.revision

    def seq(self, thread_id: str) -> int:
        return decode_flushed(self.items[flushed_key(thread_id)].value).seq


def thread_log(kv: FakeKv) -> ThreadLog[WalEntry, HotRecord]:
    return ThreadLog(cast(Wal, cast(Any, kv)), EngineConfig(), FORMAT)


async def test_a_remembered_revision_makes_a_raise_one_swap() -> None:
    kv = FakeKv()
    log = thread_log(kv)
    await log.raise_mark("t", 1, 10)
    assert (kv.gets, kv.swaps) == (1, 1)  # unknown key: read, then create
    await log.raise_mark("t", 2, 11)
    await log.raise_mark("t", 5, 14)
    assert (kv.gets, kv.swaps) == (1, 3)
    assert kv.seq("t") == 5
    assert log.mark_stats == {"cached_swaps": 2, "stale_revisions": 0, "reads": 1}


async def test_a_stale_revision_falls_back_to_a_read() -> None:
    kv = FakeKv()
    ours, theirs = thread_log(kv), thread_log(kv)
    await ours.raise_mark("t", 1, 10)
    await theirs.raise_mark("t", 3, 12)  # another flusher moved the key
    await ours.raise_mark("t", 4, 13)
    assert kv.seq("t") == 4
    assert ours.mark_stats["stale_revisions"] == 1
    await ours.raise_mark("t", 6, 15)  # the revision read in the fallback is remembered
    assert ours.mark_stats["cached_swaps"] == 1
    assert kv.seq("t") == 6


async def test_a_stale_cache_never_lowers_the_mark() -> None:
    kv = FakeKv()
    ours, theirs = thread_log(kv), thread_log(kv)
    await ours.raise_mark("t", 1, 10)
    await theirs.raise_mark("t", 9, 18)
    await ours.raise_mark("t", 4, 13)
    assert kv.seq("t") == 9
    swaps = kv.swaps
    await ours.raise_mark("t", 5, 14)  # now known to be at 9: nothing to write
    assert kv.swaps == swaps
    assert kv.seq("t") == 9


async def test_a_deleted_mark_is_created_again() -> None:
    kv = FakeKv()
    log = thread_log(kv)
    await log.raise_mark("t", 2, 11)
    del kv.items[flushed_key("t")]
    await log.raise_mark("t", 3, 12)
    assert kv.seq("t") == 3
    assert log.mark_stats["stale_revisions"] == 1


async def test_a_read_mark_is_remembered() -> None:
    kv = FakeKv()
    await thread_log(kv).raise_mark("t", 2, 11)
    log = thread_log(kv)
    mark = await log.mark("t")
    assert mark is not None
    assert mark.seq == 2
    gets = kv.gets
    await log.raise_mark("t", 3, 12)
    assert kv.gets == gets
    assert kv.seq("t") == 3
