"""The embedded SQLite backend's statement path: one hand-off to the driver thread per
statement instead of four.

``aiosqlite`` runs every call of a connection on the connection's own thread, and
SQLAlchemy's ``aiosqlite`` adapter makes four such calls for every statement that
returns rows (open a cursor, execute, fetch all, close) and three for one that does not.
Each call is a queue hand-off to that thread and a wake-up of the event loop when it is
done — and the driver thread needs the GIL, which the event-loop thread holds while it
runs other coroutines, so under load each hand-off may also wait for it. The cursor
here runs the whole statement — cursor, execute, fetch, close — as ONE call on the
driver thread and keeps the rows, description, row count and last row id it returned;
the SQL, its parameters, the transaction and the rows are exactly pysqlite's. A
transaction's ``BEGIN`` (``services.db``'s begin hook) travels with its first statement
in the same call — nothing runs between them either way — and an empty transaction
sends neither. The connection also knows from the driver thread whether a transaction
is open, so the pool's reset-on-return ROLLBACK after a COMMIT costs no hand-off.

Only the buffered (default) cursor changes; server-side cursors (``stream_results``)
keep SQLAlchemy's own. ``services.db`` passes :func:`one_hop_dbapi` as the engine's
DBAPI module (``create_async_engine(module=…)``), so nothing outside our engines changes.
"""

from __future__ import annotations

import collections
import re
import sqlite3
from collections.abc import Sequence
from typing import Any

import aiosqlite
from sqlalchemy.dialects.sqlite.aiosqlite import (
    AsyncAdapt_aiosqlite_connection,
    AsyncAdapt_aiosqlite_cursor,
    AsyncAdapt_aiosqlite_dbapi,
)
from sqlalchemy.util.concurrency import await_

__all__ = ["OneHopCursor", "one_hop_dbapi"]

#: A bare ``BEGIN [DEFERRED|IMMEDIATE|EXCLUSIVE] [TRANSACTION]`` (services.db's begin hook).
_BEGIN = re.compile(r"\s*BEGIN(\s+(DEFERRED|IMMEDIATE|EXCLUSIVE))?(\s+TRANSACTION)?\s*;?\s*$", re.I)

#: What one statement left on its pysqlite cursor (description, rows, rowcount,
#: lastrowid) and whether the connection is inside a transaction after it.
_Done = tuple[Any, list[Any] | None, int, int | None, bool]


def _statement(
    connection: aiosqlite.Connection,
    begin: str | None,
    operation: str,
    parameters: Any,
    many: bool,
) -> _Done:
    """On the driver thread: the transaction's deferred ``BEGIN`` (if any), then one
    statement to completion on a fresh cursor."""
    conn = connection._conn  # the thread's sqlite3 connection
    cursor = conn.cursor()
    try:
        if begin is not None:
            cursor.execute(begin)
        if many:
            cursor.executemany(operation, parameters)
        elif parameters is None:
            cursor.execute(operation)
        else:
            cursor.execute(operation, parameters)
        description = cursor.description
        rows = cursor.fetchall() if description else None
        return description, rows, cursor.rowcount, cursor.lastrowid, conn.in_transaction
    finally:
        cursor.close()


