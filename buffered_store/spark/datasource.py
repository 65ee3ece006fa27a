"""``spark.read.format("threadlog")``: the unflushed WAL tail as a DataFrame of entries.

The range of stream seqs that may hold unflushed entries, ``[first, last]``, comes from
the flusher consumer (`Wal.tail_bounds`): usually computed on the driver and passed as
options, so every partition reads the same tail. The range is cut into contiguous slices;
each partition connects to NATS from its executor and reads its slice with direct gets,
a chunk at a time. Reading costs O(entries in the tail), whatever the number of threads.

One row per decodable thread entry (garbage and other front-ends' subjects are skipped,
as the flusher quarantines them): the entry's seq and kind, its message delta (`keep`
plus the appended messages), the thread summary it carries, and its run.

Options: ``nats_url`` (required), ``credentials``, ``stream_name``, ``consumer_name``,
``request_timeout_s``, ``first`` and ``last`` (both or neither), ``partitions``,
``min_partition_entries``, ``chunk_entries``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import operator
import threading
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import orjson
import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from buffered_store.config import EngineConfig
from buffered_store.engine.keys import thread_from_subject
from buffered_store.engine.ports import StoredMsg
from buffered_store.errors import ConfigError, CorruptEntryError
from buffered_store.nats import NatsWal
from buffered_store.threadrun.entry import WalEntry, decode_entry_roles
from buffered_store.threadrun.records import RunRecord

T = TypeVar("T")

SOURCE_NAME = "threadlog"
MIN_PARTITION_ENTRIES = 1024
"""Default smallest slice of the tail read by one partition: each costs a NATS connection."""
_OPTION_TYPES: dict[str, Callable[[str], Any]] = {
    "first": int,
    "last": int,
    "partitions": int,
    "min_partition_entries": int,
    "chunk_entries": int,
    "request_timeout_s": float,
}

RUN_STRUCT = (
    "struct<run_id:string, thread_id:string, agent_id:string, status:string, "
    "parent_run_id:string, parent_thread_id:string, created_at:timestamp, "
    "updated_at:timestamp, finished_at:timestamp, steps:int, input_tokens:bigint, "
    "output_tokens:bigint, error:string, output:string, metadata:string>"
)
"""A run as Spark sees it: its columns, with `output` and `metadata` as JSON text."""

_RUN_FIELDS = StructType(
    [
        StructField("run_id", StringType()),
        StructField("thread_id", StringType()),
        StructField("agent_id", StringType()),
        StructField("status", StringType()),
        StructField("parent_run_id", StringType()),
        StructField("parent_thread_id", StringType()),
        StructField("created_at", TimestampType()),
        StructField("updated_at", TimestampType()),
        StructField("finished_at", TimestampType()),
        StructField("steps", IntegerType()),
        StructField("input_tokens", LongType()),
        StructField("output_tokens", LongType()),
        StructField("error", StringType()),
        StructField("output", StringType()),
        StructField("metadata", StringType()),
    ]
)
ENTRY_SCHEMA = StructType(
    [
        StructField("thread_id", StringType()),
        StructField("seq", LongType()),
        StructField("kind", StringType()),
        StructField("stream_seq", LongType()),
        StructField("at", TimestampType()),
        StructField("keep", IntegerType()),
        StructField("jump", BooleanType()),
        StructField("message_count", IntegerType()),
        StructField("created_at", TimestampType()),
        StructField("parent_thread_id", StringType()),
        StructField("metadata", StringType()),
        StructField("latest_run_id", StringType()),
        StructField("run", _RUN_FIELDS),
        StructField(
            "messages",
            ArrayType(
                StructType(
                    [StructField("role", StringType()), StructField("message", StringType())]
                )
            ),
        ),
    ]
)
"""Rows of the ``threadlog`` source. For a delete (`kind` ``del``) the summary columns
are null and `messages` is empty; `at` is the entry's time (the thread's `updated_at`)."""
ENTRY_ARROW = to_arrow_schema(ENTRY_SCHEMA, timezone="UTC")
"""`ENTRY_SCHEMA` as Arrow (timestamps in UTC)."""


def run_sync(factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine to completion from synchronous code.

    Spark's API is synchronous, but its callers may sit inside an event loop (a notebook,
    an async test): the coroutine then runs on a helper thread with its own loop.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(factory())
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bufstore-spark") as pool:
        return pool.submit(lambda: asyncio.run(factory())).result()


@dataclass(frozen=True, kw_only=True, slots=True)
class TailRead:
    """What a read of the WAL tail needs; travels to the executors inside the reader."""

    nats_url: str
    credentials: str | None = None
    stream_name: str = "THREADLOG"
    consumer_name: str = "thread-flusher"
    request_timeout_s: float = 5.0
    first: int | None = None
    last: int | None = None
    partitions: int = 2
    min_partition_entries: int = MIN_PARTITION_ENTRIES
    """A slice is never cut smaller than this: a partition costs a NATS connection."""
    chunk_entries: int = 4096
    """Entries fetched (concurrently) before rows are handed to Spark: bounds memory."""

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> TailRead:
        """Parse data source options (strings; unknown keys are rejected)."""
        given = {str(k).lower(): v for k, v in options.items() if k.lower() != "path"}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ConfigError(f"unknown {SOURCE_NAME} option(s): {', '.join(unknown)}")
        if not given.get("nats_url"):
            raise ConfigError(f"the {SOURCE_NAME} source needs the nats_url option")
        if ("first" in given) != ("last" in given):
            raise ConfigError("give both first and last, or neither")
        values: dict[str, Any] = {}
        try:
            for name, raw in given.items():
                values[name] = _OPTION_TYPES.get(name, str)(raw)
        except ValueError as exc:
            raise ConfigError(f"invalid {SOURCE_NAME} option: {exc}") from None
        read = cls(**values)
        if read.partitions < 1 or read.min_partition_entries < 1 or read.chunk_entries < 1:
            raise ConfigError("partitions, min_partition_entries and chunk_entries must be >= 1")
        return read

    def engine(self) -> EngineConfig:
        """The WAL settings of this read."""
        return EngineConfig(
            nats_url=self.nats_url,
            credentials=self.credentials,
            stream_name=self.stream_name,
            consumer_name=self.consumer_name,
            request_timeout_s=self.request_timeout_s,
        )


def tail_options(config: EngineConfig, bounds: tuple[int, int], partitions: int) -> dict[str, str]:
    """Data source options reading the tail `bounds` of the WAL described by `config`."""
    options = {
        "nats_url": config.nats_url,
        "stream_name": config.stream_name,
        "consumer_name": config.consumer_name,
        "request_timeout_s": str(config.request_timeout_s),
        "first": str(bounds[0]),
        "last": str(bounds[1]),
        "partitions": str(partitions),
    }
    if config.credentials:
        options["credentials"] = config.credentials
    return options


def split_range(first: int, last: int, partitions: int, min_size: int) -> list[tuple[int, int]]:
    """Cut ``[first, last]`` into at most `partitions` contiguous slices of >= `min_size`."""
    if last < first:
        return []
    count = last - first + 1
    parts = max(1, min(partitions, -(-count // max(1, min_size))))
    size = -(-count // parts)
    return [(lo, min(last, lo + size - 1)) for lo in range(first, last + 1, size)]


async def open_wal(config: EngineConfig) -> NatsWal:
    """A read-only WAL handle: connects without creating or checking any server object;
    its connection parses message headers faster (`nats.scan.header_lines`)."""
    wal = await NatsWal.connect(config, name="bufstore-spark", setup="none", reconnect="never")
    wal.receive_in_bulk()
    return wal


def tail_bounds(config: EngineConfig) -> tuple[int, int]:
    """``(first, last)`` stream seqs that may hold unflushed entries (empty when last < first)."""

    async def read() -> tuple[int, int]:
        wal = await open_wal(config)
        try:
            return await wal.tail_bounds()
        finally:
            await wal.close()

    return run_sync(read)


def entry_row(entry: WalEntry) -> dict[str, Any]:
    """One ``threadlog`` row (see `ENTRY_SCHEMA`)."""
    thread = entry.thread
    return {
        "thread_id": entry.thread_id,
        "seq": entry.seq,
        "kind": entry.kind.value,
        "stream_seq": entry.stream_seq,
        "at": entry.at,
        "keep": entry.keep,
        "jump": entry.jump,
        "message_count": entry.message_count,
        "created_at": thread.created_at if thread else None,
        "parent_thread_id": thread.parent_thread_id if thread else None,
        "metadata": orjson.dumps(dict(thread.metadata)).decode() if thread else None,
        "latest_run_id": thread.latest_run_id if thread else None,
        "run": run_row(entry.run) if entry.run else None,
        "messages": [
            {"role": orjson.loads(item)["role"], "message": item.decode()}
            for item in entry.messages
        ],
    }


_RUN_NAMES = tuple(f.name for f in ENTRY_ARROW.field("run").type)
_RUN_ATTRIBUTES = operator.attrgetter(*_RUN_NAMES)
"""Every `RUN_STRUCT` field's attribute of a run, in the struct's order, in one call."""
_RUN_CONVERTED: dict[str, Callable[[Any], Any]] = {
    "status": lambda status: status.value,
    "output": lambda output: orjson.dumps(output).decode(),
    "metadata": lambda metadata: orjson.dumps(dict(metadata)).decode(),
}
"""The `RUN_STRUCT` fields not stored as the run holds them (None stays None)."""


def run_row(run: RunRecord) -> dict[str, Any]:
    """A run as a `RUN_STRUCT` value."""
    row = dict(zip(_RUN_NAMES, _RUN_ATTRIBUTES(run), strict=True))
    for name, convert in _RUN_CONVERTED.items():
        if row[name] is not None:
            row[name] = convert(row[name])
    return row


def run_column(runs: Sequence[RunRecord | None]) -> pa.StructArray:
    """The ``run`` column of `ENTRY_ARROW` (what `run_row` gives per run), built field by
    field: one C-level attribute fetch per run, then the fields of `_RUN_CONVERTED`
    converted column-wise."""
    run_type = ENTRY_ARROW.field("run").type
    if not runs:
        return pa.array([], run_type)
    absent = (None,) * run_type.num_fields
    values = [absent if r is None else _RUN_ATTRIBUTES(r) for r in runs]
    columns = dict(zip(_RUN_NAMES, map(list, zip(*values, strict=True)), strict=True))
    for name, convert in _RUN_CONVERTED.items():
        columns[name] = [None if v is None else convert(v) for v in columns[name]]
    arrays = [pa.array(columns[f.name], f.type) for f in run_type]
    mask = pa.array([r is None for r in runs], pa.bool_())
    return pa.StructArray.from_arrays(arrays, fields=list(run_type), mask=mask)


async def read_entries(
    wal: NatsWal, config: EngineConfig, first: int, last: int
) -> list[tuple[WalEntry, tuple[str, ...]]]:
    """Decodable thread entries with stream seq in ``[first, last]`` and their messages'
    roles, in stream order; skips what `ThreadLog.read_tail` skips (the flusher
    quarantines it). The range comes in batches (`Wal.read_range`)."""
    return decode_messages(config, await wal.read_range(first, last))


def decode_messages(
    config: EngineConfig, messages: Iterable[StoredMsg]
) -> list[tuple[WalEntry, tuple[str, ...]]]:
    """`read_entries` once the messages are received: the decodable thread entries and
    their messages' roles, in the messages' order."""
    out: list[tuple[WalEntry, tuple[str, ...]]] = []
    for msg in messages:
        thread_id = thread_from_subject(config.stream_name, msg.subject)
        if thread_id is None:
            continue
        try:
            entry, roles = decode_entry_roles(msg.data, stream_seq=msg.seq)
        except CorruptEntryError:
            continue
        if entry.thread_id == thread_id:
            out.append((entry, roles))
    return out


def entry_batch(items: Sequence[tuple[WalEntry, tuple[str, ...]]]) -> pa.RecordBatch:
    """The ``threadlog`` rows of `items` (what `entry_row` gives), built column by column.

    The messages of all entries go into one flat list: no Python object per message
    beyond the bytes the decoder made.
    """
    texts: list[bytes] = []
    roles: list[str] = []
    offsets = [0]
    for entry, entry_roles in items:
        texts.extend(entry.messages)
        roles.extend(entry_roles)
        offsets.append(len(texts))
    entries = [entry for entry, _ in items]
    # A delete carries no thread summary.
    columns: dict[str, Any] = {
        "thread_id": [e.thread_id for e in entries],
        "seq": [e.seq for e in entries],
        "kind": [e.kind.value for e in entries],
        "stream_seq": [e.stream_seq for e in entries],
        "at": [e.at for e in entries],
        "keep": [e.keep for e in entries],
        "jump": [e.jump for e in entries],
        "message_count": [e.message_count for e in entries],
        "created_at": [None if e.deletes else e.thread_created_at for e in entries],
        "parent_thread_id": [None if e.deletes else e.parent_thread_id for e in entries],
        "metadata": [
            None if e.deletes else orjson.dumps(dict(e.metadata)).decode() for e in entries
        ],
        "latest_run_id": [None if e.deletes else e.latest_run_id for e in entries],
        "run": run_column([e.run for e in entries]),
    }
    arrays = [
        columns[f.name] if f.name == "run" else pa.array(columns[f.name], f.type)
        for f in ENTRY_ARROW
        if f.name != "messages"
    ]
    message_type = ENTRY_ARROW.field("messages").type
    values = pa.StructArray.from_arrays(
        [pa.array(roles, pa.string()), pa.array(texts, pa.binary()).cast(pa.string())],
        fields=list(message_type.value_type),
    )
    messages = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values, type=message_type)
    return pa.RecordBatch.from_arrays([*arrays, messages], schema=ENTRY_ARROW)


class _GcPause:
    """Who holds the collector paused: the last one out turns it back on, if the first
    one in found it on."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holders = 0
        self.turned_off = False

    def enter(self) -> None:
        with self.lock:
            if self.holders == 0:
                self.turned_off = gc.isenabled()
                if self.turned_off:
                    gc.disable()
            self.holders += 1

    def leave(self) -> None:
        with self.lock:
            self.holders -= 1
            if self.holders == 0 and self.turned_off:
                self.turned_off = False
                gc.enable()


