"""The pure parts of the Spark reads: condensing the WAL tail, options, SQL text.

No Spark session and no services: these run in a second. The rules checked here against
`planning.fold` are the ones the Spark merge applies per JDBC partition (see overlay.py).
"""

from __future__ import annotations

import base64
import gc
import itertools
import json
import random
import re
import threading
from datetime import UTC, datetime
from typing import Any

import pytest

from buffered_store.config import EngineConfig
from buffered_store.errors import ConfigError
from buffered_store.spark.condense import Condensed, condense_tail
from buffered_store.spark.datasource import (
    ENTRY_SCHEMA,
    TailRead,
    entry_row,
    gc_paused,
    split_range,
    tail_options,
)
from buffered_store.spark.jdbc import JdbcSource, id_set_sql, overlay_runs_sql
from buffered_store.threadrun.entry import EntryKind, WalEntry
from buffered_store.threadrun.messages import diff_snapshot, encode_messages
from buffered_store.threadrun.planning import ThreadView, fold
from buffered_store.threadrun.records import RunRecord

AT = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def as_dict(entry: WalEntry) -> dict[str, Any]:
    """An entry as the driver sees it after the ``threadlog`` read (Arrow rows)."""
    row = entry_row(entry)
    assert list(row) == ENTRY_SCHEMA.fieldNames()
    return row


def history(rng: random.Random, length: int) -> list[WalEntry]:
    """Random entries 1..length of one thread, as the writer would build them."""
    entries: list[WalEntry] = []
    snapshot: list[bytes] = []
    for seq in range(1, length + 1):
        if rng.random() < 0.1:
            entries.append(WalEntry(thread_id="t", seq=seq, kind=EntryKind.DELETE, at=AT))
            snapshot = []
            continue
        keep = len(snapshot) if rng.random() < 0.5 else rng.randint(0, len(snapshot))
        new = encode_messages(
            [{"role": "user", "content": f"{seq}.{i}"} for i in range(rng.randint(0, 3))]
        )
        target = [*snapshot[:keep], *new]
        delta = diff_snapshot(snapshot, target)
        run = RunRecord(run_id=f"r{rng.randint(1, 3)}", thread_id="t", agent_id="a", steps=seq)
        entries.append(
            WalEntry(
                thread_id="t",
                seq=seq,
                kind=EntryKind.CHECKPOINT,
                at=AT,
                keep=delta.keep,
                messages=delta.appended,
                message_count=len(target),
                run=run,
                stream_seq=100 + seq,
            )
        )
        snapshot = target
    return entries


def stored_view(entries: list[WalEntry], watermark: int) -> ThreadView:
    """What Postgres holds at `watermark`, with the run versions it would hold."""
    return fold(ThreadView(seq=0, thread=None, messages=[], runs={}), entries[:watermark])


def merged(
    condensed: Condensed, stored: ThreadView, watermark: int
) -> tuple[list[bytes] | None, dict[str, int]]:
    """The Spark merge rules for one thread, in Python: (messages or None if gone, runs)."""
    [overlay] = condensed.threads
    stored_runs = {run_id: seq for run_id, (_, seq) in stored.runs.items()}
    if overlay["ov_seq"] <= watermark:
        return (None if stored.thread is None else list(stored.messages)), stored_runs
    assert overlay["ov_first_seq"] <= watermark + 1, "gap"
    runs: dict[str, int] = {}
    deleted = overlay["ov_del_seq"] > watermark
    for run_id, seq in stored_runs.items():  # real rows
        version = next((r for r in condensed.runs if r["run_id"] == run_id), None)
        superseded = version is not None and version["ov_run_seq"] > watermark
        if not deleted and not superseded:
            runs[run_id] = seq
    for version in condensed.runs:  # replaced rows and placeholders
        if version["ov_run_seq"] > max(watermark, overlay["ov_del_seq"]):
            runs[version["run_id"]] = version["ov_run_seq"]
    if overlay["ov_deleted"]:
        return None, runs
    stored_rows = len(stored.messages) if stored.thread is not None else 0
    out: list[bytes] = []
    for position in range(max(stored_rows, overlay["ov_count"])):
        placeholder = position >= stored_rows
        index = position - overlay["ov_base"]
        entry = overlay["ov_messages"][index] if 0 <= index < len(overlay["ov_messages"]) else None
        use = entry is not None and entry["thread_seq"] > watermark
        if position < overlay["ov_count"] and (use or not placeholder):
            out.append(entry["message"].encode() if use and entry else stored.messages[position])
    return out, runs


