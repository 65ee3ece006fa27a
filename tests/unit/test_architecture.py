"""The import directions of the library, checked on the source (no import is executed).

A newcomer should find the engine, the front-ends and the adapters from the folder names
alone, and each folder should depend only on what its name promises:

- `buffered_store.engine` knows no front-end, no store and no client library: the WAL
  reaches it through its ports, entries and hot records through a front-end's format.
- `buffered_store.nats` is the only library package that imports nats-py.
- SQLAlchemy and Alembic stay in `buffered_store.stores`; PySpark in `buffered_store.spark`.
- `buffered_store.dev` (local servers, the demo) is never imported at run time.
- `buffered_store` never imports `flusher`; in `flusher`, only the service and its CLI,
  which assemble a deployment, import a front-end.
- LangGraph (and langchain-core) is imported by `buffered_store.langgraph` alone, the
  LangGraph front-end; the two front-ends (`threadrun`, `langgraph`) never import each
  other, and the engine imports neither.
- `buffered_store.model` (records, the `ThreadRunStore` protocol, messages, the change a
  checkpoint makes, coalescing, the `FlushTarget` seam) is pure and shared: the inner
  stores import it and never the thread-run front-end, whose WAL codec is its own.
- The front-ends get the engine assembled (`engine.buffer.WriteBuffer`: writer, thread
  log, pending index, locks, flushing, closing), never build it from its parts.
- No module imports another module's private (``_``-prefixed) names.
- The rest of the library imports the NATS adapter as a package (`buffered_store.nats`),
  never one of its modules; inside it, the leaves (errors, requests, scans, the connect
  policy) import none of the modules that build on them.
- In `buffered_store.dev`, a server module (NATS, Postgres) imports what the servers
  share (`common`, `processes`), never another server module or the assembly
  (`services`); containers import the local servers' helpers, not the assembly.
- No module patches a client's `request` (the NATS adapter counts requests on a view of
  the connection it hands nats-py, not by replacing the client's method), and the modules
  of `buffered_store/nats`, `buffered_store/dev`, the configuration and `flusher` stay
  under 600 lines.

The benchmark harness (`benchmarks/`, installed as `buffered_store.benchmarks`) and the
migrations are outside these rules: the harness's raw loop measures JetStream itself.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("buffered_store", "flusher")


def modules() -> Iterator[tuple[str, Path]]:
    for package in LIBRARY:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield ".".join(parts), path


def imports_of(module: str, path: Path) -> set[str]:
    """Every module an import statement names, also inside functions and TYPE_CHECKING,
    relative imports resolved against `module`."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def within(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


GRAPH = {module: imports_of(module, path) for module, path in modules()}
NATS_MODULES = tuple(sorted(m for m in GRAPH if m.startswith("buffered_store.nats.")))
DEV = "buffered_store.dev"


def offenders(
    importers: tuple[str, ...], forbidden: tuple[str, ...], *, unless: tuple[str, ...] = ()
) -> list[str]:
    return sorted(
        f"{module} imports {name}"
        for module, names in GRAPH.items()
        if within(module, *importers) and not within(module, *unless)
        for name in names
        if within(name, *forbidden)
    )


NATS_LEAVES_OF_LEAVES = (
    "buffered_store.nats.errors",
    "buffered_store.nats.connect_policy",
    "buffered_store.nats.publishing",
)
"""NATS adapter modules that import no other of its modules: every leaf may use them."""

