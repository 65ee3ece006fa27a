"""`buffered_store.model.planning`: which entries apply, their coalesced change, and `fold`."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest

from buffered_store.errors import CorruptEntryError
from buffered_store.model.changes import (
    WalEntry,
)
from buffered_store.model.checkpointing import (
    build_checkpoint_entry,
    build_delete_entry,
    validate_checkpoint,
)
from buffered_store.model.messages import apply_delta
from buffered_store.model.planning import (
    PlanStatus,
    ThreadView,
    coalesce,
    deletes_first,
    fold,
    plan_entries,
)
from buffered_store.model.records import Message, RunRecord, Thread
from buffered_store.testing import make_messages, make_run

T0 = datetime(2026, 1, 1, tzinfo=UTC)


class Writer:
    """Builds a thread's entries the way every store does."""

    def __init__(self, thread_id: str = "t") -> None:
        self.thread_id = thread_id
        self.seq = 0
        self.thread: Thread | None = None
        self.encoded: list[bytes] | None = None

    def checkpoint(self, messages: list[Message], run: RunRecord | None = None) -> WalEntry:
        call = validate_checkpoint(self.thread_id, messages, run or make_run(self.thread_id), None)
        self.seq += 1
        entry = build_checkpoint_entry(
            call,
            previous=self.thread,
            previous_messages=self.encoded,
            seq=self.seq,
            now=T0 + timedelta(seconds=self.seq),
        )
        self.thread, self.encoded = entry.thread, call.encoded
        return entry

    def delete(self) -> WalEntry:
        self.seq += 1
        self.thread, self.encoded = None, None
        return build_delete_entry(self.thread_id, seq=self.seq, now=T0)


def _chain(count: int) -> list[WalEntry]:
    writer = Writer()
    return [writer.checkpoint(make_messages(n)) for n in range(1, count + 1)]


def _seqs(entries: tuple[WalEntry, ...]) -> list[int]:
    return [entry.seq for entry in entries]


# -- plan_entries -------------------------------------------------------------------------


def test_plan_nothing_is_stale() -> None:
    assert plan_entries([], 0).status is PlanStatus.STALE


def test_plan_entries_at_or_below_watermark_are_stale() -> None:
    plan = plan_entries(_chain(3), 3)
    assert (plan.status, plan.entries) == (PlanStatus.STALE, ())


def test_plan_gap_names_the_first_missing_seq() -> None:
    _, e2, e3 = _chain(3)
    plan = plan_entries([e3, e2], 0)
    assert (plan.status, plan.entries, plan.missing_from) == (PlanStatus.GAP, (), 1)


def test_plan_applies_sorted_deduplicated_entries_above_the_watermark() -> None:
    e1, e2, e3, e4 = _chain(4)
    plan = plan_entries([e4, e2, e1, e3, e2, e4], 1)
    assert (plan.status, _seqs(plan.entries)) == (PlanStatus.APPLY, [2, 3, 4])


def test_plan_keeps_only_the_contiguous_prefix() -> None:
    e1, e2, _, e4, e5 = _chain(5)
    plan = plan_entries([e1, e2, e4, e5], 0)
    assert _seqs(plan.entries) == [1, 2]


def test_plan_keeps_first_of_duplicated_seqs() -> None:
    [entry] = _chain(1)
    other = Writer().checkpoint(make_messages(5))
    plan = plan_entries([entry, other], 0)
    assert plan.entries == (entry,)


# -- coalesce -----------------------------------------------------------------------------


def test_coalesce_appends_only_new_messages() -> None:
    writer = Writer()
    stored = writer.checkpoint(make_messages(3))
    entries = [writer.checkpoint(make_messages(n)) for n in (4, 5, 6)]
    change = coalesce(entries, stored_count=stored.message_count)
    assert (change.first_seq, change.last_seq, change.reset) == (2, 4, False)
    assert change.keep == 3
    assert change.messages == writer.encoded[3:]  # type: ignore[index]
    assert change.message_count == 6
    assert change.thread == entries[-1].thread


def test_coalesce_rewrite_lowers_keep() -> None:
    writer = Writer()
    writer.checkpoint(make_messages(4))
    rewritten = [*make_messages(1), {"role": "system", "content": "summary"}]
    entries = [writer.checkpoint(make_messages(5)), writer.checkpoint(rewritten)]
    change = coalesce(entries, stored_count=4)
    assert (change.keep, change.message_count) == (1, 2)
    assert apply_delta(stored_bytes(4), change.keep, change.messages) == writer.encoded


def test_coalesce_rewrite_inside_the_new_tail() -> None:
    writer = Writer()
    writer.checkpoint(make_messages(2))
    grown = writer.checkpoint(make_messages(6))
    edited = make_messages(6)
    edited[4] = {"role": "user", "content": "edited"}
    change = coalesce([grown, writer.checkpoint(edited)], stored_count=2)
    assert (change.keep, change.message_count) == (2, 6)
    assert apply_delta(stored_bytes(2), change.keep, change.messages) == writer.encoded


def test_coalesce_delete_in_chain_resets() -> None:
    writer = Writer()
    writer.checkpoint(make_messages(3))
    old = writer.checkpoint(make_messages(4))
    new_run = make_run("t")
    entries = [old, writer.delete(), writer.checkpoint(make_messages(1, start=9), new_run)]
    change = coalesce(entries, stored_count=3)
    assert (change.reset, change.keep, change.message_count) == (True, 0, 1)
    assert change.messages == writer.encoded
    assert list(change.runs) == [new_run.run_id]
    assert change.thread is not None
    assert change.thread.created_at == entries[-1].at


