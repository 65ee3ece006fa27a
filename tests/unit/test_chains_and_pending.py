"""Pure rules behind issue 9's fixes: jump entries (a chain whose base is unknown), the
runs a hot record carries, and the pending-thread floor."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import orjson
import pytest

from buffered_store.engine.appender import jump_seq
from buffered_store.engine.entries import chain_after
from buffered_store.engine.flushing import FlushStatus
from buffered_store.engine.pending import Floor, HotAt, decode_floor, encode_floor, plan_floor
from buffered_store.errors import CorruptEntryError
from buffered_store.model.changes import (
    EntryKind,
    WalEntry,
)
from buffered_store.model.checkpointing import (
    build_checkpoint_entry,
    build_delete_entry,
    validate_checkpoint,
)
from buffered_store.model.messages import encode_messages
from buffered_store.model.planning import PlanStatus, ThreadView, fold, plan_entries
from buffered_store.model.records import RunRecord
from buffered_store.testing import make_messages, make_run
from buffered_store.threadrun.claims import decode_run_claim, encode_run_claim
from buffered_store.threadrun.entry import (
    HOT_RUN_MAX_BYTES,
    RUNS_WINDOW,
    HotRecord,
    advance_hot,
    decode_entry,
    decode_hot,
    encode_entry,
    encode_hot,
    encode_hot_within,
    run_json,
    seeded_hot,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def entry(
    seq: int, *, jump: bool = False, keep: int = 0, n: int = 1, run: RunRecord | None = None
) -> WalEntry:
    call = validate_checkpoint("t", make_messages(n), run or make_run("t", "r"), None)
    built = build_checkpoint_entry(
        call, previous=None, previous_messages=None, seq=seq, now=T0, jump=jump
    )
    if keep:
        return WalEntry(
            thread_id="t",
            seq=seq,
            kind=EntryKind.CHECKPOINT,
            at=T0,
            keep=keep,
            messages=built.messages[keep:],
            message_count=built.message_count,
            run=built.run,
            created_at=T0,
        )
    return built


# -- jump entries ---------------------------------------------------------------------------


def test_jump_seq_is_microseconds_and_grows_faster_than_any_chain() -> None:
    assert jump_seq(T0) == int(T0.timestamp()) * 1_000_000
    # A later jump (a second later) lies above a chain of a million checkpoints started
    # by the earlier one.
    assert jump_seq(T0 + timedelta(seconds=1)) > jump_seq(T0) + 999_999


def test_jump_entry_round_trips_and_must_carry_the_whole_snapshot() -> None:
    jumped = entry(jump_seq(T0) + 1, jump=True, n=3)
    decoded = decode_entry(encode_entry(jumped))
    assert decoded.jump
    assert decoded.keep == 0
    assert decoded.message_count == 3
    assert not decode_entry(encode_entry(entry(2))).jump
    forged = encode_entry(entry(5, keep=1, n=3)).replace(b'"w":""', b'"w":"","j":true')
    with pytest.raises(CorruptEntryError, match="full snapshot"):
        decode_entry(forged)


def test_a_jump_entry_ignores_what_the_writer_knew() -> None:
    call = validate_checkpoint("t", make_messages(4), make_run("t"), None)
    previous = entry(1, n=3).thread
    built = build_checkpoint_entry(
        call,
        previous=previous,
        previous_messages=encode_messages(make_messages(3), None),
        seq=9,
        now=T0,
        jump=True,
    )
    assert (built.keep, len(built.messages), built.jump) == (0, 4, True)


def test_jump_delete_entry() -> None:
    deleted = build_delete_entry("t", seq=7, now=T0, jump=True)
    assert decode_entry(encode_entry(deleted)).jump


def test_plan_applies_a_jump_over_any_lower_watermark() -> None:
    base = jump_seq(T0)
    chain = [entry(base + 1, jump=True), entry(base + 2), entry(base + 3)]
    plan = plan_entries(reversed(chain), 3)
    assert plan.status is PlanStatus.APPLY
    assert [e.seq for e in plan.entries] == [base + 1, base + 2, base + 3]
    # Without the jump flag the same seqs are a gap above watermark 3.
    plain = [entry(base + 1), entry(base + 2)]
    assert plan_entries(plain, 3).status is PlanStatus.GAP
    # At or below the watermark a jump is stale like any entry.
    assert plan_entries(chain, base + 3).status is PlanStatus.STALE


def test_chain_after_prefers_the_next_seq_and_stops_at_a_hole() -> None:
    assert [e.seq for e in chain_after([entry(4), entry(2), entry(3), entry(6)], 1)] == [2, 3, 4]
    assert chain_after([entry(3)], 1) == []
    jumped = chain_after([entry(100, jump=True), entry(101), entry(2)], 1)
    assert [e.seq for e in jumped] == [2, 100, 101]


def test_fold_accepts_a_jump_and_rejects_a_plain_hole() -> None:
    view = ThreadView(seq=3, thread=None, messages=[b'{"role":"user"}'], runs={})
    folded = fold(view, [entry(50, jump=True, n=2), entry(51, n=3)])
    assert folded.seq == 51
    assert len(folded.messages) == 3
    with pytest.raises(CorruptEntryError):
        fold(view, [entry(50, n=2)])


# -- runs carried by the hot record -------------------------------------------------------


def test_hot_record_keeps_the_latest_version_of_recent_runs() -> None:
    record: HotRecord | None = None
    runs = [make_run("t", f"r{i}") for i in range(RUNS_WINDOW + 2)]
    for seq, run in enumerate([runs[0], runs[0], runs[1]], start=1):
        record = advance_hot(record, entry(seq, run=run.replace(steps=seq)), seq, window=8)
    assert record is not None
    assert [(r.run_id, r.steps, s) for r, s in record.runs] == [("r1", 3, 3), ("r0", 2, 2)]
    assert record.runs_from == 1
    assert record.covers_runs_after(0)
    for seq, run in enumerate(runs[2:], start=4):
        record = advance_hot(record, entry(seq, run=run), seq, window=8)
    assert len(record.runs) == RUNS_WINDOW
    # r0 (last written at 2) and r1 (at 3) fell out: only seqs from 4 on are covered.
    assert record.runs_from == 4
    assert record.covers_runs_after(3)
    assert not record.covers_runs_after(2)
    assert decode_hot(encode_hot(record)) == record


def test_hot_record_leaves_out_a_large_run() -> None:
    """A run whose JSON exceeds HOT_RUN_MAX_BYTES stays in its entry only: the hot record
    (one KV value, bounded by the server's max payload) never grows with run outputs."""
    small = make_run("t", "small")
    big = make_run("t", "big", output="x" * HOT_RUN_MAX_BYTES)
    record = advance_hot(None, entry(1, run=small), 10, window=8)
    record = advance_hot(record, entry(2, run=big), 11, window=8)
    assert [r.run_id for r, _ in record.runs] == ["small"]
    assert record.runs_from == 3
    assert not record.covers_runs_after(1)
    assert record.covers_runs_after(2)
    assert len(encode_hot(record)) < 2 * HOT_RUN_MAX_BYTES


def test_hot_record_after_a_delete_and_a_jump() -> None:
    record = advance_hot(None, entry(1, run=make_run("t", "a")), 10, window=8)
    deleted = advance_hot(record, build_delete_entry("t", seq=2, now=T0), 11, window=8)
    assert (deleted.thread, deleted.runs, deleted.deleted_seq) == (None, (), 2)
    jumped = advance_hot(deleted, entry(90, jump=True, run=make_run("t", "b")), 12, window=8)
    assert [r.run_id for r, _ in jumped.runs] == ["b"]
    assert jumped.runs_from == 90
    assert jumped.deleted_seq == 2


def test_seeded_and_old_hot_records_cover_nothing_unflushed() -> None:
    seeded = seeded_hot(5, None)
    assert seeded.covers_runs_after(5)
    assert not seeded.covers_runs_after(4)
    old = decode_hot(b'{"s":3,"ss":9,"th":null,"r":[[3,9]]}')
    assert old.runs == ()
    assert not old.covers_runs_after(2)


# -- pending floor --------------------------------------------------------------------------


def hot_at(thread_id: str, kv_seq: int) -> HotAt[HotRecord]:
    return HotAt(thread_id, kv_seq, HotRecord(seq=1, stream_seq=1, thread=None))


def test_floor_moves_past_everything_read_when_nothing_is_pending() -> None:
    assert plan_floor(Floor(5, ("x",)), [], 40) == Floor(41, ())
    assert plan_floor(Floor(5), [], 4) == Floor(5)


def test_floor_holds_pending_threads_below_it() -> None:
    floor = plan_floor(Floor(5), [hot_at("b", 30), hot_at("a", 12)], 40)
    assert floor == Floor(41, ("a", "b"))


def test_floor_stops_at_the_first_pending_thread_it_cannot_hold() -> None:
    pending = [hot_at(f"t{i}", 10 + i) for i in range(5)]
    floor = plan_floor(Floor(1), pending, 100, max_held_bytes=18)
    assert floor == Floor(13, ("t0", "t1", "t2"))
    # The floor never moves back, even when the held threads sit below it.
    again = plan_floor(floor, [hot_at("t0", 10), *pending[3:]], 12, max_held_bytes=18)
    assert again.kv_seq >= floor.kv_seq


def test_floor_round_trips() -> None:
    floor = Floor(17, ("a", "b"))
    assert decode_floor(encode_floor(floor)) == floor
    with pytest.raises(CorruptEntryError):
        decode_floor(b"{}")


# -- review fixes: chain start, oversized hot records, run claims, held budget ------------


def test_hot_record_knows_where_its_chain_starts() -> None:
    record = advance_hot(seeded_hot(3, None), entry(4), 10, window=8)
    assert record.chain_from == 1  # continues the stored seqs
    jumped = advance_hot(None, entry(900, jump=True), 11, window=8)
    jumped = advance_hot(jumped, entry(901), 12, window=8)
    assert jumped.chain_from == 900
    assert decode_hot(encode_hot(jumped)) == jumped
    assert decode_hot(b'{"s":3,"ss":9,"th":null}').chain_from == 0


def test_flush_status_counts_the_entries_of_a_jump_chain() -> None:
    plain = FlushStatus(thread_id="t", latest_seq=9, flushed_seq=3, pending_from=1)
    assert plain.pending == 6
    jumped = FlushStatus(thread_id="t", latest_seq=901, flushed_seq=3, pending_from=900)
    assert jumped.pending == 2
    flushed_into = FlushStatus(thread_id="t", latest_seq=901, flushed_seq=900, pending_from=900)
    assert flushed_into.pending == 1


def test_oversized_hot_record_leaves_its_runs_out() -> None:
    record: HotRecord | None = None
    for seq in range(1, 5):
        run = make_run("t", f"r{seq}", output="x" * (HOT_RUN_MAX_BYTES - 400))
        record = advance_hot(record, entry(seq, run=run), seq, window=8)
    assert record is not None
    assert len(record.runs) == 4
    full = encode_hot(record)
    assert encode_hot_within(record, len(full)) == full
    trimmed = decode_hot(encode_hot_within(record, len(full) - 1))
    assert trimmed.runs == ()
    assert not trimmed.covers_runs_after(0)  # readers take the runs from the entries
    assert trimmed.covers_runs_after(4)
    assert (trimmed.seq, trimmed.thread, trimmed.recent) == (4, record.thread, record.recent)


def test_run_claims_round_trip_and_old_claims_read_as_long_ago() -> None:
    claim = encode_run_claim("thread-ü", 1_700_000_000_000_000, 42)
    assert decode_run_claim(claim) == ("thread-ü", 1_700_000_000_000_000, 42)
    assert decode_run_claim(b"legacy-thread") == ("legacy-thread", 0, None)
    assert decode_run_claim(b"older\x00123") == ("older", 123, None)


def test_floor_holds_threads_up_to_a_byte_budget() -> None:
    long_ids = [hot_at("x" * 500 + str(i), 10 + i) for i in range(4)]
    floor = plan_floor(Floor(1), long_ids, 100, max_held_bytes=3 * 505)
    assert floor == Floor(13, tuple(item.thread_id for item in long_ids[:3]))
    assert plan_floor(Floor(1), long_ids, 100).held == tuple(i.thread_id for i in long_ids)


def test_runs_are_encoded_once_and_the_wire_bytes_do_not_change() -> None:
    run = make_run("t", "r1", output={"answer": "ü" * 10}, steps=3)
    data, _ = run_json(run)
    assert data == orjson.dumps(run.to_json())
    assert run_json(run)[0] is data  # cached by identity
    assert run_json(run.replace(steps=4))[0] != data
    record = advance_hot(None, entry(1, run=run), 10, window=8)
    expected = {
        "s": 1,
        "ss": 10,
        "th": record.thread.to_json() if record.thread else None,
        "r": [[1, 10]],
        "ru": [[run.to_json(), 1]],
        "rf": 1,
        "ds": 0,
        "cf": 1,
    }
    assert orjson.loads(encode_hot(record)) == expected
    assert decode_entry(encode_entry(entry(1, run=run))).run == run
