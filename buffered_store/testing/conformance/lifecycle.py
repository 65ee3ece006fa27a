"""`close()`: every later call raises `StoreClosedError`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from buffered_store import StoreClosedError, ThreadRunStore

from .assertions import cases, raises
from .helpers import fresh_id, make_messages, make_run

_TID = "closed-store-thread"

CLOSED_CALLS: dict[str, Callable[[ThreadRunStore], Awaitable[object]]] = {
    "checkpoint": lambda s: s.checkpoint(_TID, make_messages(1), make_run(_TID)),
    "checkpoint-invalid": lambda s: s.checkpoint(_TID, [{"no": "role"}], make_run(_TID)),
    "load_thread": lambda s: s.load_thread(_TID),
    "load_messages": lambda s: s.load_messages(_TID),
    "load_run": lambda s: s.load_run("closed-store-run"),
    "latest_run": lambda s: s.latest_run(_TID),
    "list_runs": lambda s: s.list_runs(),
    "list_runs-thread": lambda s: s.list_runs(_TID, limit=1),
    "list_threads": lambda s: s.list_threads(),
    "delete_thread": lambda s: s.delete_thread(_TID),
}


class LifecycleContract:
    """A closed store refuses every call; closing is idempotent."""

    group = "lifecycle"

    @cases("method", sorted(CLOSED_CALLS))
    async def test_closed_store_raises(self, empty_store: ThreadRunStore, method: str) -> None:
        await empty_store.checkpoint(_TID, make_messages(1), make_run(_TID))
        await empty_store.close()
        with raises(StoreClosedError) as info:
            await CLOSED_CALLS[method](empty_store)
        assert info.type is StoreClosedError

    async def test_close_is_idempotent(self, empty_store: ThreadRunStore) -> None:
        await empty_store.close()
        await empty_store.close()
        with raises(StoreClosedError):
            await empty_store.load_thread(fresh_id())