def test_deletes_first_puts_every_batch_of_a_deleting_thread_first_in_order() -> None:
    a, b, c = Writer("a"), Writer("b"), Writer("c")
    a1 = [a.checkpoint(make_messages(1))]
    b1 = [b.checkpoint(make_messages(1))]
    c1 = [c.checkpoint(make_messages(1))]
    c2 = [c.delete(), c.checkpoint(make_messages(1, start=4))]  # c's second batch deletes
    a2 = [a.checkpoint(make_messages(2))]
    d = Writer("d")
    d.checkpoint(make_messages(1))
    d1 = [d.delete()]  # deleted for good: before c, re-created after its delete
    batches = [a1, c1, b1, c2, a2, [], d1]
    # d first, then c's two batches in their order; the rest (the empty one too) follow.
    assert deletes_first(batches) == [[6], [1, 3], [0, 2, 4, 5]]
    assert deletes_first([a1, b1]) == [[], [], [0, 1]]
    assert deletes_first([]) == [[], [], []]


def test_coalesce_delete_last_leaves_no_thread() -> None:
    writer = Writer()
    writer.checkpoint(make_messages(2))
    change = coalesce([writer.checkpoint(make_messages(3)), writer.delete()], stored_count=2)
    assert (change.reset, change.thread, change.messages, change.runs) == (True, None, [], {})


def test_coalesce_runs_keep_their_latest_version() -> None:
    writer = Writer()
    run, other = make_run("t"), make_run("t")
    entries = [
        writer.checkpoint(make_messages(1), run.replace(steps=1)),
        writer.checkpoint(make_messages(2), other),
        writer.checkpoint(make_messages(3), run.replace(steps=3)),
    ]
    change = coalesce(entries, stored_count=0)
    assert change.runs == {run.run_id: (run.replace(steps=3), 3), other.run_id: (other, 2)}


def test_coalesce_rejects_keep_beyond_current() -> None:
    writer = Writer()
    writer.checkpoint(make_messages(2))
    entry = writer.checkpoint(make_messages(3))
    with pytest.raises(CorruptEntryError):
        coalesce([entry], stored_count=1)


def test_coalesce_needs_entries() -> None:
    with pytest.raises(ValueError, match="at least one"):
        coalesce([], stored_count=0)


def test_coalesce_and_fold_rebuild_random_histories() -> None:
    rng = random.Random(5)
    for _ in range(200):
        writer = Writer()
        snapshots: list[list[Message]] = []
        entries: list[WalEntry] = []
        for _ in range(rng.randint(1, 8)):
            if rng.random() < 0.1:
                entries.append(writer.delete())
                snapshots.append([])
                continue
            previous = snapshots[-1] if snapshots else []
            cut = rng.randint(0, len(previous))
            new = previous[:cut] + [
                {"role": "user", "content": rng.choice("abc")} for _ in range(rng.randint(0, 3))
            ]
            entries.append(writer.checkpoint(new))
            snapshots.append(new)
        split = rng.randint(0, len(entries) - 1)
        stored = fold(ThreadView(seq=0, thread=None, messages=[], runs={}), entries[:split])
        change = coalesce(entries[split:], stored_count=len(stored.messages))
        stored_base = [] if change.reset else stored.messages
        rebuilt = apply_delta(stored_base, change.keep, change.messages) if change.thread else []
        final = fold(stored, entries[split:])
        assert rebuilt == final.messages
        assert final.messages == [_enc(m) for m in (snapshots[-1] if writer.thread else [])]
        assert final.thread == writer.thread
        assert final.seq == entries[-1].seq


# -- fold ---------------------------------------------------------------------------------


def test_fold_ignores_entries_at_or_below_the_view() -> None:
    entries = _chain(3)
    view = fold(ThreadView(seq=0, thread=None, messages=[], runs={}), entries)
    assert fold(view, entries[:2]) == view
    assert view.seq == 3


def test_fold_rejects_a_gap() -> None:
    e1, _, e3 = _chain(3)
    with pytest.raises(CorruptEntryError):
        fold(ThreadView(seq=0, thread=None, messages=[], runs={}), [e1, e3])


def test_fold_never_replaces_a_run_by_an_older_version() -> None:
    writer = Writer()
    run = make_run("t")
    e1 = writer.checkpoint(make_messages(1), run.replace(steps=1))
    e2 = writer.checkpoint(make_messages(2), run.replace(steps=2))
    newer = ThreadView(
        seq=1, thread=e1.thread, messages=stored_bytes(1), runs={run.run_id: (run, 5)}
    )
    view = fold(newer, [e2])
    assert view.runs[run.run_id] == (run, 5)


def test_fold_delete_resets() -> None:
    writer = Writer()
    entries = [writer.checkpoint(make_messages(2)), writer.delete()]
    view = fold(ThreadView(seq=0, thread=None, messages=[], runs={}), entries)
    assert (view.seq, view.thread, view.messages, view.runs) == (2, None, [], {})


def _enc(message: Message) -> bytes:
    return validate_checkpoint("t", [message], make_run("t"), None).encoded[0]


def stored_bytes(count: int) -> list[bytes]:
    """The stored snapshot a Writer produced with make_messages(count)."""
    return [_enc(m) for m in make_messages(count)]
