"""`append`: a checkpoint of the thread's current snapshot followed by new messages."""

from __future__ import annotations

import asyncio
from typing import Any

from buffered_store import ThreadRunStore, ValidationError

from .assertions import cases, raises
from .helpers import as_any, fresh_id, make_messages, make_run


class AppendContract:
    """`append` extends the store's snapshot (never the caller's list) and is otherwise
    a checkpoint: same receipts, summaries, runs and validation."""

    group = "append"

    async def test_append_to_a_new_thread_creates_it(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        run = make_run(tid)
        receipt = await store.append(tid, make_messages(2), run, metadata={"k": "v"})
        assert receipt.thread_seq == 1
        assert await store.load_messages(tid) == make_messages(2)
        thread = await store.load_thread(tid)
        assert thread is not None
        assert (thread.message_count, thread.latest_run_id) == (2, run.run_id)
        assert thread.metadata == {"k": "v"}
        assert await store.load_run(run.run_id) == run

    async def test_appends_extend_the_snapshot_and_take_the_next_seqs(
        self, store: ThreadRunStore
    ) -> None:
        tid = fresh_id()
        run = make_run(tid)
        await store.checkpoint(tid, make_messages(3), run, metadata={"k": "v"})
        seqs = []
        for start in (3, 4, 6):
            new = make_messages(1 if start != 4 else 2, start=start)
            run = run.replace(steps=start)
            seqs.append((await store.append(tid, new, run)).thread_seq)
        assert seqs == [2, 3, 4]
        assert await store.load_messages(tid) == make_messages(7)
        thread = await store.load_thread(tid)
        assert thread is not None
        assert (thread.message_count, thread.metadata) == (7, {"k": "v"})
        assert await store.load_run(run.run_id) == run

    async def test_append_extends_the_stored_snapshot_not_the_callers_list(
        self, store: ThreadRunStore
    ) -> None:
        """A caller editing an earlier message does not change what `append` keeps: only
        `checkpoint` rewrites history. (The edit puts a new object in the list: a
        checkpointed message object is not changed in place, `checkpoint()`'s contract,
        docs/concepts/architecture.md, "Full snapshots cost O(new)".)"""
        tid = fresh_id()
        run = make_run(tid)
        messages = make_messages(2)
        await store.checkpoint(tid, messages, run)
        messages[0] = {**messages[0], "content": "edited"}
        messages.append(make_messages(1, start=2)[0])
        await store.append(tid, messages[-1:], run)
        assert await store.load_messages(tid) == make_messages(3)
        await store.checkpoint(tid, messages, run)
        assert await store.load_messages(tid) == messages

    async def test_append_after_a_truncating_checkpoint(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        run = make_run(tid)
        await store.checkpoint(tid, make_messages(5), run)
        await store.checkpoint(tid, make_messages(2), run)
        await store.append(tid, make_messages(1, start=9), run)
        assert await store.load_messages(tid) == [*make_messages(2), *make_messages(1, start=9)]

    async def test_empty_append_is_a_checkpoint_of_the_same_messages(
        self, store: ThreadRunStore
    ) -> None:
        tid = fresh_id()
        run = make_run(tid)
        await store.checkpoint(tid, make_messages(3), run)
        done = run.replace(steps=1)
        receipt = await store.append(tid, [], done)
        assert receipt.thread_seq == 2
        assert await store.load_messages(tid) == make_messages(3)
        assert await store.load_run(run.run_id) == done

    async def test_append_after_delete_starts_a_new_thread(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        await store.checkpoint(tid, make_messages(4), make_run(tid))
        await store.delete_thread(tid)
        run = make_run(tid)
        receipt = await store.append(tid, make_messages(1, start=7), run)
        assert receipt.thread_seq == 3
        assert await store.load_messages(tid) == make_messages(1, start=7)
        thread = await store.load_thread(tid)
        assert thread is not None
        assert thread.message_count == 1

    async def test_concurrent_appends_on_one_thread_all_land(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        run = make_run(tid)
        await store.checkpoint(tid, make_messages(1), run)
        new = [{"role": "user", "content": f"writer {i}"} for i in range(12)]
        receipts = await asyncio.gather(*(store.append(tid, [m], run) for m in new))
        assert sorted(r.thread_seq for r in receipts) == list(range(2, 14))
        stored = await store.load_messages(tid)
        assert stored is not None
        assert stored[0] == make_messages(1)[0]
        by_seq = sorted(zip(receipts, new, strict=True), key=lambda p: p[0].thread_seq)
        assert stored[1:] == [m for _, m in by_seq]

    @cases(
        "messages",
        [
            "text",
            {"role": "user"},
            [{"content": "no role"}],
            [{"role": "user", "x": float("nan")}],
            [{"role": "user", "content": "nul\x00"}],
            [{"role": "user", "content": object()}],
        ],
        ids=["str", "dict", "no-role", "nan", "nul", "object"],
    )
    async def test_append_rejects_bad_messages_and_writes_nothing(
        self, store: ThreadRunStore, messages: Any
    ) -> None:
        tid = fresh_id()
        run = make_run(tid)
        await store.checkpoint(tid, make_messages(2), run)
        bad_run = make_run(tid)
        with raises(ValidationError) as info:
            await store.append(tid, as_any(messages), bad_run)
        assert info.type is ValidationError
        assert await store.load_messages(tid) == make_messages(2)
        assert await store.load_run(bad_run.run_id) is None
        assert (await store.append(tid, [], run)).thread_seq == 2

    async def test_append_rejects_a_run_of_another_thread(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        other = make_run(fresh_id())
        with raises(ValidationError):
            await store.append(tid, make_messages(1), other)
        assert await store.load_thread(tid) is None
        assert await store.load_run(other.run_id) is None
