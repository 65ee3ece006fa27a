"""The Alembic migrations: they build exactly the tables of `buffered_store.stores.schema`, and
concurrent ``bufstore db upgrade`` processes on one fresh schema all succeed."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection, Engine, create_engine, pool, text

from buffered_store.stores import migrate
from buffered_store.stores.schema import metadata

_CATALOG = {
    "columns": """
        SELECT table_name, column_name, data_type, is_nullable, column_default,
               ordinal_position
        FROM information_schema.columns WHERE table_schema = :schema
        ORDER BY table_name, ordinal_position""",
    "indexes": """
        SELECT tablename, indexname, replace(indexdef, :schema || '.', '')
        FROM pg_indexes WHERE schemaname = :schema
        ORDER BY tablename, indexname""",
    "constraints": """
        SELECT rel.relname, con.conname, con.contype, pg_get_constraintdef(con.oid)
        FROM pg_constraint con
        JOIN pg_class rel ON rel.oid = con.conrelid
        JOIN pg_namespace ns ON ns.oid = rel.relnamespace
        WHERE ns.nspname = :schema
        ORDER BY 1, 2""",
}


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    created = create_engine(database_url, poolclass=pool.NullPool)
    yield created
    created.dispose()


@pytest.fixture
def fresh_schema(engine: Engine) -> Iterator[str]:
    """A schema name no other test uses; the schema is dropped afterwards."""
    name = f"bs_{uuid.uuid4().hex[:12]}"
    yield name
    with engine.begin() as conn:
        conn.execute(text(f'DROP SCHEMA IF EXISTS "{name}" CASCADE'))


def catalog(conn: Connection, schema: str) -> dict[str, list[tuple[Any, ...]]]:
    """Tables, columns (type, nullability, default), indexes and constraints of a schema."""
    result = {}
    for name, statement in _CATALOG.items():
        rows = conn.execute(text(statement), {"schema": schema}).all()
        result[name] = [tuple(row) for row in rows if row[0] != "alembic_version"]
    return result


def test_migrations_build_exactly_the_tables_in_code(
    database_url: str, engine: Engine, fresh_schema: str
) -> None:
    migrate.upgrade(database_url, schema=fresh_schema)
    reference = f"{fresh_schema}_ref"
    try:
        with engine.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{reference}"'))
            metadata.create_all(conn.execution_options(schema_translate_map={None: reference}))
        with engine.connect() as conn:
            migrated, expected = catalog(conn, fresh_schema), catalog(conn, reference)
    finally:
        with engine.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{reference}" CASCADE'))
    assert migrated["columns"], "the migration created no tables"
    # Compared both ways at once: same tables, columns, types, defaults, indexes, keys.
    assert migrated == expected


def test_alembic_autogenerate_sees_no_difference(database_url: str, fresh_schema: str) -> None:
    migrate.upgrade(database_url, schema=fresh_schema)
    scoped = create_engine(
        database_url,
        poolclass=pool.NullPool,
        connect_args={"options": f"-csearch_path={fresh_schema}"},
    )
    try:
        with scoped.connect() as conn:
            context = MigrationContext.configure(
                conn, opts={"compare_type": True, "compare_server_default": True}
            )
            differences = compare_metadata(context, metadata)
    finally:
        scoped.dispose()
    assert differences == []


def test_upgrade_is_idempotent_and_reports_the_revision(
    database_url: str, fresh_schema: str
) -> None:
    assert migrate.current(database_url, schema=fresh_schema) is None
    migrate.upgrade(database_url, schema=fresh_schema)
    migrate.upgrade(database_url, schema=fresh_schema)
    assert migrate.current(database_url, schema=fresh_schema) == migrate.head_revision()


def test_concurrent_upgrade_processes_all_succeed(database_url: str, fresh_schema: str) -> None:
    bufstore = Path(sys.executable).with_name("bufstore")
    command = [str(bufstore), "db", "upgrade", "--url", database_url, "--schema", fresh_schema]
    processes = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    results = [process.communicate(timeout=60) for process in processes]
    for process, (out, err) in zip(processes, results, strict=True):
        assert process.returncode == 0, f"stdout: {out}\nstderr: {err}"
        assert "0001" in out
    assert migrate.current(database_url, schema=fresh_schema) == migrate.head_revision()
