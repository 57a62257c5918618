"""The MariaDB/MySQL backend's connection: a choice of two drivers and no ROLLBACK round
trip when the pool takes back a connection whose transaction this adapter just ended.

**Drivers.** ``mysql+asyncmy://`` (the default the docs and CI use) and
``mysql+aiomysql://`` speak the same protocol to the same servers; SQLAlchemy's dialect
is the same (``MySQLDialect_pymysql``'s SQL, the ``FOUND_ROWS`` client flag every fenced
``UPDATE``'s row count rests on, the same error numbers). ``asyncmy`` parses the wire
protocol in compiled (Cython) code: a 31-column primary-key ``SELECT`` costs 0.17 ms of
CPU in the driver against 0.44 ms for ``aiomysql``'s pure-Python PyMySQL core on the
development host, and every statement of the runtime pays that difference
(``docs/performance.md``, round 11). ``aiomysql`` stays supported for deployments that
pinned it.

**Reset on return.** SQLAlchemy's pool resets every connection it takes back with a
ROLLBACK (reset on return), so every committed transaction costs one more round trip to
the server. With autocommit off, a session is inside a transaction from its first
statement until a COMMIT or ROLLBACK ends it; after this adapter's own successful
``commit()`` or ``rollback()``, and with no statement since, nothing is open and the
reset's ROLLBACK would be a no-op on the server. This adapter skips exactly that one.

It does not trust the driver's ``server_status`` for this: PyMySQL refreshes it from OK
packets but not from the EOF packet that ends a result set, so after a transaction that
only read (a ``SELECT … FOR UPDATE``, say) it still shows the state before that
transaction began — skipping on it would leave the transaction, and its row locks, open
in the pool. The adapter instead marks the connection "ended" when its ``commit()`` or
``rollback()`` returns and "open" whenever a cursor is made for a statement (every
statement is run through a new cursor), so any statement since the last end — or an
end that raised — means the ROLLBACK is sent as before.

**Ping on checkout, unless the connection just answered.** The engine's pool pings a
connection as it hands it out (``pool_pre_ping``), so one the server dropped while it sat
in the pool (``wait_timeout``, a restart, a failed-over node behind a load balancer) is
replaced instead of failing its transaction's first statement. The ping is a round trip
— ≈ 0.1 ms of CPU and 0.13-0.17 ms of wall time on the development host, on every
transaction (a durable step runs ≈ 1.4). A connection whose own COMMIT or ROLLBACK
succeeded less than :data:`ALIVE_BYPASS_S` ago, with no statement since, has just
answered the server: the ping is skipped (HikariCP's ``aliveBypassWindowMs``, 500 ms by
default, is the same rule). A server that dropped such a connection within that window
fails the transaction's first statement instead — before anything was written, with
the error of a connection lost mid-transaction, which every caller already handles (and
SQLAlchemy then recycles every connection of the pool older than the failure, so one
failure per process and outage, not one per pooled connection).

**A COMMIT carried by the transaction's last writes.** ``services.db_batch.commit_writes``
sends a transaction's last writes and its ``COMMIT`` in one round trip (ADR 0013); the
adapter then knows the transaction is over (:func:`carried_commit`): the transaction
frame's ``commit()`` sends nothing (its ``ROLLBACK`` neither), and a statement on the
connection before that ``commit()`` or ``rollback()`` — which would run outside the
committed transaction and be lost at check-in — raises an ``InvariantError`` instead.

``services.db`` passes :func:`reset_aware_dbapi` as the engine's DBAPI module
(``create_async_engine(module=…)``), so nothing outside our engines changes.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import aiomysql
import asyncmy
import pymysql
from sqlalchemy.connectors.asyncio import AsyncAdapt_dbapi_cursor
from sqlalchemy.dialects.mysql.aiomysql import (
    AsyncAdapt_aiomysql_connection,
    AsyncAdapt_aiomysql_dbapi,
)
from sqlalchemy.dialects.mysql.asyncmy import (
    AsyncAdapt_asyncmy_connection,
    AsyncAdapt_asyncmy_dbapi,
)
from sqlalchemy.util.concurrency import await_

from services.invariants import InvariantError

__all__ = [
    "ALIVE_BYPASS_S",
    "DRIVERS",
    "carried_commit",
    "commit_carried",
    "is_reset_aware",
    "reset_aware_dbapi",
    "statement_follows",
]

# asyncmy logs every note or warning a statement leaves (it sends SHOW WARNINGS after
# it) at WARNING level — on MariaDB that is a "Name 'pk_…' ignored for PRIMARY key" note
# for each table a migration creates. The services run in strict SQL mode (checked at
# start-up, docs/database-profiles.md), where a data warning is an error instead, so
# what reaches this logger is notes: only its errors reach the service log.
logging.getLogger("asyncmy").setLevel(logging.ERROR)

#: The MySQL-protocol drivers an engine URL may name (``mysql+<driver>://``).
DRIVERS = ("asyncmy", "aiomysql")

#: Seconds after a connection's own successful COMMIT or ROLLBACK during which the pool's
#: checkout ping is skipped (see the module docstring).
ALIVE_BYPASS_S = 0.5


class _ResetAware:
    """``rollback()`` is a no-op when this adapter's own COMMIT or ROLLBACK ended the
    transaction and no statement ran since (see the module docstring). Mixed into the
    driver's SQLAlchemy connection adapter, in front of it."""

    #: ``True`` only between a successful commit/rollback and the next statement (an
    #: instance attribute: this mixin has no ``__slots__``, so the connection gets a
    #: ``__dict__`` — one per pooled connection).
    ended: bool
    #: ``time.monotonic()`` when that commit/rollback returned (the server's last answer).
    ended_at: float
    #: Pings sent to the server (the pool's checkout pings that were not skipped).
    pings: int
    #: ``True`` from a round trip that carried the transaction's ``COMMIT`` with its last
    #: writes (:func:`commit_carried`) until the frame's ``commit()`` or ``rollback()``.
    carried: bool
    #: ``COMMIT`` s sent on their own (the frame's ``commit()``; a carried one is not).
    commits: int

    def __init__(self, dbapi: Any, connection: Any) -> None:
        super().__init__(dbapi, connection)  # type: ignore[call-arg]
        self.ended = False
        self.ended_at = 0.0
        self.pings = 0
        self.carried = False
        self.commits = 0

    def cursor(self, server_side: bool = False) -> AsyncAdapt_dbapi_cursor:
        statement_follows(self)
        return super().cursor(server_side)  # type: ignore[misc,no-any-return]

    def rollback(self) -> None:
        if self.carried:
            # Committed by the last writes' round trip; nothing ran since (a statement
            # would have raised): nothing is open to roll back.
            self.carried = False
            self._ended()
            return
        if self.ended:
            return  # our own COMMIT/ROLLBACK ended it and nothing ran since: a no-op
        super().rollback()  # type: ignore[misc]
        self._ended()

    def commit(self) -> None:
        if self.carried:
            self.carried = False  # the last writes' round trip carried the COMMIT
            self._ended()
            return
        self.ended = False
        self.commits += 1
        super().commit()  # type: ignore[misc]
        self._ended()

    def ping(self, reconnect: bool = False) -> None:
        if self.ended and time.monotonic() - self.ended_at < ALIVE_BYPASS_S:
            return  # it answered a COMMIT/ROLLBACK just now (see the module docstring)
        self.pings += 1
        super().ping(reconnect)  # type: ignore[misc]

    def _ended(self) -> None:
        self.ended = True
        self.ended_at = time.monotonic()


