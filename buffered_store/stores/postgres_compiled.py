"""SQLAlchemy Core statements compiled for execution on the raw psycopg connection.

`PostgresThreadRunStore.apply()` sends its statements in psycopg's pipeline mode, which
SQLAlchemy does not offer, so it needs what SQLAlchemy itself would send for them: the
SQL text the engine's dialect compiles (with its ``::TYPE`` casts of the parameters),
the schema rendered in (SQLAlchemy applies ``schema_translate_map`` to the compiled text
at execution time), the values SQLAlchemy binds by itself (the ``1`` of ``ordinal - 1``,
the JSON keys of ``record ->> 'run_id'``, ...) and the dialect's bind processors applied
to the parameters. Of the statements `apply()` sends, only the ``ARRAY`` parameters have
a processor (it copies the sequence into a list); datetimes, ints and strings go to
psycopg as they are, as they do through SQLAlchemy.

Pure: compiling does no I/O. Each statement is compiled once per `StatementCompiler`
(one per store: one dialect, one schema).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Dialect
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.compiler import SQLCompiler

__all__ = ["Compiled", "StatementCompiler"]


@dataclass(frozen=True, slots=True)
class Compiled:
    """One statement as psycopg executes it: text and parameter preparation."""

    sql: bytes
    """The statement, ``%(name)s`` placeholders (psycopg's named parameters)."""
    constants: Mapping[str, Any]
    """Parameters the statement binds itself, already processed."""
    processors: tuple[tuple[str, Callable[[Any], Any]], ...]
    """Bind processors of the caller's parameters, by name."""

    def params(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """The parameters to execute with: the statement's own, then `values`, processed
        as SQLAlchemy would process them."""
        params = dict(self.constants)
        params.update(values)
        for name, process in self.processors:
            if name in params:
                params[name] = process(params[name])
        return params


def compile_statement(statement: ClauseElement, dialect: Dialect, schema: str) -> Compiled:
    """Compile `statement` for `dialect` with the tables in `schema`."""
    compiled = statement.compile(
        dialect=dialect, schema_translate_map={None: schema}, render_schema_translate=True
    )
    if not isinstance(compiled, SQLCompiler):
        raise TypeError(f"not a SQL statement: {statement!r}")
    if compiled.escaped_bind_names or compiled.literal_execute_params:
        # Neither occurs in our statements; both would need SQLAlchemy's execution path.
        raise ValueError(f"statement needs SQLAlchemy's own execution: {compiled.string!r}")
    constants: dict[str, Any] = {}
    processors: dict[str, Callable[[Any], Any]] = {}
    for bind, name in compiled.bind_names.items():
        process = bind.type.dialect_impl(dialect).bind_processor(dialect)
        if not bind.required:
            value = bind.effective_value
            constants[name] = process(value) if process is not None else value
        elif process is not None:
            processors[name] = process
    return Compiled(compiled.string.encode(), constants, tuple(processors.items()))


class StatementCompiler:
    """Compiles statements for one dialect and schema, each once (by identity: the
    statements of `postgres_sql` are module constants or cached per shape)."""

    def __init__(self, dialect: Dialect, schema: str) -> None:
        self._dialect = dialect
        self._schema = schema
        self._compiled: dict[int, tuple[ClauseElement, Compiled]] = {}

    def compile(self, statement: ClauseElement) -> Compiled:
        """`statement`, compiled (from the cache after the first call)."""
        found = self._compiled.get(id(statement))
        if found is None:
            # The statement is kept with its compilation, so its id is never reused.
            found = (statement, compile_statement(statement, self._dialect, self._schema))
            self._compiled[id(statement)] = found
        return found[1]

    def query(
        self, statement: ClauseElement, values: Mapping[str, Any]
    ) -> tuple[bytes, dict[str, Any]]:
        """SQL text and parameters executing `statement` with `values`."""
        compiled = self.compile(statement)
        return compiled.sql, compiled.params(values)
