"""Registering a store factory and running a suite against it without pytest.

@thread_run_store_test("my store")
async def my_store() -> AsyncIterator[ThreadRunStore]:
    store = await MyStore.connect(...)
    yield store
    await store.close()          # must tolerate a store a check already closed

report = await validate(my_store)
assert report.passed_all(), report.summary()
"""

from __future__ import annotations

import asyncio
import traceback
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from .checks import STORE_SUITE, TARGET_SUITE, Check, flush_target_checks, store_checks

__all__ = [
    "CheckResult",
    "ConformanceReport",
    "RegisteredStore",
    "flush_target_test",
    "thread_run_store_test",
    "validate",
]

StoreFactory = Callable[[], AsyncIterator[Any]]
"""An async generator function yielding one fresh store (and cleaning up after it)."""
Lifespan = Callable[[], AsyncIterator[None]]
"""An async generator function run around a whole `validate()` (e.g. create a database)."""


async def _no_lifespan() -> AsyncIterator[None]:
    yield


@dataclass(frozen=True)
class RegisteredStore:
    """A store factory registered for one suite (`thread_run_store_test`, `flush_target_test`)."""

    name: str
    suite: str
    factory: StoreFactory
    lifespan: Lifespan = _no_lifespan

    def open(self) -> AbstractAsyncContextManager[Any]:
        """A fresh store from the factory, cleaned up on exit."""
        return asynccontextmanager(self.factory)()

    def checks(self) -> list[Check]:
        """The checks of this registration's suite."""
        return store_checks() if self.suite == STORE_SUITE else flush_target_checks()


def _register(suite: str, name: str, lifespan: Lifespan | None) -> Any:
    def decorator(factory: StoreFactory) -> RegisteredStore:
        return RegisteredStore(name, suite, factory, lifespan or _no_lifespan)

    return decorator


def thread_run_store_test(
    name: str, *, lifespan: Lifespan | None = None
) -> Callable[[StoreFactory], RegisteredStore]:
    """Register an async generator yielding a fresh, empty `ThreadRunStore` for the
    `ThreadRunStore` suite. `validate()` calls it once for the checks that may share a
    store and once per check needing an empty store of its own (such a check may close
    the store: the code after ``yield`` must tolerate that). `lifespan`, an async generator
    function, runs once around the whole validation."""
    registered: Callable[[StoreFactory], RegisteredStore] = _register(STORE_SUITE, name, lifespan)
    return registered


def flush_target_test(
    name: str, *, lifespan: Lifespan | None = None
) -> Callable[[StoreFactory], RegisteredStore]:
    """Register an async generator yielding a fresh, empty store that implements both
    `ThreadRunStore` and `FlushTarget` (the flush sink of the thread-run front-end), for
    the `FlushTarget` suite. It is called once per check."""
    registered: Callable[[StoreFactory], RegisteredStore] = _register(TARGET_SUITE, name, lifespan)
    return registered


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one check: `error` is None when it passed."""

    check: str
    group: str
    passed: bool
    error: str | None = None


@dataclass
class ConformanceReport:
    """What `validate()` found: one `CheckResult` per check run."""

    name: str
    suite: str
    results: list[CheckResult] = field(default_factory=list)

    @property
    def passed(self) -> list[CheckResult]:
        """The checks that passed."""
        return [r for r in self.results if r.passed]

    @property
    def failed(self) -> list[CheckResult]:
        """The checks that failed, with their errors."""
        return [r for r in self.results if not r.passed]

    def passed_all(self) -> bool:
        """Whether at least one check ran and none failed."""
        return bool(self.results) and not self.failed

    def by_group(self) -> dict[str, tuple[int, int]]:
        """Per group of checks: (passed, failed)."""
        counts: dict[str, tuple[int, int]] = {}
        for result in self.results:
            ok, bad = counts.get(result.group, (0, 0))
            counts[result.group] = (ok + result.passed, bad + (not result.passed))
        return counts

    def summary(self) -> str:
        """A readable summary: counts per group, then each failure with its error."""
        lines = [
            f"{self.name} against the {self.suite} suite: "
            f"{len(self.passed)} passed, {len(self.failed)} failed"
        ]
        for group, (ok, bad) in self.by_group().items():
            lines.append(f"  {'FAIL' if bad else 'ok  '} {group}: {ok} passed, {bad} failed")
        for result in self.failed:
            lines.append(f"\nFAILED {result.check}\n{result.error}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data."""
        return {
            "name": self.name,
            "suite": self.suite,
            "passed": len(self.passed),
            "failed": len(self.failed),
            "results": [
                {"check": r.check, "group": r.group, "passed": r.passed, "error": r.error}
                for r in self.results
            ],
        }


def _describe(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc, limit=-3)).rstrip()


async def _run_one(check: Check, subject: Any, timeout_s: float, report: ConformanceReport) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            await check.run(subject)
    except Exception as exc:
        report.results.append(CheckResult(check.id, check.group, False, _describe(exc)))
    else:
        report.results.append(CheckResult(check.id, check.group, True))


async def validate(
    registered: RegisteredStore,
    *,
    groups: set[str] | None = None,
    timeout_s: float = 60.0,
    on_result: Callable[[CheckResult], None] | None = None,
) -> ConformanceReport:
    """Run the registered store's suite and report every check (never raises for a
    failing check). `groups` limits the run to some groups (``snapshots``,
    ``validation``...); `timeout_s` bounds each check; `on_result` hears each result as
    it comes (for progress output)."""
    report = ConformanceReport(registered.name, registered.suite)
    checks = [c for c in registered.checks() if groups is None or c.group in groups]

    def record(check: Check, error: BaseException) -> None:
        report.results.append(CheckResult(check.id, check.group, False, _describe(error)))

    async def run(check: Check, subject: Any) -> None:
        await _run_one(check, subject, timeout_s, report)
        if on_result is not None:
            on_result(report.results[-1])

    async with asynccontextmanager(registered.lifespan)():
        shared = [c for c in checks if not c.needs_empty]
        if shared:
            try:
                async with registered.open() as store:
                    for check in shared:
                        await run(check, store)
            except Exception as exc:
                # The factory itself failed (opening or cleaning up): every check that
                # has not reported yet fails with that error.
                done = {r.check for r in report.results}
                for check in shared:
                    if check.id not in done:
                        record(check, exc)
        for check in (c for c in checks if c.needs_empty):
            try:
                async with registered.open() as store:
                    await run(check, store)
            except Exception as exc:
                if all(r.check != check.id for r in report.results):
                    record(check, exc)
    return report
