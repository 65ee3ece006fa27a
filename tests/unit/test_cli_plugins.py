"""The `bufstore` command line loads a plugin's entry point only for that plugin's
command (buffered_store.cli._PluginGroup): each command starts without importing what
the others need."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from buffered_store.cli import main

PROBE = """
import json, sys
from buffered_store.cli import main
try:
    main(sys.argv[1:], standalone_mode=False)
except SystemExit:
    pass
heavy = ("flusher", "buffered_store.benchmarks", "matplotlib")
print(json.dumps(sorted(m for m in heavy if m in sys.modules)))
"""


def loaded_by(*args: str) -> list[str]:
    """The heavy packages a `bufstore ARGS` process imported (stdout's last line)."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    found: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["status", "--help"], []),
        (["db", "--help"], []),
        (["flusher", "--help"], ["flusher"]),
        (["quarantine", "--help"], ["flusher"]),
        (["bench", "--help"], ["buffered_store.benchmarks", "matplotlib"]),
        (["--help"], ["buffered_store.benchmarks", "flusher", "matplotlib"]),
    ],
)
def test_a_command_imports_only_what_it_needs(args: list[str], expected: list[str]) -> None:
    assert loaded_by(*args) == expected


def test_help_lists_every_command_once() -> None:
    listed = CliRunner().invoke(main, ["--help"]).output
    section = listed.split("Commands:", 1)[1].splitlines()
    commands = [line.split()[0] for line in section if line.startswith("  ") and line.split()]
    for name in ("bench", "db", "flusher", "force-flush", "health", "quarantine", "status"):
        assert commands.count(name) == 1, listed
