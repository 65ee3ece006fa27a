"""Bad input: a `ValidationError` (exactly that class) and nothing written.

Each check taking a `probe` runs twice: on a thread that does not exist yet (it must still
not exist) and on a thread with a checkpoint (it must be unchanged, and the failed call
must not have used up a `thread_seq`).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any

from buffered_store import RunRecord, Thread, ThreadRunStore, ValidationError

from .assertions import cases, raises
from .helpers import as_any, fresh_id, make_messages, make_run


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {"leaf": True}
    for _ in range(depth):
        value = {"n": value}
    return value


@dataclass
class Probe:
    """A thread (new or existing) and what a rejected call must leave unchanged."""

    store: ThreadRunStore
    thread_id: str
    thread: Thread | None
    messages: list[dict[str, Any]] | None
    runs: list[RunRecord]
    next_seq: int
    _new_runs: list[RunRecord] = field(default_factory=list, init=False)

    def run(self, **overrides: Any) -> RunRecord:
        """A new run of the probe's thread; it must not be stored after a rejection."""
        run = make_run(self.thread_id, **overrides)
        self._new_runs.append(run)
        return run

    async def rejects(self, call: Awaitable[object]) -> None:
        """`call` raises exactly `ValidationError` and the store is unchanged."""
        with raises(ValidationError) as info:
            await call
        assert info.type is ValidationError, f"expected ValidationError, got {info.type}"
        await self.assert_unchanged()

    async def assert_unchanged(self) -> None:
        """The thread, its messages, runs and next seq are as before."""
        store, tid = self.store, self.thread_id
        assert await store.load_thread(tid) == self.thread
        assert await store.load_messages(tid) == self.messages
        assert await store.list_runs(tid) == self.runs
        for run in self._new_runs:
            assert await store.load_run(run.run_id) is None
        receipt = await store.checkpoint(tid, make_messages(1), make_run(tid))
        assert receipt.thread_seq == self.next_seq, "a rejected call used up a thread_seq"

    async def checkpoint(self, messages: Any = None, **kwargs: Any) -> None:
        """A checkpoint of the probe's thread, with valid defaults for what is not given."""
        run = kwargs.pop("run", None) or self.run()
        await self.store.checkpoint(
            self.thread_id, make_messages(2) if messages is None else messages, run, **kwargs
        )


async def open_probe(store: ThreadRunStore, existing: bool) -> Probe:
    """A probe on a fresh thread id: new (nothing stored) or existing (one checkpoint)."""
    tid = fresh_id()
    if not existing:
        return Probe(store, tid, None, None, [], next_seq=1)
    run = make_run(tid)
    await store.checkpoint(tid, make_messages(3), run, metadata={"k": "v"})
    return Probe(
        store,
        tid,
        await store.load_thread(tid),
        await store.load_messages(tid),
        [run],
        next_seq=2,
    )


