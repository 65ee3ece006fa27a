"""Concurrent checkpoints from one event loop."""

from __future__ import annotations

import asyncio

from buffered_store import CheckpointReceipt, Message, RunRecord, ThreadRunStore

from .helpers import fresh_id, make_messages, make_run


class ConcurrencyContract:
    """Concurrent writers never lose, mix or duplicate checkpoints."""

    group = "concurrency"

    async def test_concurrent_checkpoints_on_different_threads(self, store: ThreadRunStore) -> None:
        ids = [fresh_id() for _ in range(16)]
        runs = {tid: make_run(tid) for tid in ids}

        async def writer(tid: str) -> list[int]:
            return [
                (await store.checkpoint(tid, make_messages(step), runs[tid])).thread_seq
                for step in range(1, 4)
            ]

        results = await asyncio.gather(*(writer(tid) for tid in ids))
        assert results == [[1, 2, 3]] * len(ids)
        for tid in ids:
            assert await store.load_messages(tid) == make_messages(3)
            assert await store.latest_run(tid) == runs[tid]

    async def test_concurrent_checkpoints_on_one_thread(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        calls: list[tuple[list[Message], RunRecord]] = [
            ([{"role": "user", "content": f"writer {i}"}, *make_messages(i % 4)], make_run(tid))
            for i in range(20)
        ]

        async def writer(index: int) -> CheckpointReceipt:
            messages, run = calls[index]
            return await store.checkpoint(tid, messages, run)

        receipts = await asyncio.gather(*(writer(i) for i in range(len(calls))))
        assert sorted(r.thread_seq for r in receipts) == list(range(1, len(calls) + 1))
        # The thread holds exactly the snapshot and run of the last entry: never a mix.
        winner = max(range(len(calls)), key=lambda i: receipts[i].thread_seq)
        messages, run = calls[winner]
        assert await store.load_messages(tid) == messages
        assert await store.latest_run(tid) == run
        thread = await store.load_thread(tid)
        assert thread is not None
        assert (thread.latest_run_id, thread.message_count) == (run.run_id, len(messages))
        assert len(await store.list_runs(tid)) == len(calls)