@pytest.mark.parametrize("seed", range(40))
def test_condensed_tail_merged_at_any_watermark_equals_the_fold(seed: int) -> None:
    rng = random.Random(seed)
    entries = history(rng, rng.randint(1, 12))
    last = len(entries)
    for watermark in range(last + 1):
        # The tail starts anywhere at or below the watermark (older entries were acked).
        start = rng.randint(0, watermark)
        if start == last:
            continue  # nothing pending: the thread is read from Postgres as it is
        condensed = condense_tail(as_dict(e) for e in entries[start:])
        expected = fold(stored_view(entries, watermark), entries[start:])
        messages, runs = merged(condensed, stored_view(entries, watermark), watermark)
        want = None if expected.thread is None else expected.messages
        assert messages == want, (seed, watermark, start)
        # Runs: the store keeps every version since the last delete.
        assert runs == {run_id: seq for run_id, (_, seq) in expected.runs.items()}


def test_a_missing_entry_below_the_newest_moves_the_first_seq_up() -> None:
    entries = history(random.Random(1), 6)
    rows = [as_dict(e) for e in entries if e.seq != 3]
    [overlay] = condense_tail(rows).threads
    assert (overlay["ov_first_seq"], overlay["ov_seq"]) == (4, 6)


def test_a_chain_started_by_a_jump_applies_over_any_watermark() -> None:
    """A legacy thread stored at seq 3 whose buffered chain jumped (its writer could not
    read the stored seq): the merge equals the fold, and no gap is reported."""
    legacy = history(random.Random(7), 3)
    stored = stored_view(legacy, 3)
    base = 10**15
    rows = [
        encode_messages([{"role": "user", "content": f"j{i}"} for i in range(n)]) for n in (2, 3)
    ]
    chain = [
        WalEntry(
            thread_id="t",
            seq=base + 1,
            kind=EntryKind.CHECKPOINT,
            at=AT,
            messages=rows[0],
            message_count=2,
            run=RunRecord(run_id="new", thread_id="t", agent_id="a"),
            jump=True,
            stream_seq=500,
        ),
        WalEntry(
            thread_id="t",
            seq=base + 2,
            kind=EntryKind.CHECKPOINT,
            at=AT,
            keep=2,
            messages=rows[1][2:],
            message_count=3,
            run=RunRecord(run_id="new", thread_id="t", agent_id="a", steps=2),
            stream_seq=501,
        ),
    ]
    condensed = condense_tail(as_dict(e) for e in chain)
    assert condensed.threads[0]["ov_first_seq"] == 1
    expected = fold(stored, chain)
    messages, runs = merged(condensed, stored, 3)
    assert messages == expected.messages == rows[1]
    assert runs == {run_id: seq for run_id, (_, seq) in expected.runs.items()}
    assert set(runs) == {"new", *stored.runs}


def test_a_run_reused_by_another_thread_belongs_to_the_later_write() -> None:
    def entry(thread_id: str, seq: int, stream_seq: int) -> dict[str, Any]:
        run = RunRecord(run_id="shared", thread_id=thread_id, agent_id="a")
        return as_dict(
            WalEntry(
                thread_id=thread_id,
                seq=seq,
                kind=EntryKind.CHECKPOINT,
                at=AT,
                run=run,
                stream_seq=stream_seq,
            )
        )

    condensed = condense_tail([entry("a", 5, 10), entry("b", 1, 11)])
    [version] = condensed.runs
    assert (version["run_id"], version["ov_owner"], version["ov_run_seq"]) == ("shared", "b", 1)
    assert condensed.runs_by_thread() == {"a": [], "b": ["shared"]}


