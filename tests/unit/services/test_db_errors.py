"""services.db error classification and retry backoff (pure: no database)."""

from __future__ import annotations

import sqlite3

import asyncmy.errors
import pymysql
import pytest
from sqlalchemy import exc as sa_exc

from services.db import Backoff, DbErrorClass, classify_db_error

C = DbErrorClass


#: (error class name, args, expected class) of the MySQL protocol: the same for PyMySQL
#: (and aiomysql, which re-exports its classes) and asyncmy, the two supported drivers.
_MYSQL_CASES = [
    ("OperationalError", (1213, "Deadlock found"), C.RETRYABLE_CONFLICT),
    ("OperationalError", (1020, "Record has changed"), C.RETRYABLE_CONFLICT),
    ("OperationalError", (9007, "Write conflict"), C.RETRYABLE_CONFLICT),
    ("OperationalError", (8002, "SELECT FOR UPDATE conflict"), C.RETRYABLE_CONFLICT),
    ("OperationalError", (8005, "Write conflict, txn retry"), C.RETRYABLE_CONFLICT),
    ("OperationalError", (8028, "Information schema changed"), C.RETRYABLE_CONFLICT),
    ("OperationalError", (1205, "Lock wait timeout"), C.LOCK_WAIT_TIMEOUT),
    ("OperationalError", (3572, "NOWAIT lock"), C.LOCK_WAIT_TIMEOUT),
    ("OperationalError", (2006, "Server has gone away"), C.OUTCOME_UNKNOWN),
    ("OperationalError", (2013, "Lost connection"), C.OUTCOME_UNKNOWN),
    ("OperationalError", (1927, "Connection was killed"), C.OUTCOME_UNKNOWN),
    ("IntegrityError", (1062, "Duplicate entry"), C.DUPLICATE_KEY),
    ("IntegrityError", (1048, "Column cannot be null"), C.OTHER),
    ("IntegrityError", (1452, "Foreign key fails"), C.OTHER),
    ("ProgrammingError", (1064, "Syntax error"), C.OTHER),
    ("InterfaceError", ("no code",), C.OTHER),
]
_DRIVER_ERRORS = {"pymysql": pymysql.err, "asyncmy": asyncmy.errors}


@pytest.mark.parametrize("driver", sorted(_DRIVER_ERRORS))
@pytest.mark.parametrize(
    ("cls", "args", "expected"), _MYSQL_CASES, ids=[str(c[1][0]) for c in _MYSQL_CASES]
)
def test_mysql_family_error_codes(
    driver: str, cls: str, args: tuple[object, ...], expected: DbErrorClass
) -> None:
    error = getattr(_DRIVER_ERRORS[driver], cls)(*args)
    assert classify_db_error(error) is expected
    wrapped = sa_exc.OperationalError("SELECT 1", {}, error)
    assert classify_db_error(wrapped) is expected


def _sqlite_error(cls: type[sqlite3.Error], message: str, code: int | None = None) -> sqlite3.Error:
    error = cls(message)
    if code is not None:
        error.sqlite_errorcode = code
    return error


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (_sqlite_error(sqlite3.OperationalError, "database is locked"), C.RETRYABLE_CONFLICT),
        (_sqlite_error(sqlite3.OperationalError, "database table is locked"), C.RETRYABLE_CONFLICT),
        (_sqlite_error(sqlite3.OperationalError, "busy", code=5), C.RETRYABLE_CONFLICT),
        (_sqlite_error(sqlite3.OperationalError, "snapshot", code=517), C.RETRYABLE_CONFLICT),
        (
            _sqlite_error(sqlite3.IntegrityError, "UNIQUE constraint failed: t.a"),
            C.DUPLICATE_KEY,
        ),
        (_sqlite_error(sqlite3.IntegrityError, "constraint", code=2067), C.DUPLICATE_KEY),
        (_sqlite_error(sqlite3.IntegrityError, "constraint", code=1555), C.DUPLICATE_KEY),
        (_sqlite_error(sqlite3.IntegrityError, "NOT NULL constraint failed: t.a"), C.OTHER),
        (_sqlite_error(sqlite3.IntegrityError, "FOREIGN KEY constraint failed"), C.OTHER),
        (_sqlite_error(sqlite3.OperationalError, "no such table: t"), C.OTHER),
    ],
    ids=lambda v: str(v) if isinstance(v, Exception) else v.name,
)
def test_sqlite_errors(error: sqlite3.Error, expected: DbErrorClass) -> None:
    assert classify_db_error(error) is expected
    wrapped = sa_exc.DBAPIError("SELECT 1", {}, error)
    assert classify_db_error(wrapped) is expected


def test_a_disconnect_recognised_by_the_dialect_is_outcome_unknown() -> None:
    wrapped = sa_exc.OperationalError(
        "COMMIT", {}, pymysql.err.OperationalError(9999, "unlisted"), connection_invalidated=True
    )
    assert classify_db_error(wrapped) is C.OUTCOME_UNKNOWN


@pytest.mark.parametrize(
    "error", [ValueError("x"), ConnectionResetError(), RuntimeError(1213)], ids=repr
)
def test_non_database_errors_are_other(error: Exception) -> None:
    assert classify_db_error(error) is C.OTHER


def test_backoff_is_jittered_exponential_and_bounded() -> None:
    backoff = Backoff(initial_s=0.01, max_s=0.1, multiplier=2.0)
    for retry, cap in [(1, 0.01), (2, 0.02), (3, 0.04), (4, 0.08), (5, 0.1), (30, 0.1)]:
        for _ in range(50):
            assert cap / 2 <= backoff.delay(retry) <= cap
