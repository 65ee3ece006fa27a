"""The `bufstore` command line. Each command group lives in its own module."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

import click

_COMMAND_MODULES = ("db", "store", "spark", "health")


class _PluginGroup(click.Group):
    """Adds the commands of packages layered on top of this one (the flusher, the
    benchmarks) from the "bufstore.commands" entry-point group, when asked for.

    Each entry point is named after the command it adds. A command of this package runs
    without loading any of them, and a plugin's command loads its own entry point only:
    `bufstore status` does not import the flusher, nor `bufstore flusher` the benchmark
    harness and its plotting library. Listing the commands (``--help``) loads them all.
    Loading them lazily also keeps the import direction one way and lets those packages
    import `buffered_store.cli.common` without a cycle.
    """

    _loaded_all = False

    def _load(self, name: str | None) -> None:
        """Register the entry point named `name`, or every one (None), unless its
        command is registered already."""
        if self._loaded_all:
            return
        found = entry_points(group="bufstore.commands")
        if name is None:
            self._loaded_all = True
        else:
            found = found.select(name=name)
        for entry in found:
            if entry.name in self.commands:
                continue
            try:
                register = entry.load()
            except ImportError as exc:
                # A plugin whose package or extra is missing must not take the other
                # commands down with it.
                click.echo(f"bufstore: command group {entry.name!r} unavailable: {exc}", err=True)
                continue
            register(self)

    def list_commands(self, ctx: click.Context) -> list[str]:
        self._load(None)
        return super().list_commands(ctx)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is None:
            self._load(cmd_name)
            command = super().get_command(ctx, cmd_name)
        return command


@click.group(cls=_PluginGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="buffered-thread-store")
def main() -> None:
    """Write-buffering thread-checkpoint store: admin and operations commands."""


for _name in _COMMAND_MODULES:
    _module = importlib.import_module(f"buffered_store.cli.{_name}")
    _module.register(main)
