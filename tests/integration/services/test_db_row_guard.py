"""Fenced writes ride with the ``COMMIT`` behind a server-side row guard (ADR 0014):
a write that declares the one row count its check accepts (``Write.rows``) may be among
a transaction's last writes that carry its ``COMMIT`` (``services.db_batch.commit_writes``);
a guard statement right after it makes the server stop before the ``COMMIT`` whenever the
count is another, and the check then decides — and raises — as always, in the still open
transaction. On both MySQL drivers: the guarded round trip commits once and the frame
sends no ``COMMIT``; a refused count commits nothing and runs nothing after it; a guard
that refuses what its check accepts is an ``InvariantError``; ``before_commit`` fires
exactly once right before the ``COMMIT`` goes out, however it is sent, and never after a
failed write. On SQLite no guard is sent and the frame commits."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from services import db
from services.db_batch import (
    CARRY_COMMIT_OPTION,
    Write,
    commit_writes,
    execute_writes,
    row_guard,
    statements_of,
)
from services.db_mysql import DRIVERS
from services.errors import FenceLostError
from services.invariants import InvariantError
from tests.support.databases import StatementWatch, commits_sent, driver_engine, tables_engine

_md = sa.MetaData()
_t = sa.Table(
    "row_guarded",
    _md,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("version", sa.Integer, nullable=False),
)
_INSERT = sa.insert(_t)
#: A fenced UPDATE: the row at the expected version moves one version on.
_BUMP = (
    sa.update(_t)
    .where(_t.c.id == sa.bindparam("k_id"), _t.c.version == sa.bindparam("k_version"))
    .values(version=_t.c.version + 1)
)


class _Lost(FenceLostError):
    def __init__(self, count: int) -> None:
        super().__init__("row_guarded", "id", 0, count)


def _bump(row_id: int, version: int, seen: list[int], *, rows: int | None = 1) -> Write:
    """A fenced UPDATE whose check accepts exactly one row (and records what it saw)."""

    async def check(count: int) -> None:
        seen.append(count)
        if count != 1:
            raise _Lost(count)

    return Write(_BUMP, {"k_id": row_id, "k_version": version}, check=check, rows=rows)


@pytest.fixture(params=DRIVERS)
async def engine(mariadb_url: str, request: pytest.FixtureRequest) -> AsyncIterator[AsyncEngine]:
    async with driver_engine(mariadb_url, request.param, _md, pool_size=1) as eng:
        yield eng


@pytest.fixture
async def sqlite_engine(sqlite_url: str) -> AsyncIterator[AsyncEngine]:
    async with tables_engine(sqlite_url, _md, pool_size=2) as eng:
        yield eng


async def _rows(engine: AsyncEngine) -> list[tuple[int, int]]:
    async with db.transaction(engine, readonly=True) as conn:
        result = await conn.execute(sa.select(_t.c.id, _t.c.version).order_by(_t.c.id))
        return [(r[0], r[1]) for r in result]


async def _seed(engine: AsyncEngine) -> None:
    async with db.transaction(engine) as conn:
        await execute_writes(conn, [Write(_INSERT, {"id": 1, "version": 0})])


def test_a_row_guard_names_a_row_count_and_nothing_else() -> None:
    assert row_guard(3).endswith("ROW_COUNT() <> 3)")
    for bad in (-1, True, "1); DROP TABLE x; --", 1.0):
        with pytest.raises(InvariantError, match="needs a row count"):
            row_guard(bad)  # type: ignore[arg-type]


@pytest.mark.mariadb
async def test_a_guarded_fenced_write_rides_with_the_commit(engine: AsyncEngine) -> None:
    await _seed(engine)
    seen: list[int] = []
    fired: list[int] = []
    before = await commits_sent(engine)
    with StatementWatch(engine) as watch:
        async with db.transaction(engine) as conn:
            counts = await commit_writes(
                conn,
                [_bump(1, 0, seen), Write(_INSERT, {"id": 2, "version": 0})],
                before_commit=lambda: fired.append(len(watch.sql)),
            )
    assert counts == [1, 1] and seen == [1]
    [sql] = watch.sql
    assert sql.endswith("COMMIT")
    # The guard follows the fenced UPDATE; the write after it ran once the guard passed.
    kinds = [s.split(" ")[0] for s in statements_of(sql)]
    assert kinds == ["UPDATE", "SET", "INSERT"]
    assert "ROW_COUNT() <> 1" in statements_of(sql)[1]
    assert fired == [0]  # right before the round trip that carried the COMMIT
    assert await commits_sent(engine) == before  # the frame sent none
    assert await _rows(engine) == [(1, 1), (2, 0)]


@pytest.mark.mariadb
async def test_a_refused_row_count_stops_the_server_before_the_commit(
    engine: AsyncEngine,
) -> None:
    """The fence is lost (version 5 expected, 0 stored): the guard fails, so neither the
    INSERT after it nor the COMMIT runs; the check raises its own error in the open
    transaction, which the caller may still use — and which the frame rolls back."""
    await _seed(engine)
    seen: list[int] = []
    fired: list[int] = []
    before = await commits_sent(engine)
    with pytest.raises(_Lost):
        async with db.transaction(engine) as conn:
            try:
                await commit_writes(
                    conn,
                    [
                        Write(_INSERT, {"id": 3, "version": 0}),
                        _bump(1, 5, seen),
                        Write(_INSERT, {"id": 2, "version": 0}),
                    ],
                    before_commit=lambda: fired.append(1),
                )
            finally:
                # Still this transaction, uncommitted: row 3 is there, row 2 never ran.
                got = await conn.execute(sa.select(_t.c.id).order_by(_t.c.id))
                assert [r[0] for r in got] == [1, 3]
    assert seen == [0]
    assert fired == [1]  # it fired before the round trip; the COMMIT never ran
    assert await commits_sent(engine) == before
    assert await _rows(engine) == [(1, 0)]  # nothing committed


@pytest.mark.mariadb
async def test_a_guard_refusing_a_count_its_check_accepts_is_an_invariant_error(
    engine: AsyncEngine,
) -> None:
    await _seed(engine)
    seen: list[int] = []
    with pytest.raises(InvariantError, match="row guard refused the row count 1") as caught:
        async with db.transaction(engine) as conn:
            await commit_writes(conn, [_bump(1, 0, seen, rows=2)])
    assert isinstance(caught.value.__cause__, DBAPIError)
    assert seen == [1]
    assert await _rows(engine) == [(1, 0)]  # the COMMIT never ran


@pytest.mark.mariadb
async def test_a_check_without_a_declared_count_keeps_the_frames_commit(
    engine: AsyncEngine,
) -> None:
    await _seed(engine)
    seen: list[int] = []
    fired: list[int] = []
    before = await commits_sent(engine)
    with StatementWatch(engine) as watch:
        async with db.transaction(engine) as conn:
            await commit_writes(
                conn, [_bump(1, 0, seen, rows=None)], before_commit=lambda: fired.append(1)
            )
            assert fired == [1]  # after the writes, before the frame's COMMIT
    assert not watch.sql[0].endswith("COMMIT") and "ROW_COUNT" not in watch.sql[0]
    assert await commits_sent(engine) == before + 1
    assert await _rows(engine) == [(1, 1)]


@pytest.mark.mariadb
async def test_an_engine_may_keep_every_commit_on_its_own(engine: AsyncEngine) -> None:
    await _seed(engine)
    seen: list[int] = []
    before = await commits_sent(engine)
    engine.sync_engine.update_execution_options(**{CARRY_COMMIT_OPTION: False})
    with StatementWatch(engine) as watch:
        async with db.transaction(engine) as conn:
            await commit_writes(conn, [_bump(1, 0, seen), Write(_INSERT, {"id": 2, "version": 0})])
    assert not watch.sql[0].endswith("COMMIT") and "ROW_COUNT" not in watch.sql[0]
    assert await commits_sent(engine) == before + 1
    assert await _rows(engine) == [(1, 1), (2, 0)]


@pytest.mark.mariadb
async def test_before_commit_fires_before_a_carried_round_trip_never_after_a_failed_write(
    engine: AsyncEngine,
) -> None:
    await _seed(engine)
    fired: list[int] = []
    for rows in (1, None):  # carried, and kept for the frame
        with pytest.raises(DBAPIError):
            async with db.transaction(engine) as conn:
                await commit_writes(
                    conn,
                    [Write(_INSERT, {"id": 1, "version": 9}), _bump(1, 0, [], rows=rows)],
                    before_commit=lambda: fired.append(1),
                )
    # The carried round trip fires it before it is sent (the duplicate is the server's
    # answer to it); kept for the frame, a failed write never reaches the COMMIT.
    assert fired == [1]
    assert await _rows(engine) == [(1, 0)]


async def test_on_sqlite_no_guard_is_sent_and_the_frame_commits(
    sqlite_engine: AsyncEngine,
) -> None:
    await _seed(sqlite_engine)
    seen: list[int] = []
    fired: list[int] = []
    with StatementWatch(sqlite_engine) as watch:
        async with db.transaction(sqlite_engine) as conn:
            await commit_writes(conn, [_bump(1, 0, seen)], before_commit=lambda: fired.append(1))
            assert fired == [1]
    assert not any("ROW_COUNT" in s or s.rstrip().endswith("COMMIT") for s in watch.sql)
    assert seen == [1]
    assert await _rows(sqlite_engine) == [(1, 1)]
    with pytest.raises(_Lost):
        async with db.transaction(sqlite_engine) as conn:
            await commit_writes(conn, [_bump(1, 0, seen)], before_commit=lambda: fired.append(2))
    assert fired == [1]  # not after a refused write
