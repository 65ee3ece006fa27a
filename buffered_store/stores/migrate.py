"""Programmatic Alembic: upgrade the Postgres schema and read its revision.

No ``alembic.ini`` is needed: the configuration is built here, pointing at the
``buffered_store.migrations`` package (the repository's ``migrations/`` folder).
Migrations run on a synchronous psycopg engine; ``migrations/env.py`` serialises
concurrent upgrades of one schema with a Postgres advisory lock, so any number of
processes may call `upgrade` at once.
"""

from __future__ import annotations

import functools
import importlib.util
import threading
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import create_engine, exc, pool
from sqlalchemy.engine import make_url

from buffered_store.errors import ConfigError, DatabaseUnavailableError, SchemaError, StoreError

__all__ = ["current", "head_revision", "migrations_dir", "normalize_url", "upgrade"]

_MAX_SCHEMA_BYTES = 63  # NAMEDATALEN - 1: Postgres would silently truncate longer names
_ALEMBIC = threading.Lock()
"""Alembic keeps its running environment in module globals: one migration per process at a
time (processes are serialised by the advisory lock in env.py)."""


def normalize_url(url: str) -> str:
    """A SQLAlchemy URL using the psycopg 3 driver (``postgres://`` and ``postgresql://``
    are accepted as libpq-style URLs)."""
    try:
        parsed = make_url(url)
    except exc.ArgumentError as error:
        raise ConfigError(f"not a database URL: {error}") from error
    backend, _, driver = parsed.drivername.partition("+")
    if backend not in ("postgresql", "postgres"):
        raise ConfigError(f"not a PostgreSQL URL: {parsed.drivername!r}")
    if driver not in ("psycopg", "psycopg_async"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


def check_schema_name(schema: str) -> str:
    """Validate a Postgres schema name (any characters; it is always quoted)."""
    if not isinstance(schema, str) or not schema or "\x00" in schema:
        raise ConfigError(f"invalid schema name {schema!r}")
    if len(schema.encode()) > _MAX_SCHEMA_BYTES:
        raise ConfigError(f"schema name {schema!r} is longer than {_MAX_SCHEMA_BYTES} bytes")
    return schema


@functools.cache
def migrations_dir() -> Path:
    """The directory of the Alembic environment, the ``buffered_store.migrations`` package.

    The repository keeps it in the top-level ``migrations/`` folder; wheel and editable
    installs map it under our namespace. A top-level ``migrations`` is never looked at:
    installed, that name belongs to other projects (every Django app has one).
    """
    spec = importlib.util.find_spec("buffered_store.migrations")
    if spec is not None and spec.origin is not None:
        found = Path(spec.origin).parent
        if (found / "env.py").is_file():
            return found
    raise SchemaError(
        "the Alembic environment (the `buffered_store.migrations` package) is not installed"
    )


def _config(url: str, schema: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    # Passed as attributes, not main options: ConfigParser would choke on a `%` in a URL.
    config.attributes["url"] = normalize_url(url)
    config.attributes["schema"] = check_schema_name(schema)
    return config


@functools.cache
def head_revision() -> str:
    """The newest revision this version of the code knows."""
    head = ScriptDirectory(str(migrations_dir())).get_current_head()
    if head is None:  # pragma: no cover - the package always ships revisions
        raise SchemaError("no migration revisions found")
    return head


def upgrade(url: str, *, schema: str = "public", revision: str = "head") -> None:
    """Create or upgrade the store's tables in `schema` (created if missing).

    Safe to run concurrently from several processes: the upgrades of one schema take
    turns, and the later ones find the schema already at `revision`.
    """
    config = _config(url, schema)
    try:
        with _ALEMBIC:
            command.upgrade(config, revision)
    except StoreError:
        raise
    except CommandError as error:
        raise SchemaError(f"migration failed: {error}") from error
    except (exc.OperationalError, exc.InterfaceError, exc.TimeoutError) as error:
        raise DatabaseUnavailableError(f"database unavailable during migration: {error}") from error
    except exc.SQLAlchemyError as error:
        raise SchemaError(f"migration failed: {error}") from error


def current(url: str, *, schema: str = "public") -> str | None:
    """The schema's current revision, or None when it was never migrated."""
    engine = create_engine(normalize_url(url), poolclass=pool.NullPool)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(
                connection, opts={"version_table_schema": check_schema_name(schema)}
            )
            return context.get_current_revision()
    except (exc.OperationalError, exc.InterfaceError) as error:
        raise DatabaseUnavailableError(f"database unavailable: {error}") from error
    except exc.SQLAlchemyError as error:
        raise SchemaError(f"cannot read the schema revision: {error}") from error
    finally:
        engine.dispose()