def test_split_range() -> None:
    assert split_range(5, 4, 4, 1) == []
    assert split_range(1, 10, 3, 1) == [(1, 4), (5, 8), (9, 10)]
    assert split_range(1, 10, 8, 5) == [(1, 5), (6, 10)]
    assert split_range(7, 7, 8, 1024) == [(7, 7)]
    slices = split_range(1, 100_000, 16, 1024)
    assert len(slices) == 16
    assert slices[0][0] == 1
    assert slices[-1][1] == 100_000
    assert all(b + 1 == c for (_, b), (c, _) in itertools.pairwise(slices))


def test_tail_read_options_round_trip_and_reject_mistakes() -> None:
    config = EngineConfig(nats_url="nats://h:1", stream_name="S", consumer_name="c")
    read = TailRead.from_options(tail_options(config, (3, 9), 4))
    assert (read.first, read.last, read.partitions, read.stream_name) == (3, 9, 4, "S")
    assert read.engine().consumer_name == "c"
    with pytest.raises(ConfigError, match="nats_url"):
        TailRead.from_options({"stream_name": "S"})
    with pytest.raises(ConfigError, match="both first and last"):
        TailRead.from_options({"nats_url": "nats://h", "first": "1"})
    with pytest.raises(ConfigError, match="unknown"):
        TailRead.from_options({"nats_url": "nats://h", "firts": "1"})
    with pytest.raises(ConfigError, match="invalid"):
        TailRead.from_options({"nats_url": "nats://h", "partitions": "many"})


def test_pending_ids_never_reach_the_sql_text_raw() -> None:
    ids = ["x'); DROP TABLE threads; --", "ünï 🚀", '"quoted"', "a\\b"]
    sql = id_set_sql(ids)
    payload = re.search(r"decode\('([^']*)', 'base64'\)", sql)
    assert payload is not None
    assert re.fullmatch(r"[A-Za-z0-9+/=]*", payload.group(1))
    assert json.loads(base64.b64decode(payload.group(1))) == sorted(ids)
    source = JdbcSource(url="jdbc:postgresql://h/db", schema='we"ird')
    runs_sql = overlay_runs_sql(source, {thread_id: [thread_id] for thread_id in ids})
    assert '"we""ird"."runs"' in runs_sql
    assert "DROP" not in runs_sql


def test_jdbc_source_validates() -> None:
    with pytest.raises(ConfigError, match="JDBC"):
        JdbcSource(url="postgresql://h/db")
    with pytest.raises(ConfigError, match="partitions"):
        JdbcSource(url="jdbc:postgresql://h/db", partitions=0)
    source = JdbcSource.from_database_url("postgresql+psycopg://u:p%40ss@h:6543/db", schema="s")
    assert source.url == "jdbc:postgresql://h:6543/db?user=u&password=p%40ss"
    assert source.with_snapshot("00000003-0000001B-1").session_init is not None
    with pytest.raises(ConfigError):
        source.with_snapshot("x'; DROP")


def test_overlapping_tail_reads_keep_the_collector_off_until_the_last_one_ends() -> None:
    assert gc.isenabled()
    inside, release = threading.Event(), threading.Event()

    def other_read() -> None:
        with gc_paused():
            inside.set()
            release.wait(10)

    worker = threading.Thread(target=other_read)
    with gc_paused():
        assert not gc.isenabled()
        worker.start()
        assert inside.wait(10)
    assert not gc.isenabled()  # the other read still runs
    release.set()
    worker.join(10)
    assert gc.isenabled()
    with gc_paused(), gc_paused():  # nested
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_collector_turned_off_before_a_tail_read_stays_off() -> None:
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("a failed read")
    assert gc.isenabled()