RULES = {
    "the engine imports no front-end, store, adapter or client library": (
        ("buffered_store.engine",),
        (
            "buffered_store.threadrun",
            "buffered_store.langgraph",
            "buffered_store.stores",
            "buffered_store.nats",
            "buffered_store.spark",
            "buffered_store.cli",
            "buffered_store.dev",
            "buffered_store.testing",
            "flusher",
            "nats",
            "sqlalchemy",
            "alembic",
            "psycopg",
            "pyspark",
            "langgraph",
            "langchain_core",
        ),
        (),
    ),
    "only buffered_store.nats imports nats-py": (
        LIBRARY,
        ("nats",),
        ("buffered_store.nats",),
    ),
    "SQLAlchemy and Alembic stay in the stores": (
        LIBRARY,
        ("sqlalchemy", "alembic"),
        ("buffered_store.stores",),
    ),
    "PySpark stays in buffered_store.spark": (LIBRARY, ("pyspark",), ("buffered_store.spark",)),
    "LangGraph stays in buffered_store.langgraph": (
        LIBRARY,
        ("langgraph", "langchain_core"),
        ("buffered_store.langgraph",),
    ),
    "the thread-run front-end never imports the LangGraph one": (
        ("buffered_store.threadrun",),
        ("buffered_store.langgraph",),
        (),
    ),
    "the LangGraph front-end never imports the thread-run one": (
        ("buffered_store.langgraph",),
        ("buffered_store.threadrun",),
        (),
    ),
    "nothing imports the dev tools at run time": (
        LIBRARY,
        ("buffered_store.dev",),
        ("buffered_store.dev",),
    ),
    "buffered_store never imports flusher": (("buffered_store",), ("flusher",), ()),
    "the front-ends and the stores reach NATS only through the engine's ports": (
        ("buffered_store.threadrun", "buffered_store.langgraph", "buffered_store.stores"),
        ("buffered_store.nats.wal", "nats"),
        ("buffered_store.threadrun.store", "buffered_store.langgraph.saver"),
    ),
    "the NATS adapter knows no front-end or store": (
        ("buffered_store.nats",),
        (
            "buffered_store.threadrun",
            "buffered_store.langgraph",
            "buffered_store.stores",
            "buffered_store.spark",
            "flusher",
        ),
        (),
    ),
    "the front-ends get the engine assembled by engine.buffer, never piece by piece": (
        ("buffered_store.threadrun", "buffered_store.langgraph"),
        (
            "buffered_store.engine.appender",
            "buffered_store.engine.hotupdates",
            "buffered_store.engine.pending.PendingIndex",
            "buffered_store.engine.cursors.CursorCache",
            "buffered_store.engine.cursors.ThreadLocks",
            "buffered_store.engine.threadlog.flush_thread",
            "buffered_store.engine.threadlog.force_flush",
            "buffered_store.engine.threadlog.force_flush_all",
        ),
        (),
    ),
    "the inner stores never import the thread-run front-end (they share its model)": (
        ("buffered_store.stores",),
        ("buffered_store.threadrun",),
        (),
    ),
    "the thread-run model is pure: no front-end, store, adapter or client library": (
        ("buffered_store.model",),
        (
            "buffered_store.threadrun",
            "buffered_store.langgraph",
            "buffered_store.stores",
            "buffered_store.nats",
            "buffered_store.spark",
            "buffered_store.cli",
            "buffered_store.dev",
            "buffered_store.testing",
            "flusher",
            "nats",
            "sqlalchemy",
            "alembic",
            "psycopg",
            "pyspark",
            "langgraph",
            "langchain_core",
        ),
        (),
    ),
    "the rest of the library imports the NATS adapter's package, not its modules": (
        LIBRARY,
        NATS_MODULES,
        ("buffered_store.nats",),
    ),
    "the NATS adapter's leaves import nothing that builds on them": (
        (
            "buffered_store.nats.errors",
            "buffered_store.nats.connect_policy",
            "buffered_store.nats.publishing",
            "buffered_store.nats.requests",
            "buffered_store.nats.scan",
        ),
        tuple(m for m in NATS_MODULES if m not in NATS_LEAVES_OF_LEAVES),
        (),
    ),
    "what the dev servers share imports no server": (
        (f"{DEV}.common", f"{DEV}.processes"),
        tuple(
            f"{DEV}.{m}"
            for m in ("nats_server", "postgres_server", "containers", "cluster", "services", "demo")
        ),
        (),
    ),
    "a dev server module imports no other server module nor the assembly": (
        (f"{DEV}.nats_server", f"{DEV}.postgres_server"),
        tuple(
            f"{DEV}.{m}"
            for m in ("nats_server", "postgres_server", "containers", "cluster", "services", "demo")
        ),
        (),
    ),
    "the dev containers and cluster do not import the assembly": (
        (f"{DEV}.containers", f"{DEV}.cluster"),
        (f"{DEV}.services", f"{DEV}.demo"),
        (),
    ),
    "the configuration's roles import no part that uses them": (
        ("buffered_store.config",),
        (
            "buffered_store.engine",
            "buffered_store.nats",
            "buffered_store.threadrun",
            "buffered_store.langgraph",
            "buffered_store.stores",
            "buffered_store.spark",
            "buffered_store.cli",
            "buffered_store.dev",
            "buffered_store.testing",
            "flusher",
            "nats",
            "sqlalchemy",
            "psycopg",
            "pyspark",
            "langgraph",
        ),
        (),
    ),
    "the flusher's machinery is front-end agnostic": (
        ("flusher",),
        ("buffered_store.threadrun", "buffered_store.langgraph", "buffered_store.stores"),
        ("flusher.service", "flusher.cli"),
    ),
}


