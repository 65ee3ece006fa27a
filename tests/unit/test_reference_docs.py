"""docs/reference/errors.md cannot drift from the code: it lists every `StoreError`
subclass with its `retriable` flag, and every log event name the code uses."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
from pathlib import Path

import buffered_store
import flusher
from buffered_store.errors import StoreError

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference" / "errors.md"
SOURCE_FOLDERS = ("buffered_store", "flusher", "benchmarks", "migrations")


def section(title: str) -> str:
    text = REFERENCE.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def error_classes() -> dict[str, type[StoreError]]:
    """Every `StoreError` subclass defined in the two packages (all modules imported)."""
    for package in (buffered_store, flusher):
        for module in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            if not module.name.endswith("__main__"):
                importlib.import_module(module.name)
    found: dict[str, type[StoreError]] = {}
    pending: list[type[StoreError]] = [StoreError]
    while pending:
        cls = pending.pop()
        if cls.__module__.split(".")[0] in ("buffered_store", "flusher"):
            found[cls.__name__] = cls
        pending.extend(cls.__subclasses__())
    return found


def logged_actions() -> set[str]:
    """Event names in the code: ``{"action": "name", ...}`` dicts (the ``extra`` of a log
    call)."""
    actions: set[str] = set()
    for folder in SOURCE_FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Dict):
                    for key, value in zip(node.keys, node.values, strict=True):
                        if (
                            isinstance(key, ast.Constant)
                            and key.value == "action"
                            and isinstance(value, ast.Constant)
                            and isinstance(value.value, str)
                        ):
                            actions.add(value.value)
    return actions


def test_every_error_class_is_documented_with_its_retriable_flag() -> None:
    rows = re.findall(r"^\| `(\w+)` \| [^|]+ \| (yes|no) \|", section("Errors"), re.MULTILINE)
    documented = {name: flag == "yes" for name, flag in rows}
    classes = error_classes()
    assert {"StoreError", "QuarantineError", "SparkSetupError"} <= set(classes)
    assert set(documented) == set(classes), "docs/reference/errors.md vs the code"
    wrong = {name for name, cls in classes.items() if cls.retriable != documented[name]}
    assert not wrong, f"retriable differs from the code for {sorted(wrong)}"


def test_every_log_event_is_documented() -> None:
    rows = re.findall(r"^\| `(\w+)` \| `[\w.]+` \| [A-Z]+ \|", section("Log events"), re.MULTILINE)
    actions = logged_actions()
    assert {"db_unavailable", "nats_disconnected", "quarantine_thread"} <= actions
    assert set(rows) == actions, "docs/reference/errors.md vs the code"
