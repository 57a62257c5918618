"""One round trip on the driver's own cursor (MySQL-protocol backends).

SQLAlchemy's execution of driver SQL — an execution context, a result object, the
asyncio adapter's greenlet hand-off for every driver call — costs ≈ 90 µs of CPU per round
trip on asyncmy, more than the driver's own work; for a statement whose compiled form and
bound parameters the caller already has (``services.db_batch``) or that has none
(``services.db.db_now``'s clock read) it buys nothing. :func:`round_trip` sends such SQL
on the driver's cursor directly, in the connection's transaction, and keeps what
SQLAlchemy's execution does around the driver call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.util.concurrency import greenlet_spawn

from services.db_mysql import commit_carried, is_reset_aware, statement_follows
from services.invariants import InvariantError

__all__ = ["round_trip"]


async def round_trip(
    conn: AsyncConnection,
    sql: str,
    params: Sequence[Any],
    statements: int,
    results: list[tuple[Any, list[Any], int]],
    *,
    carries_commit: bool = False,
) -> None:
    """Send ``sql`` — ``statements`` statements, joined by
    ``services.db_batch.BATCH_SEPARATOR`` — with ``params`` in one round trip on
    ``conn``'s driver connection, and append each statement's ``(description, rows, row
    count)`` to ``results`` in order, as the server answers them (a failed statement's
    error is raised after the ones before it were appended; the server ran none after
    it).

    ``carries_commit``: ``sql`` ends, after those statements, with the transaction's
    ``COMMIT`` (``services.db_batch.commit_writes``, ADR 0013): its answer is read too
    (its error is raised with every statement's result appended) and, once the server
    committed, the connection's adapter is told (``services.db_mysql.commit_carried``).

    The round trip goes to the driver's own cursor, not through SQLAlchemy's execution:
    driver SQL gains nothing from an execution context, a result object or the adapter's
    greenlet hand-off per call (≈ 90 µs of CPU per round trip on asyncmy), but keeps what
    that execution does around the driver call — the connection's ``before_cursor_execute``
    and ``after_cursor_execute`` listeners see the joined statement once (statement
    counters, tests' statement watches), echo logs it, a driver error or a cancellation
    goes to the connection's own handler (wrapped as a ``DBAPIError``, ``handle_error``
    listeners, a lost connection invalidated), and the pool's reset-aware adapter learns
    that a statement ran (``services.db_mysql.statement_follows``).
    """
    sync = conn.sync_connection
    if sync is None:
        raise InvariantError("a round trip needs a started connection")
    if not sync.in_transaction():
        await greenlet_spawn(sync._autobegin)  # as a statement through SQLAlchemy would
    adapter = sync.connection.dbapi_connection
    if carries_commit and not is_reset_aware(adapter):
        raise InvariantError("a COMMIT rides only on a reset-aware MySQL connection")
    driver = adapter.driver_connection  # type: ignore[union-attr]
    parameters: Any = tuple(params)
    events = sync._has_events or sync.engine._has_events
    # Entered as SQLAlchemy's adapter enters it (aiomysql makes it in a coroutine), and
    # not closed after use, as that adapter does not close it either: a buffered cursor
    # holds nothing on the server once every result set was read (or the error that
    # ended the round trip was), and closing it would be one more await.
    try:
        cursor = await driver.cursor().__aenter__()
    except BaseException as exc:
        await greenlet_spawn(_handled, sync, adapter, exc, sql, parameters)
        raise  # pragma: no cover - the handler always raises
    if events:
        for before in sync.dispatch.before_cursor_execute:
            sql, parameters = before(sync, cursor, sql, parameters, None, False)
    if sync._echo:
        sync._log_info(sql)
        sync._log_info("[raw sql] %r", parameters)
    statement_follows(adapter)
    try:
        await cursor.execute(sql, parameters or None)  # no parameters: no % formatting
        for index in range(statements):
            if index:
                await cursor.nextset()
            rows = list(await cursor.fetchall()) if cursor.description else []
            results.append((cursor.description, rows, cursor.rowcount))
        if carries_commit:
            await cursor.nextset()  # the COMMIT's answer (its error raises here)
            commit_carried(adapter)
    except BaseException as exc:
        await greenlet_spawn(_handled, sync, adapter, exc, sql, parameters)
        raise  # pragma: no cover - the handler always raises
    if events:
        sync.dispatch.after_cursor_execute(sync, cursor, sql, parameters, None, False)


def _handled(sync: Connection, adapter: Any, exc: BaseException, sql: str, parameters: Any) -> None:
    """Raise ``exc`` as SQLAlchemy's execution would: the adapter's translation of a
    driver error first (asyncmy's ``AttributeError`` of a dead transport is an
    ``InternalError``), then the connection's handler (in a greenlet: invalidating a lost
    connection closes it). Both read the exception being handled from ``sys.exc_info()``
    (an exit exception is re-raised from it), so each runs inside an ``except`` block of
    this greenlet, where ``exc`` is raised again."""
    try:
        try:
            raise exc
        except Exception as error:
            adapter._handle_exception(error)
    except BaseException as current:
        sync._handle_dbapi_exception(current, sql, parameters, None, None)
