"""One round trip on the driver's own cursor (``services/db_raw.py``), on both supported
MySQL drivers: what SQLAlchemy's execution does around a driver call still happens —
statement events, error wrapping, ``handle_error`` listeners, invalidation of a lost or
interrupted connection, autobegin — and the pool's reset-aware adapter learns that a
statement ran, so a failed transaction whose only statements went this way is still
rolled back (not skipped as "nothing ran since the COMMIT")."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from services import db
from services.db_batch import BATCH_SEPARATOR, Write, execute_writes
from services.db_mysql import DRIVERS
from services.db_raw import round_trip
from tests.support.databases import driver_engine

pytestmark = pytest.mark.mariadb

_md = sa.MetaData()
_t = sa.Table(
    "raw_trip",
    _md,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("label", sa.String(20), nullable=False),
)
_INSERT = sa.insert(_t)


@pytest.fixture(params=DRIVERS)
async def engine(mariadb_url: str, request: pytest.FixtureRequest) -> AsyncIterator[AsyncEngine]:
    # One connection: consecutive transactions reuse the same pooled connection.
    async with driver_engine(mariadb_url, request.param, _md, pool_size=1) as eng:
        yield eng


async def _ids(engine: AsyncEngine) -> list[int]:
    async with db.transaction(engine, readonly=True) as conn:
        return [r[0] for r in await conn.execute(sa.select(_t.c.id).order_by(_t.c.id))]


_TWO = BATCH_SEPARATOR.join(
    ["INSERT INTO raw_trip (id, label) VALUES (%s, %s)", "SELECT id, label FROM raw_trip"]
)


async def test_results_in_order_and_the_statement_events_fire_once(engine: AsyncEngine) -> None:
    seen: list[tuple[str, str, Any]] = []

    def before(_c: Any, _cur: Any, sql: str, params: Any, _ctx: Any, _many: bool) -> None:
        seen.append(("before", sql, params))

    def after(_c: Any, _cur: Any, sql: str, params: Any, _ctx: Any, _many: bool) -> None:
        seen.append(("after", sql, params))

    sync = engine.sync_engine
    event.listen(sync, "before_cursor_execute", before)
    event.listen(sync, "after_cursor_execute", after)
    try:
        async with db.transaction(engine) as conn:
            results: list[tuple[Any, list[Any], int]] = []
            await round_trip(conn, _TWO, (1, "one"), 2, results)
    finally:
        event.remove(sync, "before_cursor_execute", before)
        event.remove(sync, "after_cursor_execute", after)
    assert seen == [("before", _TWO, (1, "one")), ("after", _TWO, (1, "one"))]
    (insert_desc, insert_rows, inserted), (select_desc, rows, selected) = results
    assert (insert_desc, insert_rows, inserted) == (None, [], 1)
    assert [d[0] for d in select_desc] == ["id", "label"]
    assert [tuple(r) for r in rows] == [(1, "one")] and selected == 1
    assert await _ids(engine) == [1]  # committed with the transaction


async def test_a_failing_statement_is_wrapped_after_the_results_before_it(
    engine: AsyncEngine,
) -> None:
    """A duplicate key in statement 2 of 3: statement 1's result was appended, the
    error is SQLAlchemy's ``IntegrityError`` (``handle_error`` listeners saw it), the
    server ran nothing after it, and the connection stays usable — not invalidated."""
    async with db.transaction(engine) as conn:
        await conn.execute(_INSERT, {"id": 1, "label": "one"})
    handled: list[BaseException] = []

    def on_error(ctx: Any) -> None:
        handled.append(ctx.original_exception)

    event.listen(engine.sync_engine, "handle_error", on_error)
    sql = BATCH_SEPARATOR.join(["INSERT INTO raw_trip (id, label) VALUES (%s, %s)"] * 3)
    results: list[tuple[Any, list[Any], int]] = []
    try:
        async with db.transaction(engine) as conn:
            adapter = (await conn.get_raw_connection()).dbapi_connection
            with pytest.raises(sa.exc.IntegrityError) as caught:
                await round_trip(conn, sql, (2, "two", 1, "dup", 3, "three"), 3, results)
            assert not caught.value.connection_invalidated
            assert db.classify_db_error(caught.value) is db.DbErrorClass.DUPLICATE_KEY
            assert [count for _, _, count in results] == [1]
            # The same connection takes the next statement.
            assert (await conn.execute(sa.text("SELECT 7"))).scalar_one() == 7
            assert (await conn.get_raw_connection()).dbapi_connection is adapter
    finally:
        event.remove(engine.sync_engine, "handle_error", on_error)
    assert len(handled) == 1
    assert await _ids(engine) == [1, 2]  # statement 1 committed; 3 never ran


async def test_a_listener_that_raises_stops_the_round_trip_before_anything_is_sent(
    engine: AsyncEngine,
) -> None:
    class Refused(Exception):
        pass

    def refuse(*_args: Any) -> None:
        raise Refused

    event.listen(engine.sync_engine, "before_cursor_execute", refuse)
    try:
        with pytest.raises(Refused):
            async with db.transaction(engine) as conn:
                await execute_writes(conn, [Write(_INSERT, {"id": 5, "label": "five"})])
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", refuse)
    assert await _ids(engine) == []


async def test_a_round_trip_interrupted_by_cancellation_invalidates_its_connection(
    engine: AsyncEngine,
) -> None:
    """Cancelled while the server still works on it, the round trip leaves the
    connection mid-protocol: it is invalidated (as SQLAlchemy does for an exit
    exception), never handed to the next transaction, whose statements run on a new
    session."""
    async with db.transaction(engine) as conn:
        before = int((await conn.execute(sa.text("SELECT CONNECTION_ID()"))).scalar_one())

    invalidated: list[bool] = []

    async def slow() -> None:
        async with db.transaction(engine) as conn:
            try:
                await round_trip(conn, "SELECT SLEEP(5)", (), 1, [])
            finally:
                # Before the transaction frame does anything with it.
                invalidated.append(conn.sync_connection.invalidated)  # type: ignore[union-attr]

    task = asyncio.create_task(slow())
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=10)
    assert invalidated == [True]
    async with db.transaction(engine) as conn:
        after = int((await conn.execute(sa.text("SELECT CONNECTION_ID()"))).scalar_one())
        await execute_writes(conn, [Write(_INSERT, {"id": 9, "label": "nine"})])
    assert after != before
    assert await _ids(engine) == [9]


async def test_a_lost_connection_is_wrapped_and_invalidated(engine: AsyncEngine) -> None:
    """The driver connection closed underneath (its transport gone): the error — for
    asyncmy first translated by SQLAlchemy's adapter — is wrapped as a ``DBAPIError``,
    the connection invalidated, and the next transaction runs on a new one."""
    with pytest.raises(DBAPIError) as caught:
        async with db.transaction(engine) as conn:
            raw = await conn.get_raw_connection()
            raw.driver_connection.close()
            await round_trip(conn, "SELECT 1", (), 1, [])
    assert caught.value.connection_invalidated
    assert db.classify_db_error(caught.value) is db.DbErrorClass.OUTCOME_UNKNOWN
    async with db.transaction(engine) as conn:
        assert (await conn.execute(sa.text("SELECT 3"))).scalar_one() == 3


async def test_a_failed_transaction_of_only_raw_statements_is_still_rolled_back(
    engine: AsyncEngine,
) -> None:
    """Right after a COMMIT the reset-aware adapter skips the pool's ROLLBACK (nothing
    ran since); a round trip on the driver's cursor must end that state, or a failed
    transaction's write would stay open on the pooled connection and commit with the
    next transaction."""

    class Failed(Exception):
        pass

    async with db.transaction(engine) as conn:
        await conn.execute(sa.text("SELECT 1"))  # ends with a COMMIT: 'ended' is set
    with pytest.raises(Failed):
        async with db.transaction(engine) as conn:
            await execute_writes(conn, [Write(_INSERT, {"id": 4, "label": "four"})])
            raise Failed
    async with db.transaction(engine) as conn:  # the same pooled connection
        await execute_writes(conn, [Write(_INSERT, {"id": 6, "label": "six"})])
    assert await _ids(engine) == [6]


async def test_a_round_trip_outside_a_transaction_begins_one(engine: AsyncEngine) -> None:
    async with engine.connect() as conn:
        assert not conn.in_transaction()
        answers: list[tuple[Any, list[Any], int]] = []
        await round_trip(conn, "SELECT 2", (), 1, answers)
        assert conn.in_transaction()
        assert [tuple(r) for r in answers[0][1]] == [(2,)]
        await conn.rollback()
