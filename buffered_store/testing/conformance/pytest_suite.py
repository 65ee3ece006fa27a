"""The suites as pytest test classes, for a store's own test suite (needs pytest and
pytest-asyncio; `validate()` needs neither).

Subclass one and provide its fixtures::

    from buffered_store.testing.conformance.pytest_suite import ThreadRunStoreSuite

    class TestMyStore(ThreadRunStoreSuite):
        @pytest.fixture
        async def store(self) -> AsyncIterator[ThreadRunStore]:
            async with open_my_store() as store:
                yield store

        @pytest.fixture
        def empty_store(self, store: ThreadRunStore) -> ThreadRunStore:
            return store  # valid because `store` above is fresh for every test

``store``
    An open store. It MAY be shared with other tests and hold their data: the checks
    using it only touch ids made by `fresh_id()` and only query with a thread filter.
``empty_store``
    A store holding no thread and no run when the test starts, belonging to the test
    alone: unfiltered listings use it, and it may be closed by the test, so its teardown
    must tolerate an already closed store. When `store` is fresh for every test,
    `empty_store` may simply return it.
``target`` (`FlushTargetSuite`)
    A fresh, empty store implementing `ThreadRunStore` and `FlushTarget`, owned by the test.

Each check is one test, named by its id (``test_thread_run_store[snapshots/...]``).
"""

from __future__ import annotations

from typing import Any

import pytest

from .checks import Check, flush_target_checks, store_checks

__all__ = ["FlushTargetSuite", "ThreadRunStoreSuite"]


class ThreadRunStoreSuite:
    """Every `ThreadRunStore` check; needs the ``store`` and ``empty_store`` fixtures."""

    @pytest.mark.asyncio
    @pytest.mark.parametrize("check", store_checks(empty=False), ids=str)
    async def test_thread_run_store(self, check: Check, store: Any) -> None:
        await check.run(store)

    @pytest.mark.asyncio
    @pytest.mark.parametrize("check", store_checks(empty=True), ids=str)
    async def test_thread_run_store_when_empty(self, check: Check, empty_store: Any) -> None:
        await check.run(empty_store)


class FlushTargetSuite:
    """Every `FlushTarget` check; needs the ``target`` fixture."""

    @pytest.mark.asyncio
    @pytest.mark.parametrize("check", flush_target_checks(), ids=str)
    async def test_flush_target(self, check: Check, target: Any) -> None:
        await check.run(target)
