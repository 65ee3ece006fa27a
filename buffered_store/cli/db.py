"""``bufstore db``: create, upgrade and inspect the Postgres schema."""

from __future__ import annotations

import click

from buffered_store.errors import StoreError
from buffered_store.stores import migrate

_URL = click.option(
    "--url",
    "--database-url",
    "url",
    envvar="DATABASE_URL",
    required=True,
    show_envvar=True,
    help="Database URL (postgresql://... or a SQLAlchemy URL).",
)
_SCHEMA = click.option(
    "--schema",
    envvar="BUFSTORE_SCHEMA",
    default="public",
    show_default=True,
    show_envvar=True,
    help="Postgres schema holding the store's tables.",
)


def register(group: click.Group) -> None:
    """Add the ``db`` command group to the ``bufstore`` command line."""

    @group.group("db")
    def db() -> None:
        """Manage the Postgres schema of the store (Alembic migrations)."""

    @db.command("upgrade")
    @_URL
    @_SCHEMA
    @click.option("--revision", default="head", show_default=True, help="Target revision.")
    def upgrade(url: str, schema: str, revision: str) -> None:
        """Create the schema if needed and migrate it to REVISION.

        Safe to run from several processes at once: they take turns.
        """
        try:
            migrate.upgrade(url, schema=schema, revision=revision)
            now = migrate.current(url, schema=schema)
        except StoreError as error:
            raise click.ClickException(str(error)) from error
        click.echo(f"schema {schema!r} is at revision {now}")

    @db.command("current")
    @_URL
    @_SCHEMA
    def current(url: str, schema: str) -> None:
        """Print the schema's revision and whether it is the newest one."""
        try:
            revision = migrate.current(url, schema=schema)
            head = migrate.head_revision()
        except StoreError as error:
            raise click.ClickException(str(error)) from error
        if revision is None:
            click.echo(f"schema {schema!r} is not migrated (head is {head})")
        elif revision == head:
            click.echo(f"{revision} (head)")
        else:
            click.echo(f"{revision} (head is {head}: run `bufstore db upgrade`)")
