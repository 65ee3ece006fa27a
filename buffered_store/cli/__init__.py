"""The `bufstore` command line. Each command group lives in its own module."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

import click

_COMMAND_MODULES = ("db",)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="buffered-thread-store")
def main() -> None:
    """Write-buffering thread-checkpoint store: admin and operations commands."""


for _name in _COMMAND_MODULES:
    _module = importlib.import_module(f"buffered_store.cli.{_name}")
    _module.register(main)

# Packages layered on top of this one (the flusher) add their commands through the
# "bufstore.commands" entry-point group, so the import direction stays one way.
for _entry in entry_points(group="bufstore.commands"):
    _entry.load()(main)
