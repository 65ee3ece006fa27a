"""Runs: upsert by id, `load_run`, `latest_run` and unknown ids."""

from __future__ import annotations

from datetime import timedelta, timezone

from buffered_store import RunOwnershipError, RunStatus, ThreadRunStore

from .assertions import raises
from .helpers import at, fresh_id, make_messages, make_run


class RunContract:
    """Runs are upserted by `run_id`; `latest_run` is the run of the latest checkpoint."""

    group = "runs"

    async def test_unknown_thread_reads_are_empty(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        assert await store.load_thread(tid) is None
        assert await store.load_messages(tid) is None
        assert await store.latest_run(tid) is None
        assert await store.list_runs(tid) == []

    async def test_unknown_run_is_none(self, store: ThreadRunStore) -> None:
        assert await store.load_run(fresh_id("run")) is None

    async def test_run_round_trips_every_field(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        run = make_run(
            tid,
            agent_id="agent-ü",
            status=RunStatus.FAILED,
            parent_run_id=fresh_id("parent-run"),
            parent_thread_id=fresh_id("parent"),
            created_at=at(1.000001),
            updated_at=at(2.5),
            finished_at=at(3.999999),
            steps=7,
            input_tokens=1234,
            output_tokens=2**40,
            error="boom: ✗",
            output={"answer": [1, 2.5, None, True, "ok"]},
            metadata={"model": "m", "nested": {"k": [1]}},
        )
        await store.checkpoint(tid, make_messages(1), run)
        assert await store.load_run(run.run_id) == run
        assert await store.latest_run(tid) == run
        assert await store.list_runs(tid) == [run]

    async def test_run_timestamps_in_other_timezones_keep_their_instant(
        self, store: ThreadRunStore
    ) -> None:
        tid = fresh_id()
        india = timezone(timedelta(hours=5, minutes=30))
        created = at(10).astimezone(india)
        run = make_run(tid, created_at=created, updated_at=created, finished_at=created)
        await store.checkpoint(tid, [], run)
        loaded = await store.load_run(run.run_id)
        assert loaded is not None
        assert loaded.created_at == created
        assert loaded.finished_at == created
        assert loaded.created_at.utcoffset() is not None

    async def test_run_is_upserted_by_id(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        run = make_run(tid, created_at=at(0), updated_at=at(0))
        await store.checkpoint(tid, make_messages(1), run)
        done = run.replace(
            status=RunStatus.DONE, steps=3, updated_at=at(5), finished_at=at(5), output="done"
        )
        await store.checkpoint(tid, make_messages(2), done)
        loaded = await store.load_run(run.run_id)
        assert loaded == done
        assert loaded is not None
        assert loaded.created_at == at(0)
        assert await store.list_runs(tid) == [done]

    async def test_several_runs_on_one_thread_are_all_listed(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        runs = [make_run(tid, created_at=at(i)) for i in range(4)]
        for step, run in enumerate(runs):
            await store.checkpoint(tid, make_messages(step + 1), run)
        assert await store.list_runs(tid) == list(reversed(runs))
        for run in runs:
            assert await store.load_run(run.run_id) == run

    async def test_latest_run_is_the_run_of_the_latest_checkpoint(
        self, store: ThreadRunStore
    ) -> None:
        tid = fresh_id()
        older, newer = make_run(tid, created_at=at(0)), make_run(tid, created_at=at(60))
        await store.checkpoint(tid, make_messages(1), older)
        assert await store.latest_run(tid) == older
        await store.checkpoint(tid, make_messages(2), newer)
        assert await store.latest_run(tid) == newer
        # The older run checkpointed again is the latest run, though created earlier.
        older_again = older.replace(steps=2)
        await store.checkpoint(tid, make_messages(3), older_again)
        assert await store.latest_run(tid) == older_again

    async def test_latest_run_returns_newest_version(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        run = make_run(tid)
        for steps in range(1, 4):
            await store.checkpoint(tid, make_messages(steps), run.replace(steps=steps))
        latest = await store.latest_run(tid)
        assert latest is not None
        assert latest.steps == 3

    async def test_run_id_of_another_thread_is_refused_and_nothing_is_written(
        self, store: ThreadRunStore
    ) -> None:
        # Runs are keyed by id alone: reusing one on another thread would move it
        # (issue 9, finding 6). `other` was just written, so a store's fast path for
        # the thread it wrote last is what refuses it.
        owner, other = fresh_id(), fresh_id()
        run = make_run(owner, created_at=at(0), updated_at=at(0))
        await store.checkpoint(owner, make_messages(1), run)
        own = make_run(other, created_at=at(1))
        await store.checkpoint(other, make_messages(1), own)
        with raises(RunOwnershipError) as caught:
            await store.checkpoint(other, make_messages(2), run.replace(thread_id=other))
        assert (caught.value.run_id, caught.value.owner_thread_id) == (run.run_id, owner)
        assert owner in str(caught.value)
        assert await store.load_run(run.run_id) == run
        assert await store.list_runs(owner) == [run]
        assert await store.latest_run(owner) == run
        assert await store.list_runs(other) == [own]
        assert await store.latest_run(other) == own
        assert await store.load_messages(other) == make_messages(1)
        # No seq was consumed: the next checkpoint of the thread is its second.
        receipt = await store.checkpoint(other, make_messages(2), own.replace(steps=2))
        assert receipt.thread_seq == 2

    async def test_run_id_of_another_thread_does_not_create_a_new_thread(
        self, store: ThreadRunStore
    ) -> None:
        owner, newcomer = fresh_id(), fresh_id()
        run = make_run(owner)
        await store.checkpoint(owner, make_messages(1), run)
        with raises(RunOwnershipError) as caught:
            await store.checkpoint(newcomer, make_messages(1), run.replace(thread_id=newcomer))
        assert caught.value.owner_thread_id == owner
        assert await store.load_thread(newcomer) is None
        assert await store.load_run(run.run_id) == run
        receipt = await store.checkpoint(newcomer, make_messages(1), make_run(newcomer))
        assert receipt.thread_seq == 1

    async def test_run_id_is_free_again_once_its_thread_is_deleted(
        self, store: ThreadRunStore
    ) -> None:
        owner, heir = fresh_id(), fresh_id()
        run = make_run(owner)
        await store.checkpoint(owner, make_messages(1), run)
        await store.delete_thread(owner)
        inherited = run.replace(thread_id=heir)
        await store.checkpoint(heir, make_messages(1), inherited)
        assert await store.load_run(run.run_id) == inherited
        assert await store.list_runs(heir) == [inherited]
