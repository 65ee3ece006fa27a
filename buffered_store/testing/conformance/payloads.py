"""Payloads: large messages, exact JSON round-trips, and isolation of returned objects."""

from __future__ import annotations

from typing import Any

from buffered_store import ThreadRunStore

from .helpers import assert_same_json, fresh_id, make_messages, make_run

KIB = 1024

NESTED: dict[str, Any] = {
    "role": "assistant",
    "content": "héllo wörld — 你好 — 🧵 — \u202eRTL\u202c — \\ \" ' \t \n",
    "ints": [0, 1, -1, 2**31, -(2**31), 2**53 + 1, 2**63 - 1, -(2**63)],
    "floats": [0.5, -2.25, 0.1, 1.0, -0.0, 3.141592653589793, 0.30000000000000004],
    "bools": [True, False],
    "null": None,
    "empty": {"list": [], "dict": {}, "string": ""},
    "deep": {"a": [{"b": [[1, [2, [3, {"c": None}]]]]}]},
    "keys with.dots and $ and 🧵": {"": "empty key"},
    "tool_calls": [{"id": "call_1", "arguments": '{"x": 1}'}],
}


class PayloadContract:
    """What goes in comes out: sizes, JSON types and values, and no shared state."""

    group = "payloads"

    async def test_large_message_round_trips(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        big = {"role": "tool", "content": "x" * (800 * KIB)}
        messages = [*make_messages(2), big, *make_messages(1, start=2)]
        await store.checkpoint(tid, messages, make_run(tid))
        assert await store.load_messages(tid) == messages

    async def test_thread_over_one_mib_built_by_appending(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        run = make_run(tid)
        messages: list[dict[str, Any]] = []
        for index in range(3):
            messages.append({"role": "tool", "content": f"{index}".ljust(400 * KIB, "y")})
            await store.checkpoint(tid, messages, run)
        assert await store.load_messages(tid) == messages
        thread = await store.load_thread(tid)
        assert thread is not None
        assert thread.message_count == 3

    async def test_nested_json_round_trips_exactly(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        await store.checkpoint(tid, [NESTED, {"role": "user"}], make_run(tid))
        loaded = await store.load_messages(tid)
        assert_same_json(loaded, [NESTED, {"role": "user"}])

    async def test_extreme_floats_round_trip(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        message = {
            "role": "user",
            "floats": [1e300, -1.5e-300, 1.7976931348623157e308, 5e-324, 2.5e-10, 1e16],
        }
        await store.checkpoint(tid, [message], make_run(tid))
        assert_same_json(await store.load_messages(tid), [message])

    async def test_run_and_thread_json_round_trip(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        run = make_run(tid, output=NESTED, metadata={"nested": NESTED})
        await store.checkpoint(tid, [], run, metadata={"nested": NESTED, "n": 1.5})
        loaded = await store.load_run(run.run_id)
        assert loaded is not None
        assert_same_json(loaded.output, NESTED)
        assert_same_json(dict(loaded.metadata), {"nested": NESTED})
        thread = await store.load_thread(tid)
        assert thread is not None
        assert_same_json(dict(thread.metadata), {"nested": NESTED, "n": 1.5})

    async def test_scalar_run_output_round_trips(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        for output in ("text", 42, 2.5, True, None, [1, "two"]):
            run = make_run(tid, output=output)
            await store.checkpoint(tid, [], run)
            loaded = await store.load_run(run.run_id)
            assert loaded is not None
            assert_same_json(loaded.output, output)

    async def test_returned_messages_are_copies(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        await store.checkpoint(tid, [NESTED, *make_messages(2)], make_run(tid))
        loaded = await store.load_messages(tid)
        assert loaded is not None
        loaded[0]["deep"]["a"].append("mutated")
        loaded[0]["role"] = "mutated"
        loaded[1]["content"] = "mutated"
        loaded.append({"role": "mutated"})
        assert await store.load_messages(tid) == [NESTED, *make_messages(2)]

    async def test_returned_thread_and_run_are_copies(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        run = make_run(tid, output={"list": [1]}, metadata={"m": {"n": 1}})
        await store.checkpoint(tid, [], run, metadata={"k": ["v"]})
        thread = await store.load_thread(tid)
        loaded = await store.load_run(run.run_id)
        assert thread is not None
        assert loaded is not None
        _try_mutate(thread.metadata)
        _try_mutate(loaded.output)
        _try_mutate(loaded.metadata)
        for listed in await store.list_runs(tid):
            _try_mutate(listed.metadata)
        for listed_thread in await store.list_threads(limit=1000):
            _try_mutate(listed_thread.metadata)
        thread_again = await store.load_thread(tid)
        assert thread_again is not None
        assert dict(thread_again.metadata) == {"k": ["v"]}
        assert await store.load_run(run.run_id) == run

    async def test_inputs_mutated_after_checkpoint_do_not_leak(self, store: ThreadRunStore) -> None:
        tid = fresh_id()
        messages = make_messages(2)
        metadata: dict[str, Any] = {"k": ["v"]}
        run_metadata: dict[str, Any] = {"m": [1]}
        run = make_run(tid, metadata=run_metadata, output={"o": [1]})
        await store.checkpoint(tid, messages, run, metadata=metadata)
        messages[0]["content"] = "mutated"
        messages.append({"role": "mutated"})
        metadata["k"].append("mutated")
        run_metadata["m"].append("mutated")
        run.output["o"].append("mutated")
        assert await store.load_messages(tid) == make_messages(2)
        thread = await store.load_thread(tid)
        assert thread is not None
        assert dict(thread.metadata) == {"k": ["v"]}
        loaded = await store.load_run(run.run_id)
        assert loaded is not None
        assert dict(loaded.metadata) == {"m": [1]}
        assert loaded.output == {"o": [1]}


def _try_mutate(value: Any) -> None:
    """Mutate a returned JSON container in place, if the store returned a mutable one."""
    if isinstance(value, dict):
        for item in list(value.values()):
            _try_mutate(item)
        value["mutated"] = True
    elif isinstance(value, list):
        for item in list(value):
            _try_mutate(item)
        value.append("mutated")
