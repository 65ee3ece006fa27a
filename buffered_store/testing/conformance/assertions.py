"""What the checks need from a test framework, without one: `raises` and `cases`.

The suites run under `validate()` (no pytest) and under pytest
(`buffered_store.testing.conformance.pytest_suite`) alike, so a check uses these instead
of `pytest.raises` and `pytest.mark.parametrize`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

__all__ = ["CaseTable", "Raised", "cases", "raises"]

E = TypeVar("E", bound=BaseException)
F = TypeVar("F", bound=Callable[..., Any])

CASES_ATTR = "_conformance_cases"


class Raised(Generic[E]):
    """What `raises` caught: `value` (the exception) and `type` (its exact class)."""

    value: E
    type: type[E]


@contextmanager
def raises(expected: type[E], *, match: str | None = None) -> Iterator[Raised[E]]:
    """The block must raise `expected` (or a subclass); `match` is searched in its text."""
    caught: Raised[E] = Raised()
    try:
        yield caught
    except expected as exc:
        caught.value, caught.type = exc, type(exc)
        if match is not None and not re.search(match, str(exc)):
            raise AssertionError(f"{exc!r} does not match {match!r}") from exc
        return
    raise AssertionError(f"did not raise {expected.__name__}")


class CaseTable:
    """One `cases` decoration: argument names, their rows of values, and the rows' ids."""

    def __init__(
        self, names: Sequence[str], rows: Sequence[tuple[Any, ...]], ids: Sequence[str]
    ) -> None:
        self.names = tuple(names)
        self.rows = [tuple(row) for row in rows]
        self.ids = list(ids)


def _case_id(name: str, value: object, index: int) -> str:
    if isinstance(value, bool | int | float) or value is None:
        return str(value)
    if (
        isinstance(value, str)
        and value
        and value.isascii()
        and value.isprintable()
        and len(value) <= 40
    ):
        return value
    return f"{name}{index}"


def cases(
    names: str | Sequence[str],
    values: Sequence[Any],
    *,
    ids: Sequence[str] | None = None,
) -> Callable[[F], F]:
    """Run the check once per value (like ``pytest.mark.parametrize``; several `cases` on
    one check multiply). `names` is one argument name, a comma-separated list or a
    sequence of names; with several names each value is a tuple."""
    listed = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
    rows = [tuple(v) if len(listed) > 1 else (v,) for v in values]
    made_ids = (
        list(ids)
        if ids is not None
        else [
            "-".join(_case_id(n, v, i) for n, v in zip(listed, row, strict=True))
            for i, row in enumerate(rows)
        ]
    )

    seen: set[str] = set()
    for index, made in enumerate(made_ids):
        if made in seen:
            made_ids[index] = f"{made}-{index}"
        seen.add(made_ids[index])

    def mark(check: F) -> F:
        tables: list[CaseTable] = check.__dict__.setdefault(CASES_ATTR, [])
        tables.insert(0, CaseTable(listed, rows, made_ids))
        return check

    return mark
