"""The `bufstore` command line. Each command group lives in its own module."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

import click

_COMMAND_MODULES = ("db", "store", "spark", "health")


class _PluginGroup(click.Group):
    """Adds the commands of packages layered on top of this one (the flusher, the
    benchmarks) from the "bufstore.commands" entry-point group, on first use.

    Loading them lazily keeps the import direction one way and lets those packages
    import `buffered_store.cli.common` without a cycle.
    """

    _loaded = False

    def _load_plugins(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        for entry in entry_points(group="bufstore.commands"):
            try:
                register = entry.load()
            except ImportError as exc:
                # A plugin whose package or extra is missing must not take the other
                # commands down with it.
                click.echo(f"bufstore: command group {entry.name!r} unavailable: {exc}", err=True)
                continue
            register(self)

    def list_commands(self, ctx: click.Context) -> list[str]:
        self._load_plugins()
        return super().list_commands(ctx)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        self._load_plugins()
        return super().get_command(ctx, cmd_name)


@click.group(cls=_PluginGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="buffered-thread-store")
def main() -> None:
    """Write-buffering thread-checkpoint store: admin and operations commands."""


for _name in _COMMAND_MODULES:
    _module = importlib.import_module(f"buffered_store.cli.{_name}")
    _module.register(main)
