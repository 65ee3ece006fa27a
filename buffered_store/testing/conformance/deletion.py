"""`delete_thread`: the thread disappears with its messages and runs; ids can be reused."""

from __future__ import annotations

from buffered_store import ThreadRunStore

from .helpers import fresh_id, make_messages, make_run


class DeletionContract:
    """After `delete_thread` every read behaves as if the thread never existed."""

    group = "deletion"

    async def test_delete_removes_thread_messages_and_runs(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        runs = [make_run(tid), make_run(tid)]
        for run in runs:
            await store.checkpoint(tid, make_messages(2), run, metadata={"k": "v"})
        await store.delete_thread(tid)
        assert await store.load_thread(tid) is None
        assert await store.load_messages(tid) is None
        assert await store.latest_run(tid) is None
        assert await store.list_runs(tid) == []
        for run in runs:
            assert await store.load_run(run.run_id) is None

    async def test_delete_leaves_other_threads_alone(self, store: ThreadRunStore) -> None:
        victim, other = fresh_id(), fresh_id()
        other_run = make_run(other)
        await store.checkpoint(victim, make_messages(1), make_run(victim))
        await store.checkpoint(other, make_messages(3), other_run)
        await store.delete_thread(victim)
        assert await store.load_messages(other) == make_messages(3)
        assert await store.load_run(other_run.run_id) == other_run
        assert await store.list_runs(other) == [other_run]

    async def test_deleted_runs_leave_unfiltered_lists(self, empty_store: ThreadRunStore) -> None:
        store = empty_store
        victim, other = fresh_id(), fresh_id()
        await store.checkpoint(victim, make_messages(1), make_run(victim))
        other_run = make_run(other)
        await store.checkpoint(other, make_messages(1), other_run)
        await store.delete_thread(victim)
        assert await store.list_runs() == [other_run]
        assert [t.thread_id for t in await store.list_threads()] == [other]

    async def test_deleting_unknown_thread_is_a_no_op(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        await store.delete_thread(tid)
        assert await store.load_thread(tid) is None
        receipt = await store.checkpoint(tid, make_messages(1), make_run(tid))
        assert receipt.thread_seq == 1

    async def test_deleting_twice_is_harmless(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        await store.checkpoint(tid, make_messages(1), make_run(tid))
        await store.delete_thread(tid)
        await store.delete_thread(tid)
        assert await store.load_thread(tid) is None

    async def test_recreate_after_delete_starts_fresh(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        parent = fresh_id("parent")
        old_run = make_run(tid, parent_thread_id=parent)
        receipts = [
            await store.checkpoint(tid, make_messages(n), old_run, metadata={"old": True})
            for n in (1, 2, 3)
        ]
        old = await store.load_thread(tid)
        assert old is not None
        await store.delete_thread(tid)

        new_run = make_run(tid)
        receipt = await store.checkpoint(tid, make_messages(1, start=50), new_run)

        assert receipt.thread_seq > receipts[-1].thread_seq, "seqs continue after a delete"
        thread = await store.load_thread(tid)
        assert thread is not None
        assert thread.created_at >= old.updated_at
        assert thread.created_at == thread.updated_at
        assert thread.message_count == 1
        assert thread.parent_thread_id is None
        assert dict(thread.metadata) == {}
        assert thread.latest_run_id == new_run.run_id
        assert await store.load_messages(tid) == make_messages(1, start=50)
        assert await store.list_runs(tid) == [new_run]
        assert await store.load_run(old_run.run_id) is None

    async def test_recreated_thread_keeps_gap_free_seqs(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        run = make_run(tid)
        first = [(await store.checkpoint(tid, [], run)).thread_seq for _ in range(3)]
        await store.delete_thread(tid)
        second = [(await store.checkpoint(tid, [], run)).thread_seq for _ in range(3)]
        assert first == [1, 2, 3]
        assert second == list(range(second[0], second[0] + 3))
        assert second[0] > 3

    async def test_run_id_can_be_reused_after_delete(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        run = make_run(tid, steps=1)
        await store.checkpoint(tid, make_messages(1), run)
        await store.delete_thread(tid)
        again = run.replace(steps=9)
        await store.checkpoint(tid, make_messages(1), again)
        assert await store.load_run(run.run_id) == again
        assert await store.list_runs(tid) == [again]