def statement_follows(adapter: Any) -> None:
    """A statement is about to run on ``adapter``'s driver connection (made a cursor for
    it, or — ``services.db_raw.round_trip`` — sends it on the driver's own cursor): a
    transaction may be open from now on. A no-op for any other connection.

    Raises:
        InvariantError: the transaction's ``COMMIT`` already went out with its last
            writes (:func:`commit_carried`) and the frame has not ended it: the statement
            would run in a new transaction nobody commits.
    """
    if isinstance(adapter, _ResetAware):
        if adapter.carried:
            raise InvariantError(
                "a statement after the COMMIT the transaction's last writes carried"
            )
        adapter.ended = False


def is_reset_aware(adapter: Any) -> bool:
    """``adapter`` is this module's (it can carry a ``COMMIT``: :func:`commit_carried`)."""
    return isinstance(adapter, _ResetAware)


def commit_carried(adapter: Any) -> None:
    """The round trip that just returned on ``adapter`` ended with the transaction's
    ``COMMIT`` and the server committed: the frame's ``commit()`` sends nothing."""
    if not isinstance(adapter, _ResetAware):
        raise InvariantError("only a reset-aware MySQL connection carries a COMMIT")
    adapter.carried = True


def carried_commit(adapter: Any) -> bool:
    """``adapter``'s transaction was committed by its last writes' round trip and the
    frame has not yet ended it (``commit()``/``rollback()``)."""
    return isinstance(adapter, _ResetAware) and adapter.carried


class _ResetAwareAiomysqlConnection(_ResetAware, AsyncAdapt_aiomysql_connection):
    pass


class _ResetAwareAsyncmyConnection(_ResetAware, AsyncAdapt_asyncmy_connection):
    pass


class _ResetAwareDbapi:
    """SQLAlchemy's DBAPI shim of a driver (mixed in front of it) whose connections are
    its reset-aware adapter ``_connection``."""

    _connection: Any
    driver: Any  # the driver module (SQLAlchemy's AsyncAdapt_dbapi_module sets it)

    def connect(self, *arg: Any, **kw: Any) -> Any:
        creator_fn = kw.pop("async_creator_fn", self.driver.connect)
        return await_(self._connection.create(self, creator_fn(*arg, **kw)))


class _ResetAwareAiomysqlDbapi(_ResetAwareDbapi, AsyncAdapt_aiomysql_dbapi):
    _connection = _ResetAwareAiomysqlConnection


class _ResetAwareAsyncmyDbapi(_ResetAwareDbapi, AsyncAdapt_asyncmy_dbapi):
    _connection = _ResetAwareAsyncmyConnection


def reset_aware_dbapi(driver: str = "asyncmy") -> Any:
    """The DBAPI module for ``create_async_engine(module=…)`` of a MySQL-protocol engine
    on ``driver`` (one of :data:`DRIVERS`)."""
    if driver == "asyncmy":
        return _ResetAwareAsyncmyDbapi(asyncmy)
    if driver == "aiomysql":
        return _ResetAwareAiomysqlDbapi(aiomysql, pymysql)
    raise ValueError(f"unsupported MySQL driver {driver!r} (one of {', '.join(DRIVERS)})")
