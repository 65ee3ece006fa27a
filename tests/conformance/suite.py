"""`ThreadRunStoreContract`: the conformance suite every `ThreadRunStore` must pass.

Usage, in a test module of your store::

    from tests.conformance.suite import ThreadRunStoreContract

    class TestMyStore(ThreadRunStoreContract):
        @pytest.fixture
        async def store(self) -> AsyncIterator[ThreadRunStore]:
            async with open_my_store() as store:
                yield store

        @pytest.fixture
        def empty_store(self, store: ThreadRunStore) -> ThreadRunStore:
            return store  # valid because `store` above is fresh for every test

Fixture requirements:

``store``
    An open store. It MAY be shared with other tests and hold their data: tests using it
    only touch ids made by `fresh_id()` and only query with a thread filter.
``empty_store``
    A store that holds no thread and no run when the test starts, and that belongs to the
    test alone: it is used by unfiltered listings (`list_threads`, `list_runs()`) and may
    be closed by the test, so its teardown must tolerate an already closed store. When
    `store` is fresh for every test, `empty_store` may simply return it.

The suite only uses the public `ThreadRunStore` protocol, so it runs unchanged against
the in-memory, Postgres and buffered stores (in every read-consistency mode that promises
read-your-writes). It never sleeps: time-dependent assertions hold for real clocks and
injected ones alike.
"""

from __future__ import annotations

from .appending import AppendContract
from .concurrency import ConcurrencyContract
from .deletion import DeletionContract
from .helpers import fresh_id
from .identity import IdentityContract
from .lifecycle import LifecycleContract
from .listing import ListRunsContract, ListThreadsContract
from .payloads import PayloadContract
from .runs import RunContract
from .snapshots import SnapshotContract
from .threads import ThreadSummaryContract
from .validation import ValidationContract

__all__ = ["ThreadRunStoreContract", "fresh_id"]


class ThreadRunStoreContract(
    SnapshotContract,
    AppendContract,
    ThreadSummaryContract,
    RunContract,
    ListRunsContract,
    ListThreadsContract,
    IdentityContract,
    DeletionContract,
    PayloadContract,
    ConcurrencyContract,
    ValidationContract,
    LifecycleContract,
):
    """Every behaviour of the `ThreadRunStore` protocol; subclass it and add fixtures.

    See the module docstring for the `store` and `empty_store` fixture requirements.
    """
