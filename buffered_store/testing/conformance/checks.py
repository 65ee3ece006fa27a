"""The checks of the two suites, as plain objects: what `validate()` runs and the pytest
suite parametrizes over.

A suite is a class whose ``test_*`` methods take their subject as first argument:
``store`` (an open store, maybe holding other checks' data: the check only touches ids
it makes with `fresh_id`), ``empty_store`` (a store holding nothing, owned by the check,
which may close it), ``target`` (an empty `FlushTarget` owned by the check) or ``probe``
(built on a ``store``, for a new and for an existing thread); other arguments come from
`cases`.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from .appending import AppendContract
from .assertions import CASES_ATTR, CaseTable
from .concurrency import ConcurrencyContract
from .deletion import DeletionContract
from .flush_target import FlushTargetContract
from .identity import IdentityContract
from .lifecycle import LifecycleContract
from .listing import ListRunsContract, ListThreadsContract
from .payloads import PayloadContract
from .runs import RunContract
from .snapshots import SnapshotContract
from .threads import ThreadSummaryContract
from .validation import ValidationContract, open_probe

__all__ = ["STORE_SUITE", "TARGET_SUITE", "Check", "flush_target_checks", "store_checks"]

STORE_SUITE = "thread_run_store"
TARGET_SUITE = "flush_target"

_STORE_GROUPS: tuple[type, ...] = (
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
)
_TARGET_GROUPS: tuple[type, ...] = (FlushTargetContract,)

_SUBJECTS = ("store", "empty_store", "target", "probe")


@dataclass(frozen=True)
class Check:
    """One check: ``group/name[case]``, and the subject it needs.

    ``await check.run(subject)`` runs it; it raises (an `AssertionError`, or what the
    store raised) when the store does not behave as the protocol says.
    """

    suite: str
    group: str
    name: str
    case: str | None
    subject: str
    """``store``, ``empty_store`` or ``target``: what `run` must be given."""
    _call: Callable[[Any], Awaitable[None]]

    @property
    def id(self) -> str:
        """``group/name`` or ``group/name[case]``: unique within its suite."""
        base = f"{self.group}/{self.name}"
        return f"{base}[{self.case}]" if self.case else base

    @property
    def needs_empty(self) -> bool:
        """Whether the check needs a store of its own that holds nothing."""
        return self.subject in ("empty_store", "target")

    def __str__(self) -> str:
        return self.id

    async def run(self, subject: Any) -> None:
        """Run the check against `subject` (see `subject`)."""
        await self._call(subject)


def _expand(tables: list[CaseTable]) -> list[tuple[str, dict[str, Any]]]:
    """Every combination of the tables' rows: (case id, keyword arguments)."""
    if not tables:
        return [("", {})]
    combos = []
    for picks in itertools.product(*(list(zip(t.ids, t.rows, strict=True)) for t in tables)):
        ids = "-".join(case_id for case_id, _ in picks)
        kwargs: dict[str, Any] = {}
        for table, (_, row) in zip(tables, picks, strict=True):
            kwargs.update(zip(table.names, row, strict=True))
        combos.append((ids, kwargs))
    return combos


def _bind(
    method: Callable[..., Awaitable[None]], subject: str, kwargs: dict[str, Any], probe: bool
) -> Callable[[Any], Awaitable[None]]:
    async def call(given: Any) -> None:
        if subject == "probe":
            given = await open_probe(given, probe)
        await method(given, **kwargs)

    return call


def _collect(suite: str, groups: tuple[type, ...]) -> list[Check]:
    checks: list[Check] = []
    for group_class in groups:
        instance = group_class()
        group: str = group_class.group  # type: ignore[attr-defined]
        for attr, member in vars(group_class).items():
            if not attr.startswith("test_") or not callable(member):
                continue
            params = list(inspect.signature(member).parameters)
            subject = params[1]
            if subject not in _SUBJECTS:
                raise TypeError(f"{group_class.__name__}.{attr}: unknown subject {subject!r}")
            method = getattr(instance, attr)
            probes: list[tuple[str, bool]] = (
                [("new-thread", False), ("existing-thread", True)]
                if subject == "probe"
                else [("", False)]
            )
            for case, kwargs in _expand(getattr(member, CASES_ATTR, [])):
                for probe_id, existing in probes:
                    label = "-".join(p for p in (case, probe_id) if p) or None
                    checks.append(
                        Check(
                            suite=suite,
                            group=group,
                            name=attr.removeprefix("test_"),
                            case=label,
                            subject="store" if subject == "probe" else subject,
                            _call=_bind(method, subject, kwargs, existing),
                        )
                    )
    ids = [c.id for c in checks]
    duplicated = {i for i in ids if ids.count(i) > 1}
    if duplicated:
        raise RuntimeError(f"conformance check ids are not unique: {sorted(duplicated)}")
    return checks


_STORE_CHECKS = _collect(STORE_SUITE, _STORE_GROUPS)
_TARGET_CHECKS = _collect(TARGET_SUITE, _TARGET_GROUPS)


def store_checks(*, empty: bool | None = None) -> list[Check]:
    """The `ThreadRunStore` checks; ``empty=True`` only those needing an empty store of
    their own, ``empty=False`` only those that run on a shared one."""
    return [c for c in _STORE_CHECKS if empty is None or c.needs_empty == empty]


def flush_target_checks() -> list[Check]:
    """The `FlushTarget` checks (each needs an empty store of its own)."""
    return list(_TARGET_CHECKS)
