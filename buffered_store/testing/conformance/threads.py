"""The thread summary: timestamps, latest run, message count, metadata and parent."""

from __future__ import annotations

from buffered_store import ThreadRunStore

from .helpers import fresh_id, make_messages, make_run


class ThreadSummaryContract:
    """`load_thread` reflects the latest checkpoint."""

    group = "threads"

    async def test_summary_after_first_checkpoint(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        run = make_run(tid)
        await store.checkpoint(tid, make_messages(3), run)
        thread = await store.load_thread(tid)
        assert thread is not None
        assert thread.thread_id == tid
        assert thread.message_count == 3
        assert thread.latest_run_id == run.run_id
        assert thread.parent_thread_id is None
        assert dict(thread.metadata) == {}
        assert thread.created_at.utcoffset() is not None
        assert thread.created_at == thread.updated_at

    async def test_created_at_stays_and_updated_at_moves_forward(
        self, store: ThreadRunStore
    ) -> None:
        tid = fresh_id()
        run = make_run(tid)
        seen = []
        for step in range(1, 5):
            await store.checkpoint(tid, make_messages(step), run)
            thread = await store.load_thread(tid)
            assert thread is not None
            seen.append(thread)
        assert {t.created_at for t in seen} == {seen[0].created_at}
        updated = [t.updated_at for t in seen]
        assert updated == sorted(updated)
        assert all(t.updated_at >= t.created_at for t in seen)
        assert [t.message_count for t in seen] == [1, 2, 3, 4]

    async def test_latest_run_id_follows_latest_checkpoint(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        first, second = make_run(tid), make_run(tid)
        for run in (first, second, first):
            await store.checkpoint(tid, make_messages(1), run)
            thread = await store.load_thread(tid)
            assert thread is not None
            assert thread.latest_run_id == run.run_id

    async def test_metadata_replaces_and_is_kept_when_omitted(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        run = make_run(tid)

        async def metadata_after(*given: dict[str, object] | None) -> dict[str, object]:
            if given:
                await store.checkpoint(tid, make_messages(1), run, metadata=given[0])
            else:
                await store.checkpoint(tid, make_messages(1), run)
            thread = await store.load_thread(tid)
            assert thread is not None
            return dict(thread.metadata)

        assert await metadata_after({"a": 1, "tags": ["x"]}) == {"a": 1, "tags": ["x"]}
        assert await metadata_after() == {"a": 1, "tags": ["x"]}
        assert await metadata_after(None) == {"a": 1, "tags": ["x"]}
        assert await metadata_after({"b": 2}) == {"b": 2}, "replaced, not merged"
        assert await metadata_after({}) == {}

    async def test_parent_thread_id_comes_from_run_and_is_sticky(
        self, store: ThreadRunStore
    ) -> None:
        tid, parent, other = fresh_id(), fresh_id("parent"), fresh_id("other")
        parents = []
        for run_parent in (None, parent, other, None):
            await store.checkpoint(
                tid, make_messages(1), make_run(tid, parent_thread_id=run_parent)
            )
            thread = await store.load_thread(tid)
            assert thread is not None
            parents.append(thread.parent_thread_id)
        assert parents == [None, parent, parent, parent]

    async def test_parent_thread_id_set_by_first_run(self, store: ThreadRunStore) -> None:
        tid, parent = fresh_id(), fresh_id("parent")
        await store.checkpoint(tid, [], make_run(tid, parent_thread_id=parent))
        thread = await store.load_thread(tid)
        assert thread is not None
        assert thread.parent_thread_id == parent
