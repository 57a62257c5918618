"""The embedded SQLite backend's statement path: a statement runs inline on the event-loop
thread, and at most one hand-off to the driver thread (instead of four) when it must wait.

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
sends neither. The connection also knows after every statement whether a transaction
is open, so the pool's reset-on-return ROLLBACK after a COMMIT costs nothing.

**Inline first (round 10).** On this kind of host a hand-off to the driver thread and
back costs ~0.35 ms (two thread wake-ups) while the statement itself takes microseconds:
a durable step's dozen statements spent most of their time in hand-offs. So a statement
first runs *inline*, on the event-loop thread, with the connection's busy timeout at 0:

* a statement that would wait for a lock (``SQLITE_BUSY``: another connection or process
  holds the write lock) never waits inline — it fails at once without having taken
  effect and is run again on the driver thread with the configured busy timeout
  (``PRAGMA busy_timeout`` set around that one call), where the wait blocks nothing else;
* a read (``SELECT``/``WITH``) that runs longer than :data:`INLINE_READ_BUDGET_S` is
  interrupted by a progress handler (an interrupted read changes nothing and keeps its
  transaction) and run again on the driver thread, so a large scan never stalls the
  event loop; writes are single-row or bounded batches and run to completion inline;
* ``COMMIT`` and ``ROLLBACK`` run inline the same way (WAL with ``synchronous=NORMAL``:
  no fsync on commit).

The sqlite3 connection is opened with ``check_same_thread=False``; it is still used by
one thread at a time (the adapter's statement mutex, SQLAlchemy's one-caller-per-
connection rule). Exceptions are pysqlite's own, as on the thread.

Only the buffered (default) cursor changes; server-side cursors (``stream_results``)
keep SQLAlchemy's own. ``services.db`` passes :func:`one_hop_dbapi` as the engine's
DBAPI module (``create_async_engine(module=…)``), so nothing outside our engines changes.
"""

from __future__ import annotations

import collections
import re
import sqlite3
import time
from collections.abc import Sequence
from typing import Any

import aiosqlite
from sqlalchemy.dialects.sqlite.aiosqlite import (
    AsyncAdapt_aiosqlite_connection,
    AsyncAdapt_aiosqlite_cursor,
    AsyncAdapt_aiosqlite_dbapi,
)
from sqlalchemy.util.concurrency import await_

__all__ = ["INLINE_READ_BUDGET_S", "OneHopCursor", "one_hop_dbapi"]

#: A bare ``BEGIN [DEFERRED|IMMEDIATE|EXCLUSIVE] [TRANSACTION]`` (services.db's begin hook).
_BEGIN = re.compile(r"\s*BEGIN(\s+(DEFERRED|IMMEDIATE|EXCLUSIVE))?(\s+TRANSACTION)?\s*;?\s*$", re.I)

#: What one statement left on its pysqlite cursor (description, rows, rowcount,
#: lastrowid) and whether the connection is inside a transaction after it.
_Done = tuple[Any, list[Any] | None, int, int | None, bool]


#: Longest a read runs inline before it is interrupted and re-run on the driver thread.
INLINE_READ_BUDGET_S = 0.002
#: How often (SQLite VM instructions) the inline read's progress handler looks at the clock.
_PROGRESS_EVERY = 1000
_READ = re.compile(r"\s*(SELECT|WITH)\b", re.I)
_BUSY, _INTERRUPT = sqlite3.SQLITE_BUSY, sqlite3.SQLITE_INTERRUPT


def _execute_on(
    conn: sqlite3.Connection,
    begin: str | None,
    operation: str,
    parameters: Any,
    many: bool,
) -> _Done:
    """The transaction's deferred ``BEGIN`` (if any), then one statement to completion
    on a fresh cursor of ``conn`` (on whichever thread calls it)."""
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


def _statement(
    connection: aiosqlite.Connection,
    busy_timeout_ms: int,
    begin: str | None,
    operation: str,
    parameters: Any,
    many: bool,
) -> _Done:
    """On the driver thread: :func:`_execute_on` allowed to wait ``busy_timeout_ms`` for
    a lock (the inline attempt could not take it, or read too long)."""
    conn = connection._conn  # the thread's sqlite3 connection
    conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
    try:
        return _execute_on(conn, begin, operation, parameters, many)
    finally:
        conn.execute("PRAGMA busy_timeout=0")


