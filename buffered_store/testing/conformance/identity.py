"""Identifiers: any Unicode round-trips, and an id only ever matches itself."""

from __future__ import annotations

from buffered_store import ThreadRunStore
from buffered_store.engine.ids import MAX_ID_BYTES
from buffered_store.errors import ValidationError

from .assertions import cases, raises
from .helpers import fresh_id, make_messages, make_run

UNICODE_SUFFIXES = [
    "🧵 emoji",
    "dots.in.the.middle",
    "star*",
    "gt>",
    "a.*.>",
    "with  spaces ",
    "שלום עולם",
    "مرحبا",
    "日本語のスレッド",
    "tab\tand\nnewline",
    "quote'\"back\\slash",
    "%_like_%",
    "$KV.bucket",
    "\u200bzero-width",
]


def _varied_cjk(size: int, *, prefix: str = "", start: int = 0x4E00) -> str:
    """An id of exactly `size` UTF-8 bytes: `prefix`, distinct CJK ideographs (3 bytes
    each, so nothing repeats for compression to exploit), then ASCII padding."""
    chars = (size - len(prefix.encode())) // 3
    value = prefix + "".join(chr(start + i) for i in range(chars))
    return value + "x" * (size - len(value.encode()))


class IdentityContract:
    """Ids are opaque, exact and case-sensitive strings of any Unicode."""

    group = "identity"

    @cases("suffix", UNICODE_SUFFIXES)
    async def test_unicode_thread_ids_round_trip(self, store: ThreadRunStore, suffix: str) -> None:
        tid = f"{fresh_id()}/{suffix}"
        run = make_run(tid, run_id=f"run {suffix} {fresh_id()}")
        receipt = await store.checkpoint(tid, make_messages(2), run)
        assert receipt.thread_id == tid
        thread = await store.load_thread(tid)
        assert thread is not None
        assert thread.thread_id == tid
        assert await store.load_messages(tid) == make_messages(2)
        assert await store.load_run(run.run_id) == run
        assert await store.latest_run(tid) == run
        assert await store.list_runs(tid) == [run]

    async def test_bare_subject_tokens_as_ids(self, empty_store: ThreadRunStore) -> None:
        store = empty_store
        ids = [">", "*", ".", " ", "..", "a.*.>", "-", "_", "="]
        runs = {tid: make_run(tid) for tid in ids}
        for index, tid in enumerate(ids):
            await store.checkpoint(tid, make_messages(index + 1), runs[tid])
        for index, tid in enumerate(ids):
            assert await store.load_messages(tid) == make_messages(index + 1)
            assert await store.list_runs(tid) == [runs[tid]]
        assert sorted(t.thread_id for t in await store.list_threads()) == sorted(ids)

    async def test_longest_ids_round_trip(self, store: ThreadRunStore) -> None:
        # At the limit in UTF-8 bytes, with varied CJK characters that Postgres cannot
        # compress in its indexes (repetitive ids would pass even when too long).
        tid = _varied_cjk(MAX_ID_BYTES, prefix=fresh_id())
        run_id = _varied_cjk(MAX_ID_BYTES, prefix=fresh_id("run"), start=0x5000)
        agent_id = "a" * MAX_ID_BYTES
        assert [len(x.encode()) for x in (tid, run_id, agent_id)] == [MAX_ID_BYTES] * 3
        run = make_run(tid, run_id=run_id, agent_id=agent_id)
        await store.checkpoint(tid, make_messages(1), run)
        thread = await store.load_thread(tid)
        assert thread is not None
        assert thread.thread_id == tid
        assert await store.load_run(run_id) == run
        assert await store.list_runs(tid) == [run]
        await store.delete_thread(tid)
        assert await store.load_thread(tid) is None

    async def test_ids_too_long_in_bytes_are_rejected_and_nothing_is_written(
        self, store: ThreadRunStore
    ) -> None:
        # 512 varied CJK characters pass a limit counted in characters, but their 1,536
        # bytes overflow Postgres' btree (issue 9, finding 2); one byte over is enough.
        prefix = fresh_id()
        long_tid = prefix + "".join(chr(0x4E00 + i) for i in range(MAX_ID_BYTES - len(prefix)))
        long_run = "".join(chr(0x6000 + i) for i in range(MAX_ID_BYTES))
        over_tid = _varied_cjk(MAX_ID_BYTES + 1, prefix=fresh_id())
        over_run = _varied_cjk(MAX_ID_BYTES + 1, prefix=fresh_id("run"), start=0x5000)
        assert len(long_tid) == len(long_run) == MAX_ID_BYTES
        tid = fresh_id()
        cases = [(long_tid, long_run), (over_tid, fresh_id("run")), (tid, over_run)]
        for thread_id, run_id in cases:
            with raises(ValidationError):
                # The record validates itself, so the error may come from building it.
                await store.checkpoint(
                    thread_id, make_messages(1), make_run(thread_id, run_id=run_id)
                )
        for thread_id in (long_tid, over_tid):
            with raises(ValidationError):
                await store.delete_thread(thread_id)
        assert await store.load_thread(tid) is None
        assert await store.list_runs(tid) == []
        # The store still works: no half-written or poisoned state.
        run = make_run(tid)
        await store.checkpoint(tid, make_messages(1), run)
        assert await store.list_runs(tid) == [run]

    async def test_like_metacharacters_in_thread_ids_match_exactly(
        self, store: ThreadRunStore
    ) -> None:
        prefix = fresh_id()
        ids = [f"{prefix}a_c", f"{prefix}abc", f"{prefix}a%", f"{prefix}a%c", f"{prefix}a\\c"]
        runs = {tid: make_run(tid) for tid in ids}
        for index, tid in enumerate(ids):
            await store.checkpoint(tid, make_messages(index + 1), runs[tid])
        for index, tid in enumerate(ids):
            thread = await store.load_thread(tid)
            assert thread is not None
            assert thread.thread_id == tid
            assert thread.message_count == index + 1
            assert await store.list_runs(tid) == [runs[tid]]
            assert await store.latest_run(tid) == runs[tid]
        for pattern in (f"{prefix}a", f"{prefix}%", f"{prefix}a_", f"{prefix}_bc", f"{prefix}a%%"):
            assert await store.load_thread(pattern) is None
            assert await store.list_runs(pattern) == []

    async def test_like_metacharacters_in_run_ids_match_exactly(
        self, store: ThreadRunStore
    ) -> None:
        tid = fresh_id()
        prefix = fresh_id("run")
        runs = [make_run(tid, run_id=f"{prefix}{suffix}") for suffix in ("r_1", "r11", "r%")]
        for run in runs:
            await store.checkpoint(tid, make_messages(1), run)
        for run in runs:
            assert await store.load_run(run.run_id) == run
        assert await store.load_run(f"{prefix}r_") is None
        assert await store.load_run(f"{prefix}%") is None

    async def test_delete_with_metacharacters_deletes_only_that_thread(
        self, store: ThreadRunStore
    ) -> None:
        prefix = fresh_id()
        victim, bystanders = f"{prefix}a_c", [f"{prefix}abc", f"{prefix}a_cd", f"{prefix}xa_c"]
        for tid in (victim, *bystanders):
            await store.checkpoint(tid, make_messages(1), make_run(tid))
        await store.delete_thread(f"{prefix}a%")
        await store.delete_thread(victim)
        assert await store.load_thread(victim) is None
        for tid in bystanders:
            assert await store.load_messages(tid) == make_messages(1)
            assert len(await store.list_runs(tid)) == 1

    async def test_ids_differing_in_case_space_or_normal_form_are_distinct(
        self, store: ThreadRunStore
    ) -> None:
        prefix = fresh_id()
        variants = ["abc", "ABC", "abc ", " abc", "café", "cafe\u0301", "ǅ", "ǆ"]
        ids = [prefix + v for v in variants]
        for index, tid in enumerate(ids):
            await store.checkpoint(tid, make_messages(index + 1), make_run(tid))
        for index, tid in enumerate(ids):
            thread = await store.load_thread(tid)
            assert thread is not None
            assert (thread.thread_id, thread.message_count) == (tid, index + 1)
            assert len(await store.list_runs(tid)) == 1