class OneHopCursor(AsyncAdapt_aiosqlite_cursor):
    """A buffered cursor whose statement is one call on the driver thread (see the
    module docstring). No driver cursor stays open between statements."""

    __slots__ = ("_description", "_lastrowid", "_rowcount")

    def __init__(self, adapt_connection: AsyncAdapt_aiosqlite_connection) -> None:
        # Not the base initializer: it opens a driver cursor (one thread hand-off).
        self._adapt_connection = adapt_connection
        self._connection = adapt_connection._connection
        self._cursor = None  # type: ignore[assignment]  # nothing open on the thread
        self._soft_closed_memoized = {}  # type: ignore[assignment]
        self._rows = collections.deque()
        self._description: Any = None
        self._rowcount = -1
        self._lastrowid: int | None = None

    @property
    def description(self) -> Any:
        return self._description

    @property
    def rowcount(self) -> int:
        return self._rowcount

    @property
    def lastrowid(self) -> int:
        return self._lastrowid  # type: ignore[return-value]

    @property
    def arraysize(self) -> int:
        return 1

    @arraysize.setter
    def arraysize(self, value: int) -> None:
        del value  # every row is fetched with the statement

    async def _async_soft_close(self) -> None:
        return None  # the driver cursor closed with its statement

    def close(self) -> None:
        self._rows.clear()

    async def _run(self, operation: Any, parameters: Any, many: bool) -> None:
        adapted = self._adapt_connection
        async with adapted._execute_mutex:
            begin = None
            if isinstance(adapted, _OneHopConnection):
                begin, adapted.pending_begin = adapted.pending_begin, None
                adapted.in_transaction = True  # unknown if the statement fails
            done: _Done = await self._connection._execute(
                _statement, self._connection, begin, operation, parameters, many
            )
        self._description, rows, self._rowcount, self._lastrowid, in_txn = done
        if isinstance(adapted, _OneHopConnection):
            adapted.in_transaction = in_txn
        self._rows = collections.deque(rows or ())

    def execute(self, operation: Any, parameters: Any = None) -> Any:
        adapted = self._adapt_connection
        if (
            isinstance(adapted, _OneHopConnection)
            and not parameters
            and _BEGIN.match(operation)
            and not adapted.in_transaction
            and adapted.pending_begin is None
        ):
            # Sent with the transaction's first statement, in the same hand-off.
            adapted.pending_begin = operation
            adapted.in_transaction = True
            self._description, self._rowcount, self._lastrowid = None, -1, None
            self._rows.clear()
            return
        try:
            await_(self._run(operation, parameters, False))
        except Exception as error:
            self._adapt_connection._handle_exception(error)

    def executemany(self, operation: Any, seq_of_parameters: Sequence[Any]) -> Any:
        try:
            await_(self._run(operation, seq_of_parameters, True))
        except Exception as error:
            self._adapt_connection._handle_exception(error)


class _OneHopConnection(AsyncAdapt_aiosqlite_connection):
    """The adapter connection of :class:`OneHopCursor`; it also knows whether the
    driver connection is inside a transaction (as the driver thread reported it after
    the last statement, commit or rollback), so the pool's reset-on-return ROLLBACK
    after a committed transaction costs no hand-off to the driver thread."""

    __slots__ = ("in_transaction", "pending_begin")
    _cursor_cls: type[AsyncAdapt_aiosqlite_cursor] = OneHopCursor

    def __init__(self, dbapi: Any, connection: Any) -> None:
        super().__init__(dbapi, connection)
        #: ``True`` until the driver thread says otherwise (and while a call is open).
        self.in_transaction = True
        #: A ``BEGIN …`` not sent yet: it goes with the transaction's first statement.
        self.pending_begin: str | None = None

    def rollback(self) -> None:
        if self.pending_begin is not None:  # nothing was sent: nothing to roll back
            self.pending_begin, self.in_transaction = None, False
            return
        if not self.in_transaction:
            return  # nothing open: ROLLBACK would be a no-op on the driver thread
        super().rollback()
        self.in_transaction = False

    def commit(self) -> None:
        if self.pending_begin is not None:  # an empty transaction: nothing to commit
            self.pending_begin, self.in_transaction = None, False
            return
        super().commit()
        self.in_transaction = False


class _OneHopDbapi(AsyncAdapt_aiosqlite_dbapi):
    """SQLAlchemy's ``aiosqlite`` DBAPI shim whose connections use :class:`OneHopCursor`."""

    def connect(self, *arg: Any, **kw: Any) -> AsyncAdapt_aiosqlite_connection:
        # The base opens the aiosqlite connection (its thread a daemon); the adapter
        # around it is only a reference and a mutex: wrap the same connection again.
        return _OneHopConnection(self, super().connect(*arg, **kw)._connection)


def one_hop_dbapi() -> Any:
    """The DBAPI module for ``create_async_engine(module=…)`` of a SQLite engine."""
    return _OneHopDbapi(aiosqlite, sqlite3)
