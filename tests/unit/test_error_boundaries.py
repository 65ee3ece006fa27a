"""The root `StoreError` is no answer to a question: code that branches on a failure
catches the class that names it (`WalEntriesMissingError`, `BackendUnavailableError`,
`ValidationError`, ...), so no other refusal can be taken for it. Checked on the source.

Catching the root is left to:
- process boundaries, the commands (`buffered_store.cli`, `flusher.cli`), which report
  any failure and exit;
- handlers that always raise again (a pass-through before foreign errors are
  translated, or a translation into the caller's outcome), which decide nothing.

No other place is exempt: a sink isolating a thread catches the classes that mean "this
thread's data" (`ValidationError`, `CorruptEntryError`, `ConflictError`), so a closed or
refusing backend is not taken for bad data and no thread is quarantined for it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("buffered_store", "flusher")
BOUNDARIES = ("buffered_store.cli", "flusher.cli")


def modules() -> Iterator[tuple[str, Path]]:
    for package in LIBRARY:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield ".".join(parts), path


def names_root(node: ast.expr | None) -> bool:
    """Whether an except clause's type names `StoreError` itself."""
    if node is None:
        return False
    if isinstance(node, ast.Tuple):
        return any(names_root(item) for item in node.elts)
    if isinstance(node, ast.Name):
        return node.id == "StoreError"
    if isinstance(node, ast.Attribute):
        return node.attr == "StoreError"
    return False


def always_raises(handler: ast.ExceptHandler) -> bool:
    """Whether the handler ends in a raise and never leaves otherwise (no return, break or
    continue in it): it translates or passes the error on, deciding nothing."""
    if not handler.body or not isinstance(handler.body[-1], ast.Raise):
        return False
    return not any(
        isinstance(node, ast.Return | ast.Break | ast.Continue)
        for statement in handler.body
        for node in ast.walk(statement)
    )


def root_suppressions(tree: ast.AST) -> list[int]:
    """Lines of ``contextlib.suppress(..., StoreError, ...)``: a catch that decides to
    go on, whatever the error was."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and (
            (isinstance(node.func, ast.Attribute) and node.func.attr == "suppress")
            or (isinstance(node.func, ast.Name) and node.func.id == "suppress")
        )
        and any(names_root(arg) for arg in node.args)
    ]


def root_catches(tree: ast.AST) -> Iterator[tuple[str, ast.ExceptHandler]]:
    """(qualified name of the enclosing function, handler) of every root catch."""

    def visit(node: ast.AST, scope: tuple[str, ...]) -> Iterator[tuple[str, ast.ExceptHandler]]:
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                inner = (*scope, child.name)
            if isinstance(child, ast.ExceptHandler) and names_root(child.type):
                yield ".".join(scope), child
            yield from visit(child, inner)

    yield from visit(tree, ())


def offenders() -> list[str]:
    found = []
    for module, path in modules():
        if any(module == b or module.startswith(b + ".") for b in BOUNDARIES):
            continue
        tree = ast.parse(path.read_text(), str(path))
        for scope, handler in root_catches(tree):
            if always_raises(handler):
                continue
            found.append(f"{module}:{handler.lineno} ({scope}) catches StoreError")
        found.extend(f"{module}:{line} suppresses StoreError" for line in root_suppressions(tree))
    return sorted(found)


def test_the_root_error_is_caught_only_at_boundaries() -> None:
    assert offenders() == []


def test_the_checker_sees_suppressions() -> None:
    tree = ast.parse("with contextlib.suppress(StoreError, TimeoutError):\n    f()\n")
    assert root_suppressions(tree) == [1]
    assert root_suppressions(ast.parse("with suppress(TimeoutError):\n    f()\n")) == []


@pytest.mark.parametrize(
    ("source", "caught"),
    [
        ("try:\n    f()\nexcept StoreError:\n    return None\n", True),
        ("try:\n    f()\nexcept (StoreError, TimeoutError) as e:\n    log(e)\n", True),
        ("try:\n    f()\nexcept errors.StoreError:\n    pass\n", True),
        ("try:\n    f()\nexcept StoreError:\n    raise\n", False),
        ("try:\n    f()\nexcept StoreError as e:\n    raise Other() from e\n", False),
        ("try:\n    f()\nexcept StoreError:\n    if x:\n        return 1\n    raise\n", True),
        ("try:\n    f()\nexcept ValidationError:\n    return None\n", False),
    ],
)
def test_the_checker_tells_decisions_from_pass_throughs(source: str, caught: bool) -> None:
    tree = ast.parse("def g():\n" + "".join(f"    {line}\n" for line in source.splitlines()))
    found = [h for _, h in root_catches(tree) if not always_raises(h)]
    assert bool(found) == caught
