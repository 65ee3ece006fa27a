"""Message snapshots: overwrite semantics and per-thread sequence numbers."""

from __future__ import annotations

from buffered_store import ThreadRunStore

from .helpers import fresh_id, make_messages, make_run


class SnapshotContract:
    """`checkpoint` stores the full snapshot; `load_messages` returns the latest one."""

    group = "snapshots"

    async def test_messages_round_trip(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        messages = make_messages(3)
        await store.checkpoint(tid, messages, make_run(tid))
        assert await store.load_messages(tid) == messages

    async def test_longer_snapshot_appends(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        run = make_run(tid)
        await store.checkpoint(tid, make_messages(2), run)
        await store.checkpoint(tid, make_messages(5), run)
        assert await store.load_messages(tid) == make_messages(5)

    async def test_shorter_snapshot_truncates(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        run = make_run(tid)
        await store.checkpoint(tid, make_messages(5), run)
        await store.checkpoint(tid, make_messages(2), run)
        assert await store.load_messages(tid) == make_messages(2)
        thread = await store.load_thread(tid)
        assert thread is not None
        assert thread.message_count == 2

    async def test_rewritten_middle_message_is_replaced(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        run = make_run(tid)
        await store.checkpoint(tid, make_messages(5), run)
        rewritten = make_messages(5)
        rewritten[2] = {"role": "assistant", "content": "edited"}
        await store.checkpoint(tid, rewritten, run)
        assert await store.load_messages(tid) == rewritten

    async def test_rewrite_and_grow_in_one_step(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        run = make_run(tid)
        await store.checkpoint(tid, make_messages(4), run)
        changed = [
            *make_messages(1),
            {"role": "system", "content": "summary"},
            *make_messages(3, start=10),
        ]
        await store.checkpoint(tid, changed, run)
        assert await store.load_messages(tid) == changed

    async def test_completely_different_snapshot(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        run = make_run(tid)
        await store.checkpoint(tid, make_messages(3), run)
        await store.checkpoint(tid, make_messages(2, start=100), run)
        assert await store.load_messages(tid) == make_messages(2, start=100)

    async def test_empty_snapshot_clears_messages(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        run = make_run(tid)
        await store.checkpoint(tid, make_messages(3), run)
        await store.checkpoint(tid, [], run)
        assert await store.load_messages(tid) == []
        thread = await store.load_thread(tid)
        assert thread is not None
        assert thread.message_count == 0

    async def test_first_checkpoint_without_messages_creates_thread(
        self, store: ThreadRunStore
    ) -> None:
        tid = fresh_id()
        await store.checkpoint(tid, [], make_run(tid))
        assert await store.load_messages(tid) == []
        assert await store.load_thread(tid) is not None

    async def test_identical_snapshot_keeps_messages(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        run = make_run(tid)
        first = await store.checkpoint(tid, make_messages(3), run)
        second = await store.checkpoint(tid, make_messages(3), run)
        assert (first.thread_seq, second.thread_seq) == (1, 2)
        assert await store.load_messages(tid) == make_messages(3)

    async def test_snapshot_may_hold_equal_messages(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        same = {"role": "user", "content": "again"}
        await store.checkpoint(tid, [same, same, same], make_run(tid))
        await store.checkpoint(tid, [same, same], make_run(tid))
        assert await store.load_messages(tid) == [same, same]

    async def test_many_messages_keep_their_order(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        messages = make_messages(1000)
        await store.checkpoint(tid, messages, make_run(tid))
        assert await store.load_messages(tid) == messages

    async def test_receipt_seqs_are_gap_free_from_one(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        run = make_run(tid)
        receipts = [await store.checkpoint(tid, make_messages(i), run) for i in range(1, 6)]
        assert [r.thread_seq for r in receipts] == [1, 2, 3, 4, 5]
        assert {r.thread_id for r in receipts} == {tid}

    async def test_seqs_are_per_thread(self, store: ThreadRunStore) -> None:
        first, second = fresh_id(), fresh_id()
        seqs: dict[str, list[int]] = {first: [], second: []}
        for step in range(3):
            for tid in (first, second):
                receipt = await store.checkpoint(tid, make_messages(step + 1), make_run(tid))
                seqs[tid].append(receipt.thread_seq)
        assert seqs == {first: [1, 2, 3], second: [1, 2, 3]}
