"""A transaction's last writes carry its ``COMMIT`` (``services.db_batch.commit_writes``,
ADR 0013): on both MySQL drivers the writes and the ``COMMIT`` go out in one round trip
and the frame sends no ``COMMIT`` of its own; a write that fails stops the server before
the ``COMMIT`` (nothing committed, the transaction still usable); a write with a refusing
check keeps the frame's ``COMMIT``; a statement or an exception after the carried
``COMMIT`` is an ``InvariantError``, never a silent loss; a connection lost during the
round trip, or a ``COMMIT`` that fails without a proven rollback, is
``CommitOutcomeUnknownError`` with the connection invalidated; a ``COMMIT`` refused with a
proven rollback (a deadlock, a certification failure) is retried whole; the last reads
of a read-only transaction carry its ``COMMIT`` too. On SQLite the call is
``execute_writes`` and the frame commits as before."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pymysql
import pytest
import sqlalchemy as sa
from sqlalchemy import make_url
from sqlalchemy.exc import DBAPIError, StatementError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services import db, db_batch
from services.db_batch import (
    Read,
    Write,
    commit_writes,
    execute_reads,
    execute_writes,
    execute_writes_if_absent,
    insert_if_absent_write,
    statements_of,
)
from services.db_mysql import DRIVERS
from services.db_raw import round_trip
from services.errors import CommitOutcomeUnknownError
from services.invariants import InvariantError
from tests.support.databases import (
    StatementWatch,
    admin_connection,
    commits_sent,
    driver_engine,
    kill_session,
    tables_engine,
)

_md = sa.MetaData()
_t = sa.Table(
    "carried_commit",
    _md,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("label", sa.String(20), nullable=False),
)
_INSERT = sa.insert(_t)


def _row(i: int, label: str = "x") -> Write:
    return Write(_INSERT, {"id": i, "label": label})


@pytest.fixture(params=DRIVERS)
async def engine(mariadb_url: str, request: pytest.FixtureRequest) -> AsyncIterator[AsyncEngine]:
    # One connection: consecutive transactions reuse the same pooled connection.
    async with driver_engine(mariadb_url, request.param, _md, pool_size=1) as eng:
        yield eng


@pytest.fixture
async def sqlite_engine(sqlite_url: str) -> AsyncIterator[AsyncEngine]:
    async with tables_engine(sqlite_url, _md, pool_size=2) as eng:
        yield eng


async def _ids(engine: AsyncEngine) -> list[int]:
    async with db.transaction(engine, readonly=True) as conn:
        return [r[0] for r in await conn.execute(sa.select(_t.c.id).order_by(_t.c.id))]


@pytest.mark.mariadb
async def test_the_last_writes_and_the_commit_go_in_one_round_trip(engine: AsyncEngine) -> None:
    before = await commits_sent(engine)
    with StatementWatch(engine) as watch:
        async with db.transaction(engine) as conn:
            counts = await commit_writes(conn, [_row(1), _row(2)])
    assert counts == [1, 1]
    assert len(watch.sql) == 1 and watch.sql[0].endswith("COMMIT")
    # The COMMIT is not one of the round trip's statements (as the frame's is not).
    assert [s.split(" (")[0] for s in statements_of(watch.sql[0])] == [
        "INSERT INTO carried_commit",
        "INSERT INTO carried_commit",
    ]
    assert await commits_sent(engine) == before  # the frame sent no COMMIT
    assert await _ids(engine) == [1, 2]


@pytest.mark.mariadb
async def test_the_rows_are_committed_when_the_round_trip_returns(
    engine: AsyncEngine, mariadb_url: str
) -> None:
    admin = admin_connection(mariadb_url)
    seen: list[Any] = []
    try:
        async with db.transaction(engine) as conn:
            await commit_writes(conn, [_row(7)])
            with admin.cursor() as cursor:  # another session, before the frame ends
                cursor.execute(f"SELECT id FROM `{_db(mariadb_url)}`.carried_commit")
                seen = list(cursor.fetchall())
    finally:
        admin.close()
    assert [tuple(r) for r in seen] == [(7,)]


@pytest.mark.mariadb
async def test_a_failing_write_stops_the_server_before_the_commit(engine: AsyncEngine) -> None:
    async with db.transaction(engine) as conn:
        await execute_writes(conn, [_row(1)])
    before = await commits_sent(engine)

    async def both(conn: AsyncConnection) -> None:
        await commit_writes(conn, [_row(2), _row(1)])  # 1 exists: duplicate key

    with pytest.raises(DBAPIError) as caught:
        await db.run_in_transaction(engine, both)
    assert db.classify_db_error(caught.value) is db.DbErrorClass.DUPLICATE_KEY
    assert await commits_sent(engine) == before  # and the frame rolled back
    assert await _ids(engine) == [1]  # row 2 rolled back with its transaction


@pytest.mark.mariadb
async def test_an_insert_if_absent_that_finds_its_row_leaves_the_transaction_open(
    engine: AsyncEngine,
) -> None:
    async with db.transaction(engine) as conn:
        await execute_writes(conn, [_row(1)])
    before = await commits_sent(engine)
    async with db.transaction(engine) as conn:
        present = not await execute_writes_if_absent(
            conn, [insert_if_absent_write(_t, {"id": 1, "label": "again"})], commit=True
        )
        assert present
        # Not committed: the transaction goes on and the frame commits it.
        await execute_writes(conn, [_row(3)])
    assert await commits_sent(engine) == before + 1
    assert await _ids(engine) == [1, 3]


@pytest.mark.mariadb
async def test_a_write_with_a_check_keeps_the_frames_commit(engine: AsyncEngine) -> None:
    seen: list[int] = []

    async def check(count: int) -> None:
        seen.append(count)
        if count != 1:
            raise AssertionError("refused")

    before = await commits_sent(engine)
    with StatementWatch(engine) as watch:
        async with db.transaction(engine) as conn:
            await commit_writes(conn, [_row(1), Write(_INSERT, {"id": 2, "label": "c"}, check)])
    assert seen == [1]
    assert not watch.sql[0].endswith("COMMIT")
    assert await commits_sent(engine) == before + 1
    assert await _ids(engine) == [1, 2]


@pytest.mark.mariadb
async def test_an_observer_sees_the_row_counts_and_the_commit_still_rides(
    engine: AsyncEngine,
) -> None:
    seen: list[int] = []
    before = await commits_sent(engine)
    async with db.transaction(engine) as conn:
        await commit_writes(
            conn, [_row(1), Write(_INSERT, {"id": 2, "label": "o"}, observe=seen.append)]
        )
    assert seen == [1]
    assert await commits_sent(engine) == before


@pytest.mark.mariadb
async def test_a_statement_after_the_carried_commit_is_refused_and_nothing_is_lost(
    engine: AsyncEngine,
) -> None:
    with pytest.raises(InvariantError, match="committed with its last writes") as caught:
        async with db.transaction(engine) as conn:
            await commit_writes(conn, [_row(1)])
            await conn.execute(_INSERT, {"id": 2, "label": "late"})
    assert "a statement after the COMMIT" in str(caught.value.__cause__)
    with pytest.raises(InvariantError, match="committed with its last writes"):
        async with db.transaction(engine) as conn:
            await commit_writes(conn, [_row(3)])
            await execute_writes(conn, [_row(4)])
    assert await _ids(engine) == [1, 3]  # what committed stays; nothing half-written
    async with db.transaction(engine) as conn:  # the connection is usable again
        await execute_writes(conn, [_row(5)])
    assert await _ids(engine) == [1, 3, 5]


@pytest.mark.mariadb
async def test_an_error_after_the_carried_commit_is_not_taken_for_a_rollback(
    engine: AsyncEngine,
) -> None:
    with pytest.raises(InvariantError, match="then its caller raised ValueError"):
        async with db.transaction(engine) as conn:
            await commit_writes(conn, [_row(1)])
            raise ValueError("after the commit")
    assert await _ids(engine) == [1]


@pytest.mark.mariadb
async def test_a_connection_lost_during_the_carried_round_trip_is_an_unknown_outcome(
    engine: AsyncEngine, mariadb_url: str
) -> None:
    admin = admin_connection(mariadb_url)
    try:
        with admin.cursor() as cursor:  # holds row 2's key: the victim's insert waits
            cursor.execute("START TRANSACTION")
            cursor.execute(
                f"INSERT INTO `{_db(mariadb_url)}`.carried_commit (id, label) VALUES (2, 'h')"
            )

        async def kill_after(victim: int) -> None:
            await asyncio.sleep(0.3)
            kill_session(mariadb_url, victim)

        with pytest.raises(CommitOutcomeUnknownError, match="carried COMMIT"):
            async with db.transaction(engine) as conn:
                victim = (await conn.execute(sa.text("SELECT CONNECTION_ID()"))).scalar_one()
                killing = asyncio.create_task(kill_after(int(victim)))
                try:
                    await commit_writes(conn, [_row(1), _row(2)])
                finally:
                    await killing
        with admin.cursor() as cursor:
            cursor.execute("ROLLBACK")
    finally:
        admin.close()
    assert await _ids(engine) == []  # the server rolled the killed session back
    async with db.transaction(engine) as conn:  # a new connection serves the next one
        await execute_writes(conn, [_row(3)])
    assert await _ids(engine) == [3]


def _db(url: str) -> str:
    name = make_url(url).database
    assert name
    return name


def _commit_error(code: int, message: str) -> DBAPIError:
    return DBAPIError.instance(
        "COMMIT", (), pymysql.err.OperationalError(code, message), pymysql.err.Error
    )


def _failing_commit(
    monkeypatch: pytest.MonkeyPatch, error: DBAPIError, times: int = 1
) -> list[int]:
    """Every carried round trip runs its writes for real, then — ``times`` times — its
    ``COMMIT`` answers ``error`` (the writes stay uncommitted, as after a refused
    ``COMMIT``). Returns the count of carried round trips."""
    real = db_batch.round_trip
    calls: list[int] = []

    async def round_trip(
        conn: AsyncConnection,
        sql: str,
        params: Any,
        statements: int,
        results: list[Any],
        *,
        carries_commit: bool = False,
    ) -> None:
        if not carries_commit or len(calls) >= times:
            await real(conn, sql, params, statements, results, carries_commit=carries_commit)
            return
        calls.append(1)
        await real(conn, sql.removesuffix(";\nCOMMIT"), params, statements, results)
        raise error

    monkeypatch.setattr(db_batch, "round_trip", round_trip)
    return calls


@pytest.mark.mariadb
async def test_a_carried_commit_refused_with_a_proven_rollback_is_retried_whole(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _failing_commit(monkeypatch, _commit_error(1213, "Deadlock found"))
    attempts: list[int] = []

    async def fn(conn: AsyncConnection) -> None:
        attempts.append(1)
        await commit_writes(conn, [_row(1)])

    await db.run_in_transaction(engine, fn, backoff=db.Backoff(initial_s=0.0, max_s=0.0))
    assert len(calls) == 1 and len(attempts) == 2
    assert await _ids(engine) == [1]  # once


@pytest.mark.mariadb
async def test_a_carried_commit_that_fails_otherwise_is_an_unknown_outcome(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    _failing_commit(monkeypatch, _commit_error(1180, "Got error during COMMIT"))

    async def fn(conn: AsyncConnection) -> None:
        await commit_writes(conn, [_row(1)])

    with pytest.raises(CommitOutcomeUnknownError, match="without a proven rollback"):
        await db.run_in_transaction(engine, fn)
    # The connection was invalidated (its session may still hold the transaction): the
    # next transaction runs on a new session, where nothing of it is visible.
    assert await _ids(engine) == []


async def test_on_sqlite_the_frame_commits_the_last_writes(sqlite_engine: AsyncEngine) -> None:
    with StatementWatch(sqlite_engine) as watch:
        async with db.transaction(sqlite_engine) as conn:
            assert await commit_writes(conn, [_row(1), _row(2)]) == [1, 1]
            await conn.execute(_INSERT, {"id": 3, "label": "after"})  # still the transaction
    assert not any(s.rstrip().endswith("COMMIT") for s in watch.sql)
    assert await _ids(sqlite_engine) == [1, 2, 3]


@pytest.mark.mariadb
async def test_an_error_in_the_commits_place_is_read_and_nothing_is_marked_committed(
    engine: AsyncEngine,
) -> None:
    """The driver path of a refused ``COMMIT``: the statement in its place fails on the
    server (a ``SIGNAL``), its error is raised after the write's result
    was read, and the connection is not marked committed — the frame rolls back."""
    results: list[tuple[Any, list[Any], int]] = []
    with pytest.raises(DBAPIError, match="refused in COMMIT's place"):
        async with db.transaction(engine) as conn:
            sql = "INSERT INTO carried_commit (id, label) VALUES (%s, %s)"
            sql += ";\nSIGNAL SQLSTATE '40001' SET MESSAGE_TEXT = 'refused in COMMIT''s place'"
            await round_trip(conn, sql, (1, "x"), 1, results, carries_commit=True)
    assert [count for _, _, count in results] == [1]
    assert await _ids(engine) == []  # rolled back by the frame, not committed


@pytest.mark.mariadb
async def test_the_last_reads_of_a_read_only_transaction_carry_its_commit(
    engine: AsyncEngine,
) -> None:
    async with db.transaction(engine) as conn:
        await execute_writes(conn, [_row(1), _row(2)])
    before = await commits_sent(engine)
    read = Read(sa.select(_t.c.id, _t.c.label).where(_t.c.id >= sa.bindparam("low")), {"low": 2})
    with StatementWatch(engine) as watch:
        async with db.transaction(engine, readonly=True) as conn:
            [rows] = await execute_reads(conn, [read], commit=True)
    assert [(r.id, r.label) for r in rows] == [(2, "x")]
    assert len(watch.sql) == 1 and watch.sql[0].endswith("COMMIT")
    assert await commits_sent(engine) == before
    # In a transaction that may have written, the frame commits as usual.
    async with db.transaction(engine) as conn:
        await execute_writes(conn, [_row(3)])
        [rows] = await execute_reads(conn, [read], commit=True)
    assert [r.id for r in rows] == [2, 3]
    assert await commits_sent(engine) == before + 1
    assert await _ids(engine) == [1, 2, 3]


@pytest.mark.mariadb
async def test_after_a_read_only_carried_commit_the_callers_error_stands(
    engine: AsyncEngine,
) -> None:
    """A read-only transaction wrote nothing: an error its caller raises after the reads
    that carried its COMMIT is raised unchanged (not taken for a committed write's), and
    a statement after them is still refused."""
    read = Read(sa.select(_t.c.id).where(_t.c.id == sa.bindparam("id")), {"id": 1})
    with pytest.raises(LookupError, match="no row 1"):
        async with db.transaction(engine, readonly=True) as conn:
            [rows] = await execute_reads(conn, [read], commit=True)
            if not rows:
                raise LookupError("no row 1")
    # (SQLAlchemy's execution wraps the adapter's InvariantError as a StatementError.)
    with pytest.raises(StatementError, match="a statement after the COMMIT") as caught:
        async with db.transaction(engine, readonly=True) as conn:
            await execute_reads(conn, [read], commit=True)
            await conn.execute(sa.select(_t.c.id))
    assert isinstance(caught.value.orig, InvariantError)
    assert await _ids(engine) == []  # and the connection serves the next transaction
