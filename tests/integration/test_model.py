"""Model-based test of the buffered store (issue 9): random operation sequences over two
store instances, a flusher that starts and stops, legacy threads already in Postgres and
faults injected at the WAL seam, checked after every step against a plain model.

Real components only: a nats-server and Postgres (the suite's services), two
`BufferedThreadRunStore` instances with their own NATS connections and Postgres pools (two
application processes), a `Flusher` over a third pool. Faults wrap the instance's `Wal`
methods (`publish`, `kv_swap` of the thread's hot key), the seam every write crosses:

* ``publish_flaky``: the first publish fails before reaching the server (retried);
* ``ack_lost``: the publish lands, its ack is lost (the retry must find its own entry);
* ``ack_lost_other``: as above, and the other instance appends on top before the retry;
* ``ack_lost_down``: the publish lands and every later publish fails: commit unknown;
* ``publish_down``: no publish reaches the server: commit unknown, nothing stored;
* ``hot_down``: every update of the hot record fails: commit unknown, entry stored;
* ``hot_lost_after``: the first hot-record update lands but its answer is lost.

The model keeps, per thread, the candidate states the acknowledged history allows: one,
except after a commit-unknown call, when the state without the entry stays possible for
reads (marked provisional when the test knows the entry landed: such an entry must not be
lost in the end). Every read must equal one candidate; at the end, after the flusher is
idle and `force_flush_all`, Postgres must equal a non-provisional candidate exactly.

``BUFSTORE_MODEL_EXAMPLES`` (default 20) and ``BUFSTORE_MODEL_STEPS`` (default 30) run more.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import psycopg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from buffered_store.config import BufferedStoreConfig
from buffered_store.engine.keys import hot_key
from buffered_store.engine.ports import Wal
from buffered_store.errors import (
    CommitUnknownError,
    RunOwnershipError,
    StoreError,
    WalUnavailableError,
)
from buffered_store.model.records import CheckpointReceipt, Message, RunRecord
from buffered_store.stores.postgres import PostgresThreadRunStore
from buffered_store.stores.urls import to_libpq_url
from buffered_store.threadrun.store import BufferedThreadRunStore
from flusher import Flusher, FlusherConfig
from tests.plugins.stores import delete_wal_objects, unique_names

T = TypeVar("T")

EXAMPLES = int(os.environ.get("BUFSTORE_MODEL_EXAMPLES", "20"))
STEPS = int(os.environ.get("BUFSTORE_MODEL_STEPS", "30"))

THREADS = ("t0", "t1", "t2")
"""Threads born in the buffered store."""
LEGACY = ("L0", "L1")
"""Threads written to Postgres directly before the buffered store sees them."""
INSTANCES = (0, 1)
FAULTS = (
    None,
    "publish_flaky",
    "ack_lost",
    "ack_lost_other",
    "ack_lost_down",
    "publish_down",
    "hot_down",
    "hot_lost_after",
)
# Mostly no fault: shrinking goes to the first element.
FAULT_STRATEGY = st.one_of(st.just(None), st.just(None), st.sampled_from(FAULTS))
RUN_PICKS = ("latest", "new", "other", "retired")

FLUSHER_SETTINGS: dict[str, Any] = {
    "flush_interval_s": 0.05,
    "fetch_timeout_s": 0.2,
    "nak_delay_initial_s": 0.05,
    "nak_delay_max_s": 0.5,
    "requeue_delay_s": 0.02,
    "db_retry_initial_s": 0.02,
    "db_retry_max_s": 0.2,
    "nats_retry_initial_s": 0.05,
    "nats_retry_max_s": 0.5,
    "drain_timeout_s": 10.0,
}


# -- the model -----------------------------------------------------------------------------


@dataclass(frozen=True)
class State:
    """One possible state of one thread; `messages` None: the thread does not exist."""

    messages: tuple[str, ...] | None = None
    latest_run: str | None = None
    metadata: tuple[tuple[str, Any], ...] = ()
    runs: tuple[tuple[str, RunRecord], ...] = ()
    provisional: bool = False
    """Lacks an entry the test knows landed: a read may show it, the end state may not."""

    @property
    def live(self) -> bool:
        return self.messages is not None

    def run_ids(self) -> frozenset[str]:
        return frozenset(run_id for run_id, _ in self.runs)

    def same_data(self, other: State) -> bool:
        return dataclasses.replace(self, provisional=False) == dataclasses.replace(
            other, provisional=False
        )


@dataclass(frozen=True)
class Op:
    """A write as the model applies it."""

    kind: str  # "checkpoint", "append" or "delete"
    messages: tuple[str, ...] = ()
    run: RunRecord | None = None
    metadata: dict[str, Any] | None = None

    def apply(self, state: State) -> State:
        if self.kind == "delete":
            return State(provisional=state.provisional)
        assert self.run is not None
        if self.kind == "append":
            messages = (state.messages or ()) + self.messages
        else:
            messages = self.messages
        if self.metadata is not None:
            metadata = tuple(sorted(self.metadata.items()))
        else:
            metadata = state.metadata if state.live else ()
        runs = dict(state.runs) if state.live else {}
        runs[self.run.run_id] = self.run
        return State(
            messages=messages,
            latest_run=self.run.run_id,
            metadata=metadata,
            runs=tuple(sorted(runs.items())),
            provisional=state.provisional,
        )


def dedupe(states: Sequence[State]) -> list[State]:
    kept: list[State] = []
    for state in states:
        twin = next((k for k in kept if k.same_data(state)), None)
        if twin is None:
            kept.append(state)
        elif twin.provisional and not state.provisional:
            kept[kept.index(twin)] = state
    return kept


@dataclass
class Fault:
    """The fault armed for one write of one instance, and what the seam saw."""

    kind: str | None
    thread_id: str
    on_landed: Callable[[], Awaitable[None]] | None = None
    landed: int = 0  # publishes the server answered
    tripped: bool = False  # the one-shot part of the fault happened
    unknown: int = 0  # publishes that may have reached it (error after sending)
    hot_calls: int = 0

    def verdict(self) -> bool | None:
        """Whether the entry is in the WAL: True, False, or None when unknowable."""
        if self.landed:
            return True
        return None if self.unknown else False


def message(text: str) -> Message:
    return {"role": "user", "content": text}


def texts(messages: Sequence[Message]) -> tuple[str, ...]:
    out: list[str] = []
    for item in messages:
        assert set(item) == {"role", "content"}, item
        out.append(item["content"])
    return tuple(out)


# -- the machine ---------------------------------------------------------------------------


class BufferedStoreMachine(RuleBasedStateMachine):
    nats_url: ClassVar[str] = ""
    database_url: ClassVar[str] = ""
    schema: ClassVar[str] = ""
    ops: ClassVar[Counter[str]] = Counter()
    examples: ClassVar[int] = 0

    def __init__(self) -> None:
        super().__init__()
        type(self).examples += 1
        self.runner = asyncio.Runner()
        self.wal_names = unique_names()
        self.model: dict[str, list[State]] = {}
        self.max_seq: dict[str, int] = {}
        self.legacy_runs: set[str] = set()
        self.tainted: set[str] = set()
        self.used_runs: set[str] = set()
        self.counter = itertools.count(1)
        self.trace: list[str] = []
        self.faults: dict[int, Fault | None] = dict.fromkeys(INSTANCES)
        self.stores: dict[int, BufferedThreadRunStore] = {}
        self.inners: list[PostgresThreadRunStore] = []
        self.flusher: Flusher | None = None
        settings: dict[str, Any] = {
            "nats_url": self.nats_url,
            "drain_on_close": False,
            "checkpoint_timeout_s": 1.5,
            **self.wal_names,
        }
        self.config = BufferedStoreConfig(**settings)
        self.run(self._setup())

    # -- plumbing --------------------------------------------------------------------------

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.runner.run(coro)

    async def _setup(self) -> None:
        async with await psycopg.AsyncConnection.connect(
            to_libpq_url(self.database_url), autocommit=True
        ) as conn:
            await conn.execute(
                f'TRUNCATE "{self.schema}".threads, "{self.schema}".messages, "{self.schema}".runs'
            )
        self.verifier = await self._pg()
        self.legacy_writer = await self._pg()
        self.flush_target = await self._pg()
        for index in INSTANCES:
            await self._open_instance(index)

    async def _pg(self) -> PostgresThreadRunStore:
        # Small pools: an example opens several stores (like processes), restarts open more.
        store = await PostgresThreadRunStore.connect(
            self.database_url, schema=self.schema, pool_size=3, max_overflow=2
        )
        self.inners.append(store)
        return store

    async def _open_instance(self, index: int) -> None:
        old = self.stores.get(index)
        if old is not None:
            await old.close()
            assert isinstance(old.inner, PostgresThreadRunStore)
            self.inners.remove(old.inner)
            await old.inner.close()
        inner = await self._pg()
        store = await BufferedThreadRunStore.connect(inner, self.config)
        self._install_faults(index, store.wal)
        self.stores[index] = store

    def _install_faults(self, index: int, wal: Wal) -> None:
        """Route the instance's WAL writes through the fault armed for its current call."""
        real_publish, real_swap = wal.publish, wal.kv_swap

        async def publish(subject: str, payload: bytes, **kw: Any) -> tuple[int, bool]:
            fault = self.faults[index]
            kind = fault.kind if fault is not None else None
            if fault is None or kind is None:
                return await real_publish(subject, payload, **kw)
            if kind == "publish_down" or (kind == "ack_lost_down" and fault.tripped):
                raise WalUnavailableError("NATS unreachable (injected)")
            if kind == "publish_flaky" and not fault.tripped:
                fault.tripped = True
                raise WalUnavailableError("NATS unreachable for a moment (injected)")
            try:
                result = await real_publish(subject, payload, **kw)
            except WalUnavailableError:
                fault.unknown += 1  # it may have reached the server
                raise
            fault.landed += 1
            if kind in ("ack_lost", "ack_lost_other", "ack_lost_down") and not fault.tripped:
                fault.tripped = True
                if fault.on_landed is not None:
                    await fault.on_landed()
                raise WalUnavailableError("publish ack lost (injected)")
            return result

        async def kv_swap(key: str, value: bytes, *, revision: int | None) -> int:
            fault = self.faults[index]
            if fault is None or key != hot_key(fault.thread_id):
                return await real_swap(key, value, revision=revision)
            fault.hot_calls += 1
            if fault.kind == "hot_down":
                raise WalUnavailableError("KV unreachable (injected)")
            if fault.kind == "hot_lost_after" and fault.hot_calls == 1:
                await real_swap(key, value, revision=revision)
                raise WalUnavailableError("KV answer lost (injected)")
            return await real_swap(key, value, revision=revision)

        wal.publish = publish  # type: ignore[method-assign]
        wal.kv_swap = kv_swap  # type: ignore[method-assign]

    def checked(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run a check; a failure names the steps of this example (replays of timing-
        dependent failures may differ, so Hypothesis cannot always print them itself)."""
        try:
            self.run(coro)
        except AssertionError as exc:
            steps = "\n  ".join(self.trace[-60:])
            raise AssertionError(f"{exc}\nsteps of this example:\n  {steps}") from None

    def teardown(self) -> None:
        try:
            self.checked(self._final_check())
        finally:
            try:
                self.run(self._close())
            finally:
                self.runner.close()

    async def _close(self) -> None:
        if self.flusher is not None:
            with contextlib.suppress(Exception):
                await self.flusher.stop(drain=False)
        for store in self.stores.values():
            with contextlib.suppress(Exception):
                await store.close()
        for inner in self.inners:
            with contextlib.suppress(Exception):
                await inner.close()
        with contextlib.suppress(Exception):
            await delete_wal_objects(self.nats_url, self.config)

    # -- model helpers -----------------------------------------------------------------

    def names(self) -> tuple[str, ...]:
        """Threads operations pick from: the buffered-born ones and the legacy ones made."""
        return THREADS + tuple(t for t in LEGACY if t in self.model)

    def pick_thread(self, data: st.DataObject) -> str:
        return data.draw(st.sampled_from(self.names()), label="thread")

    def states(self, thread_id: str) -> list[State]:
        return self.model.get(thread_id, [State()])

    def certain(self, thread_id: str) -> State | None:
        states = self.states(thread_id)
        return states[0] if len(states) == 1 else None

    def holder(self, run_id: str) -> str | None:
        """The thread that certainly holds the run (in every candidate, alone), if any."""
        holders = {t for t, states in self.model.items() for s in states if run_id in s.run_ids()}
        if len(holders) != 1:
            return None
        [thread_id] = holders
        states = self.states(thread_id)
        return thread_id if all(run_id in s.run_ids() for s in states) else None

    def new_run(self, thread_id: str) -> RunRecord:
        return RunRecord(run_id=f"r{next(self.counter)}", thread_id=thread_id, agent_id="agent")

    def pick_run(self, thread_id: str, pick: str, data: st.DataObject) -> tuple[RunRecord, bool]:
        """A run for a write on `thread_id`; True when the write must be refused."""
        steps = next(self.counter)
        state = self.certain(thread_id)
        if pick == "latest" and state is not None and state.latest_run is not None:
            return dict(state.runs)[state.latest_run].replace(steps=steps), False
        free = sorted(
            r
            for r in self.used_runs - self.tainted - self.legacy_runs
            if not any(r in s.run_ids() for ss in self.model.values() for s in ss)
        )
        if pick == "retired" and free:
            run_id = data.draw(st.sampled_from(free), label="retired run")
            return RunRecord(run_id=run_id, thread_id=thread_id, agent_id="a", steps=steps), False
        owned = sorted(
            r
            for r in self.used_runs - self.tainted - self.legacy_runs
            if self.holder(r) not in (None, thread_id)
            and not any(r in s.run_ids() for s in self.states(thread_id))
        )
        if pick == "other" and owned:
            run_id = data.draw(st.sampled_from(owned), label="other thread's run")
            return RunRecord(run_id=run_id, thread_id=thread_id, agent_id="a", steps=steps), True
        return self.new_run(thread_id).replace(steps=steps), False

    def note_seq(self, thread_id: str, seq: int | None, acknowledged: bool) -> None:
        if seq is None:
            return
        before = self.max_seq.get(thread_id, 0)
        if acknowledged:
            assert seq > before, f"{thread_id}: receipt seq {seq} not above {before}"
        self.max_seq[thread_id] = max(before, seq)

    def land(self, thread_id: str, op: Op, verdict: bool | None) -> None:
        """Apply a write whose call failed with commit unknown, or was acknowledged."""
        states = self.states(thread_id)
        if verdict is True:
            # Landed: visible at once, or only after the next write or flush.
            new = [op.apply(s) for s in states] + [
                dataclasses.replace(s, provisional=True) for s in states
            ]
        elif verdict is None:
            new = [op.apply(s) for s in states] + list(states)
        else:
            new = list(states)
        self.model[thread_id] = dedupe(new)

    def acknowledge(self, thread_id: str, op: Op) -> None:
        self.model[thread_id] = dedupe([op.apply(s) for s in self.states(thread_id)])

    # -- writes ------------------------------------------------------------------------

    async def _call(
        self, index: int, fault: Fault, call: Callable[[], Awaitable[Any]]
    ) -> tuple[Any, BaseException | None]:
        self.faults[index] = fault
        try:
            return await call(), None
        except StoreError as exc:
            return None, exc
        finally:
            self.faults[index] = None

    def settle(
        self, thread_id: str, op: Op, fault: Fault, result: Any, error: BaseException | None
    ) -> None:
        """Fold the outcome of one write into the model, checking what can be checked."""
        kind = fault.kind or "none"
        outcome = repr(result) if error is None else f"{type(error).__name__}: {error}"
        self.trace.append(f"    -> {outcome} (landed={fault.verdict()})")
        if error is None:
            self.ops[f"{op.kind} ok" + (f" ({kind})" if fault.kind else "")] += 1
            if isinstance(result, CheckpointReceipt):
                self.note_seq(thread_id, result.thread_seq, acknowledged=True)
            self.acknowledge(thread_id, op)
            return
        self.ops[f"{op.kind} {type(error).__name__} ({kind})"] += 1
        if op.run is not None:
            self.tainted.add(op.run.run_id)
        verdict = fault.verdict()
        if isinstance(error, CommitUnknownError):
            if error.thread_seq:
                assert verdict is not False, "commit unknown with a seq, but nothing landed"
                self.note_seq(thread_id, error.thread_seq, acknowledged=False)
                verdict = True
            self.land(thread_id, op, verdict)
            return
        # Any other error: nothing was written.
        assert verdict is not True, f"{error!r} although the entry is in the WAL"
        assert fault.kind is not None or not isinstance(error, RunOwnershipError), error

    async def _write(
        self,
        index: int,
        thread_id: str,
        op: Op,
        fault_kind: str | None,
        refused: bool,
    ) -> None:
        store = self.stores[index]
        fault = Fault(fault_kind, thread_id)
        self.trace.append(
            f"instance {index}: {op.kind} {thread_id} {op.messages} "
            f"run={op.run.run_id if op.run else None} meta={op.metadata} fault={fault_kind} "
            f"refused={refused}"
        )
        other_ops: list[tuple[Op, Any]] = []
        if fault_kind == "ack_lost_other":
            other = self.stores[1 - index]
            extra = Op("append", (f"m{next(self.counter)}",), op.run or self.new_run(thread_id))

            async def on_landed() -> None:
                assert extra.run is not None
                try:
                    outcome: Any = await other.append(
                        thread_id, [message(t) for t in extra.messages], extra.run
                    )
                except StoreError as exc:  # a timeout on a busy machine
                    outcome = exc
                other_ops.append((extra, outcome))

            fault.on_landed = on_landed
        if refused:
            fault.kind = None
        if op.kind == "delete":
            call: Callable[[], Awaitable[Any]] = lambda: store.delete_thread(thread_id)  # noqa: E731
        else:
            assert op.run is not None
            method = store.append if op.kind == "append" else store.checkpoint
            msgs, run = [message(t) for t in op.messages], op.run
            call = lambda: method(thread_id, msgs, run, metadata=op.metadata)  # noqa: E731
        result, error = await self._call(index, fault, call)
        if refused:
            assert isinstance(error, RunOwnershipError), f"run reuse not refused: {error!r}"
            self.ops[f"{op.kind} refused (run of another thread)"] += 1
            return
        if other_ops:
            # Ours landed first, the other instance's append on top of it.
            extra, outcome = other_ops[0]
            self.settle(thread_id, op, fault, result, error)
            if isinstance(outcome, CheckpointReceipt):
                # Ours is under another writer's acknowledged entry: certainly visible.
                self.model[thread_id] = dedupe(
                    [s for s in self.states(thread_id) if not s.provisional]
                )
                self.note_seq(thread_id, outcome.thread_seq, acknowledged=True)
                self.acknowledge(thread_id, extra)
                self.ops["append ok (other writer on top)"] += 1
            else:
                assert isinstance(outcome, CommitUnknownError | WalUnavailableError), outcome
                assert extra.run is not None
                self.tainted.add(extra.run.run_id)
                self.land(thread_id, extra, None)
                self.ops[f"append {type(outcome).__name__} (other writer on top)"] += 1
            return
        self.settle(thread_id, op, fault, result, error)

    WRITE_ARGS: ClassVar[dict[str, Any]] = {
        "index": st.sampled_from(INSTANCES),
        "count": st.integers(0, 2),
        "pick": st.sampled_from(RUN_PICKS),
        "with_metadata": st.booleans(),
        "fault": FAULT_STRATEGY,
        "data": st.data(),
    }

    @rule(keep=st.integers(0, 3), **WRITE_ARGS)
    def checkpoint(
        self,
        keep: int,
        index: int,
        count: int,
        pick: str,
        with_metadata: bool,
        fault: str | None,
        data: st.DataObject,
    ) -> None:
        """A snapshot: a kept prefix of the current messages plus `count` new ones."""
        thread_id = self.pick_thread(data)
        base = self.states(thread_id)[0].messages or ()
        fresh = tuple(f"m{next(self.counter)}" for _ in range(count))
        self._write_with(
            index, thread_id, "checkpoint", base[:keep] + fresh, pick, with_metadata, fault, data
        )

    @rule(**WRITE_ARGS)
    def append(
        self,
        index: int,
        count: int,
        pick: str,
        with_metadata: bool,
        fault: str | None,
        data: st.DataObject,
    ) -> None:
        """1 to 3 new messages after the thread's current ones."""
        thread_id = self.pick_thread(data)
        fresh = tuple(f"m{next(self.counter)}" for _ in range(count + 1))
        self._write_with(index, thread_id, "append", fresh, pick, with_metadata, fault, data)

    def _write_with(
        self,
        index: int,
        thread_id: str,
        kind: str,
        messages: tuple[str, ...],
        pick: str,
        with_metadata: bool,
        fault: str | None,
        data: st.DataObject,
    ) -> None:
        """A write with a run of this thread, a new one, another thread's or a retired one."""
        run, refused = self.pick_run(thread_id, pick, data)
        self.used_runs.add(run.run_id)
        metadata = {"step": next(self.counter)} if with_metadata else None
        op = Op(kind, messages, run, metadata)
        self.run(self._write(index, thread_id, op, fault, refused))

    @rule(index=st.sampled_from(INSTANCES), fault=FAULT_STRATEGY, data=st.data())
    def delete(self, index: int, fault: str | None, data: st.DataObject) -> None:
        thread_id = self.pick_thread(data)
        if fault == "ack_lost_other":
            fault = "ack_lost"
        self.run(self._write(index, thread_id, Op("delete"), fault, refused=False))

    @precondition(lambda self: any(t not in self.model for t in LEGACY))
    @rule(steps=st.integers(1, 3), data=st.data())
    def legacy_thread(self, steps: int, data: st.DataObject) -> None:
        """A thread written to Postgres before the buffered store ever sees it."""
        thread_id = data.draw(st.sampled_from([t for t in LEGACY if t not in self.model]))
        run = self.new_run(thread_id)
        self.legacy_runs.add(run.run_id)
        self.used_runs.add(run.run_id)
        state = State()
        for _ in range(steps):
            op = Op("append", (f"m{next(self.counter)}",), run.replace(steps=next(self.counter)))
            assert op.run is not None
            receipt = self.run(
                self.legacy_writer.append(thread_id, [message(t) for t in op.messages], op.run)
            )
            self.note_seq(thread_id, receipt.thread_seq, acknowledged=True)
            state = op.apply(state)
        self.model[thread_id] = [state]
        self.ops["legacy thread"] += 1
        self.trace.append(f"legacy thread {thread_id}: {state.messages} run={run.run_id}")

    @rule(data=st.data())
    def concurrent_appends(self, data: st.DataObject) -> None:
        """Both instances append to one thread at once: both land, one after the other."""
        thread_id = self.pick_thread(data)
        ops = [
            Op("append", (f"m{next(self.counter)}",), self.new_run(thread_id)) for _ in INSTANCES
        ]
        for op in ops:
            assert op.run is not None
            self.used_runs.add(op.run.run_id)

        async def one(index: int, op: Op) -> tuple[Any, BaseException | None]:
            store, run = self.stores[index], op.run
            assert run is not None
            msgs = [message(t) for t in op.messages]
            return await self._call(
                index, Fault(None, thread_id), lambda: store.append(thread_id, msgs, run)
            )

        async def both() -> list[tuple[Any, BaseException | None]]:
            calls = (one(i, op) for i, op in zip(INSTANCES, ops, strict=True))
            return list(await asyncio.gather(*calls))

        outcomes = self.run(both())
        self.trace.append(f"concurrent appends {thread_id} {[o.messages for o in ops]}: {outcomes}")
        if all(error is None for _, error in outcomes):
            order = sorted(zip(outcomes, ops, strict=True), key=lambda p: p[0][0].thread_seq)
            for (receipt, _), op in order:
                self.note_seq(thread_id, receipt.thread_seq, acknowledged=True)
                self.acknowledge(thread_id, op)
            self.ops["concurrent appends ok"] += 1
            return
        # A call timed out on a busy machine: every landed subset and order stays possible.
        self.ops["concurrent appends with an error"] += 1
        for (_, error), op in zip(outcomes, ops, strict=True):
            assert error is None or isinstance(error, CommitUnknownError | WalUnavailableError), (
                error
            )
            assert op.run is not None
            self.tainted.add(op.run.run_id)
        states = self.states(thread_id)
        candidates: list[State] = []
        for n in range(len(ops) + 1):
            for subset in itertools.permutations(range(len(ops)), n):
                needed = {i for i, (_, e) in enumerate(outcomes) if e is None}
                if not needed <= set(subset):
                    continue
                for state in states:
                    for i in subset:
                        state = ops[i].apply(state)
                    candidates.append(state)
        self.model[thread_id] = dedupe(candidates)

    @precondition(lambda self: self.flusher is None)
    @rule()
    def start_flusher(self) -> None:
        async def start() -> Flusher:
            config = FlusherConfig.from_store_config(self.config, **FLUSHER_SETTINGS)
            flusher = Flusher(self.flush_target, config)
            await flusher.start()
            return flusher

        self.flusher = self.run(start())
        self.ops["flusher started"] += 1
        self.trace.append("flusher started")

    @precondition(lambda self: self.flusher is not None)
    @rule(drain=st.booleans())
    def stop_flusher(self, drain: bool) -> None:
        assert self.flusher is not None
        self.run(self.flusher.stop(drain=drain))
        self.flusher = None
        self.ops[f"flusher stopped (drain={drain})"] += 1
        self.trace.append(f"flusher stopped (drain={drain})")

    @rule(index=st.sampled_from(INSTANCES))
    def restart_instance(self, index: int) -> None:
        """A process restart: the instance's caches and cursors are gone."""
        self.run(self._open_instance(index))
        self.ops["instance restarted"] += 1
        self.trace.append(f"instance {index} restarted")

    @rule(index=st.sampled_from(INSTANCES), data=st.data())
    def force_flush(self, index: int, data: st.DataObject) -> None:
        """After a force_flush the database holds every entry in the WAL: definitive."""
        thread_id = self.pick_thread(data)
        self.trace.append(f"instance {index}: force_flush {thread_id}")
        self.run(self.stores[index].force_flush(thread_id))
        self.checked(self._resolve_from_database([thread_id]))
        self.ops["force_flush"] += 1

    # -- checks ------------------------------------------------------------------------

    async def _observe(self, store: Any, thread_id: str) -> State:
        messages, thread, runs, latest = await asyncio.gather(
            store.load_messages(thread_id),
            store.load_thread(thread_id),
            store.list_runs(thread_id, limit=1000),
            store.latest_run(thread_id),
        )
        if thread is None:
            assert messages is None, f"{thread_id}: messages of a missing thread"
            assert runs == [], f"{thread_id}: runs of a missing thread"
            assert latest is None, f"{thread_id}: latest run of a missing thread"
            return State()
        assert messages is not None, f"{thread_id}: a thread without messages"
        assert thread.message_count == len(messages), thread
        assert latest is not None, thread
        assert latest.run_id == thread.latest_run_id, (thread, latest)
        loaded = await asyncio.gather(*(store.load_run(r.run_id) for r in runs))
        assert loaded == runs, f"{thread_id}: load_run differs from list_runs"
        return State(
            messages=texts(messages),
            latest_run=thread.latest_run_id,
            metadata=tuple(sorted(thread.metadata.items())),
            runs=tuple(sorted((r.run_id, r) for r in runs)),
        )

    def matches(self, thread_id: str, seen: State, *, final: bool = False) -> list[State]:
        states = self.states(thread_id)
        found = [s for s in states if s.same_data(seen) and not (final and s.provisional)]
        assert found, f"{thread_id}: read {seen}\n  but the model allows only {states}" + (
            "\n  (provisional states lack an entry known to be in the WAL)" if final else ""
        )
        return found

    async def _resolve_from_database(self, thread_ids: Sequence[str], final: bool = True) -> None:
        for thread_id in thread_ids:
            seen = await self._observe(self.verifier, thread_id)
            self.model[thread_id] = dedupe(
                [
                    dataclasses.replace(s, provisional=False)
                    for s in self.matches(thread_id, seen, final=final)
                ]
            )

    @invariant()
    def reads_match_the_model(self) -> None:
        self.checked(self._check_reads())

    async def _observe_settled(self, store: Any, thread_id: str) -> None:
        """The reads of a thread must match the model. A thread whose state is uncertain
        (commit unknown) may change under them, as the flusher applies the entry in doubt:
        a mixed or inconsistent set of reads is then retried until it settles."""
        for _ in range(20):
            try:
                self.matches(thread_id, await self._observe(store, thread_id))
                return
            except AssertionError:
                if len(self.states(thread_id)) == 1:
                    raise
                await asyncio.sleep(0.05)
        self.matches(thread_id, await self._observe(store, thread_id))

    async def _check_reads(self) -> None:
        names = self.names()
        stores = list(self.stores.values())
        await asyncio.gather(*(self._observe_settled(s, t) for s in stores for t in names))
        live = {t for t in names if all(s.live for s in self.states(t))}
        gone = {t for t in names if not any(s.live for s in self.states(t))}
        for store in stores:
            listed = {t.thread_id for t in await store.list_threads(limit=100)}
            assert live <= listed, (listed, live)
            assert not (gone & listed), (listed, gone)
            runs = {r.run_id: r.thread_id for r in await store.list_runs(limit=1000)}
            for thread_id in names:
                known = self.certain(thread_id)
                if known is not None:
                    held = {r for r, t in runs.items() if t == thread_id}
                    assert held == known.run_ids(), (thread_id, held, known.run_ids())

    async def _final_check(self) -> None:
        """Every acknowledged (and every known-landed) entry reaches Postgres, nothing else."""
        if self.flusher is None:
            config = FlusherConfig.from_store_config(self.config, **FLUSHER_SETTINGS)
            self.flusher = Flusher(self.flush_target, config)
            await self.flusher.start()
        await self.flusher.wait_idle(timeout_s=30)
        await self.stores[0].force_flush_all()
        names = self.names()
        await self._resolve_from_database(names, final=True)
        live = {t for t in names if self.states(t)[0].live}
        listed = {t.thread_id for t in await self.verifier.list_threads(limit=100)}
        assert listed == live, (listed, live)
        runs = {r.run_id: r for r in await self.verifier.list_runs(limit=1000)}
        expected = {r: rec for t in live for r, rec in self.states(t)[0].runs}
        assert runs == expected


# -- the test ------------------------------------------------------------------------------


@pytest.fixture
def model_schema(database_url: str) -> Iterator[str]:
    """A migrated Postgres schema shared by the examples (truncated before each)."""
    schema = f"m_{uuid.uuid4().hex[:12]}"

    async def migrate() -> None:
        store = await PostgresThreadRunStore.connect(database_url, schema=schema, migrate=True)
        await store.close()

    asyncio.run(migrate())
    yield schema

    async def drop() -> None:
        async with await psycopg.AsyncConnection.connect(
            to_libpq_url(database_url), autocommit=True
        ) as conn:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')

    asyncio.run(drop())


@pytest.mark.long
@pytest.mark.timeout(max(300, EXAMPLES * STEPS * 2))
def test_buffered_store_against_a_model(
    nats_url: str, database_url: str, model_schema: str
) -> None:
    machine = BufferedStoreMachine
    machine.nats_url, machine.database_url, machine.schema = nats_url, database_url, model_schema
    machine.ops = Counter()
    machine.examples = 0
    began = time.monotonic()
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            database=None,
            print_blob=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        ),
    )
    total = sum(machine.ops.values())
    print(
        f"\nmodel test: {machine.examples} examples, {total} operations "
        f"in {time.monotonic() - began:.0f}s"
    )
    for name, count in sorted(machine.ops.items()):
        print(f"  {count:6d}  {name}")
    assert machine.examples >= EXAMPLES
    for done in ("checkpoint ok", "append ok", "delete ok"):
        assert any(k.startswith(done) for k in machine.ops), f"no {done!r} in the whole run"
    assert any("CommitUnknownError" in k for k in machine.ops), "no fault ended commit-unknown"
