"""What a database error means, from its SQLSTATE. Pure: no I/O, no client library.

The driver's exception classes do not tell an outage from bad data: psycopg raises
`ProgramLimitExceeded` (an index row too large for its btree, SQLSTATE 54000) as an
``OperationalError``, like a lost connection. Retrying an outage is right; retrying a
deterministic rejection of the data stalls every caller behind it forever. The SQLSTATE
class says which it is (PostgreSQL, Appendix A "Error Codes").
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["DbFailure", "classify_sqlstate", "retry_in_place", "sqlstate_of"]


class DbFailure(StrEnum):
    """What a failed statement means for whoever retries it."""

    UNAVAILABLE = "unavailable"
    """The database or the way to it failed: the same call may succeed later."""
    CONFLICT = "conflict"
    """A concurrent transaction won (serialization failure, deadlock, lock timeout):
    retrying with fresh state succeeds."""
    DATA = "data"
    """The database rejected the data of the call: retrying the same data fails the same
    way. Only the caller (in a flush: the thread) whose data it was is affected."""
    OTHER = "other"
    """Anything else (a missing table, a permission, an internal error): not the data's
    fault and not transient; an operator has to look."""


_UNAVAILABLE_STATES = {
    "57014",  # query_canceled: a statement timeout
    "57P01",  # admin_shutdown
    "57P02",  # crash_shutdown
    "57P03",  # cannot_connect_now (starting up, recovering)
    "57P04",  # database_dropped
    "57P05",  # idle_session_timeout
    "40003",  # statement_completion_unknown
    "55006",  # object_in_use
}
_CONFLICT_STATES = {
    "40001",  # serialization_failure
    "40P01",  # deadlock_detected
    "55P03",  # lock_not_available
}
_UNAVAILABLE_CLASSES = {
    "08",  # connection exception
    "53",  # insufficient resources (disk full, out of memory, too many connections)
    "58",  # system error (I/O error)
    "HV",  # foreign data wrapper error: a remote server
}
_DATA_CLASSES = {
    "21",  # cardinality violation (e.g. one ON CONFLICT row affected twice)
    "22",  # data exception (bad value, untranslatable character, numeric overflow)
    "23",  # integrity constraint violation
    "40",  # transaction rollback not listed above: a deferred constraint at commit
    "44",  # WITH CHECK OPTION violation
    "54",  # program limit exceeded (index row too large, too many columns)
}


def classify_sqlstate(sqlstate: str | None) -> DbFailure | None:
    """The meaning of a five-character SQLSTATE; None when there is none to go by."""
    if not sqlstate or len(sqlstate) != 5:
        return None
    code = sqlstate.upper()
    if code in _CONFLICT_STATES:
        return DbFailure.CONFLICT
    if code in _UNAVAILABLE_STATES or code[:2] in _UNAVAILABLE_CLASSES:
        return DbFailure.UNAVAILABLE
    if code[:2] in _DATA_CLASSES:
        return DbFailure.DATA
    return DbFailure.OTHER


_SCHEMA_STATES = frozenset({"42P01", "42703", "42883", "3F000"})
"""undefined_table, undefined_column, undefined_function, invalid_schema_name."""


def schema_missing(sqlstate: str | None) -> bool:
    """Whether `sqlstate` says a table, column, function or schema the statement names
    does not exist: the schema was not set up (or is older than the code)."""
    return sqlstate is not None and sqlstate.upper() in _SCHEMA_STATES


_RETRY_IN_PLACE_STATES = frozenset({"40001", "40P01"})
"""Serialization failure and deadlock: Postgres aborted this transaction so that a
concurrent one could go on. The same transaction run again sees the winner's commit."""


def retry_in_place(sqlstate: str | None, attempt: int, *, attempts: int) -> bool:
    """Whether a transaction that failed with `sqlstate` on its `attempt`-th run
    (1-based) should run again at once, up to `attempts` runs in all.

    Only a deadlock or a serialization failure is retried in place: the database chose
    this transaction as the loser, and a new run waits behind the winner instead of
    colliding with it. A lock timeout (55P03, also a `DbFailure.CONFLICT`) is not: the
    operator bounded the wait, and waiting again would double it. Outages and rejected
    data are left to the caller.
    """
    if sqlstate is None or attempt >= attempts:
        return False
    return sqlstate.upper() in _RETRY_IN_PLACE_STATES


def sqlstate_of(error: BaseException) -> str | None:
    """The SQLSTATE a psycopg error carries, also when wrapped by SQLAlchemy (``orig``)."""
    for candidate in (getattr(error, "orig", None), error):
        if candidate is None:
            continue
        code = getattr(candidate, "sqlstate", None)
        if code is None:
            code = getattr(getattr(candidate, "diag", None), "sqlstate", None)
        if isinstance(code, str) and code:
            return code
    return None