_GC_PAUSE = _GcPause()


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for a bulk read, back on after if it was on.

    Reading a tail allocates hundreds of thousands of containers (received messages,
    parsed JSON, entries, runs) and makes no reference cycles: reference counting frees
    them all the same. With the collector on, those allocations set off collections
    that walk every object the process holds, again and again; in a process that holds
    many (a Spark driver, a notebook, the benchmark harness) decoding a 10,000-entry tail
    took 0.33 to 0.48 s instead of 0.17 to 0.19 s (docs/benchmarks/history.md). Reads that
    overlap (threads, nesting) keep it off until the last one ends; a collector that was
    off when the first began stays off.
    """
    _GC_PAUSE.enter()
    try:
        yield
    finally:
        _GC_PAUSE.leave()


def read_slice(read: TailRead, lo: int, hi: int) -> Iterator[pa.RecordBatch]:
    """The entries with stream seq in ``[lo, hi]``, one Arrow batch per chunk fetched.

    Arrow batches skip PySpark's row-by-row conversion of nested values.
    """
    config = read.engine()
    loop = asyncio.new_event_loop()
    try:
        wal = loop.run_until_complete(open_wal(config))
        try:
            for start in range(lo, hi + 1, read.chunk_entries):
                stop = min(hi, start + read.chunk_entries - 1)
                with gc_paused():  # never across a yield: Spark runs in between
                    items = loop.run_until_complete(read_entries(wal, config, start, stop))
                    batch = entry_batch(items) if items else None
                if batch is not None:
                    yield batch
        finally:
            loop.run_until_complete(wal.close())
    finally:
        loop.close()


def receive(read: TailRead, lo: int, hi: int) -> list[StoredMsg]:
    """The stored messages of ``[lo, hi]``, received in this process, not decoded."""

    async def fetch() -> list[StoredMsg]:
        wal = await open_wal(read.engine())
        try:
            return await wal.read_range(lo, hi)
        finally:
            await wal.close()

    with gc_paused():
        return run_sync(fetch)


def read_table(read: TailRead, lo: int, hi: int) -> pa.Table:
    """The rows of ``[lo, hi]``, read in this process (the driver, for a short tail)."""

    async def fetch() -> list[tuple[WalEntry, tuple[str, ...]]]:
        config = read.engine()
        wal = await open_wal(config)
        try:
            return await read_entries(wal, config, lo, hi)
        finally:
            await wal.close()

    with gc_paused():
        return pa.Table.from_batches([entry_batch(run_sync(fetch))], schema=ENTRY_ARROW)


class SeqRange(InputPartition):
    """A contiguous slice of stream seqs read by one Spark partition."""

    def __init__(self, lo: int, hi: int) -> None:
        super().__init__((lo, hi))
        self.lo = lo
        self.hi = hi


class ThreadLogReader(DataSourceReader):
    """Plans the slices on the driver side and reads one slice per partition."""

    def __init__(self, read: TailRead) -> None:
        self.read_spec = read

    def partitions(self) -> Sequence[SeqRange]:
        spec = self.read_spec
        if spec.first is None or spec.last is None:
            first, last = tail_bounds(spec.engine())
        else:
            first, last = spec.first, spec.last
        slices = split_range(first, last, spec.partitions, spec.min_partition_entries)
        return [SeqRange(lo, hi) for lo, hi in slices] or [SeqRange(1, 0)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, SeqRange)
        if partition.hi < partition.lo:
            return iter(())
        return read_slice(self.read_spec, partition.lo, partition.hi)


class ThreadLogDataSource(DataSource):
    """The ``threadlog`` batch source: entries of the unflushed WAL tail."""

    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def schema(self) -> StructType:
        return ENTRY_SCHEMA

    def reader(self, schema: Any) -> ThreadLogReader:
        return ThreadLogReader(TailRead.from_options(self.options))
