"""`FlushTargetContract`: the `FlushTarget` behaviour every native inner store must have
(the flush sink of the thread-run front-end: what the flusher applies WAL entries to).

Every check gets a FRESH, EMPTY store implementing both `ThreadRunStore` and `FlushTarget`,
owned by that check (listings are checked without filters). Entries are built with
`Chain`, exactly as the buffered writer builds them, and the results are read back
through both protocols.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from buffered_store import Message, RunRecord, RunStatus, Thread, ThreadRunStore
from buffered_store.engine.flushing import ApplyStatus
from buffered_store.model.changes import (
    WalEntry,
)
from buffered_store.model.checkpointing import (
    build_checkpoint_entry,
    build_delete_entry,
    validate_checkpoint,
)
from buffered_store.model.target import FlushTarget
from buffered_store.testing import InnerStore, make_messages, make_run
from buffered_store.threadrun.entry import (
    decode_entry,
    encode_entry,
)

from .assertions import cases
from .helpers import T0, fresh_id

__all__ = ["Chain", "FlushTargetContract", "TickingClock", "replace_entry"]


class TickingClock:
    """A fake clock: every reading is one millisecond after the previous one."""

    def __init__(self, start: datetime = T0) -> None:
        self.now = start

    def __call__(self) -> datetime:
        self.now += timedelta(milliseconds=1)
        return self.now


class Chain:
    """Consecutive WAL entries of one thread, built the way the buffered writer builds them."""

    def __init__(self, thread_id: str | None = None, clock: TickingClock | None = None) -> None:
        self.thread_id = thread_id or fresh_id()
        self.clock = clock or TickingClock()
        self.seq = 0
        self.thread: Thread | None = None
        self.encoded: list[bytes] | None = None

    def checkpoint(
        self,
        messages: Sequence[Message],
        run: RunRecord | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> WalEntry:
        """The next entry: a checkpoint of `messages` (a delta against the previous one)."""
        call = validate_checkpoint(
            self.thread_id, messages, run or make_run(self.thread_id), metadata
        )
        self.seq += 1
        entry = build_checkpoint_entry(
            call,
            previous=self.thread,
            previous_messages=self.encoded,
            seq=self.seq,
            now=self.clock(),
        )
        self.thread, self.encoded = entry.thread, call.encoded
        return entry

    def delete(self) -> WalEntry:
        """The next entry: a delete."""
        self.seq += 1
        self.thread, self.encoded = None, None
        return build_delete_entry(self.thread_id, seq=self.seq, now=self.clock())


def replace_entry(entry: WalEntry, **changes: Any) -> WalEntry:
    """A copy of an entry with some fields changed (to forge malformed entries)."""
    fields = {name: getattr(entry, name) for name in WalEntry.__dataclass_fields__}
    return WalEntry(**(fields | changes))


class FlushTargetContract:
    """Watermark-checked application of WAL entries, and versioned reads."""

    group = "flush_target"

    async def test_implements_both_protocols(self, target: InnerStore) -> None:
        assert isinstance(target, ThreadRunStore)
        assert isinstance(target, FlushTarget)

    async def test_apply_writes_entries_and_watermark(self, target: InnerStore) -> None:
        chain = Chain()
        run = make_run(chain.thread_id)
        entries = [chain.checkpoint(make_messages(n), run) for n in (1, 2, 3)]
        [outcome] = await target.apply([entries])
        assert (outcome.thread_id, outcome.status, outcome.flushed_seq) == (
            chain.thread_id,
            ApplyStatus.APPLIED,
            3,
        )
        assert await target.load_messages(chain.thread_id) == make_messages(3)
        assert await target.load_thread(chain.thread_id) == chain.thread
        assert await target.latest_run(chain.thread_id) == run
        assert await target.flushed_seqs([chain.thread_id]) == {chain.thread_id: 3}

    async def test_applies_batches_one_after_another(self, target: InnerStore) -> None:
        chain = Chain()
        run = make_run(chain.thread_id)
        entries = [chain.checkpoint(make_messages(n), run.replace(steps=n)) for n in range(1, 11)]
        for start in range(0, 10, 4):
            [outcome] = await target.apply([entries[start : start + 4]])
            assert outcome.flushed_seq == min(start + 4, 10)
        assert await target.load_messages(chain.thread_id) == make_messages(10)
        assert await target.latest_run(chain.thread_id) == run.replace(steps=10)

    async def test_applies_several_threads_in_one_call(self, target: InnerStore) -> None:
        chains = [Chain() for _ in range(8)]
        batches = [[chain.checkpoint(make_messages(n)) for n in range(1, 6)] for chain in chains]
        outcomes = await target.apply(batches)
        assert [o.thread_id for o in outcomes] == [c.thread_id for c in chains]
        assert {(o.status, o.flushed_seq) for o in outcomes} == {(ApplyStatus.APPLIED, 5)}
        for chain, batch in zip(chains, batches, strict=True):
            assert await target.load_thread(chain.thread_id) == batch[-1].thread
            assert await target.load_messages(chain.thread_id) == make_messages(5)

    async def test_several_runs_of_one_batch_all_survive(self, target: InnerStore) -> None:
        chain = Chain()
        runs = [make_run(chain.thread_id, created_at=T0 + timedelta(seconds=i)) for i in range(3)]
        await target.apply([[chain.checkpoint(make_messages(1), run) for run in runs]])
        assert await target.list_runs(chain.thread_id) == list(reversed(runs))
        assert await target.latest_run(chain.thread_id) == runs[-1]

    async def test_stale_batch_changes_nothing(self, target: InnerStore) -> None:
        chain = Chain()
        e1, e2 = chain.checkpoint(make_messages(1)), chain.checkpoint(make_messages(2))
        await target.apply([[e1, e2]])
        [outcome] = await target.apply([[e1]])
        assert (outcome.status, outcome.flushed_seq) == (ApplyStatus.STALE, 2)
        assert await target.load_messages(chain.thread_id) == make_messages(2)

    async def test_gap_writes_nothing_and_names_the_missing_seq(self, target: InnerStore) -> None:
        chain = Chain()
        e1, e2 = chain.checkpoint(make_messages(1)), chain.checkpoint(make_messages(2))
        [outcome] = await target.apply([[e2]])
        assert (outcome.status, outcome.flushed_seq, outcome.missing_from) == (
            ApplyStatus.GAP,
            0,
            1,
        )
        assert await target.load_thread(chain.thread_id) is None
        [outcome] = await target.apply([[e1]])
        assert outcome.status is ApplyStatus.APPLIED
        [outcome] = await target.apply([[e2]])
        assert (outcome.status, outcome.flushed_seq) == (ApplyStatus.APPLIED, 2)

    async def test_duplicated_and_reordered_entries_apply_once(self, target: InnerStore) -> None:
        chain = Chain()
        e1, e2, e3 = (chain.checkpoint(make_messages(n)) for n in (1, 2, 3))
        [outcome] = await target.apply([[e3, e1, e2, e1, e3]])
        assert (outcome.status, outcome.flushed_seq) == (ApplyStatus.APPLIED, 3)
        assert await target.load_messages(chain.thread_id) == make_messages(3)

    async def test_only_the_contiguous_prefix_applies(self, target: InnerStore) -> None:
        chain = Chain()
        e1, e2, e3, e4 = (chain.checkpoint(make_messages(n)) for n in (1, 2, 3, 4))
        [outcome] = await target.apply([[e1, e2, e4]])
        assert (outcome.status, outcome.flushed_seq) == (ApplyStatus.APPLIED, 2)
        assert await target.load_messages(chain.thread_id) == make_messages(2)
        [outcome] = await target.apply([[e4]])
        assert (outcome.status, outcome.missing_from) == (ApplyStatus.GAP, 3)
        [outcome] = await target.apply([[e3, e4]])
        assert (outcome.status, outcome.flushed_seq) == (ApplyStatus.APPLIED, 4)

    async def test_older_entry_never_moves_a_thread_backwards(self, target: InnerStore) -> None:
        chain = Chain()
        run = make_run(chain.thread_id)
        other_run = make_run(chain.thread_id)
        e1 = chain.checkpoint(make_messages(1), run.replace(steps=1), metadata={"v": 1})
        e2 = chain.checkpoint(make_messages(2), other_run)
        e3 = chain.checkpoint(make_messages(3), run.replace(steps=3), metadata={"v": 3})
        await target.apply([[e1, e2, e3]])
        for late in ([e2], [e1], [e1, e2], [e2, e3]):
            [outcome] = await target.apply([late])
            assert (outcome.status, outcome.flushed_seq) == (ApplyStatus.STALE, 3)
        assert await target.load_thread(chain.thread_id) == e3.thread
        assert await target.load_messages(chain.thread_id) == make_messages(3)
        assert await target.latest_run(chain.thread_id) == run.replace(steps=3)
        versioned = await target.read_run(run.run_id)
        assert versioned is not None
        assert (versioned.run.steps, versioned.thread_seq) == (3, 3)

    async def test_deleted_thread_never_comes_back_from_a_late_entry(
        self, target: InnerStore
    ) -> None:
        chain = Chain()
        run = make_run(chain.thread_id)
        e1, e2 = chain.checkpoint(make_messages(1), run), chain.checkpoint(make_messages(2), run)
        await target.apply([[e1, e2]])
        [outcome] = await target.apply([[chain.delete()]])
        assert (outcome.status, outcome.flushed_seq) == (ApplyStatus.APPLIED, 3)
        for late in ([e1], [e2], [e1, e2]):
            [outcome] = await target.apply([late])
            assert outcome.status is ApplyStatus.STALE
        assert await target.load_thread(chain.thread_id) is None
        assert await target.load_run(run.run_id) is None
        assert await target.flushed_seqs([chain.thread_id]) == {chain.thread_id: 3}
        stored = await target.read_thread(chain.thread_id, with_messages=True)
        assert (stored.flushed_seq, stored.thread, stored.messages) == (3, None, [])
        # A new incarnation continues the seqs.
        new_run = make_run(chain.thread_id)
        [outcome] = await target.apply([[chain.checkpoint(make_messages(1, start=9), new_run)]])
        assert (outcome.status, outcome.flushed_seq) == (ApplyStatus.APPLIED, 4)
        assert await target.list_runs(chain.thread_id) == [new_run]

    async def test_delete_and_recreate_in_one_batch(self, target: InnerStore) -> None:
        chain = Chain()
        old_run = make_run(chain.thread_id)
        await target.apply([[chain.checkpoint(make_messages(4), old_run, metadata={"old": 1})]])
        new_run = make_run(chain.thread_id)
        batch = [chain.delete(), chain.checkpoint(make_messages(1, start=7), new_run)]
        [outcome] = await target.apply([batch])
        assert (outcome.status, outcome.flushed_seq) == (ApplyStatus.APPLIED, 3)
        assert await target.load_messages(chain.thread_id) == make_messages(1, start=7)
        assert await target.load_run(old_run.run_id) is None
        assert await target.list_runs(chain.thread_id) == [new_run]
        thread = await target.load_thread(chain.thread_id)
        assert thread is not None
        assert dict(thread.metadata) == {}
        assert thread.created_at == batch[1].at

    async def test_entry_claiming_a_run_of_another_thread_fails_that_thread_only(
        self, target: InnerStore
    ) -> None:
        # A data failure, not retriable (the flusher quarantines it); the run never moves.
        owner, thief, bystander = Chain(), Chain(), Chain()
        run = make_run(owner.thread_id)
        await target.apply([[owner.checkpoint(make_messages(1), run)]])
        stolen = run.replace(thread_id=thief.thread_id, steps=5)
        outcomes = await target.apply(
            [
                [thief.checkpoint(make_messages(1), stolen)],
                [bystander.checkpoint(make_messages(1))],
            ]
        )
        assert [(o.status, o.retriable) for o in outcomes] == [
            (ApplyStatus.FAILED, False),
            (ApplyStatus.APPLIED, True),
        ]
        assert "RunOwnershipError" in (outcomes[0].error or "")
        assert outcomes[0].waits_for == owner.thread_id  # what a flush of the thief awaits
        assert outcomes[1].waits_for is None
        assert outcomes[0].flushed_seq == 0
        assert await target.load_run(run.run_id) == run
        assert await target.list_runs(owner.thread_id) == [run]
        assert await target.load_thread(thief.thread_id) is None
        assert await target.flushed_seqs([thief.thread_id]) == {thief.thread_id: 0}
        assert [t.thread_id for t in await target.list_threads()] != []
        assert thief.thread_id not in {t.thread_id for t in await target.list_threads()}
        assert len(await target.read_threads(limit=10, offset=0)) == 2

    @cases(
        "owner_after, bystander, claimant_re_created",
        [
            ("delete", False, False),
            ("delete", True, False),
            ("re-create", False, False),
            ("re-create", True, False),
            ("delete", False, True),
        ],
    )
    async def test_a_run_freed_by_a_delete_is_taken_over_in_the_same_call(
        self, target: InnerStore, owner_after: str, bystander: bool, claimant_re_created: bool
    ) -> None:
        # The owner's id sorts after the claimant's and its batch comes last: the delete
        # must still be written first (the writer allowed the take-over because the delete
        # came first in the WAL). With a bystander the claimant may be written together
        # with it; alone it gets a statement of its own. A claimant deleted and re-created
        # in the same call holds a delete too: the owner, deleted for good, goes first.
        owner, claimant, other = Chain(fresh_id("z")), Chain(fresh_id("a")), Chain(fresh_id("m"))
        run = make_run(owner.thread_id)
        seeded = [[owner.checkpoint(make_messages(2), run)]]
        if claimant_re_created:
            seeded.append([claimant.checkpoint(make_messages(3))])
        await target.apply(seeded)
        owner_batch = [owner.delete()]
        if owner_after == "re-create":
            owner_batch.append(owner.checkpoint(make_messages(1, start=5)))
        taken = run.replace(thread_id=claimant.thread_id, steps=3)
        claimant_batch = [claimant.delete()] if claimant_re_created else []
        claimant_batch.append(claimant.checkpoint(make_messages(1), taken))
        batches = [claimant_batch]
        if bystander:
            batches.append([other.checkpoint(make_messages(1))])
        outcomes = await target.apply([*batches, owner_batch])
        assert [o.status for o in outcomes] == [ApplyStatus.APPLIED] * len(outcomes)
        assert await target.load_run(run.run_id) == taken
        assert await target.list_runs(claimant.thread_id) == [taken]
        assert run.run_id not in {r.run_id for r in await target.list_runs(owner.thread_id)}
        recreated = await target.load_thread(owner.thread_id)
        assert (recreated is not None) == (owner_after == "re-create")

    @cases("blocked", [False, True])
    async def test_two_re_created_threads_swapping_their_runs_in_one_call(
        self, target: InnerStore, blocked: bool
    ) -> None:
        # A and B are deleted; A is re-created with B's old run and B with A's. Each
        # claim needs the other thread's delete applied first, so no order of the two
        # threads works: every reset of the call must come before any of its writes.
        # Blocked: A's re-creation also names a run a live third thread owns, so A is
        # refused; its delete must then not be applied either (nothing of a refused
        # thread is written), and B, whose run A still holds, is refused waiting for A.
        a, b, c = Chain(fresh_id("a")), Chain(fresh_id("b")), Chain(fresh_id("c"))
        run_a, run_b, run_c = make_run(a.thread_id), make_run(b.thread_id), make_run(c.thread_id)
        b_seeded = [b.checkpoint(make_messages(3), run_b)]
        await target.apply(
            [
                [a.checkpoint(make_messages(2), run_a)],
                b_seeded,
                [c.checkpoint(make_messages(1), run_c)],
            ]
        )
        a_takes = run_b.replace(thread_id=a.thread_id, steps=4)
        b_takes = run_a.replace(thread_id=b.thread_id, steps=6)
        a_batch = [a.delete(), a.checkpoint(make_messages(1, start=5), a_takes)]
        if blocked:
            a_batch.append(
                a.checkpoint(make_messages(2, start=5), run_c.replace(thread_id=a.thread_id))
            )
        b_batch = [b.delete(), b.checkpoint(make_messages(1, start=8), b_takes)]
        # A batch of B that is stale already comes first: what resets B is the next one.
        stale, *outcomes = await target.apply([b_seeded, a_batch, b_batch])
        assert stale.status is ApplyStatus.STALE
        if not blocked:
            assert [o.status for o in outcomes] == [ApplyStatus.APPLIED] * 2
            assert [o.flushed_seq for o in outcomes] == [3, 3]
            assert await target.list_runs(a.thread_id) == [a_takes]
            assert await target.list_runs(b.thread_id) == [b_takes]
            assert await target.load_run(run_b.run_id) == a_takes
            assert await target.load_run(run_a.run_id) == b_takes
            assert await target.load_messages(a.thread_id) == make_messages(1, start=5)
            assert await target.load_messages(b.thread_id) == make_messages(1, start=8)
            return
        # A's runs are held by C and, once B's delete is not applied either, by B: its
        # error may name either.
        assert [(o.status, o.retriable) for o in outcomes] == [(ApplyStatus.FAILED, False)] * 2
        assert outcomes[0].waits_for in {b.thread_id, c.thread_id}
        assert outcomes[1].waits_for == a.thread_id
        assert await target.flushed_seqs([a.thread_id, b.thread_id]) == {
            a.thread_id: 1,
            b.thread_id: 1,
        }
        assert await target.list_runs(a.thread_id) == [run_a]
        assert await target.list_runs(b.thread_id) == [run_b]
        assert await target.load_messages(a.thread_id) == make_messages(2)
        assert await target.load_messages(b.thread_id) == make_messages(3)
        assert await target.load_run(run_c.run_id) == run_c

    async def test_refusals_chained_through_resets_write_nothing(self, target: InnerStore) -> None:
        # A (re-created) is refused a run a live thread C owns, so A's delete is not
        # applied; then B (re-created), taking A's old run, is refused; then W, taking
        # B's old run. Each refusal undoes what the one before had freed.
        a, b, c, w = (Chain(fresh_id(p)) for p in "abcw")
        run_a, run_b, run_c = make_run(a.thread_id), make_run(b.thread_id), make_run(c.thread_id)
        await target.apply(
            [
                [a.checkpoint(make_messages(1), run_a)],
                [b.checkpoint(make_messages(2), run_b)],
                [c.checkpoint(make_messages(1), run_c)],
            ]
        )
        outcomes = await target.apply(
            [
                [a.delete(), a.checkpoint(make_messages(1), run_c.replace(thread_id=a.thread_id))],
                [b.delete(), b.checkpoint(make_messages(1), run_a.replace(thread_id=b.thread_id))],
                [w.checkpoint(make_messages(1), run_b.replace(thread_id=w.thread_id))],
            ]
        )
        assert [(o.status, o.waits_for) for o in outcomes] == [
            (ApplyStatus.FAILED, c.thread_id),
            (ApplyStatus.FAILED, a.thread_id),
            (ApplyStatus.FAILED, b.thread_id),
        ]
        for chain, run in ((a, run_a), (b, run_b), (c, run_c)):
            assert await target.load_run(run.run_id) == run
            assert await target.list_runs(chain.thread_id) == [run]
        assert await target.load_thread(w.thread_id) is None
        assert await target.flushed_seqs([a.thread_id, b.thread_id, w.thread_id]) == {
            a.thread_id: 1,
            b.thread_id: 1,
            w.thread_id: 0,
        }

    async def test_a_re_created_thread_refused_for_its_data_frees_none_of_its_runs(
        self, target: InnerStore
    ) -> None:
        # A is deleted and re-created with data that cannot apply: its delete is not
        # written, so X, claiming A's old run Q and a new run S, is refused, and Y,
        # claiming S too, applies (S was never X's).
        a, x, y = Chain(fresh_id("a")), Chain(fresh_id("x")), Chain(fresh_id("y"))
        run_q = make_run(a.thread_id)
        await target.apply([[a.checkpoint(make_messages(2), run_q)]])
        delete = a.delete()
        corrupt = replace_entry(a.checkpoint(make_messages(1)), keep=5, message_count=6)
        run_s = make_run(x.thread_id)
        x_batch = [
            x.checkpoint(make_messages(1), run_q.replace(thread_id=x.thread_id)),
            x.checkpoint(make_messages(2), run_s),
        ]
        y_batch = [y.checkpoint(make_messages(1), run_s.replace(thread_id=y.thread_id))]
        a_out, x_out, y_out = await target.apply([[delete, corrupt], x_batch, y_batch])
        assert (a_out.status, a_out.retriable, a_out.waits_for) == (ApplyStatus.FAILED, False, None)
        assert (x_out.status, x_out.waits_for) == (ApplyStatus.FAILED, a.thread_id)
        assert y_out.status is ApplyStatus.APPLIED
        assert await target.load_run(run_q.run_id) == run_q
        assert await target.list_runs(y.thread_id) == [run_s.replace(thread_id=y.thread_id)]

    async def test_a_later_refused_batch_keeps_its_threads_reset(self, target: InnerStore) -> None:
        # A gives two batches: a1 re-creates A with B's old run, a2 then claims a run a
        # live thread C owns and is refused; D, re-created, is refused C's run too. B,
        # re-created with A's old run, needs a1's reset, which a2's refusal must not undo.
        b, a, c, d = (Chain(fresh_id(p)) for p in "bzcd")
        runs = {chain.thread_id: make_run(chain.thread_id) for chain in (a, b, c, d)}
        await target.apply(
            [[chain.checkpoint(make_messages(1), runs[chain.thread_id])] for chain in (a, b, c, d)]
        )
        run_a, run_b, run_c = runs[a.thread_id], runs[b.thread_id], runs[c.thread_id]
        a1 = [a.delete(), a.checkpoint(make_messages(1), run_b.replace(thread_id=a.thread_id))]
        a2 = [a.checkpoint(make_messages(2), run_c.replace(thread_id=a.thread_id))]
        b_batch = [b.delete(), b.checkpoint(make_messages(1), run_a.replace(thread_id=b.thread_id))]
        d_batch = [d.delete(), d.checkpoint(make_messages(1), run_c.replace(thread_id=d.thread_id))]
        outcomes = await target.apply([a1, a2, b_batch, d_batch])
        assert [(o.status, o.waits_for) for o in outcomes] == [
            (ApplyStatus.APPLIED, None),
            (ApplyStatus.FAILED, c.thread_id),
            (ApplyStatus.APPLIED, None),
            (ApplyStatus.FAILED, c.thread_id),
        ]
        assert await target.list_runs(a.thread_id) == [a1[1].run]
        assert await target.list_runs(b.thread_id) == [b_batch[1].run]
        assert await target.load_run(run_c.run_id) == run_c

    async def test_a_refusal_undone_by_a_left_out_reset_may_apply_at_once(
        self, target: InnerStore
    ) -> None:
        # A (re-created) is refused a run a live thread C owns. Y takes A's old run and a
        # new run N; Z claims N too. With A's reset Y would write N first and refuse Z;
        # without it Y is refused too. Z was refused only by a write that never happened:
        # its refusal says it may apply at once, and alone it does.
        a, c, y, z = (
            Chain(fresh_id("a")),
            Chain(fresh_id("c")),
            Chain(fresh_id("y")),
            Chain(fresh_id("z")),
        )
        run_a, run_c = make_run(a.thread_id), make_run(c.thread_id)
        await target.apply(
            [[a.checkpoint(make_messages(1), run_a)], [c.checkpoint(make_messages(1), run_c)]]
        )
        new_run = make_run(y.thread_id)
        y_first = y.checkpoint(make_messages(1), run_a.replace(thread_id=y.thread_id))
        z_batch = [z.checkpoint(make_messages(1), new_run.replace(thread_id=z.thread_id))]
        a_out, y_out, z_out = await target.apply(
            [
                [a.delete(), a.checkpoint(make_messages(1), run_c.replace(thread_id=a.thread_id))],
                [y_first, y.checkpoint(make_messages(2), new_run)],
                z_batch,
            ]
        )
        assert [(o.status, o.waits_for) for o in (a_out, y_out)] == [
            (ApplyStatus.FAILED, c.thread_id),
            (ApplyStatus.FAILED, a.thread_id),
        ]
        assert (z_out.status, z_out.retry_now) == (ApplyStatus.FAILED, True)
        assert await target.load_run(new_run.run_id) is None
        [z_out] = await target.apply([z_batch])
        assert z_out.status is ApplyStatus.APPLIED
        stored = await target.load_run(new_run.run_id)
        assert stored is not None
        assert stored.thread_id == z.thread_id

    @cases(
        "second_re_created, keeper_first",
        [(False, False), (True, False), (True, True)],
    )
    async def test_a_re_created_thread_keeping_its_run_while_another_claims_it(
        self, target: InnerStore, second_re_created: bool, keeper_first: bool
    ) -> None:
        # X is re-created with its own old run R, and W claims R in the same call (two
        # claims of one run, which the writer lets through only when a claim lapsed).
        # One thread at most holds R. W plain: X keeps R, W is refused. W re-created too
        # (and first): each write is refused by the other's, nothing is written, and X's
        # refusal says it may apply at once: alone, it does. Whatever the order of the
        # batches in the call: threads are written in id order.
        w, x = Chain(fresh_id("a")), Chain(fresh_id("z"))
        run = make_run(x.thread_id)
        seed = [[x.checkpoint(make_messages(1), run)]]
        if second_re_created:
            seed.insert(0, [w.checkpoint(make_messages(2))])
        await target.apply(seed)
        kept = run.replace(thread_id=x.thread_id, steps=2)
        x_batch = [x.delete(), x.checkpoint(make_messages(1, start=3), kept)]
        w_batch = [w.delete()] if second_re_created else []
        w_batch.append(w.checkpoint(make_messages(1, start=6), run.replace(thread_id=w.thread_id)))
        if keeper_first:
            x_out, w_out = await target.apply([x_batch, w_batch])
        else:
            w_out, x_out = await target.apply([w_batch, x_batch])
        assert (w_out.status, w_out.waits_for) == (ApplyStatus.FAILED, x.thread_id)
        if not second_re_created:
            assert x_out.status is ApplyStatus.APPLIED
        else:
            assert (x_out.status, x_out.retry_now) == (ApplyStatus.FAILED, True)
            assert await target.load_run(run.run_id) == run
            [x_out] = await target.apply([x_batch])
            assert x_out.status is ApplyStatus.APPLIED
        assert await target.load_run(run.run_id) == kept
        assert await target.list_runs(x.thread_id) == [kept]
        assert run.run_id not in {r.run_id for r in await target.list_runs(w.thread_id)}

    async def test_two_threads_claiming_one_new_run_in_one_call(self, target: InnerStore) -> None:
        first, second = Chain(), Chain()
        run = make_run(first.thread_id)
        outcomes = await target.apply(
            [
                [first.checkpoint(make_messages(1), run)],
                [second.checkpoint(make_messages(1), run.replace(thread_id=second.thread_id))],
            ]
        )
        statuses = sorted(o.status.value for o in outcomes)
        assert statuses == [ApplyStatus.APPLIED.value, ApplyStatus.FAILED.value]
        winner = next(o.thread_id for o in outcomes if o.status is ApplyStatus.APPLIED)
        stored = await target.load_run(run.run_id)
        assert stored is not None
        assert stored.thread_id == winner

    async def test_a_failing_thread_does_not_affect_the_others(self, target: InnerStore) -> None:
        good, bad = Chain(), Chain()
        await target.apply([[bad.checkpoint(make_messages(2))]])
        # Claims to keep more messages than the stored snapshot holds.
        corrupt = replace_entry(bad.checkpoint(make_messages(3)), keep=5, message_count=6)
        outcomes = await target.apply([[corrupt], [good.checkpoint(make_messages(1))]])
        assert (outcomes[0].status, outcomes[0].retriable, outcomes[0].flushed_seq) == (
            ApplyStatus.FAILED,
            False,
            1,
        )
        assert outcomes[0].error
        assert outcomes[1].status is ApplyStatus.APPLIED
        assert await target.load_messages(bad.thread_id) == make_messages(2)
        assert await target.load_messages(good.thread_id) == make_messages(1)

    @cases("problem", ["other-thread-run", "mixed-batch", "empty-batch"])
    async def test_malformed_batches_fail_without_writing(
        self, target: InnerStore, problem: str
    ) -> None:
        chain = Chain()
        entry = chain.checkpoint(make_messages(2))
        if problem == "other-thread-run":
            batch = [replace_entry(entry, run=make_run(fresh_id()))]
        elif problem == "mixed-batch":
            batch = [entry, Chain().checkpoint(make_messages(1))]
        else:
            batch = []
        [outcome] = await target.apply([batch])
        assert (outcome.status, outcome.retriable) == (ApplyStatus.FAILED, False)
        assert outcome.error
        assert await target.load_thread(chain.thread_id) is None
        assert await target.list_threads() == []

    async def test_wire_round_tripped_entries_apply(self, target: InnerStore) -> None:
        chain = Chain()
        run = make_run(chain.thread_id, output={"x": [1.5]})
        messages = [*make_messages(3), {"role": "tool", "content": "é🧵", "n": [1, None]}]
        entries = [chain.checkpoint(messages[:n], run) for n in (1, 2, 4)]
        wire = [decode_entry(encode_entry(entry)) for entry in entries]
        await target.apply([wire])
        assert await target.load_messages(chain.thread_id) == messages
        assert await target.load_run(run.run_id) == run

    async def test_checkpoint_continues_after_applied_entries(self, target: InnerStore) -> None:
        chain = Chain()
        await target.apply([[chain.checkpoint(make_messages(n)) for n in (1, 2)]])
        receipt = await target.checkpoint(
            chain.thread_id, make_messages(3), make_run(chain.thread_id)
        )
        assert receipt.thread_seq == 3
        [outcome] = await target.apply([[chain.checkpoint(make_messages(9))]])
        assert outcome.status is ApplyStatus.STALE, "seq 3 is taken by the direct checkpoint"
        assert await target.load_messages(chain.thread_id) == make_messages(3)

    async def test_applied_entries_continue_after_direct_checkpoints(
        self, target: InnerStore
    ) -> None:
        tid = fresh_id()
        await target.checkpoint(tid, make_messages(2), make_run(tid))
        stored = await target.read_thread(tid, with_messages=True)
        chain = Chain(tid)
        chain.seq, chain.thread, chain.encoded = stored.flushed_seq, stored.thread, stored.messages
        [outcome] = await target.apply([[chain.checkpoint(make_messages(4))]])
        assert (outcome.status, outcome.flushed_seq) == (ApplyStatus.APPLIED, 2)
        assert await target.load_messages(tid) == make_messages(4)

    async def test_versioned_reads(self, target: InnerStore) -> None:
        clock = TickingClock()
        first, second = Chain(clock=clock), Chain(clock=clock)
        run_a = make_run(first.thread_id, status=RunStatus.DONE, created_at=T0)
        run_b = make_run(first.thread_id, created_at=T0 + timedelta(seconds=1))
        await target.apply(
            [
                [
                    first.checkpoint(make_messages(1), run_a),
                    first.checkpoint(make_messages(2), run_b),
                ],
                [second.checkpoint(make_messages(1))],
            ]
        )
        stored = await target.read_thread(first.thread_id, with_messages=True)
        assert (stored.flushed_seq, stored.thread) == (2, first.thread)
        assert stored.messages == first.encoded
        bare = await target.read_thread(first.thread_id, with_messages=False)
        assert bare.messages is None
        unknown = await target.read_thread(fresh_id(), with_messages=True)
        assert (unknown.flushed_seq, unknown.thread, unknown.messages) == (0, None, [])

        versioned = await target.read_runs(first.thread_id, status=None, limit=10, offset=0)
        assert [(v.run, v.thread_seq) for v in versioned] == [(run_b, 2), (run_a, 1)]
        done = await target.read_runs(None, status=RunStatus.DONE, limit=10, offset=0)
        assert [v.run for v in done] == [run_a]
        assert await target.read_run(fresh_id("run")) is None

        threads = await target.read_threads(limit=10, offset=0)
        assert [(t.thread_id, t.flushed_seq, t.messages) for t in threads] == [
            (second.thread_id, 1, None),
            (first.thread_id, 2, None),
        ]
        assert [t.thread for t in threads] == [second.thread, first.thread]
        assert [t.thread_id for t in await target.read_threads(limit=1, offset=1)] == [
            first.thread_id
        ]
        unknown_id = fresh_id()
        assert await target.flushed_seqs([first.thread_id, unknown_id]) == {
            first.thread_id: 2,
            unknown_id: 0,
        }
