"""SQLSTATE classification: an outage is retried, rejected data fails its caller alone."""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy import exc as sa_exc

from buffered_store.errors import (
    ConflictError,
    DatabaseRefusedError,
    DatabaseUnavailableError,
    SchemaError,
    ValidationError,
)
from buffered_store.stores.postgres_errors import (
    DbFailure,
    classify_sqlstate,
    retry_in_place,
    schema_missing,
    sqlstate_of,
)
from buffered_store.stores.postgres_reads import failure_of, translate_error

U, C, D, X = DbFailure.UNAVAILABLE, DbFailure.CONFLICT, DbFailure.DATA, DbFailure.OTHER

TABLE = [
    ("08000", U),  # connection_exception
    ("08006", U),  # connection_failure
    ("57P01", U),  # admin_shutdown
    ("57P02", U),  # crash_shutdown
    ("57P03", U),  # cannot_connect_now
    ("57014", U),  # query_canceled (statement timeout)
    ("53100", U),  # disk_full
    ("53200", U),  # out_of_memory
    ("53300", U),  # too_many_connections
    ("58030", U),  # io_error
    ("40001", C),  # serialization_failure
    ("40P01", C),  # deadlock_detected
    ("55P03", C),  # lock_not_available
    ("54000", D),  # program_limit_exceeded: index row too large (issue 9, finding 2)
    ("54001", D),  # statement_too_complex
    ("22001", D),  # string_data_right_truncation
    ("22P05", D),  # untranslatable_character
    ("22003", D),  # numeric_value_out_of_range
    ("23505", D),  # unique_violation
    ("23503", D),  # foreign_key_violation
    ("21000", D),  # cardinality_violation
    ("42P01", X),  # undefined_table: the schema, not the data of one thread
    ("42501", X),  # insufficient_privilege
    ("XX000", X),  # internal_error
    ("0A000", X),  # feature_not_supported
]


@pytest.mark.parametrize(("sqlstate", "expected"), TABLE)
def test_classify_sqlstate(sqlstate: str, expected: DbFailure) -> None:
    assert classify_sqlstate(sqlstate) is expected
    assert classify_sqlstate(sqlstate.lower()) is expected


@pytest.mark.parametrize("missing", [None, "", "08", "123456"])
def test_no_sqlstate_gives_no_verdict(missing: str | None) -> None:
    assert classify_sqlstate(missing) is None


def _wrapped(error: psycopg.Error, kind: type[sa_exc.DBAPIError]) -> sa_exc.DBAPIError:
    return kind("INSERT ...", None, error)


def test_program_limit_exceeded_is_data_not_an_outage() -> None:
    # psycopg raises it as an OperationalError, the class of a lost connection.
    orig = psycopg.errors.ProgramLimitExceeded("index row size 3064 exceeds btree maximum")
    assert isinstance(orig, psycopg.OperationalError)
    wrapped = _wrapped(orig, sa_exc.OperationalError)
    assert sqlstate_of(wrapped) == "54000"
    assert failure_of(wrapped) is DbFailure.DATA
    translated = translate_error(wrapped)
    assert isinstance(translated, ValidationError)
    assert not translated.retriable


def test_translation_by_sqlstate() -> None:
    shutdown = _wrapped(psycopg.errors.AdminShutdown("terminating"), sa_exc.OperationalError)
    assert isinstance(translate_error(shutdown), DatabaseUnavailableError)
    deadlock = _wrapped(psycopg.errors.DeadlockDetected("deadlock"), sa_exc.OperationalError)
    assert isinstance(translate_error(deadlock), ConflictError)
    assert translate_error(deadlock).retriable
    missing = _wrapped(psycopg.errors.UndefinedTable("no table"), sa_exc.ProgrammingError)
    unset = translate_error(missing)
    assert type(unset) is SchemaError
    assert "bufstore db upgrade" in str(unset)
    denied = _wrapped(psycopg.errors.InsufficientPrivilege("denied"), sa_exc.ProgrammingError)
    other = translate_error(denied)
    assert type(other) is DatabaseRefusedError
    assert not other.retriable


def test_a_missing_table_column_function_or_schema_means_the_schema_is_not_set_up() -> None:
    for state in ("42P01", "42703", "42883", "3F000", "42p01"):
        assert schema_missing(state)
    for other in (None, "42501", "23505", "40P01"):
        assert not schema_missing(other)


def test_without_sqlstate_the_class_decides() -> None:
    # A connection that could not be opened carries no SQLSTATE.
    lost = _wrapped(psycopg.OperationalError("connection refused"), sa_exc.OperationalError)
    assert sqlstate_of(lost) is None
    assert isinstance(translate_error(lost), DatabaseUnavailableError)
    assert isinstance(translate_error(ConnectionResetError()), DatabaseUnavailableError)
    assert type(translate_error(sa_exc.ArgumentError("bad"))) is DatabaseRefusedError
    invalidated = _wrapped(psycopg.errors.UniqueViolation("dup"), sa_exc.IntegrityError)
    invalidated.connection_invalidated = True
    assert isinstance(translate_error(invalidated), DatabaseUnavailableError)


@pytest.mark.parametrize("sqlstate", ["40P01", "40p01", "40001"])
def test_deadlock_and_serialization_failure_are_retried_in_place(sqlstate: str) -> None:
    assert [retry_in_place(sqlstate, attempt, attempts=3) for attempt in (1, 2, 3, 4)] == [
        True,
        True,
        False,
        False,
    ]


@pytest.mark.parametrize(
    "sqlstate",
    [
        None,
        "",
        "55P03",  # lock_not_available: a conflict, but the wait was bounded on purpose
        "40003",  # statement_completion_unknown: an outage, the caller's backoff
        "40002",  # integrity violation at commit: data
        "08006",
        "57P01",
        "23505",
        "42P01",
    ],
)
def test_other_failures_are_not_retried_in_place(sqlstate: str | None) -> None:
    assert not retry_in_place(sqlstate, 1, attempts=5)


def test_a_wrapped_deadlock_is_retried_in_place() -> None:
    deadlock = _wrapped(psycopg.errors.DeadlockDetected("deadlock"), sa_exc.OperationalError)
    assert retry_in_place(sqlstate_of(deadlock), 1, attempts=2)
    assert not retry_in_place(sqlstate_of(deadlock), 2, attempts=2)