@pytest.mark.parametrize("rule", sorted(RULES))
def test_import_direction(rule: str) -> None:
    importers, forbidden, unless = RULES[rule]
    assert offenders(importers, forbidden, unless=unless) == []


def test_the_checker_sees_what_it_should() -> None:
    """The rules above would pass vacuously if the scan found nothing: it must see the
    adapter importing nats-py and the store assembling the NATS adapter."""
    assert offenders(("buffered_store.nats",), ("nats",)) != []
    assert "buffered_store.nats" in GRAPH["buffered_store.threadrun.store"]
    assert offenders(("buffered_store.langgraph",), ("langgraph",)) != []
    assert len(GRAPH) > 60
    assert {"buffered_store.nats.requests", "buffered_store.nats.wal"} <= set(NATS_MODULES)
    assert offenders(("buffered_store.nats.wal",), NATS_MODULES) != []
    assert offenders((f"{DEV}.nats_server",), (f"{DEV}.common", f"{DEV}.processes")) != []
    relative = ROOT / "buffered_store" / "engine" / "entries.py"
    assert "buffered_store.errors" in imports_of("buffered_store.engine.entries", relative)


def test_relative_imports_resolve_to_the_module_they_name(tmp_path: Path) -> None:
    source = tmp_path / "mod.py"
    source.write_text("from ..nats import wal\nfrom . import sibling\n")
    found = imports_of("buffered_store.engine.mod", source)
    assert {"buffered_store.nats.wal", "buffered_store.engine.sibling"} <= found


def test_no_module_imports_private_names_of_another() -> None:
    found = sorted(
        f"{module} imports {name}"
        for module, names in GRAPH.items()
        for name in names
        if within(name, *LIBRARY)
        and name.rpartition(".")[2].startswith("_")
        and not name.rpartition(".")[2].startswith("__")
    )
    assert found == []


def test_no_module_replaces_a_request_method() -> None:
    """Request counting must not patch a client: an assignment to any ``.request``
    attribute would be exactly that."""
    found = sorted(
        f"{module}:{node.lineno}"
        for module, path in modules()
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Attribute) and target.attr == "request"
    )
    assert found == []


SIZE_CHECKED = ("buffered_store.nats", DEV, "buffered_store.config", "flusher")
MAX_LINES = 600


def test_the_split_packages_keep_their_modules_small() -> None:
    too_long = sorted(
        f"{module}: {lines} lines"
        for module, path in modules()
        if within(module, *SIZE_CHECKED)
        and (lines := len(path.read_text().splitlines())) > MAX_LINES
    )
    assert too_long == []
