"""The scenarios of `bufstore bench`. Each module has `DESCRIPTION` and `async run(bench)`.

Modules are imported on demand, so `spark-overlay`'s PySpark stays out of the others.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..harness import Bench
from ..report import Row

MODULES = {
    "hot-threads": "hot_threads",
    "saturate": "saturate",
    "remote-db": "remote_db",
    "pg-outage": "pg_outage",
    "large-thread": "large_thread",
    "force-flush": "force_flush",
    "raw": "raw",
    "spark-overlay": "spark_overlay",
    "curve": "curve",
    "writer-cpu": "writer_cpu",
    "langgraph": "langgraph_saver",
    "soak": "soak",
}


@dataclass
class Outcome:
    """What a scenario hands to the report."""

    sides: dict[str, dict[str, Any]]
    targets: list[dict[str, Any]]
    parameters: dict[str, Any]
    sections: dict[str, str] = field(default_factory=dict)
    methods: dict[str, str] = field(default_factory=dict)
    extra_plots: list[Callable[[Path], str | None]] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    """Scenario figures beyond the sides' (results.json `figures`)."""
    side_rows: list[Row] | None = None
    """Rows of the side-by-side table (default `report.SIDE_ROWS`)."""
    latency_of: str = "checkpoint"
    """What each side's latencies time, for the plots' labels ("graph step")."""


Runner = Callable[[Bench], Awaitable[Outcome]]


def load(name: str) -> tuple[str, Runner]:
    """(description, run) of a scenario."""
    module = importlib.import_module(f".{MODULES[name]}", __name__)
    return str(module.DESCRIPTION), module.run
