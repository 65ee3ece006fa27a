"""Snapshot digests: the chain a writer extends with each entry, and the proof a writer
that never saw a thread uses to send a delta instead of the whole history."""

from __future__ import annotations

import random
from datetime import UTC, datetime

import pytest

from buffered_store.errors import CorruptEntryError
from buffered_store.model.changes import EntryKind, WalEntry
from buffered_store.model.checkpointing import build_checkpoint_entry, validate_checkpoint
from buffered_store.model.messages import (
    DIGEST_SIZE,
    EMPTY_DIGEST,
    MessageSnapshot,
    encode_messages,
    extend_chain,
    prove_prefix,
)
from buffered_store.model.records import Message
from buffered_store.testing import make_messages, make_run
from buffered_store.threadrun.entry import (
    FORMAT,
    HotRecord,
    advance_hot,
    decode_entry,
    decode_hot,
    encode_entry,
    encode_hot,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def digest_of(messages: list[Message]) -> bytes:
    """The digest of a snapshot, computed from scratch."""
    chain = extend_chain(EMPTY_DIGEST, encode_messages(messages))
    return bytes(chain[-DIGEST_SIZE:]) if chain else EMPTY_DIGEST


# -- the chain ------------------------------------------------------------------------------


def test_the_digest_does_not_depend_on_how_the_snapshot_was_cut_into_entries() -> None:
    encoded = encode_messages(make_messages(9))
    whole = extend_chain(EMPTY_DIGEST, encoded)
    first = extend_chain(EMPTY_DIGEST, encoded[:4])
    rest = extend_chain(bytes(first[-DIGEST_SIZE:]), encoded[4:])
    assert len(whole) == 9 * DIGEST_SIZE
    assert whole == first + rest


def test_the_digest_tells_order_content_and_message_boundaries_apart() -> None:
    a, b = b'{"role":"a"}', b'{"role":"b"}'
    digests = {
        bytes(extend_chain(EMPTY_DIGEST, messages)[-DIGEST_SIZE:])
        for messages in ([a, b], [b, a], [a, a], [a + b], [a, b, b], [a])
    }
    assert len(digests) == 6
    assert EMPTY_DIGEST not in digests


def test_a_snapshot_computes_its_digests_once_and_only_as_far_as_asked() -> None:
    encoded = encode_messages(make_messages(6))
    snapshot = MessageSnapshot(encoded)
    assert snapshot.digest_at(0) == EMPTY_DIGEST
    assert not snapshot.chain
    assert (
        snapshot.digest_at(3)
        == extend_chain(EMPTY_DIGEST, encoded)[2 * DIGEST_SIZE : 3 * DIGEST_SIZE]
    )
    assert len(snapshot.chain) == 3 * DIGEST_SIZE
    assert snapshot.digest_at(6) == extend_chain(EMPTY_DIGEST, encoded)[-DIGEST_SIZE:]
    with pytest.raises(ValueError, match="7 messages"):
        snapshot.digest_at(7)
    # A chain handed in longer than the snapshot is cut to it.
    assert len(MessageSnapshot(encoded[:2], (), snapshot.chain).chain) == 2 * DIGEST_SIZE


# -- proving a prefix -----------------------------------------------------------------------


def test_a_snapshot_that_extends_the_stored_one_is_proven() -> None:
    stored, messages = make_messages(40), make_messages(43)
    call = validate_checkpoint("t", messages, make_run("t"), None)
    proven = prove_prefix(call.snapshot, 40, digest_of(stored))
    assert proven == encode_messages(stored)
    assert proven is not None
    assert proven.sources == messages[:40]
    assert len(proven.chain) == 40 * DIGEST_SIZE  # its chain came along
    assert proven.digest_at(40) == digest_of(stored)


@pytest.mark.parametrize(
    ("case", "messages", "count", "digest"),
    [
        ("a message of the prefix differs", "edited", 40, "stored"),
        ("the snapshot is shorter", "short", 40, "stored"),
        ("the digest is unknown", "longer", 40, "none"),
        ("the count does not match the digest", "longer", 39, "stored"),
    ],
)
def test_a_snapshot_that_does_not_extend_the_stored_one_is_not_proven(
    case: str, messages: str, count: int, digest: str
) -> None:
    stored = make_messages(40)
    edited = make_messages(43)
    edited[7] = {"role": "user", "content": "changed"}
    given = {"edited": edited, "short": make_messages(39), "longer": make_messages(43)}
    known = digest_of(stored) if digest == "stored" else b""
    call = validate_checkpoint("t", given[messages], make_run("t"), None)
    assert prove_prefix(call.snapshot, count, known) is None, case


def test_the_empty_prefix_is_proven_by_the_empty_digest() -> None:
    call = validate_checkpoint("t", make_messages(2), make_run("t"), None)
    assert prove_prefix(call.snapshot, 0, EMPTY_DIGEST) == []


# -- entries carry the digest of the snapshot they leave ------------------------------------


def test_entry_digests_follow_any_history_whatever_the_writer_knew() -> None:
    """Random histories (appends, rewrites, truncations, full snapshots) written by
    writers that know the snapshot, know only the hot record, or know nothing: every
    entry's digest, when set, is the digest of the snapshot after it, and it is set
    whenever the writer knew the digest or the snapshot of what the entry keeps."""
    rng = random.Random(27)
    pool = make_messages(60)
    for _ in range(40):
        current: list[Message] = []
        hot: HotRecord | None = None
        state: list[bytes] | None = MessageSnapshot()
        for seq in range(1, 25):
            roll = rng.random()
            if roll < 0.5 or not current:
                messages = current + pool[len(current) : len(current) + rng.randint(0, 3)]
            elif roll < 0.7:
                cut = rng.randint(0, len(current))
                messages = [*current[:cut], {"role": "user", "content": f"edit {seq}"}]
            else:
                messages = current[: rng.randint(0, len(current))]
            append = roll < 0.3 and len(messages) >= len(current)
            knows = rng.choice(("state", "hot", "nothing"))
            previous_state = state if knows == "state" else None
            call = validate_checkpoint(
                "t",
                messages[len(current) :] if append else messages,
                make_run("t"),
                None,
                previous=previous_state,
                append=append,
            )
            entry = build_checkpoint_entry(
                call,
                previous=hot.thread if hot else None,
                previous_messages=previous_state,
                seq=seq,
                now=T0,
                previous_digest=hot.digest if hot and knows != "nothing" else b"",
                digest=True,
            )
            keeps_known = (
                entry.keep == 0
                or (previous_state is not None and entry.keep <= len(previous_state))
                or (
                    knows != "nothing"
                    and hot is not None
                    and bool(hot.digest)
                    and entry.keep == current_count(hot)
                )
            )
            assert bool(entry.digest) == keeps_known, (knows, entry.keep)
            if entry.digest:
                assert entry.digest == digest_of(messages)
            state = FORMAT.state_after(previous_state, entry, owned=rng.random() < 0.5)
            if state is not None:
                assert state == encode_messages(messages)
                assert isinstance(state, MessageSnapshot)
                if entry.chain and (entry.keep == 0 or previous_state is not None):
                    # The entry's digests carried over: nothing to hash again.
                    assert len(state.chain) == DIGEST_SIZE * len(state)
                assert state.digest_at(len(state)) == digest_of(messages)
            hot = advance_hot(hot, entry, seq, window=4)
            current = messages


def current_count(hot: HotRecord | None) -> int:
    return hot.thread.message_count if hot is not None and hot.thread is not None else 0


def test_a_cold_writer_proves_the_hot_record_and_sends_only_the_new_messages() -> None:
    history = make_messages(30)
    first = build_checkpoint_entry(
        validate_checkpoint("t", history[:28], make_run("t"), None),
        previous=None,
        previous_messages=None,
        seq=1,
        now=T0,
        digest=True,
    )
    hot = advance_hot(None, first, 1, window=4)
    assert hot.thread is not None
    call = validate_checkpoint("t", history, make_run("t"), None)
    proven = prove_prefix(call.snapshot, hot.thread.message_count, hot.digest)
    entry = build_checkpoint_entry(
        call,
        previous=hot.thread,
        previous_messages=proven,
        seq=2,
        now=T0,
        previous_digest=hot.digest,
        digest=True,
    )
    assert (entry.keep, list(entry.messages)) == (28, encode_messages(history[28:]))
    assert entry.digest == digest_of(history)


# -- the wire -------------------------------------------------------------------------------


def test_digests_cross_the_wire_in_entries_and_hot_records() -> None:
    call = validate_checkpoint("t", make_messages(3), make_run("t"), None)
    entry = build_checkpoint_entry(
        call, previous=None, previous_messages=None, seq=1, now=T0, digest=True
    )
    assert entry.digest == digest_of(make_messages(3))
    decoded = decode_entry(encode_entry(entry))
    assert decoded.digest == entry.digest
    assert decoded.chain == b""  # the chain stays with the writer
    record = advance_hot(None, entry, 5, window=4)
    assert record.digest == entry.digest
    assert decode_hot(encode_hot(record)).digest == entry.digest


@pytest.mark.parametrize("value", ['"abc"', '"' + "00" * 15 + '"', "17"])
def test_a_malformed_digest_is_a_corrupt_entry(value: str) -> None:
    call = validate_checkpoint("t", make_messages(1), make_run("t"), None)
    entry = build_checkpoint_entry(
        call, previous=None, previous_messages=None, seq=1, now=T0, digest=True
    )
    data = encode_entry(entry)
    good = f'"dg":"{entry.digest.hex()}"'.encode()
    assert good in data
    with pytest.raises(CorruptEntryError, match="digest"):
        decode_entry(data.replace(good, f'"dg":{value}'.encode()))


def test_entries_without_a_digest_leave_it_unknown() -> None:
    entry = WalEntry(
        thread_id="t", seq=2, kind=EntryKind.CHECKPOINT, at=T0, keep=1, message_count=1
    )
    assert b'"dg"' not in encode_entry(entry)
    assert decode_entry(encode_entry(entry)).digest == b""
    assert advance_hot(None, entry, 3, window=4).digest == b""


def test_stores_that_apply_entries_at_once_compute_no_digest() -> None:
    call = validate_checkpoint("t", make_messages(3), make_run("t"), None)
    entry = build_checkpoint_entry(call, previous=None, previous_messages=None, seq=1, now=T0)
    assert (entry.digest, entry.chain) == (b"", b"")
