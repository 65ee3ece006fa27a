"""Conformance suites for stores users write themselves, runnable with or without pytest.

Two suites ship here:

- the `ThreadRunStore` suite: every behaviour of the protocol (snapshots, appends, runs,
  listings, identifiers, deletion, payloads, concurrency, bad input, close), the one this
  project's in-memory, Postgres and buffered stores pass;
- the `FlushTarget` suite: watermark-checked application of WAL entries and versioned
  reads, what a store must do to be the flusher's sink.

Without pytest, register a factory and validate it::

    from buffered_store.testing.conformance import thread_run_store_test, validate

    @thread_run_store_test("my store")
    async def my_store():
        store = await MyStore.connect(...)
        yield store
        await store.close()

    report = await validate(my_store)
    print(report.summary())
    assert report.passed_all()

With pytest, subclass `pytest_suite.ThreadRunStoreSuite` or `pytest_suite.FlushTargetSuite`
(one test per check). Checks never sleep; they use fresh ids (`fresh_id`), so a shared
store may hold other data.
"""

from __future__ import annotations

from .assertions import cases, raises
from .checks import Check, flush_target_checks, store_checks
from .flush_target import Chain, TickingClock, replace_entry
from .flushed import FlushedWrites
from .helpers import T0, fresh_id
from .runner import (
    CheckResult,
    ConformanceReport,
    RegisteredStore,
    flush_target_test,
    thread_run_store_test,
    validate,
)

__all__ = [
    "T0",
    "Chain",
    "Check",
    "CheckResult",
    "ConformanceReport",
    "FlushedWrites",
    "RegisteredStore",
    "TickingClock",
    "cases",
    "flush_target_checks",
    "flush_target_test",
    "fresh_id",
    "raises",
    "replace_entry",
    "store_checks",
    "thread_run_store_test",
    "validate",
]
