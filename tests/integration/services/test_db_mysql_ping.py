"""The MariaDB engine's checkout ping (``services/db_mysql.py``): skipped for a connection
whose own COMMIT or ROLLBACK returned less than ``ALIVE_BYPASS_S`` ago, sent otherwise —
so a connection the server dropped while it sat idle in the pool is still replaced at
checkout, and one dropped within the window fails its transaction's first statement
(nothing written, the connection invalidated) and the pool recovers on the next
transaction. On both supported drivers; connections are killed at the server (``KILL``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services import db, db_mysql
from services.db_mysql import DRIVERS
from tests.support.databases import driver_engine, kill_session

pytestmark = pytest.mark.mariadb

_md = sa.MetaData()
_t = sa.Table(
    "ping_bypass",
    _md,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
)


@pytest.fixture(params=DRIVERS)
async def engine(mariadb_url: str, request: pytest.FixtureRequest) -> AsyncIterator[AsyncEngine]:
    # One connection: every transaction below checks out the same pooled connection
    # (until it is replaced).
    async with driver_engine(mariadb_url, request.param, _md, pool_size=1) as eng:
        yield eng


async def _adapter(conn: AsyncConnection) -> Any:
    """The reset-aware driver adapter under ``conn`` (it counts its pings)."""
    raw = await conn.get_raw_connection()
    return raw.dbapi_connection


async def _session(conn: AsyncConnection) -> int:
    return int((await conn.execute(sa.text("SELECT CONNECTION_ID()"))).scalar_one())


async def _past_the_window() -> None:
    await asyncio.sleep(db_mysql.ALIVE_BYPASS_S + 0.1)


async def test_a_connection_that_just_committed_is_not_pinged_and_an_idle_one_is(
    engine: AsyncEngine,
) -> None:
    async with db.transaction(engine) as conn:
        adapter = await _adapter(conn)
        first = await _session(conn)
    for _ in range(3):  # back to back: each checkout follows the previous COMMIT at once
        async with db.transaction(engine, readonly=True) as conn:
            assert await _adapter(conn) is adapter
            assert await _session(conn) == first
    assert adapter.pings == 0
    await _past_the_window()
    async with db.transaction(engine, readonly=True) as conn:
        assert await _adapter(conn) is adapter
    assert adapter.pings == 1  # idle past the window: pinged at checkout, as before
    async with db.transaction(engine, readonly=True) as conn:
        pass
    assert adapter.pings == 1  # …and answered just now again


async def test_a_connection_that_ended_with_a_failure_is_pinged(engine: AsyncEngine) -> None:
    """A transaction whose statement failed ends with a ROLLBACK the server answered: the
    next checkout may skip the ping; one whose ROLLBACK never ran (a statement since the
    last end) is pinged even at once."""
    async with db.transaction(engine) as conn:
        adapter = await _adapter(conn)
        await conn.execute(_t.insert().values(id=1))
    with pytest.raises(DBAPIError):
        async with db.transaction(engine) as conn:
            await conn.execute(_t.insert().values(id=1))  # duplicate key
    async with db.transaction(engine, readonly=True) as conn:
        assert await _adapter(conn) is adapter
    assert adapter.pings == 0
    adapter.ended = False  # as after a statement whose transaction never ended
    async with db.transaction(engine, readonly=True) as conn:
        assert await _adapter(conn) is adapter
    assert adapter.pings == 1


async def test_a_connection_killed_while_idle_is_replaced_at_checkout(
    engine: AsyncEngine, mariadb_url: str
) -> None:
    async with db.transaction(engine) as conn:
        killed = await _session(conn)
    await _past_the_window()
    await asyncio.to_thread(kill_session, mariadb_url, killed)
    # The checkout ping finds it gone and the pool reconnects: the caller never sees it.
    async with db.transaction(engine) as conn:
        assert await _session(conn) != killed
        await conn.execute(_t.insert().values(id=7))
    async with db.transaction(engine, readonly=True) as conn:
        ids = (await conn.execute(sa.select(_t.c.id))).scalars().all()
    assert ids == [7]


async def test_a_connection_killed_within_the_window_fails_before_writing_and_the_pool_recovers(
    engine: AsyncEngine, mariadb_url: str
) -> None:
    async with db.transaction(engine) as conn:
        killed = await _session(conn)
    await asyncio.to_thread(kill_session, mariadb_url, killed)
    # Handed out unpinged: its first statement meets the dropped session — a connection
    # lost before COMMIT, the error every caller handles (never a retried write).
    with pytest.raises(DBAPIError) as caught:
        async with db.transaction(engine) as conn:
            await conn.execute(_t.insert().values(id=8))
    assert caught.value.connection_invalidated
    assert db.classify_db_error(caught.value) is db.DbErrorClass.OUTCOME_UNKNOWN
    # The pool replaced it: the next transaction runs on a new session, and nothing of
    # the failed one was written.
    async with db.transaction(engine) as conn:
        assert await _session(conn) != killed
        ids = (await conn.execute(sa.select(_t.c.id))).scalars().all()
    assert ids == []
