"""Alembic environment of the store's Postgres schema.

Configured programmatically by `buffered_store.stores.migrate` (``config.attributes`` carries
``url`` and ``schema``); the ``sqlalchemy.url`` and ``bufstore_schema`` main options of an
``alembic.ini`` work too. Online runs hold a Postgres advisory lock for the schema while
they create it and migrate it, so concurrent upgrades (several processes starting at
once) take turns instead of racing on ``CREATE SCHEMA`` or the version table.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, create_engine, pool, text

from buffered_store.stores.migrate import check_schema_name, normalize_url
from buffered_store.stores.schema import metadata

LOCK_NAMESPACE = 0x42554653
"""First key of the advisory lock ("BUFS"); the second is a hash of the schema name."""

config = context.config


def _schema() -> str:
    schema = config.attributes.get("schema") or config.get_main_option("bufstore_schema")
    schema = check_schema_name(schema or "public")
    # Revisions read the schema from here.
    config.attributes["schema"] = schema
    return schema


def _url() -> str:
    url = config.attributes.get("url") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no database URL: set config.attributes['url'] or sqlalchemy.url")
    return normalize_url(str(url))


def _configure(schema: str, **options: object) -> None:
    context.configure(
        target_metadata=metadata,
        version_table_schema=schema,
        compare_type=True,
        **options,  # type: ignore[arg-type]
    )


def run_offline() -> None:
    """Emit the SQL of the migrations instead of running them (``--sql``)."""
    schema = _schema()
    _configure(schema, url=_url(), literal_binds=True)
    with context.begin_transaction():
        context.execute(f"CREATE SCHEMA IF NOT EXISTS {_quote(schema)}")
        context.run_migrations()


def _quote(schema: str) -> str:
    return '"' + schema.replace('"', '""') + '"'


def _migrate(connection: Connection, schema: str) -> None:
    lock_args = {"namespace": LOCK_NAMESPACE, "schema": schema}
    # Session-level lock: it survives the commits below and dies with the connection.
    connection.execute(text("SELECT pg_advisory_lock(:namespace, hashtext(:schema))"), lock_args)
    connection.commit()
    try:
        connection.execute(text(f"CREATE SCHEMA IF NOT EXISTS {_quote(schema)}"))
        connection.commit()
        _configure(schema, connection=connection)
        with context.begin_transaction():
            context.run_migrations()
        if connection.in_transaction():
            connection.commit()
    finally:
        if not connection.invalidated:
            connection.rollback()
            connection.execute(
                text("SELECT pg_advisory_unlock(:namespace, hashtext(:schema))"), lock_args
            )
            connection.commit()


def run_online() -> None:
    """Run the migrations on a connection of our own (or one passed in attributes)."""
    schema = _schema()
    connection = config.attributes.get("connection")
    if isinstance(connection, Connection):
        _migrate(connection, schema)
        return
    engine = create_engine(_url(), poolclass=pool.NullPool)
    try:
        with engine.connect() as own:
            _migrate(own, schema)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