def _retry_on_thread(error: sqlite3.OperationalError, read: bool) -> bool:
    """Whether an inline failure left nothing done and belongs on the driver thread:
    the lock was busy, or a read ran over its inline budget."""
    code = getattr(error, "sqlite_errorcode", None)
    if code is None:
        return False
    primary = code & 0xFF
    return primary == _BUSY or (read and primary == _INTERRUPT)


def _inline(
    conn: sqlite3.Connection, begin: str | None, operation: str, parameters: Any, many: bool
) -> _Done | None:
    """:func:`_execute_on` on the event-loop thread with no lock wait; None when it must
    run again on the driver thread (nothing of it took effect; a ``BEGIN`` that did is
    reported by ``conn.in_transaction``)."""
    read = not many and _READ.match(operation) is not None
    if read:
        deadline = time.perf_counter() + INLINE_READ_BUDGET_S
        conn.set_progress_handler(lambda: time.perf_counter() > deadline, _PROGRESS_EVERY)
    try:
        return _execute_on(conn, begin, operation, parameters, many)
    except sqlite3.OperationalError as error:
        if _retry_on_thread(error, read):
            return None
        raise
    finally:
        if read:
            conn.set_progress_handler(None, 0)


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
            timeout_ms = 0
            if isinstance(adapted, _OneHopConnection):
                begin, adapted.pending_begin = adapted.pending_begin, None
                adapted.in_transaction = True  # unknown if the statement fails
                timeout_ms = adapted.busy_timeout_ms
            conn = self._connection._conn
            done = _inline(conn, begin, operation, parameters, many)
            if done is None:
                if begin is not None and conn.in_transaction:
                    begin = None  # the BEGIN took effect inline; the statement did not
                done = await self._connection._execute(
                    _statement, self._connection, timeout_ms, begin, operation, parameters, many
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

    __slots__ = ("busy_timeout_ms", "in_transaction", "pending_begin")
    _cursor_cls: type[AsyncAdapt_aiosqlite_cursor] = OneHopCursor

    def __init__(self, dbapi: Any, connection: Any) -> None:
        super().__init__(dbapi, connection)
        #: ``True`` until the driver thread says otherwise (and while a call is open).
        self.in_transaction = True
        #: A ``BEGIN …`` not sent yet: it goes with the transaction's first statement.
        self.pending_begin: str | None = None
        #: How long a statement re-run on the driver thread may wait for a lock (set by
        #: ``services.db``'s connect hook; the connection itself keeps 0 for inline runs).
        self.busy_timeout_ms = 0

    def rollback(self) -> None:
        if self.pending_begin is not None:  # nothing was sent: nothing to roll back
            self.pending_begin, self.in_transaction = None, False
            return
        if not self.in_transaction:
            return  # nothing open: ROLLBACK would be a no-op on the driver thread
        self._end(rollback=True)

    def commit(self) -> None:
        if self.pending_begin is not None:  # an empty transaction: nothing to commit
            self.pending_begin, self.in_transaction = None, False
            return
        self._end(rollback=False)

    def _end(self, *, rollback: bool) -> None:
        """COMMIT or ROLLBACK inline; on the driver thread (allowed to wait for the
        lock) only when SQLite answers busy."""
        conn = self._connection._connection
        if conn is not None:
            try:
                if rollback:
                    conn.rollback()
                else:
                    conn.commit()
                self.in_transaction = False
                return
            except sqlite3.OperationalError as error:
                if not _retry_on_thread(error, read=False):
                    self._handle_exception(error)
        if rollback:
            super().rollback()
        else:
            super().commit()
        self.in_transaction = False


class _OneHopDbapi(AsyncAdapt_aiosqlite_dbapi):
    """SQLAlchemy's ``aiosqlite`` DBAPI shim whose connections use :class:`OneHopCursor`."""

    def connect(self, *arg: Any, **kw: Any) -> AsyncAdapt_aiosqlite_connection:
        # The base opens the aiosqlite connection (its thread a daemon); the adapter
        # around it is only a reference and a mutex: wrap the same connection again.
        # Statements run inline on the event-loop thread first (module docstring).
        kw["check_same_thread"] = False
        return _OneHopConnection(self, super().connect(*arg, **kw)._connection)


def one_hop_dbapi() -> Any:
    """The DBAPI module for ``create_async_engine(module=…)`` of a SQLite engine."""
    return _OneHopDbapi(aiosqlite, sqlite3)