class ValidationContract:
    """Invalid arguments are rejected before anything is written."""

    group = "validation"

    # -- thread id ---------------------------------------------------------------------

    @cases("bad_id", ["", 123, None, b"bytes", "x" * 513, "nul\x00id"])
    async def test_rejects_invalid_thread_id(self, store: ThreadRunStore, bad_id: object) -> None:
        tid = fresh_id()
        run = make_run(tid)
        with raises(ValidationError) as info:
            await store.checkpoint(as_any(bad_id), make_messages(1), run)
        assert info.type is ValidationError
        assert await store.load_run(run.run_id) is None
        assert await store.load_thread(tid) is None

    async def test_rejects_lone_surrogate_in_thread_id(self, store: ThreadRunStore) -> None:
        tid = fresh_id() + "\ud800"
        with raises(ValidationError) as info:
            await store.checkpoint(
                tid, make_messages(1), make_run(fresh_id()).replace(thread_id=tid)
            )
        assert info.type is ValidationError

    # -- messages ----------------------------------------------------------------------

    @cases("messages", ["text", b"bytes", {"role": "user"}, None, 42])
    async def test_rejects_messages_that_are_not_a_list(
        self, probe: Probe, messages: object
    ) -> None:
        run = probe.run()
        await probe.rejects(probe.store.checkpoint(probe.thread_id, as_any(messages), run))

    @cases("message", ["hello", ["role", "user"], None, 1])
    async def test_rejects_message_that_is_not_an_object(
        self, probe: Probe, message: object
    ) -> None:
        await probe.rejects(probe.checkpoint([*make_messages(2), message]))

    @cases("message", [{}, {"content": "no role"}, {"ROLE": "user"}])
    async def test_rejects_message_without_role(
        self, probe: Probe, message: dict[str, Any]
    ) -> None:
        await probe.rejects(probe.checkpoint([message, *make_messages(1)]))

    @cases("role", [1, None, ["user"], {"name": "user"}, ""])
    async def test_rejects_role_that_is_not_a_string(self, probe: Probe, role: object) -> None:
        await probe.rejects(probe.checkpoint([{"role": role}]))

    @cases("number", [math.nan, math.inf, -math.inf])
    async def test_rejects_non_finite_float(self, probe: Probe, number: float) -> None:
        message = {"role": "user", "scores": [1.0, {"x": number}]}
        await probe.rejects(probe.checkpoint([*make_messages(1), message]))

    @cases("key", [1, None, (1, 2), 2.5])
    async def test_rejects_non_string_key(self, probe: Probe, key: object) -> None:
        message = {"role": "user", "nested": {key: "value"}}
        await probe.rejects(probe.checkpoint([message]))

    async def test_rejects_set_value(self, probe: Probe) -> None:
        await probe.rejects(probe.checkpoint([{"role": "user", "tags": {"a", "b"}}]))

    @cases("value", [object(), datetime(2026, 1, 1), b"bytes", Decimal("1.5"), 1j, frozenset()])
    async def test_rejects_value_that_is_not_json(self, probe: Probe, value: object) -> None:
        await probe.rejects(probe.checkpoint([{"role": "user", "content": value}]))

    @cases(
        "message",
        [
            {"role": "user", "content": "nul\x00char"},
            {"role": "user\x00"},
            {"role": "user", "nested": {"key\x00": 1}},
            {"role": "user", "list": ["ok", "\x00"]},
        ],
    )
    async def test_rejects_nul_character(self, probe: Probe, message: dict[str, Any]) -> None:
        await probe.rejects(probe.checkpoint([message]))

    @cases("where", ["message", "metadata", "run.output", "run.metadata"])
    @cases(
        "value",
        [2**64, -(2**63) - 1, _nested(300), "lone \ud800 surrogate"],
        ids=["int-2**64", "int-below-int64", "nested-300-deep", "lone-surrogate"],
    )
    async def test_rejects_json_the_wal_cannot_encode(
        self, probe: Probe, where: str, value: object
    ) -> None:
        if where == "message":
            call = probe.checkpoint([{"role": "user", "v": value}])
        elif where == "metadata":
            call = probe.checkpoint(metadata={"v": value})
        elif where == "run.output":
            call = probe.checkpoint(run=probe.run(output={"v": value}))
        else:
            call = probe.checkpoint(run=probe.run(metadata={"v": value}))
        await probe.rejects(call)

    # -- run ---------------------------------------------------------------------------

    async def test_rejects_run_of_another_thread(self, probe: Probe) -> None:
        other = make_run(fresh_id())
        await probe.rejects(probe.store.checkpoint(probe.thread_id, make_messages(1), other))
        assert await probe.store.load_thread(other.thread_id) is None

    @cases("kind", ["dict", "json", "none"])
    async def test_rejects_run_that_is_not_a_run_record(self, probe: Probe, kind: str) -> None:
        record = make_run(probe.thread_id)
        bad = {"dict": {"run_id": record.run_id}, "json": record.to_json(), "none": None}[kind]
        await probe.rejects(probe.store.checkpoint(probe.thread_id, make_messages(1), as_any(bad)))
        assert await probe.store.load_run(record.run_id) is None

    @cases("field", ["created_at", "updated_at", "finished_at"])
    async def test_naive_datetime_rejected_by_run_record(self, probe: Probe, field: str) -> None:
        naive: dict[str, Any] = {field: datetime(2026, 1, 1, 12, 0)}
        with raises(ValidationError) as info:
            make_run(probe.thread_id, **naive)
        assert info.type is ValidationError
        await probe.assert_unchanged()

    @cases("output", [{1, 2}, math.nan, {"k": object()}, {3: "int key"}])
    async def test_rejects_run_output_that_is_not_json(self, probe: Probe, output: object) -> None:
        await probe.rejects(probe.checkpoint(run=probe.run(output=output)))

    @cases("metadata", [{"k": math.inf}, {"k": {1, 2}}, {"k": {4: "int"}}])
    async def test_rejects_run_metadata_that_is_not_json(
        self, probe: Probe, metadata: dict[str, Any]
    ) -> None:
        await probe.rejects(probe.checkpoint(run=probe.run(metadata=metadata)))

    # -- thread metadata ---------------------------------------------------------------

    @cases("metadata", [["a", 1], "text", 1, b"bytes"])
    async def test_rejects_metadata_that_is_not_an_object(
        self, probe: Probe, metadata: object
    ) -> None:
        await probe.rejects(probe.checkpoint(metadata=metadata))

    @cases("metadata", [{"k": math.nan}, {"k": {1, 2}}, {1: "int key"}, {"k": "nul\x00"}])
    async def test_rejects_metadata_that_is_not_json(
        self, probe: Probe, metadata: dict[Any, Any]
    ) -> None:
        await probe.rejects(probe.checkpoint(metadata=metadata))

    # -- reads -------------------------------------------------------------------------

    @cases(("limit", "offset"), [(-1, 0), (0, -1), (-5, -5), (1.5, 0), ("10", 0), (None, 0)])
    async def test_list_calls_reject_bad_pagination(
        self, store: ThreadRunStore, limit: object, offset: object
    ) -> None:
        for call in (
            lambda: store.list_runs(fresh_id(), limit=as_any(limit), offset=as_any(offset)),
            lambda: store.list_runs(limit=as_any(limit), offset=as_any(offset)),
            lambda: store.list_threads(limit=as_any(limit), offset=as_any(offset)),
        ):
            with raises(ValidationError) as info:
                await call()
            assert info.type is ValidationError

    @cases("bad_id", ["", 7, None])
    async def test_reads_and_deletes_reject_invalid_ids(
        self, store: ThreadRunStore, bad_id: object
    ) -> None:
        calls: list[Callable[[], Awaitable[object]]] = [
            lambda: store.load_thread(as_any(bad_id)),
            lambda: store.load_messages(as_any(bad_id)),
            lambda: store.latest_run(as_any(bad_id)),
            lambda: store.load_run(as_any(bad_id)),
            lambda: store.delete_thread(as_any(bad_id)),
        ]
        if bad_id is not None:  # None means "every thread" for list_runs
            calls.append(lambda: store.list_runs(as_any(bad_id)))
        for call in calls:
            with raises(ValidationError) as info:
                await call()
            assert info.type is ValidationError
