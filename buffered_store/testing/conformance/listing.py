"""`list_runs` and `list_threads`: filters, order and pagination.

Tests without a thread filter use the `empty_store` fixture: they need to see every row.
"""

from __future__ import annotations

from buffered_store import RunRecord, RunStatus, Thread, ThreadRunStore

from .helpers import at, fresh_id, make_messages, make_run


def _thread_order(threads: list[Thread]) -> list[str]:
    ordered = sorted(threads, key=lambda t: (t.updated_at, t.thread_id), reverse=True)
    return [t.thread_id for t in ordered]


class ListRunsContract:
    """`list_runs`: newest `created_at` first, then `run_id` descending."""

    group = "list_runs"

    async def test_list_runs_order(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        runs = {
            name: make_run(tid, run_id=f"{tid}-{name}", created_at=at(seconds))
            for name, seconds in (("b", 3), ("a", 1), ("d", 2), ("c", 2), ("e", 1.000001))
        }
        for run in runs.values():
            await store.checkpoint(tid, make_messages(1), run)
        listed = [r.run_id.rsplit("-", 1)[1] for r in await store.list_runs(tid)]
        assert listed == ["b", "d", "c", "e", "a"]

    async def test_list_runs_filters_by_status_within_thread(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        statuses = [RunStatus.RUNNING, RunStatus.DONE, RunStatus.FAILED, RunStatus.DONE]
        runs = [make_run(tid, status=s, created_at=at(i)) for i, s in enumerate(statuses)]
        for run in runs:
            await store.checkpoint(tid, make_messages(1), run)
        assert await store.list_runs(tid, status=RunStatus.DONE) == [runs[3], runs[1]]
        assert await store.list_runs(tid, status=RunStatus.FAILED) == [runs[2]]
        assert await store.list_runs(tid, status=RunStatus.CANCELLED) == []
        assert await store.list_runs(tid, status=None) == list(reversed(runs))

    async def test_list_runs_status_follows_upsert(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        run = make_run(tid)
        await store.checkpoint(tid, make_messages(1), run)
        done = run.replace(status=RunStatus.DONE)
        await store.checkpoint(tid, make_messages(2), done)
        assert await store.list_runs(tid, status=RunStatus.RUNNING) == []
        assert await store.list_runs(tid, status=RunStatus.DONE) == [done]

    async def test_list_runs_pagination(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        runs = [make_run(tid, created_at=at(i)) for i in range(5)]
        for run in runs:
            await store.checkpoint(tid, make_messages(1), run)
        newest_first = list(reversed(runs))
        assert await store.list_runs(tid, limit=2) == newest_first[:2]
        assert await store.list_runs(tid, limit=2, offset=2) == newest_first[2:4]
        assert await store.list_runs(tid, limit=2, offset=4) == newest_first[4:]
        assert await store.list_runs(tid, limit=2, offset=5) == []
        assert await store.list_runs(tid, offset=100) == []
        assert await store.list_runs(tid, limit=0) == []
        assert await store.list_runs(tid, limit=0, offset=2) == []

    async def test_list_runs_default_limit_is_50(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        runs = [make_run(tid, created_at=at(i)) for i in range(53)]
        for run in runs:
            await store.checkpoint(tid, [], run)
        listed = await store.list_runs(tid)
        assert listed == list(reversed(runs))[:50]

    async def test_list_runs_of_every_thread(self, empty_store: ThreadRunStore) -> None:
        store = empty_store
        assert await store.list_runs() == []
        first, second = fresh_id(), fresh_id()
        runs: list[RunRecord] = []
        for _ in range(3):
            for tid in (first, second):
                runs.append(make_run(tid, created_at=at(len(runs))))
                await store.checkpoint(tid, make_messages(1), runs[-1])
        assert await store.list_runs() == list(reversed(runs))
        assert await store.list_runs(limit=2, offset=1) == list(reversed(runs))[1:3]

    async def test_list_runs_by_status_across_threads(self, empty_store: ThreadRunStore) -> None:
        store = empty_store
        first, second = fresh_id(), fresh_id()
        done_1 = make_run(first, status=RunStatus.DONE, created_at=at(1))
        running = make_run(second, created_at=at(2))
        done_2 = make_run(second, status=RunStatus.DONE, created_at=at(3))
        for run in (done_1, running, done_2):
            await store.checkpoint(run.thread_id, make_messages(1), run)
        assert await store.list_runs(status=RunStatus.DONE) == [done_2, done_1]
        assert await store.list_runs(status=RunStatus.RUNNING) == [running]
        assert await store.list_runs(second, status=RunStatus.DONE) == [done_2]


class ListThreadsContract:
    """`list_threads`: live threads, newest `updated_at` first, then `thread_id` descending."""

    group = "list_threads"

    async def test_list_threads_of_empty_store(self, empty_store: ThreadRunStore) -> None:
        assert await empty_store.list_threads() == []

    async def test_list_threads_order(self, empty_store: ThreadRunStore) -> None:
        store = empty_store
        prefix = fresh_id()
        # Checkpoint order and id order agree, so ties of updated_at cannot change the result.
        ids = [f"{prefix}-a", f"{prefix}-b", f"{prefix}-c"]
        for tid in ids:
            await store.checkpoint(tid, make_messages(1), make_run(tid))
        listed = await store.list_threads()
        assert [t.thread_id for t in listed] == list(reversed(ids))
        for thread in listed:
            assert thread == await store.load_thread(thread.thread_id)

    async def test_list_threads_moves_updated_thread_first(
        self, empty_store: ThreadRunStore
    ) -> None:
        store = empty_store
        prefix = fresh_id()
        ids = [f"{prefix}-a", f"{prefix}-b", f"{prefix}-c"]
        for tid in ids:
            await store.checkpoint(tid, make_messages(1), make_run(tid))
        await store.checkpoint(ids[0], make_messages(2), make_run(ids[0]))
        loaded = [await store.load_thread(tid) for tid in ids]
        threads = [t for t in loaded if t is not None]
        assert threads[0].updated_at >= threads[2].updated_at
        listed = await store.list_threads()
        assert [t.thread_id for t in listed] == _thread_order(threads)
        if threads[0].updated_at > threads[2].updated_at:
            assert listed[0].thread_id == ids[0]

    async def test_list_threads_pagination(self, empty_store: ThreadRunStore) -> None:
        store = empty_store
        prefix = fresh_id()
        ids = [f"{prefix}-{i}" for i in range(5)]
        for tid in ids:
            await store.checkpoint(tid, make_messages(1), make_run(tid))
        newest_first = list(reversed(ids))

        async def page(**kwargs: int) -> list[str]:
            return [t.thread_id for t in await store.list_threads(**kwargs)]

        assert await page(limit=2) == newest_first[:2]
        assert await page(limit=2, offset=2) == newest_first[2:4]
        assert await page(limit=2, offset=4) == newest_first[4:]
        assert await page(limit=2, offset=5) == []
        assert await page(offset=50) == []
        assert await page(limit=0) == []

    async def test_list_threads_default_limit_is_50(self, empty_store: ThreadRunStore) -> None:
        store = empty_store
        prefix = fresh_id()
        ids = [f"{prefix}-{i:03d}" for i in range(52)]
        for tid in ids:
            await store.checkpoint(tid, [], make_run(tid))
        listed = await store.list_threads()
        assert [t.thread_id for t in listed] == list(reversed(ids))[:50]

    async def test_list_threads_excludes_deleted(self, empty_store: ThreadRunStore) -> None:
        store = empty_store
        prefix = fresh_id()
        ids = [f"{prefix}-{i}" for i in range(3)]
        for tid in ids:
            await store.checkpoint(tid, make_messages(1), make_run(tid))
        await store.delete_thread(ids[1])
        assert [t.thread_id for t in await store.list_threads()] == [ids[2], ids[0]]
        assert [t.thread_id for t in await store.list_threads(limit=1, offset=1)] == [ids[0]]
